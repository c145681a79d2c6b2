"""The per-step achievable bound: how fast one global batch could possibly run.

``% of ideal`` (the simulator's ``fraction_of_ideal``) compares a plan with compute at peak
rates, no communication, no recomputation and perfect balance -- a bound that memory and
physics often make unreachable (a sample that only fits with recomputation pays it in every
plan; a sample too long to split across the world bounds the step by itself). The *step bound*
is the tightest simple bound that every plan of the step must respect under the cost model:

    bound = max(work / W, heaviest) + step_overhead(W)

- ``work``: the sum over the step's samples of each sample's *best GPU-seconds*: the minimum,
  over every usable SP size ``p`` and every recompute count ``r`` whose micro-batch capacity
  ``caps_p[r]`` holds the sample, of ``p`` x the sample's share of a full micro-batch of
  ``caps_p[r]`` tokens at ``(p, r)`` -- its own per-token and attention terms plus the
  micro-batch's constant spread over the most tokens that micro-batch can hold. With costs linear
  in (tokens, attention work, 1) per micro-batch, as both the analytic and the profiled models
  are, no plan spends fewer GPU-seconds on the sample, so ``work / W`` (perfect balance over all
  ``W`` ranks) is a lower bound on the compute span.
- ``heaviest``: the largest, over the step's samples, of the sample's best time alone: the
  minimum over usable SP sizes of ``item_time([l], p, min_recompute(l, p))``. Some group must run
  the sample, and adding samples to a micro-batch never makes it faster.
- ``step_overhead(W)``: the step-end gradient all-reduce and optimizer step, paid once per step.

With per-rank speeds (:mod:`~lightning_dcp.planning.speeds`; a rank at speed ``s`` runs everything
in ``t / s``): ``max(work / sum(speeds), heaviest / max(speeds))`` -- the work spread over the ranks'
combined pace, the heaviest sample on the fastest rank's pace (an SP group only runs as fast as its
slowest member, so both stay lower bounds).

"Usable" SP sizes are what the planner may use (:meth:`CostModel.sp_splits
<lightning_dcp.planning.cost_model.CostModel.sp_splits>`): the divisors of the heads and, where the
cost model prices ring attention, the ring sizes, up to the world, ``max_sp_size`` and the shard
group. On a ring size the sample's best GPU-seconds count the ring's key/value transfers as hidden
behind compute (:func:`~lightning_dcp.planning.ring.ring_steps_compute`): packing a sample with
compute-heavy ones can hide them, so only that keeps ``work`` a lower bound.

``fraction = bound / step_time`` is at most 1 for any plan the cost model times (up to the
planner's float rounding); the runtime logs it as ``dcp/step_bound_fraction``.

Pure Python + numpy, no torch. Deterministic.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.view import CostView
from lightning_dcp.planning.units import describe_limit
from lightning_dcp.planning.speeds import uniform


@dataclass(frozen=True)
class StepBound:
    """The parts of one step's bound (seconds); ``seconds`` is what plans are compared with."""

    work_s: float
    """Sum of the samples' best GPU-seconds divided by the world size."""
    heaviest_s: float
    """The heaviest sample's best time alone on any usable SP size."""
    overhead_s: float
    """``cost_model.step_overhead(world_size)``: all-reduce + optimizer step."""

    @property
    def seconds(self) -> float:
        return max(self.work_s, self.heaviest_s) + self.overhead_s

    @property
    def limited_by(self) -> str:
        """``"work"`` when perfect balance bounds the step, ``"heaviest"`` when one sample does."""
        return "work" if self.work_s >= self.heaviest_s else "heaviest"


