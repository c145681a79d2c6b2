"""The typed step (lightning_dcp.runtime.step) and the executor built from a plain RankRuntime."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from _dcp_helpers import TinyLM, make_dataset, max_rel_err, reference_run
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.runtime.agreement import plan_fingerprint
from lightning_dcp.runtime.executor import StepExecutor
from lightning_dcp.runtime.loader import StepDataset
from lightning_dcp.runtime.oom import OOMRecovery
from lightning_dcp.runtime.rank import RankRuntime
from lightning_dcp.runtime.settings import DCPSettings
from lightning_dcp.runtime.step import LoadedStep, PreparedStep, RankItem, Step, StepResult

PLAN = StepPlan((WorkItem((0, 1), (4, 7), (30, 12), 2), WorkItem((1,), (3,), (9,)), WorkItem((0,), (5, 6), (8, 20), 1),
                 WorkItem((2, 3), (1,), (40,))))



def _replicas(module):
    """The runtime of sharding="none" on one rank (what every RankRuntime holds)."""
    from lightning_dcp.planning.sharding.registry import get_mode
    from lightning_dcp.runtime.sharding.replicated import ReplicatedShards

    return ReplicatedShards(module, get_mode("none", 1))

def test_step_is_built_from_the_plan_for_each_rank():
    steps = [Step.build(PLAN, epoch=2, index=5, rank=r, world_size=4) for r in range(4)]
    assert [[it.index for it in s.items] for s in steps] == [[0, 2], [0, 1], [3], [3]]
    s0, s1 = steps[0], steps[1]
    assert [it.micro_batch for it in s1.items] == [0, 1] and [it.sp_rank for it in s1.items] == [1, 0]
    assert s0.items[0] == RankItem(index=0, micro_batch=0, ranks=(0, 1), sp_rank=0, samples=(4, 7), lengths=(30, 12),
                                   recompute=2)
    assert s0.items[1].work_item == PLAN.items[2] and s0.items[0].sp_size == 2
    assert s0.plan_hash == plan_fingerprint(PLAN.to_dict(), 2, 5) != plan_fingerprint(PLAN.to_dict(), 2, 6)
    assert all(s.plan_hash == s0.plan_hash for s in steps)  # what every rank compares
    assert s0.global_tokens == 119 and s0.global_samples == 6 and s0.plan_lengths == [30, 12, 9, 8, 20, 40]
    assert s0.items[1].describe() == "item 2 (samples [5, 6], lengths [8, 20], SP 1, recompute 1)"
    with pytest.raises(ValueError, match="rank 2 is not in item 0"):
        RankItem.of(PLAN.items[0], index=0, micro_batch=0, rank=2)


def test_step_values_are_immutable_and_replaced_not_edited():
    step = Step.build(PLAN, epoch=0, index=1, rank=0, world_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.index = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.items[0].recompute = 0
    assert isinstance(step.items, tuple)
    other = StepPlan((WorkItem((0,), (4, 7, 3, 5, 6, 1), (30, 12, 9, 8, 20, 40)),))
    replanned = step.with_plan(other)
    assert (replanned.epoch, replanned.index, replanned.rank) == (0, 1, 0) and replanned.plan == other
    assert step.plan == PLAN and replanned.plan_hash != step.plan_hash  # the original is untouched
    loaded = LoadedStep(step, ({"x": torch.zeros(2)}, {"x": torch.ones(2)}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.batches = ()
    with pytest.raises(ValueError, match="1 loaded micro-batches for 2 work items of rank 0"):
        LoadedStep(step, ({"x": torch.zeros(2)},))


def test_loaded_step_pickles_for_worker_processes():
    ds = make_dataset()
    plan = StepPlan((WorkItem((0,), (1, 2), (ds.lengths[1], ds.lengths[2])), WorkItem((0, 1), (3,), (ds.lengths[3],))))
    loaded = StepDataset(ds)[Step.build(plan, epoch=1, index=0, rank=0, world_size=2)]
    back = pickle.loads(pickle.dumps(loaded))
    assert back.step == loaded.step and back.step.plan.to_dict() == plan.to_dict()
    assert len(back.batches) == 2
    for a, b in zip(back.batches, loaded.batches):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def test_loaded_step_passes_lightning_precision_conversion_and_the_executor_converts_it():
    """Lightning's loop runs ``precision_plugin.convert_input`` over the batch before the strategy sees it."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    plan = StepPlan((WorkItem((0,), (1,), (3,)),))
    loaded = LoadedStep(Step.build(plan, epoch=0, index=0, rank=0, world_size=1), ({"x": torch.ones(3)},))
    precision = HalfPrecision("bf16-true")
    assert precision.convert_input(loaded) is loaded
    module = TinyLM()
    runtime = RankRuntime(module=module, settings=DCPSettings(support="safe"), backward=lambda loss: None,
                          shards=_replicas(module), support="safe", convert_input=precision.convert_input)
    executor = StepExecutor(runtime, None, None, None, OOMRecovery(None, max_replans=0, write_checkpoint=False))
    ready = executor.ready(loaded)
    assert ready.on_device and ready.micro_batches[0].data["x"].dtype == torch.bfloat16
    assert loaded.batches[0]["x"].dtype == torch.float32  # the loaded step is not edited


