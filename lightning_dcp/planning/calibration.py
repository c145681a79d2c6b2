"""Plans that learn from the run: the refit of the cost model's time terms from per-item measurements.

The fit-start cost model is off in real steps and some ranks are slower than others. :class:`Calibrator` turns the
rows every rank measured (:mod:`~lightning_dcp.planning.measurements`, gathered at each step's end, the same on
every rank) into the factors :class:`~lightning_dcp.planning.calibrated.CalibratedCostModel` applies: a time scale
per SP size (measured / predicted at typical speed; ``default_scale`` for sizes not measured yet), a speed per rank
(relative to the median rank; an SP item runs at its slowest member's pace) and the step overhead (a step's seconds
beyond its slowest rank's predicted items). The refit, steps 1-6, and why every rank computes the same factors bit
for bit: docs/calibration.md, "How the refit works". Modes: ``"adaptive"`` (refit), ``"fixed"`` (the factors stay;
measurements are still compared with the predictions), ``"off"`` (every factor 1.0). Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

from lightning_dcp.planning.measurements import ItemMeasurement, StepTiming

__all__ = ["CalibrationConfig", "CalibrationFactors", "Calibrator", "MODES", "StepPrediction", "robust_mean",
           "robust_ratio"]

MODES = ("adaptive", "fixed", "off")


@dataclass(frozen=True)
class CalibrationConfig:
    """How the :class:`Calibrator` refits."""

    every: int = 20
    alpha: float = 0.5
    """Exponential smoothing: a factor moves this fraction of the way to its new estimate."""
    low: float = 0.25
    """Smallest factor (time scale or speed)."""
    high: float = 4.0
    max_change: float = 2.0
    """A factor changes by at most this ratio per refit."""
    min_samples: int = 3
    """Samples (items) a factor needs to be refitted."""
    mad_cut: float = 3.0
    rel_floor: float = 0.05

    def __post_init__(self) -> None:
        if int(self.every) < 1:
            raise ValueError(f"CalibrationConfig.every={self.every}: refit after at least 1 step")
        if not 0.0 < float(self.alpha) <= 1.0:
            raise ValueError(f"CalibrationConfig.alpha={self.alpha} must be in (0, 1]")
        if not 0.0 < float(self.low) <= 1.0 <= float(self.high):
            raise ValueError(f"CalibrationConfig low={self.low}, high={self.high}: need 0 < low <= 1 <= high")
        if float(self.max_change) < 1.0:
            raise ValueError(f"CalibrationConfig.max_change={self.max_change} must be >= 1")
        if int(self.min_samples) < 1:
            raise ValueError(f"CalibrationConfig.min_samples={self.min_samples} must be >= 1")


@dataclass(frozen=True)
class CalibrationFactors:
    """The refitted factors: what :class:`~lightning_dcp.planning.calibrated.CalibratedCostModel` scales by."""

    time_scale: tuple[tuple[int, float], ...] = ()
    """``(sp, factor)`` pairs, ascending SP."""
    default_scale: float = 1.0
    rank_speeds: tuple[float, ...] | None = None
    """None: all 1.0."""
    step_overhead_s: float | None = None
    """None: the base model's estimate."""

    def scale(self, sp: int) -> float:
        return next((f for p, f in self.time_scale if p == sp), self.default_scale)

    def to_dict(self) -> dict:
        return {"time_scale": {str(p): f for p, f in self.time_scale}, "default_scale": self.default_scale,
                "rank_speeds": None if self.rank_speeds is None else list(self.rank_speeds),
                "step_overhead_s": self.step_overhead_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CalibrationFactors:
        ts = tuple(sorted((int(p), float(f)) for p, f in dict(d.get("time_scale", {})).items()))
        speeds, overhead = d.get("rank_speeds"), d.get("step_overhead_s")
        return cls(ts, float(d.get("default_scale", 1.0)), None if speeds is None else tuple(float(s) for s in speeds),
                   None if overhead is None else float(overhead))


@dataclass(frozen=True)
class StepPrediction:
    """Predicted (current factors; ``base_``: uncalibrated) vs measured busy seconds of one step's slowest rank (what
    the runtime logs); ``overhead_s``: the predicted seconds outside the micro-batch loop."""

    step: int
    predicted_s: float
    base_predicted_s: float
    measured_s: float
    overhead_s: float = 0.0

    @property
    def relative_error(self) -> float:
        """``(measured - predicted) / measured`` (positive: the prediction was too low)."""
        return (self.measured_s - self.predicted_s) / self.measured_s if self.measured_s > 0 else 0.0


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _inliers(xs: Sequence[float], mad_cut: float, rel_floor: float) -> list[bool]:
    """Per sample: within ``mad_cut`` x 1.4826 x MAD (at least ``rel_floor`` x |median|) of the median."""
    med = _median(xs)
    cut = max(mad_cut * 1.4826 * _median([abs(x - med) for x in xs]), rel_floor * abs(med))
    return [abs(x - med) <= cut for x in xs]


def robust_mean(xs: Sequence[float], mad_cut: float = 3.0, rel_floor: float = 0.05) -> float:
    """Mean of the :func:`_inliers` of ``xs``; order-independent (``math.fsum``)."""
    kept = [x for x, ok in zip(xs, _inliers(xs, mad_cut, rel_floor)) if ok]
    return math.fsum(kept) / len(kept)


def robust_ratio(num: Sequence[float], den: Sequence[float], mad_cut: float = 3.0, rel_floor: float = 0.05) -> float:
    """``sum(num) / sum(den)`` over the pairs whose ratio is an inlier: the time-weighted scale, so the kept items'
    predicted total equals the measured one (a mean of ratios overweights short items). Order-independent."""
    kept = [(n, d) for n, d, ok in zip(num, den, _inliers([n / d for n, d in zip(num, den)], mad_cut, rel_floor)) if ok]
    return math.fsum(n for n, _ in kept) / math.fsum(d for _, d in kept)


@dataclass
class _Item:
    """One micro-batch of the window, its members' rows combined; ``measured = ratio x predicted``; ``computes``: per
    member measured minus all-to-all seconds (empty unless every member measured both)."""

    sp: int
    ranks: tuple[int, ...]
    ratio: float
    waits: tuple[float, ...]
    predicted: float = 0.0
    computes: tuple[float, ...] = ()


class Calibrator:
    """Refits per-SP-size time scales, per-rank speeds and the step overhead from gathered measurements (module
    docstring); ``factors``: the starting ones (default all 1.0)."""

    def __init__(self, world_size: int, config: CalibrationConfig | None = None, *, mode: str = "adaptive",
                 factors: CalibrationFactors | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"calibration mode {mode!r} is not one of {MODES}")
        self.world_size = int(world_size)
        self.config = config or CalibrationConfig()
        self.mode = mode
        self.factors = CalibrationFactors() if mode == "off" or factors is None else factors
        if self.factors.rank_speeds is not None and len(self.factors.rank_speeds) != self.world_size:
            raise ValueError(f"factors carry {len(self.factors.rank_speeds)} rank speeds for a world of {self.world_size}")
        self.window: list[ItemMeasurement] = []
        self.timings: list[StepTiming] = []
        self.step_rows: dict[int, list[ItemMeasurement]] = {}
        """Each recent step's item rows, until its timings arrive (one step later) for the step overhead."""
        self.steps_seen = 0
        self.refits = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def observe(self, measurements: Iterable[ItemMeasurement],
                timings: Iterable[StepTiming] = ()) -> CalibrationFactors | None:
        """Record one step's gathered measurements (all ranks') and the timings of an earlier step; the new factors
        when this completes ``config.every`` steps (``"adaptive"`` only), else None."""
        if self.mode == "off":
            return None
        rows = [m for m in measurements if 0 <= m.rank < self.world_size]
        self.steps_seen += 1
        if self.mode != "adaptive":
            return None
        self.window.extend(rows)
        self.timings.extend(t for t in timings if 0 <= t.rank < self.world_size)
        for m in rows:
            self.step_rows.setdefault(m.step, []).append(m)
        for k in sorted(self.step_rows)[:-(2 * int(self.config.every) + 1)]:  # never timed: forget
            del self.step_rows[k]
        if self.steps_seen % int(self.config.every):
            return None
        return self.refit()

    def predict(self, measurements: Iterable[ItemMeasurement], step: int = -1,
                base_overhead_s: float = 0.0) -> StepPrediction:
        """The step's :class:`StepPrediction`; its overhead the factors' measured one, else ``base_overhead_s``."""
        _, rows = self._items(measurements)
        meas = [0.0] * self.world_size
        for m in rows:
            meas[m.rank] += m.measured_s
        pred, base = self._busy(rows, self.factors), self._busy(rows, CalibrationFactors())
        overhead = self.factors.step_overhead_s
        return StepPrediction(step, max(pred, default=0.0), max(base, default=0.0), max(meas, default=0.0),
                              float(base_overhead_s) if overhead is None else overhead)

    def refit(self) -> CalibrationFactors:
        """New factors from the window's measurements (module docstring); clears the window."""
        items = self._combine(self.window)
        self.window = []
        cfg = self.config
        old = self.factors
        speeds = list(old.rank_speeds) if old.rank_speeds is not None else [1.0] * self.world_size
        est_scale: dict[int, float] = {}
        speed_samples: dict[int, list[float]] = {}
        per_rank: dict[int, list[float]] = {}  # SP-1 items: per-rank ratios; the median rank defines speed 1.0
        preds: dict[int, list[float]] = {}
        for it in items:
            if it.sp == 1:
                per_rank.setdefault(it.ranks[0], []).append(it.ratio)
                preds.setdefault(it.ranks[0], []).append(it.predicted)
        rank_ratio = {r: robust_ratio([x * p for x, p in zip(v, preds[r])], preds[r], cfg.mad_cut, cfg.rel_floor)
                      for r, v in sorted(per_rank.items()) if len(v) >= cfg.min_samples}
        first: dict[int, float] = {}
        if rank_ratio:
            s1 = est_scale[1] = _median(list(rank_ratio.values()))
            for r, v in sorted(per_rank.items()):
                speed_samples[r] = [s1 / x for x in v]
            first = {r: s1 / x for r, x in rank_ratio.items()}
        cur = self._timed_speeds(items, [first.get(r, speeds[r]) for r in range(self.world_size)], speed_samples)
        # SP items: scale per size at the slowest member's pace; untimed items: the sample to that member
        by_sp: dict[int, list[_Item]] = {}
        for it in items:
            if it.sp > 1:
                by_sp.setdefault(it.sp, []).append(it)
        for p, its in sorted(by_sp.items()):
            if len(its) < cfg.min_samples:
                continue
            sp_scale = robust_ratio([it.ratio * it.predicted * min(cur[r] for r in it.ranks) for it in its],
                                    [it.predicted for it in its], cfg.mad_cut, cfg.rel_floor)
            est_scale[p] = sp_scale
            for it in its:
                who = None if it.computes else _slowest(it, cur)
                if who is not None:
                    speed_samples.setdefault(who, []).append(sp_scale / it.ratio)
        adjusted = [it.ratio * it.predicted * min(cur[r] for r in it.ranks) for it in items]
        default = old.default_scale
        if len(adjusted) >= cfg.min_samples:
            estimate = robust_ratio(adjusted, [it.predicted for it in items], cfg.mad_cut, cfg.rel_floor)
            default = self._move(old.default_scale, estimate, first=self.refits == 0)
        scales = dict(old.time_scale)
        for p, e in est_scale.items():
            scales[p] = self._move(scales.get(p, old.default_scale), e, first=p not in scales)
        for r, v in speed_samples.items():
            if len(v) >= cfg.min_samples:
                speeds[r] = self._move(speeds[r], robust_mean(v, cfg.mad_cut, cfg.rel_floor),
                                       first=old.rank_speeds is None)
        rank_speeds = None if all(s == 1.0 for s in speeds) else tuple(speeds)
        new = CalibrationFactors(tuple(sorted(scales.items())), default, rank_speeds, old.step_overhead_s)
        overhead = self._overhead(new)
        if overhead is not None and old.step_overhead_s is not None:
            overhead = old.step_overhead_s + cfg.alpha * (overhead - old.step_overhead_s)
        self.factors = new if overhead is None else replace(new, step_overhead_s=overhead)
        self.refits += 1
        return self.factors

    def _timed_speeds(self, items: Sequence[_Item], cur: list[float],
                      speed_samples: dict[int, list[float]]) -> list[float]:
        """Step 3: speed samples from SP items with measured waits (into ``speed_samples``); ``cur`` updated by them."""
        cfg = self.config
        timed: dict[int, list[float]] = {}
        for it in items:
            if it.sp == 1 or not it.computes:
                continue
            work = math.fsum(cur[r] * c for r, c in zip(it.ranks, it.computes)) / len(it.ranks)
            for r, c in zip(it.ranks, it.computes):
                timed.setdefault(r, []).append(work / c)
        out = list(cur)
        for r, v in sorted(timed.items()):
            speed_samples.setdefault(r, []).extend(v)
            if len(v) >= cfg.min_samples:
                out[r] = robust_mean(speed_samples[r], cfg.mad_cut, cfg.rel_floor)
        return out

    def _overhead(self, factors: CalibrationFactors) -> float | None:
        """Step 5 under ``factors``, or None (too few whole steps: they wait for the next refit); the steps used are
        dropped."""
        by_step: dict[int, list[StepTiming]] = {}
        for t in sorted(self.timings, key=lambda t: t.to_floats()):
            by_step.setdefault(t.step, []).append(t)
        whole = [k for k, ts in sorted(by_step.items())
                 if len({t.rank for t in ts}) == self.world_size and k in self.step_rows]
        if len(whole) < self.config.min_samples:
            return None
        samples = [max(t.step_s for t in by_step[k]) - max(self._busy(self.step_rows[k], factors)) for k in whole]
        used = set(whole)
        self.timings = [t for t in self.timings if t.step not in used]
        self.step_rows = {k: v for k, v in self.step_rows.items() if k not in used}
        return max(0.0, robust_mean(samples, self.config.mad_cut, self.config.rel_floor))

    def _busy(self, measurements: Iterable[ItemMeasurement], factors: CalibrationFactors) -> list[float]:
        """Every rank's predicted seconds of its items in ``measurements`` under ``factors``."""
        items, _ = self._items(measurements)
        busy = [0.0] * self.world_size
        for first, ranks, _ in items.values():
            s = 1.0 if factors.rank_speeds is None else min(factors.rank_speeds[r] for r in ranks)
            for r in ranks:
                busy[r] += first.predicted_s * factors.scale(first.sp) / s
        return busy

    def _move(self, old: float, estimate: float, first: bool = False) -> float:
        """Step 6: ``old`` smoothed towards ``estimate`` (``first``: taken as is), at most ``max_change`` x, clamped."""
        cfg = self.config
        new = estimate if first else old + cfg.alpha * (estimate - old)
        new = min(max(new, old / cfg.max_change), old * cfg.max_change)
        return min(max(new, cfg.low), cfg.high)

    def _items(self, measurements: Iterable[ItemMeasurement]):
        """``({(step, item): (first row, ranks, rows)}, rows)`` of valid rows, in canonical order."""
        rows = sorted((m for m in measurements if 0 <= m.rank < self.world_size), key=ItemMeasurement.sort_key)
        grouped: dict[tuple[int, int], list[ItemMeasurement]] = {}
        for m in rows:
            grouped.setdefault((m.step, m.item), []).append(m)
        items = {}
        for key in sorted(grouped):
            ms = sorted(grouped[key], key=lambda m: (m.rank, m.sort_key()))
            items[key] = (ms[0], tuple(sorted({m.rank for m in ms})), ms)
        return items, rows

    def _combine(self, measurements: Iterable[ItemMeasurement]) -> list[_Item]:
        """One :class:`_Item` per ``(step, item)`` with a positive prediction, in canonical order."""
        items, _ = self._items(measurements)
        out = []
        for first, ranks, ms in items.values():
            measured = max(m.measured_s for m in ms)
            if first.predicted_s <= 0 or measured <= 0:
                continue
            waits = tuple(min(m.wait_s for m in ms if m.rank == r) for r in ranks)
            computes: tuple[float, ...] = ()
            if first.sp > 1 and len(ranks) == first.sp and all(w >= 0 for w in waits):
                computes = tuple(min(m.measured_s for m in ms if m.rank == r) - w for r, w in zip(ranks, waits))
                computes = computes if all(c > 0 for c in computes) else ()
            out.append(_Item(first.sp, ranks, measured / first.predicted_s, waits, first.predicted_s, computes))
        return out

    def state_dict(self) -> dict:
        """JSON-able state: mode, config, factors, the window's rows, counters."""
        return {"version": 2, "mode": self.mode, "world_size": self.world_size, "config": asdict(self.config),
                "factors": self.factors.to_dict(), "window": [m.to_floats() for m in self.window],
                "timings": [t.to_floats() for t in self.timings],
                "step_rows": [m.to_floats() for k in sorted(self.step_rows)
                              for m in sorted(self.step_rows[k], key=ItemMeasurement.sort_key)],
                "steps_seen": self.steps_seen, "refits": self.refits}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the mode given at construction wins); ``ValueError`` for another world
        size or version."""
        if int(state.get("version", 0)) not in (1, 2):
            raise ValueError(f"calibration state version {state.get('version')!r} is not 1 or 2")
        if int(state["world_size"]) != self.world_size:
            raise ValueError(f"calibration state is of a world of {state['world_size']} ranks, this run has "
                             f"{self.world_size}; start calibration afresh (mode='adaptive' without loading)")
        self.config = CalibrationConfig(**state["config"])
        self.factors = CalibrationFactors() if self.mode == "off" else CalibrationFactors.from_dict(state["factors"])
        self.window = [m for m in (ItemMeasurement.from_floats(r) for r in state["window"]) if m is not None]
        self.timings = [t for t in (StepTiming.from_floats(r) for r in state.get("timings", [])) if t is not None]
        self.step_rows = {}
        for m in (ItemMeasurement.from_floats(r) for r in state.get("step_rows", [])):
            if m is not None:
                self.step_rows.setdefault(m.step, []).append(m)
        self.steps_seen = int(state["steps_seen"])
        self.refits = int(state["refits"])


def _slowest(it: _Item, speeds: Sequence[float]) -> int | None:
    """The member an SP item's pace is attributed to: least all-to-all wait, else lowest speed (None on ties)."""
    if len(it.ranks) == 1:
        return it.ranks[0]
    if all(w >= 0 for w in it.waits):
        return min(zip(it.waits, it.ranks))[1]
    low = min(speeds[r] for r in it.ranks)
    who = [r for r in it.ranks if speeds[r] == low]
    return who[0] if len(who) == 1 else None