class StepBounder:
    """Step bounds of one (cost model, world size, max SP size), caching per-length answers.

    Build it once (e.g. next to the planner) and call :meth:`parts` / :meth:`seconds` per step:
    a length's best GPU-seconds and best time are computed once and reused across steps.
    """

    def __init__(self, cost_model: CostModel, world_size: int, max_sp_size: int | None = None, *,
                 view: CostView | None = None, rank_speeds: Sequence[float] | None = None, max_tp_size: int = 1):
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size <= 0:
            raise PlanningError(f"world size must be a positive integer, got {world_size!r}")
        if max_sp_size is not None and (not isinstance(max_sp_size, (int, np.integer)) or max_sp_size <= 0):
            raise PlanningError(f"max_sp_size must be a positive integer (ranks) or None, got {max_sp_size!r}")
        self.world_size = int(world_size)
        max_sp = self.world_size
        if max_sp_size is not None:
            max_sp = min(max_sp, int(max_sp_size))
        self.cost_model = cost_model
        self.view = view if view is not None and view.cm is cost_model and view.sp_sizes[-1] <= max_sp \
            else CostView(cost_model, max_sp, world_size=self.world_size, max_tp=max_tp_size)
        self.overhead = float(cost_model.step_overhead(self.world_size))
        speeds = rank_speeds if rank_speeds is not None else (view.speeds if view is not None else None)
        self.speeds = None if uniform(speeds) else tuple(float(x) for x in speeds)  # type: ignore[union-attr]
        """Per-rank speeds: the work spreads over their sum, the heaviest sample runs at the fastest pace."""
        self._gpu_s: dict[int, float] = {}
        self._alone: dict[int, np.ndarray] = {}

    def _best_gpu_seconds(self, lengths: list[int]) -> None:
        """Fill ``_gpu_s`` for ``lengths`` (new, distinct): min over (p, r) of p x amortized share.

        One vectorized cost-model call per SP size over every (recompute threshold, length) pair.
        """
        L = np.asarray(lengths, dtype=np.float64)
        work = np.array([self.view.work(n) for n in lengths], dtype=np.float64)
        best = np.full(len(L), np.inf)
        for p in self.view.sp_sizes:
            for ring, tp in self.view.splits_of(p):  # every split an item may take
                caps = self.view.capacities(p, ring, tp)
                rs = [r for r, c in enumerate(caps) if c > 0 and (r == 0 or c != caps[r - 1])]  # same cap: never better
                if not rs:
                    continue
                cap = np.array([caps[r] for r in rs], dtype=np.float64)[:, None]
                count = cap / L[None, :]  # a full micro-batch of length-l samples (fractional count)
                tokens = np.broadcast_to(cap, count.shape).ravel()
                rr = np.broadcast_to(np.array(rs, dtype=np.float64)[:, None], count.shape).ravel()
                t = self._times(tokens, (work[None, :] * count).ravel(), count.ravel(), p, rr, ring,
                                tp).reshape(count.shape)
                share = np.where(L[None, :] <= cap, t * (L[None, :] / cap) * p, np.inf)
                best = np.minimum(best, share.min(axis=0))
        for n, v in zip(lengths, best.tolist()):
            self._gpu_s[n] = v

    def _times(self, tokens: np.ndarray, sq: np.ndarray, n: np.ndarray, p: int, r: np.ndarray,
               ring: int, tp: int = 1) -> np.ndarray:
        if self.view.fast_paths:
            return self.view.time_many(tokens, sq, n, p, r, lower=True, ring=ring, tp=tp)
        # generic cost model (no item_time_sum): whole micro-batches of k = floor(cap / l) equal
        # samples (k <= 4096), scaled to the full count -- within ~1% of the linear form
        out = []
        for t, c, rk in zip(tokens.tolist(), n.tolist(), r.tolist()):
            ell = int(round(t / c))
            k = max(1, min(int(c), 4096))
            out.append(self.view.time([ell] * k, p, int(rk), ring) * c / k)
        return np.array(out, dtype=np.float64)

    def alone_times(self, length: int) -> np.ndarray:
        """Time of one sample of ``length`` tokens alone on each usable SP size (``view.sp_sizes``), with
        the fewest recomputed layers that fit; ``inf`` where it does not fit. Cached per length."""
        got = self._alone.get(length)
        if got is None:
            got = np.full(len(self.view.sp_sizes), np.inf)
            for k, p in enumerate(self.view.sp_sizes):
                for ring, tp in self.view.splits_of(p):
                    r = self.view.min_recompute(length, p, ring, tp)
                    if r is not None:
                        got[k] = min(got[k], self.view.time([length], p, r, ring, tp))
            self._alone[length] = got
        return got

    def best_alone(self, length: int) -> float:
        """Fastest time of one sample of ``length`` tokens alone, over the usable SP sizes (inf if none holds it)."""
        return float(self.alone_times(length).min())

    def parts(self, lengths: Sequence[int]) -> StepBound:
        """The bound of one step that runs the samples of ``lengths`` (tokens)."""
        lens = [int(n) for n in lengths]
        if not lens:
            return StepBound(0.0, 0.0, self.overhead)
        new = sorted({n for n in lens if n not in self._gpu_s})
        if new:
            self._best_gpu_seconds(new)
        gs = self._gpu_s
        work = math.fsum(gs[n] for n in lens)
        if not math.isfinite(work):
            bad = max(n for n in lens if not math.isfinite(gs[n]))
            raise PlanningError(
                f"a sample of {bad} tokens fits no SP size up to {self.view.sp_sizes[-1]} ranks with every layer "
                f"recomputed (memory budget {describe_limit(self.cost_model)}): no step runs it; drop or "
                f"split it, or use more ranks / memory")
        top = sorted(set(lens), reverse=True)[:4]  # best time grows with length; look at a few for safety
        heaviest = max(self.best_alone(n) for n in top)
        if self.speeds is not None:
            return StepBound(work / math.fsum(self.speeds), heaviest / max(self.speeds), self.overhead)
        return StepBound(work / self.world_size, heaviest, self.overhead)

    def seconds(self, lengths: Sequence[int]) -> float:
        """``parts(lengths).seconds``."""
        return self.parts(lengths).seconds


