"""The base of every peer: one setting for the whole run, tuned on the run's own global batches.

A peer (:class:`TunedPolicy`) is its system's rules for one step given one setting
(:meth:`TunedPolicy.plan_with`) and the settings its system allows (:meth:`TunedPolicy.axes`): discrete
choices (an SP size, a checkpointing switch, a communication type) each with at most one integer knob
(a token budget) on a range. It is tuned the way its users tune it, by trying settings on the data and
keeping the fastest:

1. **Data.** :meth:`Policy.prepare <lightning_dcp.planning.policies.base.Policy.prepare>` hands the run's
   global batches (:meth:`~lightning_dcp.planning.planner.Planner.plan` does); a policy asked to plan
   before that tunes on :data:`FALLBACK_BATCHES` batches drawn from the dataset (:func:`tuning_batches`).
2. **Price.** Every candidate plans every batch; :func:`~lightning_dcp.planning.step_time.step_time` prices
   each step, plus the step-end overhead. A candidate whose rules fail on any batch (a
   :class:`~lightning_dcp.planning.errors.PlanningError`: the real system would stop there) is out.
3. **Grid.** The knob runs over a geometric grid of ratio ``1 + COARSE`` from its low to its high end
   (both included); then, around the :data:`TOP` fastest so far, ``1 + FINE[0]``, then ``1 + FINE[1]``
   (:meth:`TunedPolicy.tune`). ``grid_scale=`` divides every step (``benchmarks/peer_fidelity.py
   --grid-check`` re-tunes at half the steps and reports how much tokens/s moves: under 1% is the aim).
4. **Choice.** The fewest seconds per token wins; ties go to the first tried (the grid's order). Limits
   are counted in candidates, never in seconds, so every rank tunes to the same setting.

Also here: :func:`aligned_starts`, where a peer's power-of-two groups go on the world's aligned blocks.
Pure Python + numpy.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.search.layouts import world_blocks
from lightning_dcp.planning.plan import StepPlan
from lightning_dcp.planning.policies.base import Policy
from lightning_dcp.planning.view import CostView
from lightning_dcp.planning.step_time import ItemPrices, step_time
from lightning_dcp.planning.topology import Topology

COARSE = 0.04
"""First pass: the knob's grid ratio is ``1 + COARSE``."""

FINE = (0.01, 0.0025)
"""Refinements around the :data:`TOP` fastest settings so far."""

TOP = 4
"""Settings refined after each pass."""

FALLBACK_BATCHES = 4
"""Batches drawn from the dataset when the policy plans before :meth:`TunedPolicy.prepare` (the runtime's sampler)."""

TUNE_TOKENS_PER_GPU = 65536
"""Tokens of a fallback batch per GPU unless ``tune_tokens=`` says otherwise."""


@dataclass(frozen=True)
class Axis:
    """One discrete choice of a peer's settings and the range of its integer knob (``lo == hi``: no knob)."""

    choice: Hashable
    lo: int = 0
    hi: int = 0


@dataclass(frozen=True)
class Trial:
    """One candidate tried while tuning: seconds per token (``inf``: it failed or lost early) and why it failed."""

    setting: Hashable
    seconds_per_token: float
    failure: str = ""


def geometric(lo: int, hi: int, step: float) -> list[int]:
    """Integers from ``lo`` to ``hi`` (both included) at ratio ``1 + step``, ascending, no repeats."""
    lo, hi = int(lo), int(hi)
    if hi <= lo:
        return [lo]
    count = max(1, int(math.ceil(math.log(hi / max(lo, 1)) / math.log1p(step))))
    vals = np.unique(np.round(np.geomspace(max(lo, 1), hi, count + 1)).astype(np.int64)).tolist()
    return [v for v in vals if lo <= v <= hi] or [lo]


