"""THE layout / dispatch / fill engine: units on one block of consecutive ranks, as groups of SP sizes.

One engine serves dcp (units are samples, packed into micro-batches per group: :class:`SampleBlocks`) and the
DCP paper's Algorithm 1 (units are micro-batches cut beforehand:
:class:`~lightning_dcp.planning.policies.algorithm_one.MicroBatchBlocks`). On a block (the world, or a group's
ranks after its own units):

1. every unit gets a preferred SP size (the rules' :meth:`Blocks.prefer`: fewest GPU-seconds, promoted when it
   is longer than the block's mean load);
2. candidate layouts (:meth:`Blocks.candidates`: the block's work split over the sizes, rounded, and its
   neighbours -- Hydraulis §7);
3. each candidate is dispatched longest first (:func:`~lightning_dcp.planning.search.dispatch.lpt_dispatch`) in
   two modes: *nested* (a unit that prefers a smaller size may run as a *fill*: after the group's own units, on a
   sub-block of its ranks, planned by this engine recursively) and *flat* (every unit on all its group's ranks);
   the best estimate of each mode is realized exactly and the lower span wins.

A fill only goes where every group of the size holds a group of its own size wherever it is placed
(:meth:`~lightning_dcp.planning.view.CostView.contains`). Pure Python + numpy; deterministic.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from lightning_dcp.planning.plan import interleave_items
from lightning_dcp.planning.search.dispatch import fill_costs, lpt_dispatch
from lightning_dcp.planning.search.layouts import Layout, place
from lightning_dcp.planning.search.objective import improves, makespan
from lightning_dcp.planning.search.problem import Placed
from lightning_dcp.planning.view import CostView

__all__ = ["Block", "BlockPlan", "Blocks", "GroupPlan", "Mode", "Preference"]


class GroupPlan(NamedTuple):
    """One group's items (its own, then its fills' nested plan) and its time."""

    items: list[Placed]
    time: float


class BlockPlan(NamedTuple):
    """A block's plan: per group its items, the span (the slowest group), the layout (SP size per group)."""

    groups: list[list[Placed]]
    span: float
    layout: Layout


class Preference(NamedTuple):
    """The rules' view of a block: each unit's preferred class and its GPU-seconds there, the mean rank load, the
    class the layout must hold (``must``) and the largest one some unit needs (``need``), the early-exit bound."""

    pref: np.ndarray
    gpu_s: np.ndarray
    mean_load: float
    must: int
    need: int
    bound: float


@dataclass
class Block:
    """One block's units and their costs: ``Es[k, j]`` unit ``j``'s time on class ``k`` (``<= kmax``; ``inf`` where it
    does not fit or the block cannot always hold the class), ``C`` / ``F`` its dispatch cost and fill floor
    (:func:`fill_costs`), ``own_time`` its time at its preferred class."""

    ids: np.ndarray
    Es: np.ndarray
    C: np.ndarray
    F: np.ndarray
    own_time: np.ndarray
    prefs: Preference
    classes: list[int]
    size: int
    offset: int
    kmax: int
    barred: bool

    @property
    def pref(self) -> np.ndarray:
        return self.prefs.pref

    @property
    def present(self) -> frozenset[int]:
        """SP sizes some unit prefers."""
        return frozenset(self.classes[k] for k in self.prefs.pref.tolist())

    @property
    def fill(self) -> np.ndarray:
        """``fill[k, j]``: unit ``j`` runs as a fill on a group of class ``k``."""
        return self.F > 0.0


class Mode(NamedTuple):
    """The best candidate layout of one dispatch mode, realized."""

    nested: bool
    plans: list[GroupPlan]
    span: float
    layout: Layout
    groups: list[tuple[int, ...]]
    members: list[list[int]]


