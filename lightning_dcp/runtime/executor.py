"""The step executor: runs one planned step on this rank and decides nothing.

Per optimizer step (one DataLoader item, a :class:`~lightning_dcp.runtime.step.LoadedStep`, see
:mod:`lightning_dcp.runtime.sampler` and :mod:`lightning_dcp.runtime.step`):

1. **prepare** (:meth:`StepExecutor.prepare`, on the host, before the batch moves to the device;
   gives a :class:`~lightning_dcp.runtime.step.PreparedStep`): per item, the module's ``dcp_prepare_batch`` (e.g. a per-sample label shift), token weights and
   loss units, this rank's shard (the module's ``dcp_shard_batch`` or the contiguous rule) and its
   loss-token count -- everything the step needs from the data is counted here, so the micro-batch
   loop never syncs the device;
2. **micro-batch loop** (:meth:`StepExecutor.run_items`): for each of this rank's items in plan
   order, activate its SP group and recompute count (:func:`~lightning_dcp.sp.context.sp_context`),
   call the user's ``training_step``, turn its loss into a sum over its loss units and run backward
   (the ``backward`` callable of the :class:`~lightning_dcp.runtime.rank.RankRuntime`);
   then park the gradients in flat buckets (:class:`~lightning_dcp.runtime.buckets.GradBuckets`);
3. **step-end gather** (:meth:`StepExecutor.gather`): one world all-gather of a
   :class:`~lightning_dcp.runtime.row.StepRow` per rank plus a has-gradient flag per parameter: the
   metrics, the exact global loss and its divisor, the plan hashes of this step and the next
   (:mod:`lightning_dcp.runtime.agreement`) and the out-of-memory flags
   (:class:`~lightning_dcp.runtime.oom.OOMRecovery`); then, in steps where some rank logged a value with
   ``self.log(..., sync_dist=True)`` in the loop, one more world all-gather reduces them
   (:class:`~lightning_dcp.runtime.step_logs.StepLogs`);
4. the strategy's ``optimizer_step`` then calls :meth:`StepExecutor.reduce_gradients`: one SUM
   all-reduce per bucket over the world, scaled by ``1 / global loss units``; then the strategy runs Lightning's
   ``on_after_backward`` once, on the reduced gradients.

The sharding mode's runtime (the :class:`~lightning_dcp.runtime.sharding.protocol.Shards` of the
:class:`~lightning_dcp.runtime.rank.RankRuntime`) decides what the step start, the rounds and the
reduction do: ``"zero2"`` / ``"fsdp"`` start with the weights' all-gather (before step 2; a no-op where
they are already full) and step 4 is a SUM reduce-scatter per bucket into the sharded gradients.

Manual optimization (:meth:`StepExecutor.run_manual_step`): steps 2 and 4 are the module's, driven through
:func:`~lightning_dcp.micro_batches` (:mod:`~lightning_dcp.runtime.manual`: a reduction at each loop's end);
step 3 runs after its ``training_step``, for the metrics and the plan hashes.

:meth:`StepExecutor.run_step` returns a :class:`~lightning_dcp.runtime.step.StepResult` (the exact
global loss, the metrics row, the plan that ran); the strategy logs it. The executor holds no
strategy: it is built from a :class:`~lightning_dcp.runtime.rank.RankRuntime`.

Collectives: inside the loop only the active SP group's (Ulysses all-to-alls; a ring item's P2P inside
its rings); before and after it, the world-wide ones above, the same number on every rank whatever its
item count -- and, before the first micro-batch of a step whose plan names SP groups that do not exist
yet, their creation (:meth:`~lightning_dcp.sp.groups.SPGroups.ensure`, every rank, sorted). Under
``sharding="hsdp"`` (:mod:`lightning_dcp.runtime.sharding.hsdp`) the loop runs the plan's lockstep rounds
of this rank's shard group instead (its item, or where it has none a dummy round that runs only the
shard group's per-layer collectives, :mod:`~lightning_dcp.runtime.sharding.dummy`); the round count
comes from the plan, whose hash the ranks compared before the step's first micro-batch, and an
out-of-memory error in a round stops the run as in an SP > 1 item.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dcp.planning.sample_names import name_samples
from lightning_dcp.runtime.agreement import STEP_CAUSE, check_column, plan_fingerprint
from lightning_dcp.runtime.calibration import slow_rank_clock
from lightning_dcp.runtime.collective_guard import CollectiveInLoopError, LoopCollectiveGuard
from lightning_dcp.runtime.faults import collective_error, is_collective_failure
from lightning_dcp.runtime.metrics import CalibrationMetrics, StepMetrics, step_metrics
from lightning_dcp.runtime.model import item_refusal
from lightning_dcp.runtime.oom import OOM_ERRORS, OOMRecovery, StepOutOfMemoryError
from lightning_dcp.runtime.rank import RankRuntime
from lightning_dcp.runtime.row import GatheredStep, StepRow
from lightning_dcp.runtime.sharding.protocol import GradReduction, Round
from lightning_dcp.runtime.step import LoadedStep, MicroBatch, PreparedStep, Step, StepResult
from lightning_dcp.runtime.step_logs import StepLogs

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.runtime.manual import ManualResult
from lightning_dcp.sp.context import sp_context
from lightning_dcp.sp.contract import local_batch, read_model
from lightning_dcp.sp.tokens import count_weighted_calls, is_weighted

__all__ = ["StepExecutor", "world_all_gather"]


def world_all_gather(t: Tensor, *, world_size: int, device: torch.device, step: Step | None = None,
                     what: str = "the step-end all-gather", timeout: timedelta | None = None) -> Tensor:
    """All-gather ``t`` over the world into ``[world, *t.shape]`` on the CPU (``[1, ...]`` without a world).

    A failed or timed-out collective during a step (``step`` given) becomes a
    :class:`~lightning_dcp.runtime.faults.CollectiveError` naming the step and ``what``.
    """
    if world_size == 1 or not dist.is_initialized():
        return t.unsqueeze(0)
    t = t.to(device if dist.get_backend() == "nccl" else torch.device("cpu"))
    out = [torch.empty_like(t) for _ in range(world_size)]
    try:
        dist.all_gather(out, t)
    except Exception as err:
        if step is None or not is_collective_failure(err):
            raise
        raise collective_error(err, epoch=step.epoch, step=step.index, what=what,
                               group=f"the world ({world_size} ranks)", timeout=timeout) from err
    return torch.stack(out).cpu()


class StepExecutor:
    """Runs the steps of one fit on this rank (built by the strategy when the train loader is).

    Args:
        runtime: this rank's :class:`~lightning_dcp.runtime.rank.RankRuntime` (module, settings, groups,
            device, backward...).
        sampler: the fit's :class:`~lightning_dcp.runtime.sampler.DCPBatchSampler` (``None``: no
            next-plan check, no re-plans).
        step_dataset: loads a re-planned step's micro-batches (``step_dataset[step]``).
        cost_model: what the fit plans with (the out-of-memory limits start from it).
        oom: the fit's :class:`~lightning_dcp.runtime.oom.OOMRecovery`.
        bounder: the per-step achievable bound for ``dcp/step_bound_fraction`` (``None``: not logged).
        calibration: the fit's :class:`~lightning_dcp.runtime.calibration.RunCalibration` (``None``: off).
    """

    def __init__(self, runtime: RankRuntime, sampler: Any, step_dataset: Any, cost_model: Any, oom: OOMRecovery,
                 bounder: Any = None, calibration: Any = None) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.sampler = sampler
        self.step_dataset = step_dataset
        self.cost_model = cost_model
        self.oom = oom
        self.bounder = bounder
        self.calibration = calibration
        # without calibration the slow-rank test hook (if set) still slows its rank
        self._clock = calibration.clock if calibration is not None else slow_rank_clock(runtime.device, runtime.rank,
                                                                                        runtime.world_size)
        self.buckets: GradReduction | None = None
        self.grads_parked = False
        self.in_micro_loop = False
        self.manual: Any = None
        """The running manual-optimization step's :class:`~lightning_dcp.runtime.manual.ManualDriver` (else
        ``None``)."""
        timeout = self.settings.timeout
        self.guard = LoopCollectiveGuard(runtime.module, runtime.rank, runtime.world_size,
                                         timeout.total_seconds() if timeout is not None else None)
        """Refuses world collectives from user code inside the loop (:mod:`~lightning_dcp.runtime.collective_guard`)."""
        self.step_logs = StepLogs(lambda: getattr(runtime.trainer, "_results", None))
        """The step's ``self.log(..., sync_dist=True)`` values, reduced after the step-end gather
        (:mod:`~lightning_dcp.runtime.step_logs`)."""
        self._world_has_grad: Tensor | None = None
        self._loss_divisor = 1.0
        self._verified_next: tuple[int, int] | None = None  # (epoch, step) whose plan all ranks already compared
        self._last_step_start: float | None = None

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    def _gather(self, t: Tensor, step: Step | None = None, what: str = "the step-end all-gather") -> Tensor:
        return world_all_gather(t, world_size=self.world_size, device=self.runtime.device, step=step, what=what,
                                timeout=self.settings.timeout)

    # ------------------------------------------------------------------ 1. prepare (host)
    def prepare(self, loaded: LoadedStep) -> PreparedStep:
        """Build this rank's micro-batches of ``loaded`` on the host (see the module docstring):
        :func:`~lightning_dcp.sp.contract.local_batch` per item."""
        runtime = self.runtime
        contract = runtime.contract if runtime.contract is not None else read_model(runtime.module,
                                                                                     support=runtime.support)
        reduction = self.settings.loss_reduction
        micro_batches = []
        for mb, it in zip(loaded.batches, loaded.step.items):
            local = local_batch(contract, mb, it.sp_rank, it.sp_size, reduction, lengths=list(it.lengths), ring=it.ring)
            micro_batches.append(MicroBatch(it, local.data, loss_units=local.loss_units,
                                            local_loss_tokens=local.local_loss_tokens,
                                            item_loss_tokens=local.item_loss_tokens, real_tokens=local.real_tokens))
        return PreparedStep(loaded.step, tuple(micro_batches), collated=runtime.support == "safe")

    def validate(self, step: Step) -> None:
        """The step fits this world: its world size, its ranks, Ulysses sizes that divide the heads, ring items only
        for a module that runs ring attention (:func:`~lightning_dcp.runtime.model.item_refusal`)."""
        runtime = self.runtime
        if step.world_size != runtime.world_size:
            raise RuntimeError(f"the step was planned for {step.world_size} ranks but the world has {runtime.world_size}")
        layout = self._ring_layout()
        for idx, item in enumerate(step.plan.items):
            ranks = list(item.ranks)
            if any(b <= a for a, b in zip(ranks, ranks[1:])) or ranks[0] < 0 or ranks[-1] >= runtime.world_size:
                raise ValueError(f"{step.where()}: item {idx} runs on ranks {ranks}, which are not distinct increasing "
                                 f"ranks of this world of {runtime.world_size}; fix the plan")
            if len(ranks) > 1 and runtime.sp_groups is None:
                raise ValueError(f"{step.where()}: item {idx} runs on ranks {ranks} but this run has no SP groups (SP size 1 "
                                 "only); fix the plan")
            problem = item_refusal(len(ranks), item.ring, runtime.num_heads, layout)
            if problem:
                raise ValueError(f"{step.where()}: item {idx} (samples {name_samples(item.samples, runtime.sample_name)}, "
                                 f"ranks {ranks}): {problem}")

    def _ring_layout(self) -> str | None:
        """The module's ring token layout (``None``: no ring attention)."""
        contract = self.runtime.contract
        return contract.ring_layout if contract is not None else "contiguous"

    def _ensure_groups(self, step: Step) -> None:
        """Create the SP groups ``step`` needs that do not exist yet (every rank, the same plan, sorted: see
        :class:`~lightning_dcp.sp.groups.SPGroups`), before its first micro-batch."""
        groups = self.runtime.sp_groups
        if groups is not None and self.world_size > 1:
            groups.ensure(step.plan.items)

    def ready(self, batch: Any) -> PreparedStep:
        """``batch`` prepared (:meth:`prepare`) and on the device (the strategy's ``batch_to_device``; a batch
        that bypassed it is made ready in :meth:`run_step`)."""
        if isinstance(batch, LoadedStep):
            batch = self.prepare(batch.with_batches(self.runtime.convert_input(batch.batches)))
        if not isinstance(batch, PreparedStep):
            raise TypeError("DCPStrategy.training_step expects the batches of its own train dataloader (a LoadedStep "
                            f"or PreparedStep); got {type(batch).__name__}. Did a custom train dataloader bypass "
                            "process_dataloader (e.g. a CombinedLoader of several loaders)?")
        return batch if batch.on_device else batch.to_device(self.runtime.to_device)

    # ------------------------------------------------------------------ the step
    def run_step(self, batch: LoadedStep | PreparedStep, batch_idx: int) -> StepResult:
        """Run this rank's micro-batches of one optimizer step; return the step's exact global loss and metrics."""
        prepared = self.ready(batch)
        self.validate(prepared.step)
        self.check_plan_before_loop(prepared.step)  # the plans agree before any group is created from them
        self.oom.begin_step()
        if self.oom.resume_due(prepared.step):
            prepared = self.oom.replan_resumed(prepared.step, self.cost_model, self._replan)
        now = time.perf_counter()
        step_s = now - self._last_step_start if self._last_step_start is not None else 0.0
        self._last_step_start = now
        self._begin_step()
        for attempt in range(self.oom.max_replans + 1):
            self._ensure_groups(prepared.step)  # a re-plan may name new groups
            busy, local_loss, failed = self.run_items(prepared, batch_idx)
            gathered = self.gather(prepared, busy, local_loss, failed)
            if not gathered.failed_items:
                break
            prepared = self.oom.replan_failed(prepared.step, gathered.failed_items, attempt, self.cost_model,
                                              self._replan, sample_name=self.runtime.sample_name)
        prediction = None
        if self.calibration is not None:
            planned = max(gathered.column("planned_upto"))
            prediction = self.calibration.after_step(gathered.measurements, prepared.step, planned)
        return self._finish(gathered, prepared.step, step_s, prediction)

    def run_manual_step(self, batch: LoadedStep | PreparedStep, batch_idx: int) -> "ManualResult":
        """Manual optimization: the module's ``training_step`` once, with a
        :class:`~lightning_dcp.runtime.manual.ManualStep` to loop over (:func:`~lightning_dcp.micro_batches`); each
        loop's end reduces the gradients (:class:`~lightning_dcp.runtime.manual.ManualDriver`). Then the step-end
        gather (metrics, the next plan's hash, a refused collective)."""
        from lightning_dcp.runtime.manual import ManualDriver, ManualResult, ManualStep

        prepared = self.ready(batch)
        step = prepared.step
        self.validate(step)
        self.check_plan_before_loop(step)
        now = time.perf_counter()
        step_s = now - self._last_step_start if self._last_step_start is not None else 0.0
        self._last_step_start = now
        self._begin_step()
        self._ensure_groups(step)
        runtime = self.runtime
        driver = self.manual = ManualDriver(self, prepared)
        results = getattr(runtime.trainer, "_results", None)
        if results is not None:  # self.log outside the loops: this rank's samples of the step
            results.batch, results.batch_size = None, driver.batch_size
        try:
            with runtime.train_step_context():
                output = runtime.module.training_step(ManualStep(prepared, driver), batch_idx)
            driver.end()
        except CollectiveInLoopError as err:  # raised in a loop's body: every rank stops at that loop's end
            driver.report_trip(err)
            raise
        finally:
            driver.abort()
            self.manual = None
        gathered = self.gather(prepared, driver.busy_s, 0.0)
        return ManualResult(output, self._metrics(gathered.rows, step, step_s, float("nan")), step)

    def _begin_step(self) -> None:
        """The mode's step start (``"fsdp"``: the weights' all-gather, before any micro-batch); the buckets once."""
        shards = self.runtime.shards
        shards.begin_step()
        if self.buckets is None:
            self.buckets = shards.grad_reduction(self.settings.bucket_cap_bytes)

    def _finish(self, gathered: GatheredStep, step: Step, step_s: float, prediction: Any = None) -> StepResult:
        """Park the divisor and the has-gradient flags for the reduction; the loss and the metrics row."""
        self._world_has_grad = gathered.has_grad
        divisor = gathered.loss_units
        self._loss_divisor = divisor if divisor > 0 else 1.0  # no loss token in the step: zero gradients
        self.grads_parked = True
        loss = float(sum(r.loss for r in gathered.rows)) / self._loss_divisor
        metrics = self._metrics(gathered.rows, step, step_s, loss, prediction)
        return StepResult(torch.tensor(loss, dtype=torch.float32, device=self.runtime.device), metrics, step)

    def _replan(self, step: Step, planner: Any, seed_offset: int) -> PreparedStep:
        """Plan ``step``'s samples again with ``planner``; the new step loaded, prepared and on the device."""
        new_plan = self.sampler.replan(step.epoch, step.index, step.plan, planner, seed_offset=seed_offset)
        return self.ready(self.step_dataset[step.with_plan(new_plan)])

    # ------------------------------------------------------------------ 2. micro-batch loop
    def run_items(self, prepared: PreparedStep, batch_idx: int) -> tuple[float, float, int]:
        """Forward and backward of this rank's items. Returns (busy seconds, summed loss, 1 + the plan
        index of an SP-1 item that ran out of memory or 0; see :mod:`lightning_dcp.runtime.oom`)."""
        self.buckets.begin()
        self.step_logs.begin()
        clock = self._clock
        if clock is not None:
            clock.begin()
        t0 = time.perf_counter()
        local_loss = torch.zeros((), dtype=torch.float64, device=self.runtime.device)  # no sync per item
        failed = 0
        step = prepared.step
        self.in_micro_loop = True
        shards, guard = self.runtime.shards, self.guard
        try:
            with guard.loop():
                for rnd in shards.rounds(step.plan, self.runtime.rank):
                    mb = prepared.micro_batches[rnd.position] if rnd.position is not None else None
                    if (failed or guard.tripped) and mb is not None and mb.item.sp_size == 1 and not rnd.lockstep:
                        continue  # the step is re-run or stops; SP > 1 items still run, their partners need this rank
                    shards.begin_round(rnd)
                    try:
                        with guard.round(self._round_name(step, mb), self._round_groups(rnd)):
                            if mb is None:
                                shards.run_dummy()
                            elif clock is None:
                                local_loss += self._run_item(mb, batch_idx)
                            else:
                                clock.start(mb)
                                local_loss += self._run_item(mb, batch_idx)
                                clock.stop()
                    except CollectiveInLoopError as err:
                        if rnd.lockstep:  # the shard group's rounds cannot be kept in step: stop this rank now
                            raise
                        guard.trip(err)  # reported to every rank by the step-end gather
                    except OOM_ERRORS as err:
                        if mb is None or mb.item.sp_size > 1 or rnd.lockstep:  # SP > 1 or lockstep: no per-rank re-plan
                            raise StepOutOfMemoryError(self._sp_oom_stop(step, mb, rnd), this_rank_only=True) from err
                        failed = mb.item.index + 1
                    except Exception as err:
                        if not is_collective_failure(err):
                            raise
                        raise self._collective_error(err, step, mb, rnd) from err
        finally:
            self.in_micro_loop = False
        if failed:  # free what the failed item left; every rank discards this attempt's gradients
            self._drop_grads()
            local_loss.zero_()
        self.buckets.park()
        loss = float(local_loss)  # the one host sync of the step: busy time includes all queued work
        return time.perf_counter() - t0, loss, failed

    def _round_name(self, step: Step, mb: MicroBatch | None) -> str:
        what = mb.item.describe(self.runtime.sample_name) if mb is not None else "a dummy round"
        return f"{step.where()}, {what}"

    def _round_groups(self, rnd: Round) -> tuple[Any, ...]:
        """The groups a lockstep round's per-layer collectives use (the shard mesh's), besides the SP groups."""
        mesh = getattr(self.runtime.shards, "mesh", None) if rnd.lockstep else None
        return tuple(mesh.get_all_groups()) if mesh is not None else ()

    def _collective_error(self, err: Exception, step: Step, mb: MicroBatch | None, rnd: Round) -> Exception:
        """A failed collective in a round, naming the step, the item (or the dummy round) and its group."""
        rank, k = self.runtime.rank, self.runtime.shards.mode.shard_group_size
        if mb is None:
            what, group = "a dummy round (no item on this rank)", f"the shard group of rank {rank} ({k} ranks)"
        else:
            it = mb.item
            what = it.describe(self.runtime.sample_name)
            group = f"SP group {list(it.ranks)}" if it.sp_size > 1 else f"rank {rank}"
            if rnd.lockstep:
                group += f" and its shard group ({k} ranks)"
        return collective_error(err, epoch=step.epoch, step=step.index, what=what, group=group,
                                timeout=self.settings.timeout)

    def _drop_grads(self) -> None:
        for p in self.buckets.params:
            p.grad = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _sp_oom_stop(self, step: Step, mb: MicroBatch | None, rnd: Round) -> str:
        self._drop_grads()  # this step's partial gradients are discarded; free them first
        runtime = self.runtime
        timeout = self.settings.timeout.total_seconds() if self.settings.timeout is not None else None
        return self.oom.sp_stop_message(step, mb.item if mb is not None else None, rank=runtime.rank, timeout_s=timeout, cost_model=self.cost_model,
                                        trainer=runtime.trainer, checkpoint_io=runtime.checkpoint_io,
                                        no_checkpoint_reason=runtime.shards.unsaveable_reason,
                                        lockstep=rnd.lockstep, sample_name=runtime.sample_name)

    def _run_item(self, mb: MicroBatch, batch_idx: int) -> Tensor:
        runtime = self.runtime
        module, it, local = runtime.module, mb.item, mb.data
        trainer = runtime.trainer
        results = getattr(trainer, "_results", None)
        if results is not None:  # what Lightning's self.log reads for the batch size
            results.batch, results.batch_size = local, len(it.samples)
        self.step_logs.weight = mb.log_weight
        with sp_context(it.sp_context(runtime.sp_groups, self._ring_layout() or "contiguous")):
            count_weighted_calls(reset=True)
            with runtime.train_step_context():
                out = module.training_step(local, batch_idx)
            loss = self._summed_loss(out, mb, weighted=count_weighted_calls(reset=True) > 0)
            runtime.backward(loss)
        value = loss.detach().double()
        if mb.local_loss_tokens == 0:  # a shard without loss tokens: its (0-weighted) loss may be NaN
            value = torch.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0)
        return value

    def _summed_loss(self, out: Any, mb: MicroBatch, weighted: bool = False) -> Tensor:
        """The item's loss as a *sum* over its loss units (the divisor comes once, at the step's end):
        :func:`~lightning_dcp.sp.tokens.weighted_loss` -- or anything built from it (``weighted``: the
        step called it) -- as is; a plain mean times its local count."""
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            name = type(self.runtime.module).__name__
            shape = "" if not isinstance(loss, Tensor) else " of shape " + str(tuple(loss.shape))
            raise TypeError(f"{name}.training_step must return a scalar loss tensor (or a dict with 'loss') under "
                            f"DCPStrategy; got {type(loss).__name__}{shape}")
        if weighted or is_weighted(loss):
            return loss
        local, samples = mb.local_loss_tokens, mb.item.samples
        if local == 0:
            return loss * 0.0
        if self.runtime.support == "safe" or self.settings.loss_reduction == "token":
            return loss * float(local)
        if len(samples) == 1:
            return loss * (local / mb.item_loss_tokens)
        raise ValueError(
            f"loss_reduction='sample' with a micro-batch packing {len(samples)} samples {list(samples)}: a plain "
            "mean cannot be re-weighted per sample; return lightning_dcp.weighted_loss(token_loss, batch) from "
            "training_step (token_loss = per-token loss with reduction='none')")

    # ------------------------------------------------------------------ 3. step-end gather
    def gather(self, prepared: PreparedStep, busy: float, local_loss: float, failed: int = 0) -> GatheredStep:
        """The step's one world all-gather (see the module docstring); checks the plan hashes."""
        step = prepared.step
        epoch, index = step.epoch, step.index
        nxt = self.sampler.next_plan(epoch, index + 1) if self.sampler is not None else None
        next_hash = plan_fingerprint(nxt.to_dict(), epoch, index + 1) if nxt is not None else 0.0
        upto = getattr(self.sampler, "planned_upto", -1) if self.sampler is not None else -1
        logs, logs_hash = self.step_logs.signature()
        row = StepRow(busy_s=busy, loss=local_loss, tokens=prepared.real_tokens, items=len(prepared.micro_batches),
                      loss_units=prepared.loss_units, plan_hash=step.plan_hash, next_plan_hash=next_hash,
                      oom_item=failed, planned_upto=upto, loop_collective=self.guard.flag, sync_logs=logs,
                      sync_logs_hash=logs_hash)
        rows = self.calibration.rows(step) if self.calibration is not None else None
        width = 0 if rows is None else rows.numel()
        gathered = GatheredStep(self._gather(row.to_tensor(self.buckets.has_grad, rows), step), width)
        where = f"at the end of {step.where()}"
        check_column(gathered.column("plan_hash"), f"the plan of {step.where()}", STEP_CAUSE, where)
        check_column(gathered.column("next_plan_hash"), f"the plan of step {index + 1} of epoch {epoch}", STEP_CAUSE,
                     where + ", one step before any rank runs it")
        self._verified_next = (epoch, index + 1) if next_hash else None
        self.guard.stop_if_tripped(gathered.column("loop_collective"),
                                   lambda t: self._gather(t, step, "the report of a collective inside training_step"))
        if not gathered.failed_items:  # an attempt that is re-run logs again
            self.step_logs.finish(gathered.column("sync_logs"), gathered.column("sync_logs_hash"),
                                  lambda t: self._gather(t, step, "the reduction of the step's sync_dist values"),
                                  lambda obj: self._gather_objects(obj, step))
        return gathered

    def _gather_objects(self, obj: Any, step: Step) -> list[Any]:
        """``obj`` of every rank, in rank order (an all-gather of picklable objects over the world)."""
        if self.world_size == 1 or not dist.is_initialized():
            return [obj]
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj)
        except Exception as err:
            if not is_collective_failure(err):
                raise
            raise collective_error(err, epoch=step.epoch, step=step.index, what="the reduction of the step's "
                                   "sync_dist values", group=f"the world ({self.world_size} ranks)",
                                   timeout=self.settings.timeout) from err
        return out

    def check_plan_before_loop(self, step: Step) -> None:
        """Compare this step's plan hash across ranks before its first micro-batch, unless the previous
        step's end already did (every step but a fit's, a resume's or an epoch's first)."""
        if self._verified_next == (step.epoch, step.index) or self.world_size == 1 or not dist.is_initialized():
            return
        gathered = self._gather(torch.tensor([step.plan_hash], dtype=torch.float64), step,
                                "the plan comparison before the first micro-batch")
        check_column(gathered[:, 0].tolist(), f"the plan of {step.where()}", STEP_CAUSE,
                     "before the step's first micro-batch")

    # ------------------------------------------------------------------ 4. the reduction
    def reduce_gradients(self) -> bool:
        """SUM all-reduce the parked gradients over the world and restore them as ``.grad`` (once per step);
        with sharded weights, SUM reduce-scatter them into the sharded gradients instead. ``False``: nothing was
        parked (nothing to reduce)."""
        if not self.grads_parked or self.buckets is None:
            return False
        self.grads_parked = False
        self.buckets.reduce(self._world_has_grad, world=self.world_size if dist.is_initialized() else 1,
                            scale=1.0 / self._loss_divisor)
        self.runtime.shards.after_reduce()
        return True

    # ------------------------------------------------------------------ metrics
    def _metrics(self, rows: list[StepRow], step: Step, step_s: float, loss: float, prediction: Any = None) -> StepMetrics:
        bound = self.bounder.seconds(step.plan_lengths) if self.bounder is not None else float("nan")
        rounds = self.runtime.shards.mode.rounds
        m = step_metrics(rows, epoch=step.epoch, step=step.index, step_s=step_s, plan=step.plan,
                         global_tokens=step.global_tokens, loss=loss, step_bound_s=bound,
                         dummy_rounds=rounds.dummy_rounds(step.plan, self.world_size))
        if prediction is not None:
            speeds = self.calibration.factors.rank_speeds
            m.calibration = CalibrationMetrics(prediction.predicted_s, prediction.base_predicted_s,
                                               prediction.measured_s, list(speeds) if speeds is not None else [],
                                               self.calibration.calibrator.refits, prediction.overhead_s)
        return m
