"""Sharded weights, gradients and optimizer state: ``DCPStrategy(sharding="zero2" | "fsdp")``.

Two process launches (``run_distributed``; every Trainer runs inside them), each mode in each:

- **4 processes**: the reduce-scatter's layout on uneven and empty shards; then 3 steps (SGD with momentum: optimizer state, and linear, so exact against the
  reference; AdamW's update amplifies summation-order noise in near-zero gradients) of plans
  that mix SP 1, 2 and 4 in every step, with uneven and empty ranks and recompute 0..3: the weights
  equal the single-process reference (1e-5), and the optimizer state really is split over the ranks.
  In every run of the file, the module's weights between steps are sharded DTensors under
  ``"fsdp"`` and full tensors under ``"zero2"``.
- **2 processes**: (a) 2K steps with gradient clipping equal the reference clipped the same way (the
  norm of sharded gradients is global), ``on_after_backward`` running once per step on the shards of the reduced
  gradients (their global norm: the reference's, before clipping); (b) K steps writing a sharded checkpoint directory, resumed
  to 2K, equal (a) (1e-6); (c) a planner that gives rank 0 one micro-batch and rank 1 seven, every
  step: the steps finish -- the launch's hard time-out is what would catch a hang -- and equal the
  reference, with validation inside the fit and validate / predict after it; (e) an out-of-memory error in an SP-1 micro-batch is re-planned in process and stays
  exact; (d) bad inputs fail on every rank with the reason: ranks passing different modes, an
  optimizer built over parameters the strategy did not shard.

Single-process checks: argument errors, the precision a mode refuses, a parameter fully_shard cannot
shard, and the memory each mode tells the planner.
"""

from __future__ import annotations

import os
from typing import Sequence

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.tensor import DTensor

from _dcp_helpers import AfterBackward, RandomPlanner, TinyLM, make_dataset, make_trainer, max_rel_err, reference_run
from _dist import run_distributed
from lightning_dcp import DCPStrategy
from lightning_dcp.data import plain_collate
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.runtime.checkpoint import is_sharded_checkpoint
from lightning_dcp.planning.cost_model import CostModel, ItemCost
from lightning_dcp.planning.sharding.base import UnplannableCostModel
from lightning_dcp.planning.sharding.registry import get_mode
from lightning_dcp.runtime.checks import check_precision
from lightning_dcp.runtime.sharding.fsdp import FsdpShards
from lightning_dcp.runtime.sharding.states import ModelStates, plan_cost_model
from lightning_dcp.sp.context import active_context

MODES = ("zero2", "fsdp")
LR = 0.05
K = 3  # checkpoint after K steps, compare after 2K
STEPS_4 = 3  # steps of the 4-process runs


class Record(pl.Callback):
    """Keeps every step's plan and whether the module's weights were sharded after it (each rank, in memory)."""

    def __init__(self) -> None:
        self.plans: list[dict] = []
        self.sharded_at_rest: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.plans.append(batch.step.plan.to_dict())
        self.sharded_at_rest.append(isinstance(next(pl_module.parameters()), DTensor))


class SkewPlanner:
    """Every step: rank 0 runs one micro-batch (one sample), rank 1 seven (one sample each), recompute 0..3."""

    one_step_per_batch = True

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        pairs = list(zip(samples, lengths))
        ranks = [(0,)] + [(1,)] * (len(pairs) - 1)
        return [StepPlan(tuple(WorkItem(r, (s,), (n,), i % 4) for i, (r, (s, n)) in enumerate(zip(ranks, pairs))))]


class OOMOnceLM(TinyLM):
    """Rank 1 raises torch.OutOfMemoryError once, in its first SP-1 micro-batch of step 1."""

    def __init__(self) -> None:
        super().__init__(lr=LR, optimizer="momentum")
        self.fired = False

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1 and self.trainer.global_rank == 1 and not self.fired and active_context().size == 1:
            self.fired = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
        return super().training_step(batch, batch_idx)


class EvalLM(TinyLM):
    """TinyLM with validation and predict steps (a val loss equal on every rank, logged with sync_dist)."""

    def __init__(self) -> None:
        super().__init__(lr=LR, optimizer="momentum")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss = torch.nn.functional.cross_entropy(self.model(batch).float(), batch["labels"], ignore_index=-100)
        self.log("val_loss", loss, sync_dist=True, batch_size=1)

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(batch).argmax(-1)

    def _loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(make_dataset(n=8), batch_size=2, collate_fn=plain_collate)

    val_dataloader = predict_dataloader = _loader


class CapturedParamsLM(TinyLM):
    """Builds its optimizer over parameters captured before the strategy sharded the module (wrong)."""

    def __init__(self) -> None:
        super().__init__()
        self.early = list(self.parameters())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.early, lr=LR)


def _full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank: the full weights (all-gathering DTensor shards)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()}


