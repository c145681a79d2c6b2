"""DCPBatchSampler / DCPDataLoader: equal length on all ranks, coverage, determinism, resume, errors."""

from __future__ import annotations

import pytest
import torch

from _dcp_helpers import RandomPlanner, make_dataset
from _fakes import FakeCostModel
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.runtime.lengths import resolve_lengths
from lightning_dcp.runtime.loader import DCPDataLoader
from lightning_dcp.runtime.sampler import DCPBatchSampler
from lightning_dcp.runtime.step import LoadedStep


def _sampler(rank=0, world=2, **kw):
    lengths = kw.pop("lengths", make_dataset().lengths)
    return DCPBatchSampler(lengths, planner=kw.pop("planner", RandomPlanner(world, seed=5)),
                           global_batch_size=kw.pop("gbs", 8) if "global_batch_tokens" not in kw else None,
                           num_replicas=world, rank=rank, seed=kw.pop("seed", 1), **kw)


def test_len_equal_and_items_cover_each_batch_once():
    samplers = [_sampler(r, 4, planner=RandomPlanner(4, seed=2)) for r in range(4)]
    assert len({len(s) for s in samplers}) == 1 and len(samplers[0]) == 48 // 8
    for steps in zip(*(list(s) for s in samplers)):
        descs = [x[0] for x in steps]
        plan = descs[0].plan
        assert all(d.plan == plan and d.plan_hash == descs[0].plan_hash for d in descs)
        seen = sorted(plan.samples)
        assert len(seen) == 8 and len(set(seen)) == 8
        for r, d in enumerate(descs):
            assert d.rank == r and d.world_size == 4
            assert [it.samples for it in d.items] == [it.samples for it in plan.items if r in it.ranks]
            for k, it in enumerate(d.items):
                assert it.ranks[it.sp_rank] == r and it.micro_batch == k and plan.items[it.index].samples == it.samples


def test_epoch_changes_order_and_is_deterministic():
    a, b = _sampler(), _sampler()
    e0 = [x[0].plan for x in a]
    assert e0 == [x[0].plan for x in b]
    a.sampler.set_epoch(1)  # Lightning's _set_sampler_epoch reaches batch_sampler.sampler
    assert [x[0].plan for x in a] != e0


def test_state_dict_resumes_mid_epoch_with_same_order():
    a = _sampler(plan_ahead=True)
    full = [x[0].plan for x in a]
    b = _sampler()
    it = iter(b)
    for _ in range(2):
        d = next(it)[0]
        b.mark_consumed(d.epoch, d.index)
    next(it)  # prefetched by Lightning but not trained: not in the state
    state = b.state_dict()
    assert state["step"] == 2
    c = _sampler()
    c.load_state_dict(state)
    assert [x[0].plan for x in c] == full[2:]
    assert [x[0].plan for x in c] == full  # the offset applies once


def test_state_at_epoch_end_moves_to_next_epoch():
    s = _sampler()
    s.load_state_dict({"epoch": 0, "step": len(s), "seed": 1, "num_replicas": 2})
    assert s.epoch == 1


def test_token_budget_batches():
    lengths = [10] * 20
    s = DCPBatchSampler(lengths, planner=RandomPlanner(2), global_batch_tokens=35, num_replicas=2, rank=0)
    batches = s.global_batches(0)
    assert all(sum(lengths[i] for i in b) <= 35 for b in batches) and len(batches) == 6  # 3 per batch, last dropped


class _Recording(RandomPlanner):
    """Records ``prepare`` (with the batches' lengths) and ``plan_batch`` (its step key) in call order."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls = []

    def prepare(self, batches):
        self.calls.append(("prepare", [list(b) for b in batches]))

    def plan_batch(self, samples, lengths, step=0):
        self.calls.append(("plan", step))
        return super().plan_batch(samples, lengths, step)


@pytest.mark.parametrize("plan_ahead", [False, True])
def test_the_planner_is_shown_each_epochs_batches_before_its_first_step(plan_ahead):
    """As ``Planner.plan`` does: ``prepare`` once per epoch with the lengths of its global batches, before any of
    them is planned (a tuned peer policy tunes on the run's own batches)."""
    from lightning_dcp.runtime.calibration import step_key

    planner = _Recording(2, seed=5)
    s = _sampler(planner=planner, plan_ahead=plan_ahead)
    lengths = s.lengths
    list(s)
    s.set_epoch(1)
    list(s)
    prepares = [k for k, c in enumerate(planner.calls) if c[0] == "prepare"]
    assert prepares == [0, len(s) + 1]
    for k, epoch in zip(prepares, (0, 1)):
        assert planner.calls[k][1] == [[lengths[i] for i in b] for b in s.global_batches(epoch)]
        assert planner.calls[k + 1:k + 1 + len(s)] == [("plan", step_key(epoch, i)) for i in range(len(s))]


class _MultiStep:
    """A bucket-like planner: each sample its own step on rank 0."""

    one_step_per_batch = False

    def plan_batch(self, samples, lengths, step=0):
        return [StepPlan((WorkItem((0,), (s,), (n,)),)) for s, n in zip(samples, lengths)]


def test_multi_step_planner_plans_epoch_up_front():
    s = _sampler(planner=_MultiStep(), gbs=4)
    assert len(s) == 48
    descs = [x[0] for x in s]
    assert len(descs) == 48 and all(len(d.items) == 1 for d in descs)
    s1 = _sampler(rank=1, planner=_MultiStep(), gbs=4)
    assert len(s1) == 48 and all(x[0].items == () for x in s1)  # a rank with no work still yields each step


def test_lengths_errors():
    class NoLengths(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"input_ids": torch.zeros(2, dtype=torch.long)}

    with pytest.raises(ValueError, match="give the dataset a `lengths` attribute"):
        resolve_lengths(NoLengths())
    assert resolve_lengths(NoLengths(), lambda ds: [2, 2, 2]) == [2, 2, 2]
    with pytest.raises(ValueError, match="3 samples"):
        resolve_lengths(NoLengths(), [1, 2])


def test_too_long_sample_named_before_its_step():
    cm = FakeCostModel(num_layers=4, num_heads=4)
    lengths = [10] * 15 + [10**9]
    s = DCPBatchSampler(lengths, planner=RandomPlanner(2), global_batch_size=4, num_replicas=2, rank=0,
                        cost_model=cm, shuffle=False)
    it = iter(s)
    next(it), next(it), next(it)
    with pytest.raises(PlanningError, match=r"sample 15 has 1000000000 tokens"):
        next(it)


def test_dataloader_packs_items_and_is_stateful():
    from lightning.fabric.utilities.types import _Stateful

    ds = make_dataset()
    s = _sampler(planner=RandomPlanner(2, seed=0, force_mix=True))
    dl = DCPDataLoader(ds, s)
    assert isinstance(dl, _Stateful) and len(dl) == len(s)
    batch = next(iter(dl))
    assert isinstance(batch, LoadedStep) and len(batch.batches) == len(batch.step.items) > 0
    for packed, it in zip(batch.batches, batch.step.items):
        assert packed["sample_indices"] == list(it.samples)
        assert packed["loss_mask"].shape[0] % it.sp_size == 0
        assert int(packed["loss_mask"].sum()) == sum(it.lengths)
