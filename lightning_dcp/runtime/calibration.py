"""Plans that learn from the run, the runtime's part: time every item, refit, plan later steps with the refit.

The planning side (:mod:`lightning_dcp.planning.calibration`) refits per-SP-size time scales and
per-rank speeds from measurement rows; this module feeds it and applies what it learns:

1. **measure** (:class:`ItemClock`): each micro-batch this rank runs is timed -- wall time on the
   CPU; on a GPU two CUDA events per item, read at the step's end, after the one host sync the step
   already has (no extra sync in the loop). Inside an SP item the seconds spent in the group's
   all-to-alls, forward and backward, are timed the same way (:mod:`lightning_dcp.sp.comm_timer`):
   the member that spent least there set the item's pace. The whole step is timed too, from the
   loop's start to the end of the optimizer step (:meth:`RunCalibration.step_done`), and reported
   with the next step's rows as a :class:`~lightning_dcp.planning.measurements.StepTiming`: the step's
   time beyond its slowest rank's predicted items becomes the measured step overhead.
2. **gather**: this rank's payload -- the previous step's timing, then its rows
   (:class:`~lightning_dcp.planning.measurements.ItemMeasurement`, fixed width, padded to the plan's
   largest per-rank item count, which every rank knows from the plan) -- rides on the step-end
   all-gather (:mod:`lightning_dcp.runtime.row`): no new collective.
3. **refit**: every rank feeds the same gathered rows to its
   :class:`~lightning_dcp.planning.calibration.Calibrator`, so every rank computes the same factors,
   bit for bit (the refit is order-independent), whatever its own measurements were.
4. **switch** (:class:`VersionedPlanner`): the sampler plans ahead (a thread, and the DataLoader
   prefetches), so a refit cannot change plans already made. Each rank's step-end row carries the
   largest step key its sampler has handed to the planner (``StepRow.planned_upto``); a refit at the
   end of a step takes effect from ``1 + max over ranks`` of it -- a step no rank has planned yet, the
   same on every rank. Steps from there on are planned with
   ``CalibratedCostModel(base, factors)``; the plan-agreement checks keep holding.

Modes (``DCPStrategy(calibration=...)``): ``"adaptive"`` (the default: measure, refit every
``calibrate_every`` steps, plan with the refit), ``"fixed"`` (measure and log predicted vs measured;
plans keep the factors they start with -- 1.0, or a resumed checkpoint's), ``"off"`` (nothing
measured, the planner untouched: today's plans bit for bit). A user ``planner=`` and safe mode
plan without the strategy's cost model: calibration only measures there.

The state (:meth:`RunCalibration.state_dict`: the calibrator's and the factor versions) goes into
the checkpoint under :data:`CHECKPOINT_KEY`; a resumed run plans with the refitted model.

Test and benchmark hook: ``LIGHTNING_DCP_SLOW_RANK=RANK:FACTOR`` (e.g. ``1:1.5``) makes rank
``RANK`` sleep ``FACTOR - 1`` times each item's own duration after it, so that rank runs
``FACTOR`` x slower in proportion to its work -- a throttled device, on demand. Never set it in
production.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Sequence

import torch

from lightning_dcp.planning.batches import step_key
from lightning_dcp.planning.calibration import CalibrationConfig, CalibrationFactors, Calibrator, StepPrediction
from lightning_dcp.planning.measurements import ItemMeasurement, StepTiming, pack_payload, unpack_payload
from lightning_dcp.planning.plan import StepPlan
from lightning_dcp.sp.comm_timer import AllToAllTimer, set_active, time_mark

__all__ = ["CHECKPOINT_KEY", "SLOW_RANK_ENV", "ItemClock", "RunCalibration", "VersionedPlanner", "build_calibration",
           "parse_slow_rank", "slow_rank_clock", "step_key"]

CHECKPOINT_KEY = "dcp_calibration"
"""Where the calibration state goes in a checkpoint."""

SLOW_RANK_ENV = "LIGHTNING_DCP_SLOW_RANK"
"""Test/benchmark hook: ``RANK:FACTOR`` slows one rank down by ``FACTOR`` (see the module docstring)."""


def parse_slow_rank(spec: str | None, world_size: int) -> tuple[int, float] | None:
    """``(rank, factor)`` of :data:`SLOW_RANK_ENV`'s value ``RANK:FACTOR``, or None when unset.

    Raises:
        ValueError: a malformed value, a rank outside the world or a factor below 1, naming it.
    """
    if not spec:
        return None
    rank_s, sep, factor_s = str(spec).partition(":")
    try:
        rank, factor = int(rank_s), float(factor_s)
    except ValueError:
        rank, factor, sep = -1, 0.0, ""
    if not sep or not 0 <= rank < world_size or not factor >= 1.0:
        raise ValueError(f"{SLOW_RANK_ENV}={spec!r}: expected RANK:FACTOR with 0 <= RANK < {world_size} and FACTOR >= 1 "
                         "(e.g. '1:1.5': rank 1 runs 1.5x slower); unset it to run at full speed")
    return rank, factor


class ItemClock:
    """Times this rank's micro-batches of one step, and the SP all-to-alls inside each (CUDA events on a
    GPU, read at the step's end).

    Args:
        device: this rank's device.
        slow_factor: the slow-rank hook's factor for this rank (1.0: none).
    """

    def __init__(self, device: torch.device, slow_factor: float = 1.0) -> None:
        self.cuda = device.type == "cuda"
        self.slow_factor = float(slow_factor)
        self._marks: list[list[Any]] = []
        self._begun = time.perf_counter()

    def begin(self) -> None:
        """The micro-batch loop starts."""
        self._marks = []
        self._begun = time.perf_counter()

    def elapsed(self) -> float:
        """Wall seconds since :meth:`begin`."""
        return time.perf_counter() - self._begun

    def start(self, what: Any) -> None:
        """Start timing ``what`` (a micro-batch) and the all-to-alls it runs."""
        comm = AllToAllTimer(self.cuda)
        self._marks.append([time_mark(self.cuda), None, time.perf_counter(), what, comm])
        set_active(comm)

    def stop(self) -> None:
        set_active(None)
        mark = self._marks[-1]
        if self.slow_factor > 1.0:  # the hook: the item's own duration, stretched (synced: a test hook only)
            if self.cuda:
                torch.cuda.synchronize()
            time.sleep((self.slow_factor - 1.0) * (time.perf_counter() - mark[2]))
        mark[1] = time_mark(self.cuda)

    def timed(self) -> list[tuple[Any, float, float]]:
        """``(what, seconds, seconds inside its all-to-alls)`` of every item that finished, in order (call
        after the step's host sync)."""
        out = []
        for a, b, _, what, comm in self._marks:
            if b is None:
                continue
            seconds = a.elapsed_time(b) / 1000.0 if self.cuda else b - a
            out.append((what, seconds, comm.seconds()))
        return out


def _prepare(planner: Any, batches: list[list[int]]) -> None:
    prepare = getattr(planner, "prepare", None)
    if callable(prepare):
        prepare(batches)


class VersionedPlanner:
    """A planner whose cost model changes at agreed step keys: ``plan_batch(step=key)`` plans with the
    newest factors installed for a key ``<= key`` (see the module docstring).

    Args:
        base: the planner over the uncalibrated cost model (used until the first switch).
        build: makes a planner over ``CalibratedCostModel(base cost model, factors)``.
    """

    def __init__(self, base: Any, build: Callable[[CalibrationFactors], Any]) -> None:
        self.base = base
        self._build = build
        self._lock = threading.Lock()
        self.versions: list[tuple[int, CalibrationFactors, Any]] = []
        self._batches: list[list[int]] | None = None  # the epoch's global batches' lengths (prepare)

    @property
    def one_step_per_batch(self) -> bool:
        return bool(getattr(self.base, "one_step_per_batch", True))

    def planner_at(self, key: int) -> Any:
        with self._lock:
            for start, _, planner in reversed(self.versions):
                if start <= key:
                    return planner
        return self.base

    def factors_at(self, key: int) -> CalibrationFactors:
        with self._lock:
            for start, factors, _ in reversed(self.versions):
                if start <= key:
                    return factors
        return CalibrationFactors()

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> Any:
        return self.planner_at(step).plan_batch(samples, lengths, step=step)

    def prepare(self, batches: Sequence[Sequence[int]]) -> None:
        """``prepare`` every version with the epoch's global batches (a version installed later, at install)."""
        self._batches = [list(b) for b in batches]
        with self._lock:
            planners = [self.base, *(planner for _, _, planner in self.versions)]
        for planner in planners:
            _prepare(planner, self._batches)

    def install(self, start: int, factors: CalibrationFactors, now: int) -> None:
        """Plan step keys ``>= start`` with ``factors``; versions no step from ``now`` on can use are dropped."""
        planner = self._build(factors)
        if self._batches is not None:
            _prepare(planner, self._batches)
        with self._lock:
            kept = [v for i, v in enumerate(self.versions)
                    if not any(w[0] <= now for w in self.versions[i + 1:])]
            self.versions = [v for v in kept if v[0] < start] + [(int(start), factors, planner)]

    def __getattr__(self, name: str) -> Any:
        if name in ("base", "_build", "_lock", "versions", "_batches") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base, name)