def _fit(world: int, mode: str, planner, steps: int, callbacks=(), ckpt_path=None, module=None, **trainer_kw):
    record = Record()
    strategy = DCPStrategy(planner=planner, global_batch_size=8, seed=1, sharding=mode)
    module = module if module is not None else TinyLM(lr=LR, optimizer="momentum")
    trainer = make_trainer(world, strategy, [record, *callbacks], max_steps=steps, **trainer_kw)
    trainer.fit(module, ckpt_path=ckpt_path)
    if mode != "none":
        assert record.sharded_at_rest == [mode == "fsdp"] * len(record.plans), record.sharded_at_rest
    return module, trainer, record.plans


def _check_reference(rank: int, weights: dict, plans: list[dict], steps: int, what: str, clip: float | None = None):
    if rank != 0:
        return
    _, ref = reference_run(plans, steps, lr=LR, optimizer="momentum", clip=clip)
    for name, w in ref.items():
        err = max_rel_err(weights[name], w)
        assert err < 1e-5, f"{what}: weight {name} after {steps} steps: relative error {err:.2e}"


def _check_split(trainer: pl.Trainer) -> None:
    """The optimizer state is sharded like the parameters it steps, each rank holding its part."""
    shards = trainer.strategy.shards
    local = total = 0
    opt = trainer.optimizers[0]
    for p in shards.sharded.values():
        state = opt.state[p]["momentum_buffer"]
        assert isinstance(state, DTensor) and state.to_local().shape == p.to_local().shape
        local += p.to_local().numel()
        total += p.numel()
    counts = torch.tensor([float(local)])
    dist.all_reduce(counts)
    assert counts.item() == total and local < total  # each rank holds its part, together the whole


class Uneven(torch.nn.Module):
    """Parameters whose dim 0 does not divide by 4, or is smaller than 4 (ranks with an empty shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(5, 3))
        self.b = torch.nn.Parameter(torch.zeros(2))
        self.c = torch.nn.Parameter(torch.zeros(1, 4))
        self.d = torch.nn.Parameter(torch.zeros(7))
        self.e = torch.nn.Parameter(torch.zeros(3))


def _reduce_scatter_layout(rank: int, world: int) -> None:
    """Full local gradients (rank r: (r + 1) * g, e unused on every rank) reduce-scatter into the right
    slices of fully_shard's uneven shards, in several buckets (a tiny cap), scaled once."""
    module = Uneven()
    shards = FsdpShards(module, get_mode("fsdp", world), torch.device("cpu"))
    shards.unshard()
    buckets = shards.grad_reduction(cap_bytes=64)
    assert len(buckets.keys) > 1
    base = {n: torch.arange(p.numel(), dtype=torch.float32).view_as(p) + 1 for n, p in shards.full.items()}
    buckets.begin()
    for n, p in shards.full.items():
        if n != "e":
            p.grad = base[n] * (rank + 1)
    buckets.park()
    has = torch.tensor([0.0 if n == "e" else world for n in shards.full])
    buckets.reduce(has, scale=0.5)
    total = sum(range(1, world + 1)) * 0.5
    for n, s in shards.sharded.items():
        if n == "e":
            assert s.grad is None
            continue
        assert s.grad.full_tensor().equal(base[n] * total), n
    shards.reshard()


def _mixed_sp_four(rank: int, world: int) -> None:
    _reduce_scatter_layout(rank, world)
    for mode in MODES:
        module, trainer, plans = _fit(world, mode, RandomPlanner(world, seed=world, force_mix=True), STEPS_4)
        _check_split(trainer)
        assert all(sorted({len(it["ranks"]) for it in p["items"]}) == [1, 2, 4] for p in plans), plans
        assert len({it["recompute"] for p in plans for it in p["items"]}) > 1
        _check_reference(rank, _full_weights(module), plans, STEPS_4, f"{mode} on 4 processes")


def test_sharded_exact_four_processes_mixed_sp():
    """SP 1/2/4 in every step, uneven and idle ranks, recompute: each mode equals the single-process reference."""
    run_distributed(_mixed_sp_four, 4, timeout=400)