_BOUNDERS: "weakref.WeakKeyDictionary[CostModel, dict[tuple, StepBounder]]" = weakref.WeakKeyDictionary()


def _bounder(cost_model: CostModel, world_size: int, max_sp_size: int | None,
             rank_speeds: Sequence[float] | None = None, max_tp_size: int | None = None) -> StepBounder:
    speeds = None if uniform(rank_speeds) else tuple(float(x) for x in rank_speeds)  # type: ignore[union-attr]
    tp = int(max_tp_size or 1)
    try:
        per = _BOUNDERS.setdefault(cost_model, {})
    except TypeError:  # not weak-referenceable: no cache
        return StepBounder(cost_model, world_size, max_sp_size, rank_speeds=speeds, max_tp_size=tp)
    key = (int(world_size), max_sp_size, speeds) if tp == 1 else (int(world_size), max_sp_size, speeds, tp)
    b = per.get(key)
    if b is None:
        b = per[key] = StepBounder(cost_model, world_size, max_sp_size, rank_speeds=speeds, max_tp_size=tp)
    return b


def step_bound(lengths: Sequence[int], cost_model: CostModel, world_size: int, max_sp_size: int | None = None,
               rank_speeds: Sequence[float] | None = None, max_tp_size: int | None = None) -> float:
    """Lower bound (seconds) on the time of one step running ``lengths``, all-reduce included.

    ``max(work / W, heaviest) + step_overhead(W)`` (see the module docstring); with ``rank_speeds``
    ``max(work / sum(speeds), heaviest / max(speeds)) + step_overhead(W)``; ``max_tp_size``: items may also take
    tensor-parallel splits up to that degree (:class:`~lightning_dcp.planning.view.CostView`). Cached per cost
    model, world size, ``max_sp_size``, speeds and TP degree, so calling it every step costs little.
    """
    return _bounder(cost_model, world_size, max_sp_size, rank_speeds, max_tp_size).seconds(lengths)


def step_bound_parts(lengths: Sequence[int], cost_model: CostModel, world_size: int,
                     max_sp_size: int | None = None) -> StepBound:
    """:func:`step_bound` with its parts (work, heaviest sample, overhead)."""
    return _bounder(cost_model, world_size, max_sp_size).parts(lengths)


def plan_step_bound(step: object, cost_model: CostModel, world_size: int, max_sp_size: int | None = None) -> float:
    """:func:`step_bound` of one step plan: a :class:`StepPlan` or its ``to_dict()`` (``{"items": [...]}``)."""
    items = step["items"] if isinstance(step, dict) else step.items  # type: ignore[union-attr,index]
    lengths: list[int] = []
    for item in items:
        lengths.extend(item["lengths"] if isinstance(item, dict) else item.lengths)
    return step_bound(lengths, cost_model, world_size, max_sp_size)
