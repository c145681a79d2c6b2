"""A cost model scaled by what the run measured: :class:`CalibratedCostModel`.

A view of any :class:`~lightning_dcp.planning.cost_model.CostModel` (analytic, profiled, a
:class:`~lightning_dcp.planning.sharding.hsdp_cost.ShardGroupCostModel`, a lowered-memory one) whose item
times are the base's times the refitted time scale of the item's SP size, and whose step overhead is
the measured one once the run measured it
(:class:`~lightning_dcp.planning.calibration.CalibrationFactors`). Memory is the base's, untouched:
a refit changes which plan is fastest, never whether a plan fits. ``rank_speeds`` carries the
per-rank speeds for the planner and the simulator (:mod:`~lightning_dcp.planning.speeds`).

It composes both ways with the sharding view: ``CalibratedCostModel(ShardGroupCostModel(...))``
scales the whole round time (what a run under ``sharding="hsdp"`` measures per item), and
``ShardGroupCostModel(CalibratedCostModel(...))`` adds unscaled collectives to scaled compute;
the sharding it states (``sharding``, ``state_bytes``, ``rounds``, ``collective_prices``) and attributes
the view does not define (``shard_group_size``, ...) are the base's. Pure Python.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from lightning_dcp.planning.calibration import CalibrationFactors
from lightning_dcp.planning.cost_model import CostModel, ItemCost, prices_ring_of
from lightning_dcp.planning.cost_model import ring_kwargs as _ring

__all__ = ["CalibratedCostModel"]


class CalibratedCostModel(CostModel):
    """``base`` with item times scaled per SP size and the measured step overhead; memory and SP sizes unchanged.

    Args:
        base: the cost model the run started with (the predictions the measurements compare with).
        factors: the calibrator's factors (default: all 1.0, i.e. the base's times exactly).
    """

    def __init__(self, base: CostModel, factors: CalibrationFactors | None = None) -> None:
        self.base = base
        self.factors = factors or CalibrationFactors()
        self.num_layers, self.num_heads = base.num_layers, base.num_heads
        self.gpus_per_node = getattr(base, "gpus_per_node", 8)
        self.memory_limit = float(base.memory_limit)
        self.sharding, self.state_bytes, self.rounds = base.sharding, base.state_bytes, base.rounds
        self.memory_in_bytes = base.memory_in_bytes
        self.collective_prices = base.collective_prices
        # the planner's fast paths, where the base has them (getattr checks must see them or not)
        time_sum = getattr(base, "item_time_sum", None)
        if callable(time_sum):
            scale = self.factors.scale
            self.item_time_sum = lambda tokens, sq_sum, n, sp, recompute, **ring: (
                time_sum(tokens, sq_sum, n, sp, recompute, **ring) * scale(sp))
        for name in ("item_memory_tokens", "attention_work"):
            got = getattr(base, name, None)
            if callable(got):
                setattr(self, name, got)

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found normally: the base's (sharding, shard_group_size, ...)
        if name in ("base", "__setstate__", "__getstate__") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def prices_ring(self) -> bool:  # type: ignore[override]
        return prices_ring_of(self.base)

    @property
    def rank_speeds(self) -> tuple[float, ...] | None:
        """Per-rank speeds for the planner (None: all 1.0)."""
        return self.factors.rank_speeds

    def scale(self, sp: int) -> float:
        """The time factor of SP size ``sp``."""
        return self.factors.scale(sp)

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        """The base's cost with every time part scaled (``ideal``, the peak-rate compute, is not)."""
        c = self.base.item_cost(lengths, sp, recompute, **_ring(ring))
        f = self.scale(sp)
        return replace(c, compute=c.compute * f, recompute=c.recompute * f, comm=c.comm * f, overhead=c.overhead * f)

    def item_time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.base.item_time(lengths, sp, recompute, **_ring(ring)) * self.scale(sp)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.base.item_memory(lengths, sp, recompute, **_ring(ring))

    def fits(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> bool:
        return self.base.fits(lengths, sp, recompute, **_ring(ring))

    def min_recompute(self, lengths: Sequence[int], sp: int, ring: int = 1) -> int | None:
        return self.base.min_recompute(lengths, sp, **_ring(ring))

    def max_length(self, sp: int, recompute: int | None = None, ring: int = 1) -> int:
        return self.base.max_length(sp, recompute, **_ring(ring))

    def step_overhead(self, world_size: int) -> float:
        """The measured step overhead where the run measured one, else the base's estimate."""
        measured = self.factors.step_overhead_s
        return self.base.step_overhead(world_size) if measured is None else measured

    def sp_sizes(self, world_size: int) -> list[int]:
        return self.base.sp_sizes(world_size)

    def ideal_time(self, lengths: Sequence[int]) -> float:
        return self.base.ideal_time(lengths)

    def signature(self) -> dict:
        """The base's signature and the factors: ranks planning with different factors disagree."""
        return {"kind": "calibrated", "factors": self.factors.to_dict(), "base": self.base.signature()}