def _two_processes(rank: int, world: int, tmp: str) -> None:
    clip = 0.05
    for mode in MODES:
        planner = RandomPlanner(world, seed=11, force_mix=True)
        # (a) uninterrupted, clipped
        after = AfterBackward()
        module, _, plans = _fit(world, mode, planner, 2 * K, [after], gradient_clip_val=clip)
        full = _full_weights(module)
        assert all(sorted({len(it["ranks"]) for it in p["items"]}) == [1, 2] for p in plans)
        _check_reference(rank, full, plans, 2 * K, f"{mode} clipped", clip=clip)
        # on_after_backward: once per step, on this rank's shards of the reduced (unclipped) gradients
        after.check(plans, 2 * K, lr=LR, optimizer="momentum")
        # (b) K steps, sharded checkpoint, resume to 2K
        ckdir = os.path.join(tmp, mode)
        ckpt = ModelCheckpoint(dirpath=ckdir, every_n_train_steps=K, save_top_k=-1, save_last=False)
        _fit(world, mode, planner, K, [ckpt], enable_checkpointing=True, gradient_clip_val=clip)
        dist.barrier()
        paths = [os.path.join(ckdir, f) for f in sorted(os.listdir(ckdir))]
        assert len(paths) == 1 and is_sharded_checkpoint(paths[0]), paths
        module, _, resumed_plans = _fit(world, mode, planner, 2 * K, ckpt_path=paths[0], gradient_clip_val=clip)
        assert resumed_plans == plans[K:]
        for name, w in _full_weights(module).items():
            assert max_rel_err(w, full[name]) < 1e-6, f"{mode} resumed: {name}"
        # (c) rank 0 runs 1 micro-batch per step, rank 1 runs 7; validation inside the fit, validate and
        # predict after it (the weights are gathered for evaluation and put back at rest)
        module, trainer, plans = _fit(world, mode, SkewPlanner(), 3, module=EvalLM(), limit_val_batches=2,
                                      val_check_interval=2)
        assert all([sum(r in it["ranks"] for it in p["items"]) for r in (0, 1)] == [1, 7] for p in plans), plans
        assert len(trainer.predict(module)) == 2 and "val_loss" in trainer.validate(module, verbose=False)[0]
        _check_reference(rank, _full_weights(module), plans, 3, f"{mode} with 1 vs 7 micro-batches")
        # (f) a second fit on the same trainer and strategy, after validate/predict, reuses the sharded units
        trainer.fit_loop.epoch_loop.max_steps = trainer.global_step + 1
        trainer.fit(module)
        assert trainer.global_step == 4
        # (e) out of memory in an SP-1 micro-batch: the step is re-planned in process and stays exact
        module, trainer, plans = _fit(world, mode, RandomPlanner(world, seed=5, force_mix=True), 2, module=OOMOnceLM())
        assert trainer.strategy.oom_replans == 1
        _check_reference(rank, _full_weights(module), plans, 2, f"{mode} after an out-of-memory re-plan")
    # (d) bad inputs: every rank raises the same error before any step
    with pytest.raises(ValueError, match="differs across ranks"):
        make_trainer(world, DCPStrategy(planner=RandomPlanner(world), global_batch_size=8,
                                        sharding=MODES[rank]), [], max_steps=1).fit(TinyLM())
    with pytest.raises(ValueError, match="not one of the module's sharded parameters"):
        make_trainer(world, DCPStrategy(planner=RandomPlanner(world), global_batch_size=8, sharding="fsdp"), [],
                     max_steps=1).fit(CapturedParamsLM())


def test_sharded_two_processes_clip_resume_skewed_counts_and_errors(tmp_path):
    """Per mode: clipped run = reference; resume from a sharded checkpoint = uninterrupted; 1 vs 7
    micro-batches per step finish (hard time-out of the launch) and are exact; a second fit on the same
    strategy works; bad inputs raise."""
    run_distributed(_two_processes, 2, str(tmp_path), timeout=500)


# ----------------------------------------------------------------------------- single process
def test_sharding_argument_errors_and_zero1_alias():
    with pytest.raises(ValueError, match="'fsdp'"):
        DCPStrategy(sharding="zero3")
    with pytest.raises(ValueError, match="contradict"):
        DCPStrategy(zero1=True, sharding="fsdp")
    with pytest.raises(TypeError, match="sharding"):
        DCPStrategy(shardng="fsdp")
    with pytest.warns(FutureWarning, match="sharding='zero1'"):
        strategy = DCPStrategy(zero1=True)
    assert strategy.settings.sharding == "zero1" and strategy.settings.zero1
    assert DCPStrategy(sharding="zero1").settings.zero1


def test_sixteen_mixed_refused_with_nearest_modes():
    plugin = MixedPrecision("16-mixed", "cpu")
    for mode in MODES:
        with pytest.raises(ValueError, match="bf16-mixed.*sharding='zero1'"):
            check_precision(plugin, mode)
    check_precision(MixedPrecision("bf16-mixed", "cpu"), "fsdp")


def test_unshardable_parameter_names_it_and_nearest_mode():
    module = TinyLM()
    module.temperature = torch.nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="'temperature' is a scalar.*sharding='zero1'"):
        FsdpShards(module, get_mode("fsdp", 2), torch.device("cpu"))


