"""Per-layer sharding inside the micro-batch loop: ``DCPStrategy(sharding="hsdp", shard_group_size=K)``.

Spawned gloo processes with hard time-outs (``run_distributed``); each run's final weights are compared
with the single-process reference on the same global batches (SGD with momentum: linear in the
gradients, so exact up to summation order):

- **2 processes, ZeRO-3 (K = 2)**: (a) a skewed plan, rank 0 one micro-batch and rank 1 seven every step
  (rank 0 runs six dummies in lockstep), within 1e-5; (b) plans mixing SP 1 and 2 with recompute 0..3,
  2K steps within 1e-5, and K steps written as a sharded checkpoint then resumed to 2K within 1e-6 of
  the uninterrupted run.
- **4 processes**: K = 2 (HSDP: 2-D mesh, the replicas' all-reduce in the last round only) and K = 4
  (ZeRO-3): a skewed plan (rank 0 one micro-batch, rank 3 seven: rank 1 and 2 run only dummies) and
  mixed SP 1/2(/4) plans with recompute, within 1e-5; the module's weights are sharded DTensors on the
  mesh of that K; resume from a sharded checkpoint with K = 2 within 1e-6.

Single process: the settings' errors, the round schedule, the memory the planner gets.
"""

from __future__ import annotations

import os
from typing import Sequence

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from _dcp_helpers import RandomPlanner, TinyLM, make_trainer, max_rel_err, reference_run
from _dist import run_distributed
from lightning_dcp import DCPStrategy
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.runtime.checkpoint import is_sharded_checkpoint
from lightning_dcp.planning.sharding.registry import get_mode
from lightning_dcp.planning.sharding.rounds import Lockstep
from lightning_dcp.runtime.sharding.states import ModelStates

LR = 0.05
K_STEPS = 2  # checkpoint after K_STEPS steps, compare after 2 * K_STEPS


class SkewPlanner:
    """Every step: rank 0 runs one micro-batch (one sample), the last rank the rest (one sample each)."""

    one_step_per_batch = True

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        pairs = list(zip(samples, lengths))
        ranks = [(0,)] + [(self.world_size - 1,)] * (len(pairs) - 1)
        return [StepPlan(tuple(WorkItem(r, (s,), (n,), i % 4) for i, (r, (s, n)) in enumerate(zip(ranks, pairs))))]


class PlanRecord(pl.Callback):
    """Keeps every step's plan (each rank, in memory)."""

    def __init__(self) -> None:
        self.plans: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.plans.append(batch.step.plan.to_dict())


def _fit(world: int, k: int, planner, steps: int, callbacks=(), ckpt_path=None, offload=False, **trainer_kw):
    record = PlanRecord()
    strategy = DCPStrategy(planner=planner, global_batch_size=8, seed=1, sharding="hsdp", shard_group_size=k,
                           offload=offload)
    module = TinyLM(lr=LR, optimizer="momentum")
    trainer = make_trainer(world, strategy, [record, *callbacks], max_steps=steps, **trainer_kw)
    trainer.fit(module, ckpt_path=ckpt_path)
    strategy = trainer.strategy
    assert strategy.mode.name == "hsdp" and strategy.shard_group_size == strategy.shards.mode.shard_group_size == k
    p = next(module.parameters())
    assert isinstance(p, DTensor) and p.device_mesh.ndim == (1 if k == world else 2)
    return module, trainer, record.plans


def _full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()}


def _check_reference(rank: int, weights: dict, plans: list[dict], steps: int, what: str) -> None:
    if rank != 0:
        return
    _, ref = reference_run(plans, steps, lr=LR, optimizer="momentum")
    for name, w in ref.items():
        err = max_rel_err(weights[name], w)
        assert err < 1e-5, f"{what}: weight {name} after {steps} steps: relative error {err:.2e}"


def _skewed(rank: int, world: int, k: int, offload: bool = False) -> None:
    module, _, plans = _fit(world, k, SkewPlanner(world), 2, offload=offload)
    last = world - 1
    assert all([sum(r in it["ranks"] for it in p["items"]) for r in (0, last)] == [1, 7] for p in plans), plans
    _check_reference(rank, _full_weights(module), plans, 2, f"hsdp K={k}{', offload' if offload else ''}, 1 vs 7 "
                                                             "micro-batches")


def _mixed_and_resume(rank: int, world: int, k: int, tmp: str, resume: bool) -> None:
    planner = RandomPlanner(world, seed=11, max_sp=k, force_mix=True)
    module, _, plans = _fit(world, k, planner, 2 * K_STEPS)
    full = _full_weights(module)
    sizes = sorted({len(it["ranks"]) for p in plans for it in p["items"]})
    assert sizes == [s for s in (1, 2, 4) if s <= k], sizes
    assert len({it["recompute"] for p in plans for it in p["items"]}) > 1
    _check_reference(rank, full, plans, 2 * K_STEPS, f"hsdp K={k}, mixed SP")
    if not resume:
        return
    ckdir = os.path.join(tmp, f"k{k}")
    ckpt = ModelCheckpoint(dirpath=ckdir, every_n_train_steps=K_STEPS, save_top_k=-1, save_last=False)
    _fit(world, k, planner, K_STEPS, [ckpt], enable_checkpointing=True)
    dist.barrier()
    paths = [os.path.join(ckdir, f) for f in sorted(os.listdir(ckdir))]
    assert len(paths) == 1 and is_sharded_checkpoint(paths[0]), paths
    module, _, resumed = _fit(world, k, planner, 2 * K_STEPS, ckpt_path=paths[0])
    assert resumed == plans[K_STEPS:]
    for name, w in _full_weights(module).items():
        assert max_rel_err(w, full[name]) < 1e-6, f"hsdp K={k} resumed: {name}"


