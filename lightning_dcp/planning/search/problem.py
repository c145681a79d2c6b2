"""The search's inputs as values: :class:`SearchSpace` (per run) and :class:`StepProblem` (per step).

dcp's searches (:mod:`~lightning_dcp.planning.search.blocks`, :mod:`~lightning_dcp.planning.search.trees`) read
nothing from the policy object: a space built once per (cost view, world, options) and a frozen problem built once
per global batch are passed in. A problem's memo tables (packs, nested plans, cost rows) live and die with it.

Per SP size ``p`` (a *class*), a sample of length ``l`` is charged its amortized time on ``p`` ranks
(:meth:`~lightning_dcp.planning.view.CostView.estimator`): ``E[k, i]``; ``G = E x p`` its GPU-seconds.
Under lockstep rounds (``sharding="hsdp"``) a sample may not hold its shard group's round up where another SP
size holds it within one round (:meth:`SearchSpace.costs`).

Pure Python + numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Sequence

import numpy as np

from lightning_dcp.planning.bound import StepBounder
from lightning_dcp.planning.search.layouts import Layout
from lightning_dcp.planning.search.packing import pack_time_balanced
from lightning_dcp.planning.search.tree import BuddyTree
from lightning_dcp.planning.view import CostView

__all__ = ["Pack", "Placed", "SearchSpace", "StepProblem"]

GROUP_TREES = 8
"""Trees with a layout plan's groups as nodes kept per run (:meth:`SearchSpace.tree`)."""


class Pack(NamedTuple):
    """One micro-batch of a group: step-local sample indices, recomputed layers, time at the cost model's pace, and
    its split's ring and tensor-parallel degrees."""

    members: list[int]
    recompute: int
    time: float
    ring: int = 1
    tp: int = 1


class Placed(NamedTuple):
    """One planned micro-batch: its SP group's ranks, step-local sample (or unit) indices, recomputed layers, ring
    and tensor-parallel degrees."""

    ranks: tuple[int, ...]
    members: list[int]
    recompute: int
    ring: int = 1
    tp: int = 1