def test_gradients_accumulate_in_the_buckets():
    """``begin`` makes each ``.grad`` a view of its bucket slice: backward adds into the bucket (no second
    copy); a parameter backward never reached has no gradient."""
    from lightning_dcp.runtime.buckets import GradBuckets

    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    buckets = GradBuckets([used, unused], cap_bytes=1 << 20)
    for _ in range(2):
        buckets.begin()
        (used * 2.0).sum().backward()
        (used * 3.0).sum().backward()
        assert used.grad.data_ptr() == buckets.buffers[0].data_ptr()
        buckets.park()
        assert buckets.has_grad.tolist() == [1.0, 0.0] and used.grad is None
        buckets.reduce(None)
        assert used.grad.tolist() == [5.0] * 3 and unused.grad is None


def test_planner_memory_per_mode():
    """W=100, B=4, G=100, O=200 on 4 ranks: the loop's static bytes per mode, and what the planner subtracts."""
    from lightning_dcp.planning.profiled import ProfiledCostModel

    def states(mode: str) -> ModelStates:
        return ModelStates(100.0, 4.0, 100.0, 200.0, sharding=mode, world_size=4)

    assert [states(m).step_bytes for m in ("none", "zero1", "zero2", "fsdp")] == [404.0, 254.0, 279.0, 279.0]
    assert [states(m).rest_bytes for m in ("none", "zero1", "zero2", "fsdp")] == [404.0, 254.0, 204.0, 104.0]

    class Plain(CostModel):  # states nothing about sharding: used as given under the modes without a shard group
        num_layers, num_heads, memory_limit = 2, 4, 1e9

        def item_cost(self, lengths, sp, recompute, ring=1):
            return ItemCost(1.0, 0.0, 0.0, 0.0, 1.0)

        def item_memory(self, lengths, sp, recompute, ring=1):
            return 10.0 * sum(lengths)

        def step_overhead(self, world_size):
            return 0.0

        def signature(self):
            return {}

    class Declares(Plain):
        sharding = "zero1"

    with pytest.raises(UnplannableCostModel, match="sharding='zero1' but DCPStrategy runs sharding='fsdp'"):
        plan_cost_model(Declares(), states("fsdp"))

    class Adapts(Plain):
        def with_sharding(self, info: dict) -> dict:
            return info

    assert plan_cost_model(Adapts(), states("zero2"))["step_bytes"] == 279.0
    # a profile without the state split (param_bytes and memory_bytes only) plans with the runtime's bytes
    base = ProfiledCostModel(_tiny_profile())
    sharded = plan_cost_model(base, states("fsdp"))
    assert isinstance(sharded, ProfiledCostModel) and (sharded.sharding, sharded.world_size) == ("fsdp", 4)
    assert base.item_memory([64], 1, 0) - sharded.item_memory([64], 1, 0) == pytest.approx(404.0 - 279.0)
    assert plan_cost_model(sharded, states("fsdp")).signature() == sharded.signature()  # re-applied: the same
    assert plan_cost_model(base, states("none")).item_memory([64], 1, 0) == base.item_memory([64], 1, 0)
    plain = Plain()  # neither the hook nor a declared mode: used as given
    assert plan_cost_model(plain, states("fsdp")) is plain and plan_cost_model(base, None) is base
    # under hsdp a cost model whose memory is in bytes must say which states it counts, or it is refused
    hsdp = ModelStates(100.0, 4.0, 100.0, 200.0, sharding="hsdp", world_size=4, shard_group_size=2)
    with pytest.raises(UnplannableCostModel, match="Plain cannot plan sharding='hsdp'.*state_bytes"):
        plan_cost_model(plain, hsdp)


def _tiny_profile() -> dict:
    entries = [{"seq_len": n, "micro_batch": 1, "sp": 1, "forward_s": 1e-4 * n, "backward_s": 2e-4 * n,
                "activation_bytes": 100.0 * n, "input_bytes": 10.0 * n} for n in (16, 64, 256)]
    return {"schema": "lightning-dcp/profile/v1", "key": {}, "model": {"num_layers": 2, "num_heads": 4},
            "device": {"memory_limit_bytes": 1e9}, "entries": entries,
            "constant": {"time_s": 1e-4, "optimizer_s": 1e-3, "allreduce_s": 1e-3, "memory_bytes": 404.0,
                         "param_bytes": 100.0}}


def test_planner_memory_does_not_depend_on_allocated_optimizer_state():
    """The optimizer bytes the planner gets are the class estimate: the same before the first step and
    after a resume (a ZeroRedundancyOptimizer's uneven partitions would otherwise differ across ranks and
    stop a resumed zero1 run at the cost-model agreement check)."""
    strategy = DCPStrategy(sharding="zero1")
    module = TinyLM(optimizer="adamw")
    strategy.connect(module)
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    strategy.optimizers = [opt]
    before = strategy.model_states().optimizer
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # allocates exp_avg, exp_avg_sq (and step counters)
    assert strategy.model_states().optimizer == before == 2 * sum(p.numel() * 4 for p in module.parameters())