class _Groups:
    """Stands in for SPGroups: the group of an SP > 1 block is a marker object."""

    def __init__(self) -> None:
        self.marker = object()

    def group_for(self, ranks):
        return self.marker if len(ranks) > 1 else None


def test_sp_context_is_built_from_a_rank_item():
    step = Step.build(PLAN, epoch=0, index=0, rank=1, world_size=4)
    groups = _Groups()
    sp2, sp1 = step.items
    ctx = sp2.sp_context(groups)
    assert (ctx.group, ctx.size, ctx.rank, ctx.recompute, ctx.item) == (groups.marker, 2, 1, 2, PLAN.items[0])
    ctx = sp1.sp_context(groups)
    assert (ctx.group, ctx.size, ctx.rank, ctx.recompute, ctx.item) == (None, 1, 0, 0, PLAN.items[1])


def _executor(module: TinyLM, settings: DCPSettings) -> StepExecutor:
    runtime = RankRuntime(module=module, settings=settings, backward=lambda loss: loss.backward(),
                          shards=_replicas(module))
    oom = OOMRecovery(None, max_replans=0, write_checkpoint=False)
    return StepExecutor(runtime, sampler=None, step_dataset=None, cost_model=None, oom=oom)


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_executor_runs_a_step_from_a_plain_rank_runtime(reduction):
    """No strategy, no Trainer: the gradients equal those of plain training on the step's global batch."""
    torch.manual_seed(0)
    ds = make_dataset()
    plan = StepPlan((WorkItem((0,), (1,), (ds.lengths[1],), 1), WorkItem((0,), (2,), (ds.lengths[2],))))
    if reduction == "token":  # several samples in one micro-batch (a plain mean is re-weighted by its count)
        plan = StepPlan((WorkItem((0,), (1, 5), (ds.lengths[1], ds.lengths[5]), 1), *plan.items[1:]))
    module = TinyLM(reduction=reduction)
    executor = _executor(module, DCPSettings(loss_reduction=reduction))
    loaded = StepDataset(ds)[Step.build(plan, epoch=0, index=0, rank=0, world_size=1)]
    prepared = executor.prepare(loaded)
    assert isinstance(prepared, PreparedStep) and not prepared.on_device and prepared.step is loaded.step
    assert [mb.item for mb in prepared.micro_batches] == list(loaded.step.items)
    assert prepared.real_tokens == plan.tokens
    result = executor.run_step(prepared, 0)
    assert isinstance(result, StepResult) and result.plan == plan and not result.loss.requires_grad
    assert result.metrics.microbatches == [2] and result.metrics.global_tokens == plan.tokens
    assert result.metrics.loss == pytest.approx(float(result.loss))
    executor.reduce_gradients()
    want, _ = reference_run([plan.to_dict()], 1, dataset=ds, reduction=reduction)
    for name, p in module.named_parameters():
        assert max_rel_err(p.grad, want[name]) < 1e-5, name


def test_executor_refuses_a_batch_of_another_loader():
    executor = _executor(TinyLM(), DCPSettings())
    with pytest.raises(TypeError, match="expects the batches of its own train dataloader.*got dict"):
        executor.run_step({"input_ids": torch.zeros(3)}, 0)
    wrong_world = Step.build(PLAN, epoch=0, index=0, rank=0, world_size=4)
    with pytest.raises(RuntimeError, match="planned for 4 ranks but the world has 1"):
        executor.run_step(PreparedStep(wrong_world, (), on_device=True), 0)
