"""A cost model with a lower memory limit: what a step is re-planned with after running out of memory.

Pure planning: the runtime (:mod:`lightning_dcp.runtime.oom`) decides *when* to re-plan; this
module says *with what*: the same costs, a limit just below the estimate of the item that failed,
so the planner packs fewer samples, recomputes more layers or uses more SP for that shape.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from lightning_dcp.planning.cost_model import CostModel, DelegatingCostModel
from lightning_dcp.planning.plan import WorkItem

__all__ = ["MARGIN", "LoweredMemory", "lowered_limit"]

#: Margin below a failed item's estimated memory for the re-plan's limit.
MARGIN = 0.95


class LoweredMemory(DelegatingCostModel):
    """``base`` with a lower ``memory_limit``: what a re-plan after an out-of-memory error plans with.

    Args:
        base: the cost model the step was planned with.
        memory_limit: the new limit (below ``base.memory_limit``).
    """

    describe_limit = CostModel.describe_limit  # this view's limit

    def __init__(self, base: CostModel, memory_limit: float) -> None:
        super().__init__(base)
        self.memory_limit = float(memory_limit)
        self.memory_limit_source = f"lowered after an out-of-memory error from {base.describe_limit()}"

    def signature(self) -> dict:
        return {"kind": "lowered-memory", "memory_limit": self.memory_limit, "base": self.base.signature()}


def lowered_limit(cost_model: CostModel, failed: Sequence[Mapping[str, Any]]) -> float:
    """A memory limit just below the smallest estimate of the ``failed`` items (``WorkItem.to_dict()``s: ``lengths``,
    ``recompute``, ``ranks`` (default one rank) and ``ring``), and never above the current limit."""
    from lightning_dcp.planning.item_pricing import item_memory_of

    def need(it: Mapping[str, Any]) -> float:
        lengths = tuple(int(n) for n in it["lengths"])
        item = WorkItem(tuple(it.get("ranks", (0,))), tuple(range(len(lengths))), lengths, int(it["recompute"]),
                        int(it.get("ring", 1)))
        return float(item_memory_of(cost_model, item))

    return min(float(cost_model.memory_limit), min(need(it) for it in failed)) * MARGIN
