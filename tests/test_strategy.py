"""DCPStrategy pieces that need no processes: groups, sharding, weights, errors, metrics, buckets."""

from __future__ import annotations

import pytest
import torch

from _dcp_helpers import TinyLM
from lightning_dcp.sp.context import LOSS_MASK, TOKEN_WEIGHT
from lightning_dcp.data import pack_samples
from lightning_dcp.sp.groups import SPGroups, aligned_blocks
from lightning_dcp.planning.plan import StepPlan
from lightning_dcp.runtime.metrics import step_metrics
from lightning_dcp.sp.tokens import add_token_weights, is_weighted, shard_batch, weighted_loss
from lightning_dcp.runtime.buckets import GradBuckets
from lightning_dcp.runtime.model import SPCap, resolve_sp_cap
from lightning_dcp.sp.contract import read_model
from lightning_dcp.runtime.row import GatheredStep, StepRow
from lightning_dcp.runtime.strategy import DCPStrategy


def _packed(lengths, sp):
    samples = [{"input_ids": torch.arange(n), "labels": torch.arange(n)} for n in lengths]
    return pack_samples(samples, pad_to_multiple=sp)


def test_aligned_blocks_and_non_power_of_two_world():
    assert aligned_blocks(4) == [(0, 1), (2, 3), (0, 1, 2, 3)]
    assert aligned_blocks(6) == [(0, 1), (2, 3), (4, 5), (0, 1, 2, 3)]
    assert aligned_blocks(8, max_sp_size=2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    g = SPGroups(6, rank=5, create=False)
    assert g.sizes == [1, 2, 4] and g.has((4, 5)) and not g.has((4, 5, 6, 7))
    with pytest.raises(ValueError, match=r"no SP group for ranks \[2, 3, 4, 5\]"):
        g.group_for((2, 3, 4, 5))


def test_shard_keeps_whole_sequence_keys_and_splits_tokens():
    b = _packed([5, 2], 4)
    shards = [shard_batch(b, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([s["input_ids"] for s in shards]), b["input_ids"])
    assert all(torch.equal(s["cu_seqlens"], b["cu_seqlens"]) for s in shards)
    with pytest.raises(ValueError, match="not a multiple of the SP size 3"):
        shard_batch(b, 0, 3)


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_token_weights_over_loss_units_give_the_global_mean(reduction):
    """Summed weighted losses over all items and SP shards / summed loss units = the global mean,
    with prompt-masked labels (-100 inside samples) and a sample without any loss token."""
    items = [[5, 2], [7], [1, 1, 3]]
    masked = {(0, 0): [0, 1], (1, 0): [0, 1, 2, 3], (2, 1): [0]}  # (item, sample) -> prompt positions
    per_sample_means, tokens, token_sum = [], 0, 0.0
    total, units = 0.0, 0
    for i, lengths in enumerate(items):
        samples = []
        for j, n in enumerate(lengths):
            labels = torch.arange(n) + 10 * j
            labels[masked.get((i, j), [])] = -100
            samples.append({"input_ids": torch.arange(n), "labels": labels})
            values = labels[labels != -100].double()  # token_loss = the label value, for the check
            if len(values):
                per_sample_means.append(float(values.mean()))
                tokens, token_sum = tokens + len(values), token_sum + float(values.sum())
        b = pack_samples(samples, pad_to_multiple=4)
        units += add_token_weights(b, reduction)
        assert float(b[TOKEN_WEIGHT][~b[LOSS_MASK]].abs().sum()) == 0.0
        token_loss = torch.where(b["labels"] == -100, torch.zeros_like(b["labels"]), b["labels"]).float()
        b["tl"] = token_loss
        total += float(sum(weighted_loss(s["tl"], s) for s in (shard_batch(b, r, 4) for r in range(4))))
    expected = token_sum / tokens if reduction == "token" else sum(per_sample_means) / len(per_sample_means)
    assert units == (tokens if reduction == "token" else len(per_sample_means))
    assert abs(total / units - expected) < 1e-5


def test_loss_mask_excludes_ignored_labels():
    b = pack_samples([{"input_ids": torch.arange(4), "labels": torch.tensor([-100, -100, 2, 3])}], pad_to_multiple=3)
    assert b[LOSS_MASK].tolist() == [False, False, True, True, False, False]


def test_weighted_loss_marks_and_falls_back_outside_dcp():
    b = _packed([3], 1)
    add_token_weights(b, "token")
    assert is_weighted(weighted_loss(torch.ones(3), b))
    plain = _packed([3], 1)
    out = weighted_loss(torch.full((3,), 2.0), plain)
    assert not is_weighted(out) and float(out) == 2.0


def test_heads_check_names_both_values():
    with pytest.raises(ValueError, match=r"max_sp_size=8 allows SP size 8, which does not divide the model's 4 attention "
                                         r"heads: .* the SP sizes are 1, 2, 4. Use max_sp_size=4"):
        resolve_sp_cap(8, world_size=8, heads=4)
    with pytest.raises(ValueError, match=r"max_sp_size=5 .* 12 attention heads: .* SP sizes are 1, 2, 3, 4, 6, 12. Use "
                                         r"max_sp_size=4 .* ring attention"):
        resolve_sp_cap(5, world_size=8, heads=12)
    assert read_model(TinyLM()).num_heads == 4


def test_max_sp_size_takes_any_size_the_model_allows():
    """Any divisor of the heads (not only powers of two); with ring attention any size at all."""
    assert resolve_sp_cap(6, world_size=8, heads=12) == SPCap(6, ulysses=(1, 2, 3, 4, 6))
    assert resolve_sp_cap(3, world_size=6, heads=6).group_sizes == (1, 2, 3)
    assert resolve_sp_cap(5, world_size=8, heads=12, ring=True) == SPCap(5, ulysses=(1, 2, 3, 4), ring=True)
    assert resolve_sp_cap(None, world_size=8, heads=12, ring=True) == SPCap(8, ulysses=(1, 2, 3, 4, 6), ring=True)
    assert resolve_sp_cap(None, world_size=6, heads=None).group_sizes == (1, 2, 4)  # heads unknown: powers of two up front


def test_setup_takes_any_allowed_max_sp_size_and_refuses_an_impossible_head_split():
    """DCPStrategy(max_sp_size=3) is a valid cap; on a 4-head module without ring attention it is refused at setup
    naming the sizes; with ring attention (dcp_ring_layout) it runs as ring x Ulysses."""
    from lightning_dcp.runtime.fit_setup import resolve_model_setup

    settings = DCPStrategy(max_sp_size=3).settings
    with pytest.raises(ValueError, match="positive number of ranks"):
        DCPStrategy(max_sp_size=0)
    lm = TinyLM()
    lm.dcp_ring_layout = None
    with pytest.raises(ValueError, match=r"max_sp_size=3 allows SP size 3, which does not divide the model's 4 attention "
                                         r"heads: .* SP sizes are 1, 2, 4. Use max_sp_size=2"):
        resolve_model_setup(read_model(lm), settings, 8)
    lm.dcp_ring_layout = "zigzag"
    contract = read_model(lm)
    assert contract.ring_layout == "zigzag"
    assert resolve_model_setup(contract, settings, 8) == (4, "sp", SPCap(3, ulysses=(1, 2), ring=True))
    assert read_model(TinyLM(), support="packed").ring_layout is None  # no SP, no ring


def test_default_max_sp_follows_heads_and_world():
    assert resolve_sp_cap(None, world_size=8, heads=2) == SPCap(2, heads_cap=2, ulysses=(1, 2))
    assert resolve_sp_cap(None, world_size=8, heads=16) == SPCap(8, ulysses=(1, 2, 4, 8))
    assert resolve_sp_cap(None, world_size=6, heads=12) == SPCap(6, ulysses=(1, 2, 3, 4, 6))  # was 4: powers of two
    with pytest.warns(UserWarning, match="capped at 4 on this world of 5"):
        assert resolve_sp_cap(None, world_size=5, heads=12).size == 4
    with pytest.warns(UserWarning, match="exceeds the world"):
        assert resolve_sp_cap(8, world_size=4, heads=16) == SPCap(4, ulysses=(1, 2, 4))


def test_item_refusal_names_the_split_and_the_fix():
    from lightning_dcp.runtime.model import item_refusal

    assert item_refusal(6, 1, 6, None) is None and item_refusal(4, 2, 2, "contiguous") is None
    assert "Ulysses size 4 (SP 4) does not divide the model's 6 attention heads" in item_refusal(4, 1, 6, None)
    assert "max_sp_size=3" in item_refusal(4, 1, 6, None)
    assert "plan it as ring 2 x Ulysses 2 (WorkItem(..., ring=2))" in item_refusal(4, 1, 2, "zigzag")
    assert "cannot run ring attention" in item_refusal(4, 2, 2, None)


def test_misspelled_arguments_name_the_closest_valid_one():
    with pytest.raises(TypeError, match=r"'global_batchsize' \(did you mean 'global_batch_size'\?\)"):
        DCPStrategy(global_batchsize=8)
    with pytest.raises(TypeError, match=r"'polcy' \(did you mean 'policy'\?\)"):
        DCPStrategy(polcy="bucket")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'xyzzy'; valid arguments: .*policy"):
        DCPStrategy(xyzzy=1)
    with pytest.raises(TypeError):
        DCPStrategy("dcp")  # keyword-only: a positional policy is refused, not taken as something else


def test_settings_are_frozen_and_validated():
    s = DCPStrategy(seed=3, planner_options={"fallback": False}, timeout=12)
    with pytest.raises(AttributeError):
        s.settings.seed = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.settings.planner_options["fallback"] = True  # type: ignore[index]
    assert s.settings.timeout.total_seconds() == 12.0
    for bad in ({"max_sp_size": 0}, {"global_batch_size": 0}, {"timeout": -1}, {"support": "full"},
                {"max_oom_replans": -1}, {"bucket_cap_mb": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DCPStrategy(**bad)
    assert s.settings.agreement(world_size=2)["seed"] == 3


def test_constructor_errors_and_ddp_wrapper_args():
    with pytest.raises(ValueError, match="loss_reduction"):
        DCPStrategy(loss_reduction="mean")
    with pytest.raises(ValueError, match="not both"):
        DCPStrategy(global_batch_size=4, global_batch_tokens=100)
    with pytest.warns(UserWarning, match="find_unused_parameters"):
        DCPStrategy(find_unused_parameters=True)


def test_registry():
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dcp import _registry

    DCPStrategy.register_strategies(StrategyRegistry)
    assert "dcp" in StrategyRegistry and "dcp_spawn" in StrategyRegistry
    assert isinstance(StrategyRegistry.get("dcp_spawn"), DCPStrategy)
    assert StrategyRegistry.get("dcp_spawn")._start_method == "spawn"
    assert [n for n, _ in _registry._NAMES] == ["dcp", "dcp_spawn"]
    assert not isinstance(StrategyRegistry.get("ddp"), DCPStrategy)  # DDP's own names are left alone


def _rows(*values):
    return [StepRow(busy_s=b, loss=l, tokens=t, items=i, loss_units=0, plan_hash=1.0, next_plan_hash=0.0)
            for b, l, t, i in values]


def test_step_metrics_imbalance():
    plan = StepPlan.from_dict({"items": [{"ranks": [0], "samples": [0], "lengths": [100], "recompute": 1},
                                         {"ranks": [0, 1], "samples": [1], "lengths": [100], "recompute": 0}]})
    m = step_metrics(_rows((1.0, 0.5, 100, 2), (0.5, 0.25, 50, 1)), epoch=0, step=3, step_s=2.0, plan=plan,
                     global_tokens=200, loss=0.75)
    assert m.idle_s == [0.0, 0.5] and abs(m.imbalance - 0.25) < 1e-12
    assert m.tokens_per_s == 100.0 and m.sp_sizes == [1, 2] and m.loss == 0.75
    assert m.as_log_dict()["dcp/microbatches_max"] == 2.0


def test_grad_buckets_park_and_restore():
    ps = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2)), torch.nn.Parameter(torch.randn(5))]
    b = GradBuckets(ps, cap_bytes=24)
    assert len(b.buffers) == 3
    ps[0].grad, ps[1].grad = torch.ones(3), torch.full((2, 2), 2.0)
    b.park()
    assert all(p.grad is None for p in ps) and b.has_grad.tolist() == [1, 1, 0]
    b.reduce(None)
    assert torch.equal(ps[1].grad, torch.full((2, 2), 2.0)) and ps[2].grad is None


def test_step_row_round_trips_through_the_gathered_table():
    a = StepRow(busy_s=1.5, loss=2.0, tokens=10, items=2, loss_units=7, plan_hash=123.0, next_plan_hash=0.0, oom_item=3)
    b = StepRow(busy_s=0.5, loss=1.0, tokens=4, items=1, loss_units=5, plan_hash=123.0, next_plan_hash=0.0)
    table = torch.stack([a.to_tensor(torch.tensor([1.0, 0.0])), b.to_tensor(torch.tensor([1.0, 1.0]))])
    g = GatheredStep(table)
    assert g.rows == [a, b] and g.loss_units == 12.0 and g.failed_items == [2]
    assert g.has_grad.tolist() == [2.0, 1.0] and g.column("plan_hash") == [123.0, 123.0]
