"""Out-of-memory inside a step: re-plan the step without the shape that failed, or stop cleanly.

What happens when ``torch.OutOfMemoryError`` hits a work item (see :mod:`lightning_dcp.strategy`):

- **SP 1 item** (no partner waits on this rank inside a collective): the rank frees the item,
  skips its other SP-1 items (it still runs its SP > 1 items, whose partners need it), and flags
  the failed item on the step-end all-gather. Every rank then discards the step's gradients, the
  step is re-planned with a :class:`LoweredMemory` cost model whose limit sits just below the
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
  weights equal those of a run without the fault. No file is written with ``zero1=True`` (the
  optimizer state is sharded; gathering it needs every rank) or ``DCPStrategy(oom_checkpoint=False)``.

The planner stays pure: a re-plan is a new planner over a lowered cost model, deterministic on
every rank, built from what every rank agreed on (the step plan and the gathered failure flags).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_dcp.planning.cost_model import CostModel, ItemCost

__all__ = ["CHECKPOINT_KEY", "OOM_ERRORS", "LoweredMemory", "StepOutOfMemoryError", "lowered_limit"]

#: What counts as an out-of-memory error (``torch.cuda.OutOfMemoryError`` is the same class).
OOM_ERRORS: tuple[type[BaseException], ...] = tuple({getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),
                                                     torch.cuda.OutOfMemoryError})

#: Margin below a failed item's estimated memory for the re-plan's limit.
MARGIN = 0.95


class StepOutOfMemoryError(RuntimeError):
    """A step ran out of memory and could not be re-planned (SP > 1, or too many attempts).

    ``this_rank_only`` is true where only the rank that hit the error raises it (SP > 1; its
    partners fail in a collective): that rank's message is the one to show."""

    def __init__(self, message: str, *, this_rank_only: bool = False) -> None:
        super().__init__(message)
        self.this_rank_only = this_rank_only


class LoweredMemory(CostModel):
    """``base`` with a lower ``memory_limit``: what a re-plan after an out-of-memory error plans with.

    Args:
        base: the cost model the step was planned with.
        memory_limit: the new limit (below ``base.memory_limit``).
    """

    def __init__(self, base: CostModel, memory_limit: float) -> None:
        self.base = base
        self.memory_limit = float(memory_limit)
        self.num_layers = base.num_layers
        self.num_heads = base.num_heads
        self.gpus_per_node = getattr(base, "gpus_per_node", 8)

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int) -> ItemCost:
        return self.base.item_cost(lengths, sp, recompute)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int) -> float:
        return self.base.item_memory(lengths, sp, recompute)

    def step_overhead(self, world_size: int) -> float:
        return self.base.step_overhead(world_size)

    def sp_sizes(self, world_size: int) -> list[int]:
        return self.base.sp_sizes(world_size)

    def signature(self) -> dict:
        return {"kind": "lowered-memory", "memory_limit": self.memory_limit, "base": self.base.signature()}


#: The key of an out-of-memory checkpoint's own entry: ``{"epoch", "step", "memory_limit", "item"}``.
CHECKPOINT_KEY = "dcp_oom"


def lowered_limit(cost_model: CostModel, failed: Sequence[Any]) -> float:
    """A memory limit just below the smallest estimate of the ``failed`` items (``lengths``,
    ``recompute`` and the SP size ``len(ranks)``, 1 without ``ranks``), and never above the current limit."""
    need = min(float(cost_model.item_memory(list(it["lengths"]), len(it.get("ranks", (0,))), int(it["recompute"])))
               for it in failed)
    return min(float(cost_model.memory_limit), need) * MARGIN


def sp_oom_message(where: str, item: str, rank: int, timeout_s: float | None, checkpoint: str | None = None,
                   memory_limit: float | None = None, no_checkpoint: str = "") -> str:
    """The error for an out-of-memory error in an SP > 1 item (the step cannot be retried in process)."""
    limit = f"{timeout_s:g} s" if timeout_s is not None else "the backend's time-out"
    head = (f"{where}: {item} ran out of memory on rank {rank}. Its SP partners may already wait inside the group's "
            f"collectives, so the step cannot be retried in process; the run stops (the partners fail when this rank "
            f"exits, at the latest after the collective time-out of {limit}). ")
    if checkpoint is not None:
        lowered = (f"re-planned with the memory limit lowered to {memory_limit / 2**30:.3g} GiB"
                   if memory_limit is not None else "re-planned by your planner with another step seed")
        return (head + f"The state before this step is saved in {checkpoint}: resume with trainer.fit(..., "
                f"ckpt_path={checkpoint!r}) and this step is {lowered}; no sample is skipped or trained twice")
    return (head + (f"No checkpoint was written ({no_checkpoint}). " if no_checkpoint else "")
            + "Lower the planner's memory limit (profile with a smaller DCPProfiler(memory_limit_bytes=...), or a cost "
            "model with a lower memory_limit) and resume: a checkpoint resumes from the last step saved before this one")
