"""The cost model the strategy plans with when it has neither a given nor a measured one."""

from __future__ import annotations

from typing import Sequence

from lightning_dcp.planning.cost_model import CostModel, ItemCost

__all__ = ["DefaultCostModel"]


def _no_ring(ring: int) -> None:
    if ring != 1:
        raise ValueError("DefaultCostModel prices no ring attention (prices_ring is False; a plan's ring items are "
                         "priced by CostModel.ring_cost); plan with ring=1")


class DefaultCostModel(CostModel):
    """Fallback cost model when neither ``cost_model=`` nor a profiler supplied one.

    Time of a micro-batch: ``sum(l^2) * 1e-9 + sum(l) * 1e-6`` (attention + linear work,
    arbitrary units) split over the SP size, plus ``1e-4`` per micro-batch and ``1e-5 * l / sp``
    of communication per SP rank when ``sp > 1``. Memory (arbitrary units): ``tokens / sp *
    (1 + num_layers - recompute)`` against a limit that holds ``max_tokens`` tokens on one rank
    without recomputation, so samples up to ``max_tokens`` (the strategy uses 4x the longest
    sample) run at SP size 1 and ranks are balanced by gradient accumulation (DCP-inter only).
    Measure the model (``DCPProfiler``) or pass a cost model to get SP and recompute choices.
    """

    memory_in_bytes = False

    def __init__(self, num_layers: int = 0, num_heads: int = 1, max_tokens: int = 1 << 16) -> None:
        self.num_layers = int(num_layers)
        self.num_heads = max(1, int(num_heads))
        self.max_tokens = int(max_tokens)
        self.memory_limit = float(self.max_tokens * (1 + self.num_layers))

    def describe_limit(self) -> str:
        """The limit is tokens, not bytes."""
        return (f"{self.max_tokens} tokens per rank without recompute (DefaultCostModel(max_tokens=...): no measured "
                "memory; measure the model with DCPProfiler or pass a cost model)")

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        _no_ring(ring)
        lin = sum(lengths) * 1e-6
        sq = sum(n * n for n in lengths) * 1e-9
        per_layer = (lin + sq) / max(1, self.num_layers or 1)
        comm = 1e-5 * sum(lengths) / sp if sp > 1 else 0.0
        return ItemCost(compute=(lin + sq) / sp, recompute=per_layer * recompute / sp, comm=comm, overhead=1e-4,
                        ideal=(lin + sq) / sp)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        _no_ring(ring)
        return sum(lengths) / sp * (1 + self.num_layers - recompute)

    def step_overhead(self, world_size: int) -> float:
        return 1e-3

    def signature(self) -> dict:
        return {"kind": "default", "num_layers": self.num_layers, "num_heads": self.num_heads,
                "max_tokens": self.max_tokens}