def _two_processes(rank: int, world: int, tmp: str) -> None:
    _skewed(rank, world, 2)
    _mixed_and_resume(rank, world, 2, tmp, resume=True)


def test_hsdp_two_processes_skewed_mixed_sp_and_resume(tmp_path):
    """ZeRO-3 on 2 ranks: 1 vs 7 micro-batches per step and mixed SP with recompute equal the reference;
    a resumed run equals the uninterrupted one."""
    run_distributed(_two_processes, 2, str(tmp_path), timeout=500)


def _offloaded(rank: int, world: int) -> None:
    try:
        _skewed(rank, world, 2, offload=True)
    except ValueError as err:  # on CPU the shards are in host memory already: a clear refusal, on every rank
        assert "offload=True keeps the shards in host memory" in str(err) and "'cpu'" in str(err), err
    else:
        raise AssertionError("offload=True on CPU was not refused")


def test_hsdp_offload_on_cpu_is_refused_by_name():
    """FSDP2's CPUOffloadPolicy needs an accelerator: on CPU, offload=True stops at setup with the fix (the
    offloaded fit itself needs GPUs and is not run by this suite)."""
    run_distributed(_offloaded, 2, timeout=500)


def _four_processes(rank: int, world: int, tmp: str) -> None:
    for k in (2, 4):
        _skewed(rank, world, k)
        _mixed_and_resume(rank, world, k, tmp, resume=k == 2)


def test_hsdp_four_processes_shard_groups_of_two_and_world(tmp_path):
    """HSDP (K=2, 2-D mesh) and ZeRO-3 (K=4): skewed and mixed-SP plans equal the reference; resume (K=2)."""
    run_distributed(_four_processes, 4, str(tmp_path), timeout=800)


# ----------------------------------------------------------------------------- single process
def test_hsdp_settings_errors():
    with pytest.raises(ValueError, match="sharding='hsdp' only"):
        DCPStrategy(sharding="fsdp", shard_group_size=2)
    with pytest.raises(ValueError, match="sharding='hsdp' only"):
        DCPStrategy(offload=True)
    with pytest.raises(ValueError, match="shard_group_size must be an int"):
        DCPStrategy(sharding="hsdp", shard_group_size=0)
    settings = DCPStrategy(sharding="hsdp", shard_group_size=3).settings
    with pytest.raises(ValueError, match="must be a positive divisor of the world size"):
        get_mode("hsdp", 4, shard_group_size=3)
    assert settings.agreement()["sharding"] == "hsdp"


def test_rank_rounds_give_dummies_and_keep_order():
    """Rank 0 has one item, rank 1 three, rank 2-3 one SP-2 item: each group's ranks get the same round count."""
    plan = StepPlan((WorkItem((0,), (0,), (4,), 0), WorkItem((1,), (1,), (4,), 0), WorkItem((1,), (2,), (4,), 0),
                     WorkItem((1,), (3,), (4,), 0), WorkItem((2, 3), (4,), (4,), 0)))
    assert [Lockstep(2).rank_rounds(plan, 4, r) for r in range(4)] == [[0, None, None], [0, 1, 2], [0], [0]]
    assert [len(Lockstep(4).rank_rounds(plan, 4, r)) for r in range(4)] == [3] * 4
    assert Lockstep(2).dummy_rounds(plan, 4) == 2 and Lockstep(4).dummy_rounds(plan, 4) == 12 - 6
    idle = StepPlan((WorkItem((0,), (0,), (4,), 0),))  # ranks 2-3 have nothing: one dummy round (the all-reduce)
    assert [Lockstep(2).rank_rounds(idle, 4, r) for r in range(4)] == [[0], [None], [None], [None]]
    assert Lockstep(2).dummy_rounds(idle, 4) == 3
    with pytest.raises(Exception, match="spans two shard groups"):
        Lockstep(1).rank_rounds(StepPlan((WorkItem((1, 2), (0,), (4,), 0),)), 4, 0)


def test_hsdp_memory_for_the_planner():
    """The loop's static bytes under hsdp: (W + G + O)/K + B + 2R + 4L (offload: B + 2R + 4L)."""
    states = ModelStates(100.0, 4.0, 100.0, 200.0, sharding="hsdp", world_size=4, shard_group_size=2,
                         layer_bytes=10.0, root_bytes=20.0)
    assert states.step_bytes == 400.0 / 2 + 4.0 + 40.0 + 40.0
    assert states.rest_bytes == 204.0
    offloaded = ModelStates(100.0, 4.0, 100.0, 200.0, sharding="hsdp", world_size=4, shard_group_size=2,
                            layer_bytes=10.0, root_bytes=20.0, offload=True)
    assert offloaded.step_bytes == 84.0
