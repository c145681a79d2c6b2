"""A small, fast, fully deterministic cost model for planner and simulator tests.

It has the shape of the real analytic model (paper eqs. 4-6): memory falls linearly in the
recompute count and grows linearly in tokens per device; time is linear + quadratic in the
lengths, with a GEMM-efficiency factor that punishes tiny micro-batches, an all-to-all term for
SP > 1 (slower across nodes), a per-micro-batch constant and recompute = r forward layers.
Units are arbitrary ("seconds", "bytes"). It offers the same fast paths as
``AnalyticCostModel`` (``fast_paths``: ``item_time_sum``, ``item_memory_tokens``) and prices no ring
(a plan's ring items on it: the estimate of ``CostModel.ring_cost``).
"""

from __future__ import annotations

from typing import Sequence

from lightning_dcp.planning.cost_model import CostModel, ItemCost


def _no_ring(ring: int) -> None:
    if ring != 1:
        raise ValueError(f"FakeCostModel prices no ring (prices_ring is False); got ring {ring}")


class FakeCostModel(CostModel):
    """Toy model: ``num_layers`` layers, ``memory_limit`` 100 units, up to SP 64 (``num_heads``)."""

    fast_paths = True

    def __init__(self, num_layers: int = 8, num_heads: int = 64, memory_limit: float = 100.0,
                 states: float = 20.0, act: float = 0.01, inp: float = 0.001, gpus_per_node: int = 8):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.memory_limit = memory_limit
        self.gpus_per_node = gpus_per_node
        self.states, self.act, self.inp = states, act, inp
        self.c_lin, self.c_sq, self.half_eff = 1e-6, 2e-10, 256.0
        self.c_comm, self.c_const = 2e-7, 1e-3

    # -- fast paths ---------------------------------------------------------------------
    def item_memory_tokens(self, tokens: int, sp: int, recompute: int, ring: int = 1) -> float:
        _no_ring(ring)
        per_dev = tokens / sp
        return self.states + per_dev * ((self.num_layers - recompute) * self.act + self.num_layers * self.inp)

    def _parts(self, tokens: int, sq_sum: float, n: int, sp: int, recompute: int) -> ItemCost:
        per_dev = tokens / sp
        flops_layer = (self.c_lin * tokens + self.c_sq * sq_sum) / sp
        eff = per_dev / (per_dev + self.half_eff) if per_dev > 0 else 1.0
        fwd = flops_layer / eff
        compute = 3 * fwd * self.num_layers
        rec = fwd * recompute
        comm = 0.0
        if sp > 1:
            slow = 4.0 if sp > self.gpus_per_node else 1.0
            comm = self.c_comm * per_dev * slow * (2 * self.num_layers + recompute) / 8
        ideal = 3 * flops_layer * self.num_layers
        return ItemCost(compute, rec, comm, self.c_const, ideal)

    def item_time_sum(self, tokens: int, sq_sum: float, n: int, sp: int, recompute: int, ring: int = 1,
                      ring_exposed: bool = True) -> float:
        _no_ring(ring)
        return self._parts(tokens, sq_sum, n, sp, recompute).total

    # -- the CostModel interface --------------------------------------------------------
    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        _no_ring(ring)
        return self._parts(sum(lengths), float(sum(n * n for n in lengths)), len(lengths), sp, recompute)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.item_memory_tokens(sum(lengths), sp, recompute, ring)

    def step_overhead(self, world_size: int) -> float:
        return 0.005 + 0.0005 * max(world_size - 1, 0).bit_length()

    def signature(self) -> dict:
        return {"kind": "fake", "num_layers": self.num_layers, "memory_limit": self.memory_limit}


class SlowPathCostModel(FakeCostModel):
    """The same numbers without the fast paths, to exercise the planner's fallbacks."""

    fast_paths = False
