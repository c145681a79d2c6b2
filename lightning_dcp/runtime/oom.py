"""Out-of-memory inside a step: re-plan the step without the shape that failed, or stop cleanly.

What happens when ``torch.OutOfMemoryError`` hits a work item (:class:`OOMRecovery` holds it all; the
executor, :mod:`lightning_dcp.runtime.executor`, calls it):

- **SP 1 item** (no partner waits on this rank inside a collective): the rank frees the item,
  skips its other SP-1 items (it still runs its SP > 1 items, whose partners need it), and flags
  the failed item on the step-end all-gather. Every rank then discards the step's gradients, the
  step is re-planned with a :class:`~lightning_dcp.planning.lowered.LoweredMemory` cost model whose limit sits just below the
  failed item's estimated memory (so the planner packs fewer samples, recomputes more layers or
  uses more SP for that shape) and run again: the same samples, each exactly once, so the weights
  equal those of a run without the fault. Each re-plan counts in ``dcp/oom_replans``; after
  ``max_oom_replans`` failures of the same step a :class:`StepOutOfMemoryError` stops the run.
- **SP > 1 item**: a partner may already wait inside the group's all-to-all, so the step cannot
  be retried in process. The failing rank writes a checkpoint of the state before the step (the
  optimizer has not stepped; model, optimizer, loops and sampler position are those of the step's
  start) to ``<default_root_dir>/dcp_oom/`` with the lowered memory limit for that step, then
  raises :class:`StepOutOfMemoryError` naming the file; its partners' collectives fail (peer gone)
  or time out (``DCPStrategy(timeout=...)``) and the run ends. ``trainer.fit(..., ckpt_path=that
  file)`` resumes at the failed step, re-planned with the lowered limit: the same samples, so the
  weights equal those of a run without the fault. No file is written with a ``sharding`` other than
  ``"none"`` (sharded states; gathering them needs every rank) or ``DCPStrategy(oom_checkpoint=False)``.

The planner stays pure: a re-plan is a new planner over a lowered cost model, deterministic on
every rank, built from what every rank agreed on (the step plan and the gathered failure flags).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.lowered import LoweredMemory, lowered_limit
from lightning_dcp.planning.padded import PaddedCostModel
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.planning.sample_names import SampleNamer
from lightning_dcp.runtime.faults import describe_item
from lightning_dcp.planning.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.runtime.step import PreparedStep, RankItem, Step

__all__ = ["CHECKPOINT_KEY", "OOM_ERRORS", "OOMRecovery", "StepOutOfMemoryError", "sp_oom_message"]

#: ``replan(step, planner, seed_offset) -> PreparedStep``: the step's samples planned again by
#: ``planner``, loaded, prepared and on the device (the executor provides it).
Replan = Callable[["Step", Any, int], "PreparedStep"]

#: What counts as an out-of-memory error (``torch.cuda.OutOfMemoryError`` is the same class).
OOM_ERRORS: tuple[type[BaseException], ...] = tuple({getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),
                                                     torch.cuda.OutOfMemoryError})

class StepOutOfMemoryError(RuntimeError):
    """A step ran out of memory and could not be re-planned (SP > 1, or too many attempts).

    ``this_rank_only`` is true where only the rank that hit the error raises it (SP > 1; its
    partners fail in a collective): that rank's message is the one to show."""

    def __init__(self, message: str, *, this_rank_only: bool = False) -> None:
        super().__init__(message)
        self.this_rank_only = this_rank_only


#: The key of an out-of-memory checkpoint's own entry: ``{"epoch", "step", "memory_limit", "item"}``.
CHECKPOINT_KEY = "dcp_oom"


def sp_oom_message(where: str, item: str, rank: int, timeout_s: float | None, checkpoint: str | None = None,
                   memory_limit: float | None = None, no_checkpoint: str = "", lockstep: bool = False) -> str:
    """The error for an out-of-memory error in an SP > 1 item or a lockstep round (the step cannot be retried
    in process)."""
    limit = f"{timeout_s:g} s" if timeout_s is not None else "the backend's time-out"
    partners = ("The other ranks of its shard group may already wait inside the round's per-layer collectives "
                "(lockstep rounds)" if lockstep else "Its SP partners may already wait inside the group's collectives")
    head = (f"{where}: {item} ran out of memory on rank {rank}. {partners}, so the step cannot be retried in process; "
            f"the run stops (the partners fail when this rank exits, at the latest after the collective time-out of "
            f"{limit}). ")
    if checkpoint is not None:
        lowered = (f"re-planned with the memory limit lowered to {format_bytes(memory_limit)}"
                   if memory_limit is not None else "re-planned by your planner with another step seed")
        return (head + f"The state before this step is saved in {checkpoint}: resume with trainer.fit(..., "
                f"ckpt_path={checkpoint!r}) and this step is {lowered}; no sample is skipped or trained twice")
    return (head + (f"No checkpoint was written ({no_checkpoint}). " if no_checkpoint else "")
            + "Lower the planner's memory limit (profile with a smaller DCPProfiler(memory_limit_bytes=...), or a cost "
            "model with a lower memory_limit) and resume: a checkpoint resumes from the last step saved before this one")


