"""Per-rank speeds: how fast each rank computes relative to what the cost model predicts.

A rank at speed ``s`` runs a micro-batch in ``t / s`` seconds; an SP item on ranks ``R`` at its slowest member's pace,
``t / min(s[r] for r in R)`` (its all-to-alls make every member wait). Speed 1.0 everywhere is the cost model as is,
the same floats. Speeds are measured (:class:`~lightning_dcp.planning.calibration.Calibrator`, as ``rank_speeds`` of
a :class:`~lightning_dcp.planning.calibrated.CalibratedCostModel`) or given (``lightning-dcp simulate --rank-speed``).
Pure Python.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from lightning_dcp.planning.errors import PlanningError

__all__ = ["RANK_SPEED_SYNTAX", "check_rank_speeds", "group_speed", "parse_rank_speeds", "rank_speeds_of", "uniform"]

RANK_SPEED_SYNTAX = (
    "comma-separated RANKS:SPEED terms, RANKS a rank (5) or an inclusive range (0-7), SPEED a positive factor "
    "(0.7: 70% of the cost model's pace); later terms override earlier ones, unnamed ranks run at 1.0; "
    "e.g. '0-7:0.7' (the first 8-GPU node at 0.7x) or '0-7:0.7,12:0.5'"
)
"""What ``--rank-speed`` accepts (:func:`parse_rank_speeds`)."""


def parse_rank_speeds(spec: str, world_size: int) -> tuple[float, ...]:
    """Speeds of ``world_size`` ranks from ``spec`` (:data:`RANK_SPEED_SYNTAX`); :class:`PlanningError` naming a
    malformed term, a rank outside the world or a non-positive speed."""
    speeds = [1.0] * int(world_size)
    for term in (t.strip() for t in str(spec).split(",")):
        if not term:
            continue
        ranks, sep, value = term.partition(":")
        try:
            if not sep:
                raise ValueError
            lo_s, dash, hi_s = ranks.strip().partition("-")
            lo = int(lo_s)
            hi = int(hi_s) if dash else lo
            speed = float(value)
        except ValueError:
            raise PlanningError(f"rank speed term {term!r} is malformed; expected {RANK_SPEED_SYNTAX}") from None
        if not (0 <= lo <= hi < world_size):
            raise PlanningError(f"rank speed term {term!r} names ranks {lo}-{hi}, outside the world of "
                                f"{world_size} ranks (0-{world_size - 1})")
        if not (math.isfinite(speed) and speed > 0):
            raise PlanningError(f"rank speed term {term!r} has speed {value!r}; speeds must be positive and finite")
        for r in range(lo, hi + 1):
            speeds[r] = speed
    return tuple(speeds)


def check_rank_speeds(speeds: Sequence[float] | None, world_size: int) -> tuple[float, ...] | None:
    """``speeds`` as a tuple of floats, or None when absent or all 1.0; :class:`PlanningError` for a length other
    than ``world_size`` or a non-positive speed."""
    if speeds is None:
        return None
    out = tuple(float(s) for s in speeds)
    if len(out) != int(world_size):
        raise PlanningError(f"rank speeds name {len(out)} ranks but the world has {world_size}; give one speed per rank")
    bad = [(r, s) for r, s in enumerate(out) if not (math.isfinite(s) and s > 0)]
    if bad:
        raise PlanningError(f"rank speeds must be positive and finite; rank {bad[0][0]} has {bad[0][1]!r}")
    return None if uniform(out) else out


def uniform(speeds: Sequence[float] | None) -> bool:
    """True when there are no speeds or every one is exactly 1.0."""
    return speeds is None or all(s == 1.0 for s in speeds)


def group_speed(speeds: Sequence[float] | None, ranks: Sequence[int]) -> float:
    """Pace of an item on ``ranks``: its slowest member's speed (1.0 without speeds)."""
    return 1.0 if speeds is None else min(speeds[r] for r in ranks)


def rank_speeds_of(cost_model: Any) -> tuple[float, ...] | None:
    """The ``rank_speeds`` a cost model carries, looking through views that wrap another (``.base``), or None."""
    seen = 0
    cm = cost_model
    while cm is not None and seen < 16:
        got = getattr(cm, "rank_speeds", None)
        if got is not None:
            return tuple(float(s) for s in got)
        cm = cm.__dict__.get("base") if hasattr(cm, "__dict__") else None
        seen += 1
    return None
