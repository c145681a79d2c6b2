"""A cost model scaled by what the run measured: :class:`CalibratedCostModel`.

A view of any cost model whose item times are the base's times the refitted time scale of the item's SP size, and
whose step overhead is the measured one once the run measured it
(:class:`~lightning_dcp.planning.calibration.CalibrationFactors`). Memory is the base's: a refit changes which plan
is fastest, never whether a plan fits. ``rank_speeds`` carries the per-rank speeds for the planner and the simulator
(:mod:`~lightning_dcp.planning.speeds`). Composes both ways with hsdp's view:
``CalibratedCostModel(ShardGroupCostModel(...))`` scales the whole round time (what a run under ``sharding="hsdp"``
measures per item), ``ShardGroupCostModel(CalibratedCostModel(...))`` adds unscaled collectives to scaled compute.
Pure Python.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from lightning_dcp.planning.calibration import CalibrationFactors
from lightning_dcp.planning.cost_model import CostModel, DelegatingCostModel, ItemCost

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.cost_model import Num

__all__ = ["CalibratedCostModel"]


class CalibratedCostModel(DelegatingCostModel):
    """``base`` with item times scaled per SP size and the measured step overhead; memory and SP sizes unchanged.
    Attributes the view does not define (``shard_group_size``, ``hardware``, ...) are the base's.

    Args:
        base: the cost model the run started with (the predictions the measurements compare with).
        factors: the calibrator's factors (default: all 1.0, i.e. the base's times exactly).
    """

    def __init__(self, base: CostModel, factors: CalibrationFactors | None = None) -> None:
        super().__init__(base)
        self.factors = factors or CalibrationFactors()

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found normally: the base's (shard_group_size, hardware, ...)
        if name in ("base", "__setstate__", "__getstate__") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def rank_speeds(self) -> tuple[float, ...] | None:
        """Per-rank speeds for the planner (None: all 1.0)."""
        return self.factors.rank_speeds

    def scale(self, sp: int) -> float:
        """The time factor of SP size ``sp``."""
        return self.factors.scale(sp)

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        """The base's cost with every time part scaled (``ideal``, the peak-rate compute, is not)."""
        c = self.base.item_cost(lengths, sp, recompute, ring)
        f = self.scale(sp)
        return replace(c, compute=c.compute * f, recompute=c.recompute * f, comm=c.comm * f, overhead=c.overhead * f)

    def item_time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.base.item_time(lengths, sp, recompute, ring) * self.scale(sp)

    def item_time_lower(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.base.item_time_lower(lengths, sp, recompute, ring) * self.scale(sp)

    def item_time_sum(self, tokens: Num, sq_sum: Num, n: Num, sp: int, recompute: Num, ring: int = 1,
                      ring_exposed: bool = True) -> Num:
        return self.base.item_time_sum(tokens, sq_sum, n, sp, recompute, ring, ring_exposed) * self.factors.scale(sp)

    def tp_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1, tp: int = 1) -> ItemCost:
        c = self.base.tp_cost(lengths, sp, recompute, ring, tp)
        f = self.scale(sp)
        return replace(c, compute=c.compute * f, recompute=c.recompute * f, comm=c.comm * f, overhead=c.overhead * f)

    def tp_time_sum(self, tokens: Num, sq_sum: Num, n: Num, sp: int, recompute: Num, ring: int = 1, tp: int = 1,
                    ring_exposed: bool = True) -> Num:
        return self.base.tp_time_sum(tokens, sq_sum, n, sp, recompute, ring, tp, ring_exposed) * self.factors.scale(sp)

    def step_overhead(self, world_size: int) -> float:
        """The measured step overhead where the run measured one, else the base's estimate."""
        measured = self.factors.step_overhead_s
        return self.base.step_overhead(world_size) if measured is None else measured

    def signature(self) -> dict:
        """The base's signature and the factors: ranks planning with different factors disagree."""
        return {"kind": "calibrated", "factors": self.factors.to_dict(), "base": self.base.signature()}