def _free_cuda_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OOMRecovery:
    """Everything the runtime does about out-of-memory errors, and the state it keeps for it.

    Args:
        planners: the fit's :class:`~lightning_dcp.runtime.planner_factory.PlannerFactory` (re-plans use it).
        max_replans: how often one step may be re-planned (``DCPStrategy(max_oom_replans=...)``).
        write_checkpoint: write the state before the step after an SP > 1 failure
            (``DCPStrategy(oom_checkpoint=...)``).
        resume_entry: a loaded out-of-memory checkpoint's entry (:data:`CHECKPOINT_KEY`), if any: its
            step is re-planned when it comes.
        replans: re-plans already counted this fit (a train loader built again mid-fit keeps counting).
    """

    def __init__(self, planners: Any, *, max_replans: int, write_checkpoint: bool,
                 resume_entry: Mapping[str, Any] | None = None, replans: int = 0) -> None:
        self.planners = planners
        self.max_replans = int(max_replans)
        self.write_checkpoint = bool(write_checkpoint)
        self.replans = int(replans)
        """Steps re-planned after an out-of-memory error this fit (logged as ``dcp/oom_replans``)."""
        self.resume_entry: Mapping[str, Any] | None = resume_entry
        """An out-of-memory checkpoint's entry, until its step is re-planned."""
        self.attempts = 0
        """Earlier out-of-memory stops of the current step (from a resumed checkpoint)."""
        self.lowered: CostModel | None = None
        """The lowered cost model of the current step's re-plans."""

    # -- per step ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A new step: a lowered limit applies to the re-plans of one step only."""
        self.lowered = None
        self.attempts = 0

    def resume_due(self, step: "Step") -> bool:
        """Whether ``step`` is the one a loaded out-of-memory checkpoint stopped in."""
        entry = self.resume_entry
        return entry is not None and (entry["epoch"], entry["step"]) == (step.epoch, step.index)

    def _seed_offset(self, attempt: int) -> int:
        """Step-seed offset for a user planner's re-plan: a new one for every attempt, across resumes."""
        return 7919 * (self.attempts + attempt + 1)

    def replan_resumed(self, step: "Step", cost_model: CostModel, replan: Replan) -> "PreparedStep":
        """The step that ran out of memory in an SP > 1 item before the resume, planned again with the
        checkpoint's lowered memory limit (a user's planner: with another step seed)."""
        entry, self.resume_entry = self.resume_entry, None
        self.attempts = int(entry.get("attempts", 1))
        self.replans += 1
        rank_zero_info(f"resuming after an out-of-memory error in {step.where()} ({entry['item']}): re-planning the "
                       "step with less memory")
        lengths = step.plan_lengths
        user_planner = self.planners.settings.planner
        try:
            if user_planner is not None or entry.get("memory_limit") is None:
                planner = user_planner if user_planner is not None else self.planners.planner(cost_model, lengths)
                return replan(step, planner, self._seed_offset(0))
            self.lowered = LoweredMemory(cost_model, min(float(entry["memory_limit"]), float(cost_model.memory_limit)))
            return replan(step, self.planners.planner(self.lowered, lengths), 0)
        except PlanningError as err:
            raise StepOutOfMemoryError(f"{step.where()} ran out of memory before the "
                                       f"resume ({entry['item']}), and cannot be re-planned with less memory: {err}. "
                                       "Resume from an earlier checkpoint with a smaller memory limit or more ranks, or "
                                       "split or drop the longest samples") from err

    def replan_failed(self, step: "Step", failed_items: list[int], attempt: int, cost_model: CostModel,
                      replan: Replan, sample_name: SampleNamer | None = None) -> "PreparedStep":
        """Every rank saw these plan items run out of memory at SP 1: re-plan the step's samples with the
        memory limit just below the failed items' estimate; the next attempt's prepared step (``sample_name``:
        the dataset's, naming the failed items' samples)."""
        epoch, index, plan = step.epoch, step.index, step.plan
        failed = [plan.items[i] for i in failed_items]
        what = "; ".join(describe_item(it, i, sample_name) for i, it in zip(failed_items, failed))
        self.replans += 1
        if attempt >= self.max_replans:
            raise StepOutOfMemoryError(
                f"step {index} of epoch {epoch} ran out of memory {attempt + 1} time(s) at SP 1 ({what}) and was re-planned "
                f"{attempt} time(s) with less memory; stopping. Lower the cost model's memory limit (profile with "
                "DCPProfiler(memory_limit_bytes=...)), split or drop long samples, or raise max_oom_replans")
        rank_zero_warn(f"step {index} of epoch {epoch}: {what} ran out of memory; re-planning the step with less memory "
                       f"(attempt {attempt + 1} of {self.max_replans}); no sample is skipped or trained twice")
        try:
            planner, offset = self._lowered_planner(plan, failed, attempt, cost_model)
            return replan(step, planner, offset)
        except PlanningError as err:
            raise StepOutOfMemoryError(f"step {index} of epoch {epoch}: {what} ran out of memory, and the step cannot be "
                                       f"re-planned with less memory: {err}") from err

    def _lowered_planner(self, plan: StepPlan, failed: list[WorkItem], attempt: int,
                         cost_model: CostModel) -> tuple[Any, int]:
        """(planner, step-seed offset) for a re-plan: the fit's planner over a cost model whose limit sits
        below the failed items; a user's planner is asked again with another step seed."""
        user_planner = self.planners.settings.planner
        if user_planner is not None:
            return user_planner, self._seed_offset(attempt + 1 if self.attempts else attempt)
        base = self.lowered if self.lowered is not None else cost_model
        batch_lengths = [n for it in plan.items for n in it.lengths]
        if isinstance(base, PaddedCostModel):
            limit = min(base.max_padded_tokens, min(PaddedCostModel.padded_tokens(list(it.lengths)) for it in failed) - 1)
            lowered: CostModel = PaddedCostModel(base.base, max(1, limit))
        else:
            lowered = LoweredMemory(base, lowered_limit(base, [it.to_dict() for it in failed]))
        self.lowered = lowered
        return self.planners.planner(lowered, batch_lengths), 0

    # -- SP > 1: stop with a checkpoint ----------------------------------------------------------
    def sp_stop_message(self, step: "Step", it: "RankItem | None", *, rank: int, timeout_s: float | None,
                        cost_model: CostModel | None, trainer: Any, checkpoint_io: Any,
                        no_checkpoint_reason: str | None = None, lockstep: bool = False,
                        sample_name: SampleNamer | None = None) -> str:
        """Out of memory in an SP > 1 item or a lockstep round (``it``: ``None`` in a dummy round): write the
        state before the step (unless ``no_checkpoint_reason`` or ``oom_checkpoint=False`` says not to) and
        return the error message (``sample_name``: the dataset's, naming the item's samples). The caller has
        already dropped the step's partial gradients."""
        _free_cuda_cache()
        what = it.describe(sample_name) if it is not None else "a dummy round (the shard group's collectives, no item)"
        args = (step.where(), what, rank, timeout_s)
        if not self.write_checkpoint:
            return sp_oom_message(*args, no_checkpoint="DCPStrategy(oom_checkpoint=False)", lockstep=lockstep)
        if no_checkpoint_reason:
            return sp_oom_message(*args, no_checkpoint=no_checkpoint_reason, lockstep=lockstep)
        attempts = self.attempts + 1
        if attempts > self.max_replans or it is None:
            why = "a dummy round has no item to re-plan" if it is None else (
                f"this step ran out of memory {attempts} times, across resumes; max_oom_replans is {self.max_replans}")
            return sp_oom_message(*args, no_checkpoint=why, lockstep=lockstep)
        limit = None
        if self.planners.settings.planner is None:
            limit = lowered_limit(self.lowered if self.lowered is not None else cost_model, [it.work_item.to_dict()])
        path = os.path.join(trainer.default_root_dir, "dcp_oom", f"epoch={step.epoch}-step={step.index}-rank={rank}.ckpt")
        entry = {"epoch": step.epoch, "step": step.index, "memory_limit": limit, "item": what,
                 "attempts": attempts}
        try:
            self._save(trainer, checkpoint_io, path, entry)
        except Exception as save_err:  # never hide the out-of-memory error behind a failed save
            return sp_oom_message(*args, no_checkpoint=f"saving {path} failed: {type(save_err).__name__}: {save_err}",
                                  lockstep=lockstep)
        return sp_oom_message(*args, checkpoint=path, memory_limit=limit, lockstep=lockstep)

    @staticmethod
    def _save(trainer: Any, checkpoint_io: Any, path: str, entry: dict) -> None:
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint[CHECKPOINT_KEY] = entry
        # Lightning counts a restart as if saved at a batch's end (+1 logger step); this step did not end
        epoch_loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict")
        if isinstance(epoch_loop, dict) and epoch_loop.get("_batches_that_stepped", 0) > 0:
            epoch_loop["_batches_that_stepped"] -= 1
        checkpoint_io.save_checkpoint(checkpoint, path)

    # -- checkpoints -----------------------------------------------------------------------------
    def clear(self) -> None:
        """At teardown: an out-of-memory checkpoint's entry lives for the one fit that loaded it."""
        self.resume_entry = None