@dataclass
class SearchSpace:
    """What dcp's searches know of the run: the SP sizes (classes), their capacities, estimators and token budgets.

    Built once per policy; its caches (trees, bounds) are the run's.
    """

    view: CostView
    world_size: int
    trials: int = 1
    refine_rounds: int = 64
    candidates: dict[int, list[Layout]] = field(default_factory=dict)
    """The dataset's candidate layouts per largest SP size (Hydraulis §7)."""

    def __post_init__(self) -> None:
        view = self.view
        self.classes: list[int] = list(view.sp_sizes)
        self.class_arr = np.array(self.classes, dtype=np.float64)
        # a running maximum: "the first SP size that holds l" stays a sorted search (a profile may not be monotone)
        self.maxlens = np.maximum.accumulate(np.array([view.item_capacities(p)[-1] for p in self.classes],
                                                      dtype=np.int64))
        self.est = [view.item_estimator(p) for p in self.classes]
        self.budget = [view.pack_target(p) for p in self.classes]
        self.lockstep = bool(view.cm.rounds.lockstep)
        self.round_cap = self._round_height() if self.lockstep else None
        self.kof = {p: k for k, p in enumerate(self.classes)}
        self._tree: BuddyTree | None = None
        self._group_trees: dict[frozenset, BuddyTree] = {}
        self._bounder: StepBounder | None = None

    def tree(self, groups: set[tuple[int, int]] | None = None) -> BuddyTree:
        """The run's buddy tree; with ``groups`` (``(start, size)`` pairs), the same chain with them as nodes (the
        last few kept: steps often repeat a layout)."""
        if self._tree is None:
            self._tree = BuddyTree(self.view.topology, self.classes)
        if not groups:
            return self._tree
        key = frozenset(groups)
        got = self._group_trees.get(key)
        if got is None:
            got = BuddyTree(self.view.topology, self.classes, chain=self._tree.chain, groups=groups)
            if len(self._group_trees) >= GROUP_TREES:
                self._group_trees.pop(next(iter(self._group_trees)))
            self._group_trees[key] = got
        return got

    def bounder(self) -> StepBounder:
        """The step bounder on this space's cost view (its SP sizes are the classes), built once."""
        if self._bounder is None:
            view = self.view
            self._bounder = StepBounder(view.cm, self.world_size, view.sp_sizes[-1], view=view, rank_speeds=view.speeds)
        return self._bounder

    def bound_span(self, lengths: Sequence[int]) -> float:
        """The step bound's compute part, ``max(work / W, heaviest)`` (seconds, no step-end overhead)."""
        got = self.bounder().parts(lengths)
        return max(got.work_s, got.heaviest_s)

    def _round_height(self) -> float | None:
        """Under lockstep rounds, the tallest a round's items should be: a micro-batch of the smallest SP size at its
        token capacity, every layer recomputed (samples of 2,048 and 8,192 tokens, the taller). The shard group's
        other ranks cannot fill a taller round."""
        view = self.view
        for p in self.classes:
            cap = view.max_len(p)
            if cap > 0:
                return max(view.time_uniform(min(cap, ell), cap / min(cap, ell), p, view.num_layers)
                           for ell in (2048, 8192))
        return None

    def costs(self, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(E, G)`` of the samples ``L``: classes x samples (``inf``: does not fit)."""
        E = np.vstack([est(L) for est in self.est])
        if self.round_cap is not None and E.size:
            E = self._lockstep_sizes(E)
        return E, E * self.class_arr[:, None]

    def _lockstep_sizes(self, E: np.ndarray) -> np.ndarray:
        """``E`` without the SP sizes on which a sample holds its shard group's round up. A sample that alone takes
        longer than a round on a size keeps only the sizes that hold it within the round where there are any; where
        none do, only the size of fewest lockstep GPU-seconds ``p t + (K - p)(t - height)`` (its own and the
        group's other ranks' wait)."""
        cap, k = self.round_cap, float(self.view.cm.rounds.domain or self.world_size)
        fits = np.isfinite(E)
        over = E > cap
        held = (fits & ~over).any(axis=0)
        E = np.where(over & held[None, :], np.inf, E)
        loose = ~held & fits.any(axis=0)
        if loose.any():
            p = self.class_arr[:, None]
            sub = E[:, loose]
            cost = np.where(np.isfinite(sub), sub * p + np.maximum(k - p, 0.0) * np.maximum(sub - cap, 0.0), np.inf)
            keep = np.argmin(cost, axis=0)
            mask = np.full(sub.shape, np.inf)
            mask[keep, np.arange(sub.shape[1])] = 0.0
            E[:, loose] = sub + mask
        return E


@dataclass(frozen=True)
class StepProblem:
    """One global batch as the searches see it: lengths, per-class costs, and the step's memo tables.

    Sample indices are step-local (``0 .. n-1``); ``samples`` maps them to dataset indices.
    """

    space: SearchSpace
    samples: tuple[int, ...]
    L: np.ndarray
    E: np.ndarray
    G: np.ndarray
    rng: np.random.Generator
    work: tuple[float, ...] | None
    """Attention work of every sample (the fast path's sums), or None without the cost model's fast path."""
    packs: dict = field(default_factory=dict, repr=False)
    nested: dict = field(default_factory=dict, repr=False)
    _rows: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, space: SearchSpace, samples: Sequence[int], lengths: Sequence[int], rng: np.random.Generator,
              work_cache: dict[int, float]) -> "StepProblem":
        L = np.asarray(lengths, dtype=np.int64)
        E, G = space.costs(L)
        work = None
        if space.view.fast_paths:
            w = space.view.work
            work = tuple(work_cache[n] if n in work_cache else work_cache.setdefault(n, float(w(n))) for n in L.tolist())
        return cls(space, tuple(int(s) for s in samples), L, E, G, rng, work)

    @cached_property
    def lengths(self) -> list[int]:
        return self.L.tolist()

    @cached_property
    def rows(self) -> list[list[float]]:
        """Per sample, its row of ``E`` (the dispatch's scalar loops read ``rows[i][k]``)."""
        return self.E.T.tolist()

    def row(self, k: int) -> list[float]:
        got = self._rows.get(k)
        if got is None:
            got = self._rows[k] = self.E[k].tolist()
        return got

    def pack(self, idx: Sequence[int], sp: int) -> list[Pack]:
        """Micro-batches of ``sp`` ranks running samples ``idx`` (time-balanced within the size's token budget, each on
        its fastest split with the fewest recomputed layers that fit: :meth:`~lightning_dcp.planning.view.CostView.setting`),
        memoized: refinements re-pack the same sets."""
        if not idx:
            return []
        key = (sp, tuple(idx))
        got = self.packs.get(key)
        if got is not None:
            return got
        space, view = self.space, self.space.view
        k = space.kof[sp]
        lens = [self.lengths[i] for i in idx]
        ek = self.row(k)
        est = [ek[i] for i in idx]
        work = self.work
        out = []
        for pack in pack_time_balanced(lens, est, space.budget[k]):
            members = [idx[j] for j in pack]
            pl = [lens[j] for j in pack]
            got_ = view.setting(pl, sp, None if work is None else float(sum([work[i] for i in members])))
            if got_ is None:
                raise ValueError(f"a micro-batch of {sum(pl)} tokens does not fit {sp} ranks even with full recompute")
            out.append(Pack(members, got_.recompute, got_.time, got_.ring, got_.tp))
        self.packs[key] = out
        return out

    def alone_times(self, length: int) -> np.ndarray:
        """Time of one sample of ``length`` alone on each class (``inf`` where it does not fit)."""
        return self.space.bounder().alone_times(length)
