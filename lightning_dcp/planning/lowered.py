"""A cost model with a lower memory limit: what a step is re-planned with after running out of memory.

Pure planning: the runtime (:mod:`lightning_dcp.runtime.oom`) decides *when* to re-plan; this
module says *with what*: the same costs, a limit just below the estimate of the item that failed,
so the planner packs fewer samples, recomputes more layers or uses more SP for that shape.
"""

from __future__ import annotations

from typing import Any, Sequence

from lightning_dcp.planning.cost_model import CostModel, ItemCost, prices_ring_of, ring_kwargs

__all__ = ["MARGIN", "LoweredMemory", "lowered_limit"]

#: Margin below a failed item's estimated memory for the re-plan's limit.
MARGIN = 0.95


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
        self.memory_limit_source = f"lowered after an out-of-memory error from {base.describe_limit()}"
        self.sharding, self.state_bytes, self.rounds = base.sharding, base.state_bytes, base.rounds
        self.memory_in_bytes = base.memory_in_bytes
        self.collective_prices = base.collective_prices

    @property
    def prices_ring(self) -> bool:  # type: ignore[override]
        return prices_ring_of(self.base)

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        return self.base.item_cost(lengths, sp, recompute, **ring_kwargs(ring))

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.base.item_memory(lengths, sp, recompute, **ring_kwargs(ring))

    def step_overhead(self, world_size: int) -> float:
        return self.base.step_overhead(world_size)

    def sp_sizes(self, world_size: int) -> list[int]:
        return self.base.sp_sizes(world_size)

    def signature(self) -> dict:
        return {"kind": "lowered-memory", "memory_limit": self.memory_limit, "base": self.base.signature()}


def lowered_limit(cost_model: CostModel, failed: Sequence[Any]) -> float:
    """A memory limit just below the smallest estimate of the ``failed`` items (``lengths``,
    ``recompute`` and the SP size ``len(ranks)``, 1 without ``ranks``), and never above the current limit."""
    need = min(float(cost_model.item_memory(list(it["lengths"]), len(it.get("ranks", (0,))), int(it["recompute"])))
               for it in failed)
    return min(float(cost_model.memory_limit), need) * MARGIN
