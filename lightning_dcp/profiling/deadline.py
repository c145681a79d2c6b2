"""The profile's time budget: :class:`ProfileDeadline`, wall seconds for the *whole* profile.

The budget counts from the profile's start (:class:`~lightning_dcp.profiling.DCPProfiler`: the start of its
``on_fit_start``, before the samples are read and the cache is looked up) to its end, the constant parts
included. :func:`~lightning_dcp.profiling.profile_module` asks it, before each optional grid point, whether the
point's forecast fits what is left, and again after the point's first (warm-up) pass; a point that does not fit
is skipped, the cost model fits what was measured and extrapolates, and :func:`skipped_line` says in one line
which lengths and settings were skipped and how to give the profile more time.

Pure Python; the clock is injectable (a test passes a fake one).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = ["DEFAULT_TIME_SOURCE", "ProfileDeadline", "Skip", "skipped_line"]

#: How messages name the time budget when the caller names nothing else.
DEFAULT_TIME_SOURCE = "DCPProfiler(time_budget_s=...)"


@dataclass(frozen=True)
class Skip:
    """One grid point (or the constant parts at a length, ``what="constant"``) left unmeasured, and why."""

    seq_len: int
    micro_batch: int
    sp: int
    forecast_s: float | None = None
    what: str = "point"

    def to_dict(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "micro_batch": self.micro_batch, "sp": self.sp, "what": self.what,
                "forecast_s": None if self.forecast_s is None else round(float(self.forecast_s), 3)}


@dataclass
class ProfileDeadline:
    """A budget of ``budget_s`` wall seconds (``None``: no budget) counted from ``start`` on ``clock``.

    The budget covers the whole profile, its constant parts included: the cheapest point of each SP size always
    runs; every other point runs only when it is forecast to end within the budget, else it is skipped and the
    cost model extrapolates (``meta.skipped_points``; :func:`skipped_line` says it in one line).

    Args:
        budget_s: seconds for the whole profile; ``None`` measures every point.
        clock: seconds, monotonic (default ``time.perf_counter``).
        start: the profile's start on ``clock`` (default: now).
        source: how messages name the setting that gives more time (default ``DCPProfiler(time_budget_s=...)``).
    """

    budget_s: float | None
    clock: Callable[[], float] = time.perf_counter
    start: float | None = None
    source: str = DEFAULT_TIME_SOURCE
    skipped: list[Skip] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.budget_s is not None and not self.budget_s >= 0:
            raise ValueError(f"time_budget_s must be >= 0 seconds or None, got {self.budget_s!r}")
        if self.start is None:
            self.start = self.clock()

    def elapsed(self) -> float:
        """Seconds since the start (this rank's clock; :func:`profile_module` agrees the maximum over ranks)."""
        return self.clock() - float(self.start)

    def allows(self, seconds: float, elapsed: float) -> bool:
        """Whether ``seconds`` more work, started ``elapsed`` seconds in, ends within the budget."""
        return self.budget_s is None or elapsed + max(0.0, seconds) <= self.budget_s

    def skip(self, skip: Skip) -> None:
        self.skipped.append(skip)


def _lengths(values: Sequence[int]) -> str:
    return "[" + ", ".join(str(v) for v in sorted(set(values))) + "]"


def skipped_line(meta: Mapping[str, Any], source: str | None = None) -> str | None:
    """One line for a profile that stopped at its budget (``None`` when nothing was skipped): the budget and the
    seconds it took, the lengths and settings skipped, what the cost model extrapolates from, and the fix.

    ``meta`` is the profile's ``meta`` section (``skipped_points``, ``time_budget_s``, ``profiling_s``,
    ``measured_lengths``); ``source`` names the setting that gives more time (default the profile's own)."""
    skips = [s for s in meta.get("skipped_points") or []]
    if not skips:
        return None
    points = [s for s in skips if s.get("what", "point") == "point"]
    constants = [s for s in skips if s.get("what") == "constant"]
    parts = []
    by_len: dict[int, set[tuple[int, int]]] = {}
    for s in points:
        by_len.setdefault(int(s["seq_len"]), set()).add((int(s["micro_batch"]), int(s["sp"])))
    for n in sorted(by_len):
        settings = sorted(by_len[n])
        mbs = sorted({b for b, _ in settings})
        sps = sorted({p for _, p in settings})
        parts.append(f"{n} tokens (micro-batch {'/'.join(map(str, mbs))}, SP {'/'.join(map(str, sps))})")
    if constants:
        parts.append("the constant parts at " + _lengths([int(s["seq_len"]) for s in constants]) + " tokens")
    measured = meta.get("measured_lengths") or []
    budget = meta.get("time_budget_s")
    took = float(meta.get("profiling_s") or 0.0)
    forecast = [float(s["forecast_s"]) for s in skips if s.get("forecast_s") is not None]
    more = (f"; about {math.ceil(took + sum(forecast))} s would measure them all" if len(forecast) == len(skips)
            else "")
    return (f"DCP profiling stopped at its {budget:g} s budget ({took:.1f} s): skipped {len(points)} of "
            f"{len(points) + int(meta.get('grid') or 0)} grid points, at {'; '.join(parts)}; the cost model fits the "
            f"measured lengths {_lengths(measured)} and extrapolates beyond them. Give it more time with "
            f"{source or meta.get('time_budget_source') or DEFAULT_TIME_SOURCE}{more}")