class RunCalibration:
    """The fit's calibration: builds the measurement rows, refits, installs the new planner versions.

    Args:
        mode: ``"adaptive"``, ``"fixed"`` or ``"off"``.
        world_size, rank: the world and this rank.
        cost_model: the uncalibrated cost model (the rows' ``predicted_s``).
        every: refit after this many steps (``None``: the calibrator's default).
        planner: the :class:`VersionedPlanner` the sampler plans with (``None``: plans are not the
            strategy's to change; measure only).
        device: this rank's device (for the item clock).
        slow: the slow-rank hook's ``(rank, factor)``.
    """

    def __init__(self, mode: str, *, world_size: int, rank: int, cost_model: Any, every: int | None,
                 planner: VersionedPlanner | None, device: torch.device, slow: tuple[int, float] | None = None) -> None:
        config = CalibrationConfig() if every is None else CalibrationConfig(every=int(every))
        self.calibrator = Calibrator(world_size, config, mode=mode)
        self.world_size, self.rank = int(world_size), int(rank)
        self.cost_model = cost_model
        self.planner = planner
        factor = slow[1] if slow is not None and slow[0] == rank else 1.0
        self.clock = ItemClock(device, factor)
        self.last: StepPrediction | None = None
        self._predicted: dict[tuple, float] = {}
        self._key = -1  # the step whose rows were built last
        self._busy_s = 0.0  # its loop's seconds
        self._timing: StepTiming | None = None  # the last finished step's timing, for the next payload

    @property
    def mode(self) -> str:
        return self.calibrator.mode

    @property
    def factors(self) -> CalibrationFactors:
        return self.calibrator.factors

    @staticmethod
    def row_count(plan: StepPlan, world_size: int) -> int:
        """Rows every rank contributes: the plan's largest per-rank item count (at least 1)."""
        counts = [0] * world_size
        for item in plan.items:
            for r in item.ranks:
                counts[r] += 1
        return max(counts + [1])

    def _predict_item(self, lengths: tuple[int, ...], sp: int, recompute: int, ring: int = 1) -> float:
        key = (lengths, sp, recompute, ring)
        got = self._predicted.get(key)
        if got is None:
            got = float(self.cost_model.item_time(list(lengths), sp, recompute, ring))
            if len(self._predicted) > 4096:
                self._predicted.clear()
            self._predicted[key] = got
        return got

    def rows(self, step: Any) -> torch.Tensor:
        """This rank's payload for ``step``'s all-gather (float64): the previous step's timing, then its
        rows (``row_count x NUM_FIELDS``) from the item clock (call after the loop's host sync)."""
        self._key, self._busy_s = step_key(step.epoch, step.index), self.clock.elapsed()
        out = []
        for mb, s, comm_s in self.clock.timed():
            it = mb.item
            out.append(ItemMeasurement(
                step=self._key, item=int(it.index), rank=self.rank, sp=it.sp_size, recompute=int(it.recompute),
                samples=len(it.samples), tokens=float(sum(it.lengths)), work=float(sum(n * n for n in it.lengths)),
                predicted_s=self._predict_item(tuple(it.lengths), it.sp_size, int(it.recompute), int(it.ring)),
                measured_s=float(s),
                wait_s=float(comm_s) if it.sp_size > 1 else -1.0))
        flat = pack_payload(self._timing, out, self.row_count(step.plan, self.world_size))
        return torch.tensor(flat, dtype=torch.float64)

    def step_done(self) -> None:
        """The optimizer step of the step whose rows were built last has ended: keep its timing."""
        if self._key >= 0:
            self._timing = StepTiming(self._key, self.rank, max(self.clock.elapsed(), self._busy_s), self._busy_s)

    def after_step(self, flat: Sequence[float], step: Any, planned_upto: float) -> StepPrediction:
        """Feed the gathered rows (every rank's, flat) to the calibrator; on a refit install the new planner
        from step key ``planned_upto + 1`` on. Returns the step's predicted vs measured time."""
        timings, rows = unpack_payload(flat, self.world_size)
        now = step_key(step.epoch, step.index)
        planned = self.planner.factors_at(now) if self.planner is not None else self.factors
        base_overhead = float(self.cost_model.step_overhead(self.world_size))
        self.last = Calibrator(self.world_size, mode="fixed", factors=planned).predict(rows, step=now,
                                                                                       base_overhead_s=base_overhead)
        new = self.calibrator.observe(rows, timings)
        if new is not None and self.planner is not None:
            self.planner.install(int(planned_upto) + 1, new, now)
        return self.last

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        versions = [] if self.planner is None else [[start, f.to_dict()] for start, f, _ in self.planner.versions]
        return {"calibrator": self.calibrator.state_dict(), "versions": versions}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (the mode of this run wins; ``"off"`` loads nothing)."""
        if self.mode == "off":
            return
        self.calibrator.load_state_dict(state["calibrator"])
        if self.planner is not None:
            for start, f in state.get("versions", []):
                self.planner.install(int(start), CalibrationFactors.from_dict(f), int(start))

def slow_rank_clock(device: torch.device, rank: int, world_size: int) -> ItemClock | None:
    """The slow-rank hook's clock for a fit without calibration (``None`` when the hook is unset or names
    another rank): with ``calibration="off"`` the hook still slows its rank, so a calibrated run has a
    baseline slowed the same way."""
    slow = parse_slow_rank(os.environ.get(SLOW_RANK_ENV), world_size)
    if slow is None or slow[0] != rank:
        return None
    return ItemClock(device, slow[1])


def build_calibration(settings: Any, planners: Any, planner: Any, cost_model: Any, lengths: list[int], *,
                      world_size: int, rank: int, device: torch.device, resume: dict | None = None) -> tuple[Any, RunCalibration | None]:
    """The planner the sampler plans with and the fit's :class:`RunCalibration` (``None`` when ``"off"``).

    The strategy's own planner (``settings.planner`` unset, not safe mode) is wrapped in a
    :class:`VersionedPlanner` whose later versions plan with ``CalibratedCostModel(cost_model,
    factors)`` (``planners``: the fit's :class:`~lightning_dcp.runtime.planner_factory.PlannerFactory`,
    ``lengths`` the train lengths); any other planner is kept as is (measured, never changed). ``resume``: a checkpoint's
    :data:`CHECKPOINT_KEY` entry.
    """
    if settings.calibration == "off" or cost_model is None:  # a user's planner without a cost model: nothing to predict
        return planner, None
    from lightning_dcp.planning.calibrated import CalibratedCostModel
    from lightning_dcp.planning.planner import Planner

    versioned = None
    if settings.planner is None and isinstance(planner, Planner):
        versioned = VersionedPlanner(planner, lambda f: planners.planner(CalibratedCostModel(cost_model, f), lengths))
    slow = parse_slow_rank(os.environ.get(SLOW_RANK_ENV), world_size)
    calibration = RunCalibration(settings.calibration, world_size=world_size, rank=rank, cost_model=cost_model,
                                 every=settings.calibrate_every, planner=versioned, device=device, slow=slow)
    if resume is not None:
        calibration.load_state_dict(resume)
    return (versioned if versioned is not None else planner), calibration