class Blocks(abc.ABC):
    """The engine (module docstring); subclasses give the rules: preference, candidates, modes, own units' items."""

    early_exit = False
    """Stop at a dispatch estimate within the block's bound (dcp)."""
    flat_present_only = False
    """In flat mode, only layouts of preferred sizes (Algorithm 1)."""
    fills_after_own = True
    """A group runs its own units before its fills (dcp), for the dispatch's estimate of its finish."""

    def __init__(self, view: CostView, world_size: int, cost: np.ndarray, *, speeds: Sequence[float] | None = None,
                 trials: int = 1, rng: np.random.Generator | None = None) -> None:
        self.view, self.world_size, self.cost, self.speeds = view, int(world_size), cost, speeds
        self.classes = list(view.sp_sizes)
        self.trials, self.rng = int(trials), rng

    def solve(self, ids: np.ndarray, size: int, offset: int, kmax: int, *, top: bool = False,
              full: bool = False) -> BlockPlan:
        """Units ``ids`` on ranks ``offset .. offset + size - 1`` with classes ``<= kmax``."""
        block = self.block(ids, size, offset, kmax, top)
        result = None
        for nested in self.modes(block, top or full):
            got = self.dispatch(block, self.candidates(block, top), nested)
            if got is None:
                continue
            if result is None or improves(got.span, result.span):
                result = got
            if self.early_exit and (not np.any(block.F) or got.span <= block.prefs.bound):
                break
        assert result is not None, "no layout holds the block's units"
        plans, span = self.refine(block, result, top, full)
        return BlockPlan([p.items for p in plans], span, result.layout)

    def block(self, ids: np.ndarray, size: int, offset: int, kmax: int, top: bool) -> Block:
        """The block's costs: classes ``<= kmax``, those a group of ``size`` ranks cannot always hold barred."""
        classes = self.classes[: kmax + 1]
        Es = self.cost[: kmax + 1][:, ids]
        barred = [k for k, c in enumerate(classes) if not self.view.contains(size, c)] if size < self.world_size else []
        if barred:
            Es = Es.copy()
            Es[barred] = np.inf
        prefs = self.prefer(Es, ids, size, offset, classes, top, bool(barred))
        C, F, ep = fill_costs(Es, prefs.pref, np.arange(len(ids)), prefs.gpu_s, classes,
                              fill_ok=self.view.fill_ok(len(classes)))
        return Block(ids, Es, C, F, ep, prefs, classes, size, offset, kmax, bool(barred))

    # -- the rules -------------------------------------------------------------------------
    @abc.abstractmethod
    def prefer(self, Es: np.ndarray, ids: np.ndarray, size: int, offset: int, classes: list[int], top: bool,
               barred: bool) -> Preference:
        """Each unit's preferred class, and what the candidates need to know of the block."""

    @abc.abstractmethod
    def candidates(self, block: Block, top: bool) -> list[Layout]:
        """The block's candidate layouts, in the order they are tried."""

    @abc.abstractmethod
    def modes(self, block: Block, full: bool) -> tuple[bool, ...]:
        """Which modes to try, in order (True: nested, with fills)."""

    @abc.abstractmethod
    def own(self, block: Block, units: list[int], ranks: tuple[int, ...], k: int) -> GroupPlan:
        """The items (and time) of a group of class ``k`` on ``ranks`` running the block-local ``units`` itself."""

    def nested(self, units: np.ndarray, size: int, offset: int, kmax: int) -> BlockPlan:
        """The nested plan of a group's fills (this engine, recursively)."""
        return self.solve(units, size, offset, kmax)

    def refine(self, block: Block, mode: Mode, top: bool, full: bool) -> tuple[list[GroupPlan], float]:
        """The winner's group plans, improved (dcp) or as they are."""
        return mode.plans, mode.span

    # -- the engine --------------------------------------------------------------------------
    def dispatch(self, block: Block, cands: list[Layout], nested: bool) -> Mode | None:
        """The best candidate layout by dispatch estimate in one mode, realized; None if no layout holds the units."""
        ids, Es, classes = block.ids, block.Es, block.classes
        key = self.order_key(block)
        cost, floor = (block.C, block.F) if nested else (Es, None)
        costT, floorT = cost.T.tolist(), None if floor is None else floor.T.tolist()
        best = None
        for lay in cands:
            if not nested and self.flat_present_only and any(p not in block.present for p in lay):
                continue
            for groups in self.placements(lay, block):
                gs = None if self.speeds is None else [self.view.speed(g) for g in groups]
                try:
                    members, _, span = lpt_dispatch(
                        cost, lay, classes, key, self.trials, self.rng, floor=floor, costT=costT, floorT=floorT,
                        fills_after_own=self.fills_after_own,
                        cutoff=best[3] * (1 - 1e-9) if best is not None else math.inf, group_speed=gs)
                except ValueError:  # a unit fits no group of this layout
                    continue
                if best is None or improves(span, best[3]):
                    best = (lay, members, groups, span)
                if self.early_exit and span <= block.prefs.bound:
                    break
            else:
                continue
            break
        if best is None:
            return None
        layout, members, groups, _ = best
        plans = [self.group(block, list(members[g]), groups[g], nested) for g in range(len(groups))]
        return Mode(nested, plans, makespan(p.time for p in plans), layout, groups, [list(m) for m in members])

    def order_key(self, block: Block) -> np.ndarray:
        """Units are dispatched longest first by this key."""
        return block.Es[block.pref, np.arange(len(block.ids))]

    def placements(self, layout: Layout, block: Block) -> list[list[tuple[int, ...]]]:
        """Rank tuples of ``layout``'s groups on the block: the first-fit placement, and with uneven rank speeds also
        its mirror image when the placement rule allows it (the dispatch then keeps slow ranks out of long units)."""
        topo = self.view.topology
        groups = place(layout, topo, block.offset, block.size)
        if groups is None:
            return []
        out = [groups]
        speeds = self.speeds
        lo, hi = block.offset, block.offset + block.size
        if speeds is not None and len(set(speeds[lo:hi])) > 1:
            mirror = [tuple(range(hi - (g[0] - lo) - len(g), hi - (g[0] - lo))) for g in groups]
            if all(topo.legal(g[0], len(g)) for g in mirror) and \
                    [self.view.speed(g) for g in mirror] != [self.view.speed(g) for g in out[0]]:
                out.append(mirror)
        return out

    def group(self, block: Block, mem: list[int], ranks: tuple[int, ...], nested: bool) -> GroupPlan:
        """One group running the block-local units ``mem``: its own units, then its fills as a nested plan."""
        if not mem:
            return GroupPlan([], 0.0)
        k = self.classes.index(len(ranks))
        ids = block.ids
        if k > 0 and nested:
            fk = block.fill[k]
            own, fill = [j for j in mem if not fk[j]], [j for j in mem if fk[j]]
        else:
            own, fill = list(mem), []
        got = self.own(block, own, ranks, k) if own else GroupPlan([], 0.0)
        if not fill:
            return got
        sub = self.nested(ids[fill], len(ranks), ranks[0], k - 1)
        return GroupPlan(got.items + interleave_items(sub.groups), got.time + sub.span)