def aligned_starts(sizes: Sequence[int], world_size: int, topology: Topology | None = None) -> list[int] | None:
    """Start rank of each group of ``sizes`` (powers of two), placed largest first at the next free
    offset of the world's aligned blocks; ``None`` when they do not fit. Same order as ``sizes``.
    With a :class:`~lightning_dcp.planning.topology.Topology`: groups of any size where its rule puts them
    (the same places for powers of two)."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    out = [0] * len(sizes)
    if topology is not None:
        groups = topology.place([sizes[i] for i in order])
        if groups is None:
            return None
        for i, g in zip(order, groups):
            out[i] = g[0]
        return out
    free = [[s, s + b] for s, b in world_blocks(world_size)]
    for i in order:
        p = sizes[i]
        for blk in free:
            if blk[1] - blk[0] >= p:
                out[i] = blk[0]
                blk[0] += p
                break
        else:
            return None
    return out


def tuning_batches(dataset_lengths: Sequence[int], tokens: int, count: int = FALLBACK_BATCHES,
                   seed: int = 0) -> list[list[int]]:
    """``count`` global batches of ``tokens`` tokens drawn from the dataset (a seeded shuffle cut in order)."""
    lengths = np.asarray(list(dataset_lengths), dtype=np.int64)
    if not len(lengths):
        return []
    rng = np.random.default_rng([seed & 0xFFFFFFFF, 0x7E4E])
    shuffled = lengths[rng.permutation(len(lengths))]
    ends = np.searchsorted(np.cumsum(shuffled), tokens * np.arange(1, count + 1), side="left")
    out, start = [], 0
    for e in ends.tolist():
        e = min(int(e) + 1, len(shuffled))
        if e > start:
            out.append(shuffled[start:e].tolist())
        start = e
    return out


class TunedPolicy(Policy):
    """A peer: its rules for one step (:meth:`plan_with`) at one run-wide setting, tuned on the run (module docstring).

    Subclasses set ``name`` (and ``peer``, the system's name in errors), list the options that fix parts of the
    setting in ``setting_options``, and implement :meth:`axes`, :meth:`setting_of` and :meth:`plan_with`.
    """

    peer: str = ""
    setting_options: tuple[str, ...] = ()

    def __init__(self, world_size: int, view: CostView, **kw: Any):
        super().__init__(world_size, view, **kw)
        self.grid_scale = float(self.options.get("grid_scale", 1.0))
        self.setting: Hashable | None = None
        """The setting every step uses (set by :meth:`prepare`)."""
        self.trials: list[Trial] = []
        """Every candidate :meth:`tune` tried, in order."""
        self._prepared: tuple = ()

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return cls.setting_options + ("tune_tokens", "grid_scale")

    # -- what a subclass says ------------------------------------------------------------
    @abc.abstractmethod
    def axes(self, batches: Sequence[Sequence[int]]) -> list[Axis]:
        """The settings the system allows for a run of ``batches`` (its options fixing some), as choices x knob ranges."""

    @abc.abstractmethod
    def setting_of(self, choice: Hashable, knob: int) -> Hashable:
        """The setting of one choice at one knob value."""

    @abc.abstractmethod
    def plan_with(self, setting: Any, samples: Sequence[int], lengths: Sequence[int]) -> list[StepPlan]:
        """One global batch at ``setting``, by the system's rules; :class:`PlanningError` where they fail."""

    # -- tuning --------------------------------------------------------------------------
    def prepare(self, batches: Sequence[Sequence[int]]) -> None:
        """Tune on the run's global batches (:meth:`tune`); the same batches again keep the setting."""
        key = tuple(tuple(int(n) for n in b) for b in batches if len(b))
        if self.setting is not None and key == self._prepared:
            return
        self.setting = self.tune([list(b) for b in key])
        self._prepared = key

    def fallback_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """What to tune on when :meth:`prepare` was not called: batches drawn from the dataset, else this batch."""
        if not self.dataset_lengths:
            return [list(lengths)]
        tokens = int(self.options.get("tune_tokens") or max(self.world_size * TUNE_TOKENS_PER_GPU,
                                                             4 * max(self.dataset_lengths)))
        return tuning_batches(self.dataset_lengths, tokens, seed=self.seed) or [list(lengths)]

    def tune(self, batches: Sequence[Sequence[int]]) -> Hashable:
        """The fastest setting on ``batches`` (module docstring): the coarse grid, then refinements around the best."""
        cm = self.view.cm
        prices = ItemPrices(cm)
        overhead = prices.overhead(self.world_size)
        tokens = sum(sum(b) for b in batches)
        scores: dict[Hashable, float] = {}
        self.trials = []
        best: list[float] = [math.inf]

        where: dict[Hashable, tuple[int, int]] = {}

        def run(a: int, v: int) -> None:
            setting = self.setting_of(axes[a].choice, v)
            if setting in scores:
                return
            where[setting] = (a, v)
            total, failure = 0.0, ""
            try:
                for batch in batches:
                    for step in self.plan_with(setting, range(len(batch)), batch):
                        total += step_time(step, cm, self.world_size, prices=prices).span + overhead
                    if total > best[0]:  # already slower than the best on the same batches: it cannot win
                        total = math.inf
                        break
            except PlanningError as err:
                total, failure = math.inf, str(err)
            scores[setting] = total
            self.trials.append(Trial(setting, total / tokens if tokens else math.inf, failure))
            best[0] = min(best[0], total)

        axes = self.axes(batches)
        if len(axes) == 1 and axes[0].lo == axes[0].hi:  # one setting (fixed by the options): nothing to tune
            return self.setting_of(axes[0].choice, axes[0].lo)
        for a, ax in enumerate(axes):
            for v in geometric(ax.lo, ax.hi, COARSE / self.grid_scale):
                run(a, v)
        for fine in FINE:
            fine /= self.grid_scale
            ranked = sorted((t for t in self.trials if math.isfinite(t.seconds_per_token)),
                            key=lambda t: t.seconds_per_token)
            for t in ranked[:TOP]:
                a, v = where[t.setting]
                span = (1 + fine) ** 4  # the neighbours up to four fine steps away
                for w in geometric(max(axes[a].lo, int(v / span)), min(axes[a].hi, int(math.ceil(v * span))), fine):
                    run(a, w)
        winners = [t for t in self.trials if math.isfinite(t.seconds_per_token)]
        if not winners:
            raise PlanningError(self._no_setting(batches))
        return min(winners, key=lambda t: t.seconds_per_token).setting  # min keeps the first on ties

    def _no_setting(self, batches: Sequence[Sequence[int]]) -> str:
        why: dict[str, int] = {}
        for t in self.trials:
            key = t.failure.split(": ", 1)[-1] if t.failure else "no setting"
            why[key] = why.get(key, 0) + 1
        top = sorted(why.items(), key=lambda kv: -kv[1])[:3]
        return (f"{self.peer or self.name}: none of the {len(self.trials)} settings its rules allow runs every one of "
                f"the run's {len(batches)} global batches on {self.world_size} GPUs; "
                + "; ".join(f"{n} failed: {w}" for w, n in top))

    # -- planning ------------------------------------------------------------------------
    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        if self.setting is None:
            self.prepare(self.fallback_batches(lengths))
        return self.plan_with(self.setting, samples, lengths)
