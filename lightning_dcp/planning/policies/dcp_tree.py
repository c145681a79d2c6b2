"""dcp's buddy-tree search (step 6 of :mod:`~lightning_dcp.planning.policies.dcp`): a step as a tree of SP groups.

A buddy tree (:class:`~lightning_dcp.planning.policies.tree.BuddyTree`) is a hierarchy of aligned
blocks that split over the step: a block runs its own micro-batches on all its ranks, then its
two halves go on independently, to any depth. :class:`BuddyTreeSearch` places every sample on a
node by a deadline greedy (the cheapest SP size that still ends by a deadline just above the
step bound), packs each node's samples exactly, and refines the placement -- and the layout
plan's, itself a two-level tree -- by moving and swapping samples off the critical path (on
small worlds, or about a sample per rank: a pass over the tree per round), then balances it
(:mod:`~lightning_dcp.planning.policies.tree_balance`: per move, not per tree).
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np

from lightning_dcp.planning.policies.base import interleave_items
from lightning_dcp.planning.policies.objective import improves
from lightning_dcp.planning.policies.tree import BuddyTree
from lightning_dcp.planning.policies.tree_balance import TreeState, balance

TREE_SLACK = 0.005
"""dcp keeps its layout plan without trying buddy-tree schedules when that plan is within this fraction of the step bound."""

TREE_DEADLINES = (1.0, 1.02)
"""Deadlines of the buddy-tree greedy, as multiples of the step bound's compute part (1.1 and 1.2 never won on
``benchmarks/planner_speed.py``'s 32-GPU grid: past 1.05 the least-loaded greedy repeats itself and best fit
only gets worse)."""

TREE_FIRST_DEADLINES = (1.02,)
"""The deadlines of a step of many samples per rank (:meth:`BuddyTreeSearch._tree_search` with ``many``): after
balancing, 1.02 was as good as or better than 1.0 on ``benchmarks/simulate_scaling.py``'s 256- and 1024-GPU cells."""

BEST_FIT_MAX_WORLD = 64
"""The buddy-tree greedy also tries best fit (each unit on the fullest node it still ends on by the deadline) on
worlds of at most this many ranks; above, scanning every node of a level per unit costs more than it wins."""

BALANCE_PACKS_PER_NODE = 2
"""The balancing after tree refinement (:func:`~lightning_dcp.planning.policies.tree_balance.balance`) re-packs
at most this many nodes per node of the tree (a work budget: the same plan on every rank)."""

TREE_REFINE_MAX_WORLD = 128
"""Tree refinement (:meth:`BuddyTreeSearch._tree_refine`: a pass over the tree per round) runs before balancing on
worlds of at most this many ranks; above, balancing alone was as good on ``benchmarks/simulate_scaling.py``'s
256- and 1024-GPU cells, for a fraction of the time."""

TREE_REFINE_SAMPLES_PER_RANK = 2
"""... and on any world with at most this many samples per rank (one sample per rank: a move needs a swap; on
``benchmarks/planner_speed.py``'s 1024-GPU rows refinement still won up to 0.9% of the step there)."""

GROUP_TREES = 8
"""Trees with a layout plan's groups as nodes kept per policy (:meth:`BuddyTreeSearch._group_tree`)."""

TREE_REFINE_WIDTH = 8
"""Tree refinement looks at the largest this-many samples of a node (moves and swaps)."""


class BuddyTreeSearch:
    """Mixin of :class:`~lightning_dcp.planning.policies.dcp.DCPPolicy`: buddy-tree schedules of one step.

    Uses the policy's ``world_size``, ``classes`` (SP sizes), ``view``, ``budget`` (token budget
    per SP size), ``refine_rounds`` and its packer ``_pack`` (from
    :class:`~lightning_dcp.planning.policies.dcp_schedule.LayoutScheduler`).
    """

    _tree: BuddyTree | None = None
    _tree_var: list[list[float]] = []
    _tree_const: list[list[float]] = []
    _group_trees: dict[frozenset, BuddyTree]

    def _tree_schedule(self, L: np.ndarray, E: np.ndarray, floor: float, span: float, blocks: list):
        """A buddy-tree schedule of the step (:mod:`~lightning_dcp.planning.policies.tree`) if it beats ``span``.

        The deadline greedy's best schedule, refined (:meth:`_tree_search`), and the layout plan
        (``blocks``) refined as a tree (:meth:`_tree_of_layout`): the faster of the two if it is
        faster than ``span`` (the layout plan's), as :meth:`_tree_levels`; else None.
        """
        best = self._tree_search(L, E, floor)
        got = self._tree_of_layout(blocks, L, E)
        if got is not None and improves(got[0], best[0]):
            best = got
        return self._tree_levels(best) if improves(best[0], span) else None

    def _tree_search(self, L: np.ndarray, E: np.ndarray, floor: float, many: bool = False) -> tuple:
        """The deadline greedy's best schedule, refined: ``(span, where, packs, own, tree)``.

        Tries the deadlines ``floor x TREE_DEADLINES`` (``floor``: the step bound's compute
        part), keeps the lowest exact span, then moves samples off its critical path while that
        lowers the span (:meth:`_tree_refine`, where :meth:`_refines`) and balances it (:meth:`_tree_balance`). ``many``
        (a step of many samples per rank, :meth:`~lightning_dcp.planning.policies.dcp.DCPPolicy._tree_first`):
        the deadlines ``TREE_FIRST_DEADLINES`` and balancing without the refinement before it.
        """
        if self._tree is None:
            self._tree = BuddyTree(self.view.topology, self.classes)
        tree = self._tree
        Ll = self._Ll
        var, const = [], []
        work = np.asarray(self._Wl, dtype=np.float64) if self.view._time_fast is not None else None
        for p in self.classes:
            v, c = self.view.split_costs(L, p, work)
            var.append(v.tolist())
            const.append(c.tolist())
        self._tree_var, self._tree_const = var, const
        order = np.argsort(-L, kind="stable").tolist()
        best = None
        for f in TREE_FIRST_DEADLINES if many else TREE_DEADLINES:
            for best_fit in ((False, True) if self.world_size <= BEST_FIT_MAX_WORLD else (False,)):
                where = tree.assign(var, const, Ll, self.budget, order, floor * f, best_fit=best_fit)
                packs, own = self._tree_realize(tree, where, L, E)
                got = tree.span(own)
                if best is None or improves(got, best[0]):
                    best = (got, where, packs, own, tree)
            if best[0] <= floor * (1 + TREE_SLACK):
                break
        if self.refine_rounds:
            if many or not self._refines(len(L)):  # balancing alone does as well, for less time
                got, where, packs, own = best[:4]
            else:
                got, where, packs, own = self._tree_refine(tree, best[1], best[2], best[3], L, E, var)
            best = self._tree_balance(tree, where, packs, own, L, E)
        return best

    def _refines(self, samples: int) -> bool:
        """Whether tree schedules of ``samples`` samples are refined (:meth:`_tree_refine`) before balancing: on
        worlds of at most ``TREE_REFINE_MAX_WORLD`` ranks, or with at most ``TREE_REFINE_SAMPLES_PER_RANK``
        samples per rank (where a move needs a swap, which balancing does not make)."""
        return self.world_size <= TREE_REFINE_MAX_WORLD or samples <= TREE_REFINE_SAMPLES_PER_RANK * self.world_size

    def _tree_balance(self, tree: BuddyTree, where: list[int], packs: dict, own: list[float], L: np.ndarray,
                      E: np.ndarray) -> tuple:
        """:func:`~lightning_dcp.planning.policies.tree_balance.balance` on a refined tree schedule (at most
        ``BALANCE_PACKS_PER_NODE`` packs per node of the tree): ``(span, where, packs, own, tree)``."""
        members: dict[int, list[int]] = {}
        for i, v in enumerate(where):
            members.setdefault(v, []).append(i)
        state = TreeState(tree, members, dict(packs), list(own))

        def pack(v: int, idx: list[int]) -> tuple[list, float]:
            got = self._pack(idx, tree.size[v], L, E)
            return got, sum(t for _, _, t in got) / self._pace(tree, v)

        if balance(state, pack, self._tree_var, self._tree_const, self._Ll, self.budget, self.classes,
                   BALANCE_PACKS_PER_NODE * len(tree.size)):
            where = list(where)
            for v, idx in state.members.items():
                for i in idx:
                    where[i] = v
        return tree.span(state.own), where, state.packs, state.own, tree

    def _tree_of_layout(self, blocks: list, L: np.ndarray, E: np.ndarray) -> tuple | None:
        """The layout plan (``blocks``: its groups, then their fills on sub-blocks, is a tree schedule too)
        refined as a tree: ``(span, where, packs, own, tree)``, or None without refinement rounds.

        On the search's tree when the plan's groups are nodes of it, else on a tree with its groups as nodes.
        Needs :meth:`_tree_search` first (its tree and costs).
        """
        if not self.refine_rounds:
            return None
        tree, Ll = self._tree, self._Ll
        groups = {(ranks[0], len(ranks)) for blk in blocks for ranks, _, _ in blk}
        ltree = tree if all(tree.has_group(a, n) for a, n in groups) else self._group_tree(groups)
        node = {(ltree.offset[v], ltree.size[v]): v for v in range(len(ltree.size))}
        where = [-1] * len(Ll)
        for blk in blocks:
            for ranks, idx, _ in blk:
                v = node[(ranks[0], len(ranks))]
                for i in idx:
                    where[i] = v
        packs, own = self._tree_realize(ltree, where, L, E)
        if self._refines(len(L)):
            _, where, packs, own = self._tree_refine(ltree, where, packs, own, L, E, self._tree_var)
        return self._tree_balance(ltree, where, packs, own, L, E)

    def _group_tree(self, groups: set[tuple[int, int]]) -> BuddyTree:
        """The search's tree with ``groups`` as nodes (the last few kept: steps often repeat a layout)."""
        key = frozenset(groups)
        got = self._group_trees.get(key)
        if got is None:
            got = BuddyTree(self.view.topology, self.classes, chain=self._tree.chain, groups=groups)
            if len(self._group_trees) >= GROUP_TREES:
                self._group_trees.pop(next(iter(self._group_trees)))
            self._group_trees[key] = got
        return got

    def _tree_levels(self, best: tuple):
        """A tree schedule ``(span, where, packs, own, tree)`` as ``(item lists per level, largest SP first; span;
        SP size of every node that runs items)``."""
        got, _, packs, _, tree = best
        levels: dict[int, list[list]] = {}
        nodes = sorted(packs, key=lambda u: (-tree.size[u], tree.offset[u]))
        for v in nodes:
            ranks = tree.ranks(v)
            levels.setdefault(tree.size[v], []).append([(ranks, idx, rec) for idx, rec, _ in packs[v]])
        return [interleave_items(levels[p]) for p in sorted(levels, reverse=True)], got, [tree.size[v] for v in nodes]

    def _pace(self, tree: BuddyTree, v: int) -> float:
        """Node ``v``'s pace: its slowest rank's speed (1.0 without rank speeds)."""
        speeds = self.view.speeds
        if speeds is None:
            return 1.0
        return min(speeds[tree.offset[v]:tree.offset[v] + tree.size[v]])

    def _tree_realize(self, tree: BuddyTree, where: Sequence[int], L: np.ndarray, E: np.ndarray):
        """Micro-batches of every node that holds samples, and every node's exact own time."""
        members: dict[int, list[int]] = {}
        for i, v in enumerate(where):
            members.setdefault(v, []).append(i)
        own = [0.0] * len(tree.size)
        packs = {}
        for v, mem in members.items():
            packs[v] = self._pack(mem, tree.size[v], L, E)
            own[v] = sum(t for _, _, t in packs[v]) / self._pace(tree, v)
        return packs, own

    def _tree_refine(self, tree: BuddyTree, where: list[int], packs: dict, own: list[float], L: np.ndarray,
                     E: np.ndarray, var: list[list[float]]):
        """Move or swap samples off the critical path of a tree schedule while that lowers its exact span.

        Each round looks at the nodes on the slowest root-to-leaf paths and, for their samples,
        at moves to the three least-loaded nodes of each SP size that holds them (off those
        paths) and at swaps with the samples there, ranked by the estimated span of the pair
        afterwards (own times, ``var``); it makes the first of the best six that lowers the
        exact span (both nodes re-packed).
        """
        where = list(where)
        members: dict[int, list[int]] = {}
        for i, v in enumerate(where):
            members.setdefault(v, []).append(i)
        span = tree.span(own)
        spread = tree.spread(own)
        tried: set[tuple[int, int, int, int]] = set()
        for _ in range(self.refine_rounds):
            cands = self._tree_moves(tree, members, tree.through(own), span, var, L, tried)
            moved = False
            for _, _, s_, i, d, j in cands[:6]:
                tried.add((s_, i, d, j))
                src = [x for x in members[s_] if x != i] + ([j] if j >= 0 else [])
                dst = [x for x in members.get(d, []) if x != j] + [i]
                ps = self._pack(src, tree.size[s_], L, E) if src else []
                pd = self._pack(dst, tree.size[d], L, E)
                new = list(own)
                new[s_] = sum(t for _, _, t in ps) / self._pace(tree, s_)
                new[d] = sum(t for _, _, t in pd) / self._pace(tree, d)
                got = tree.span(new)
                sq = tree.spread(new)
                if improves(got, span) or (got <= span and improves(sq, spread)):
                    spread = sq
                    members[s_], members[d] = src, dst
                    packs[d] = pd
                    if src:
                        packs[s_] = ps
                    else:
                        packs.pop(s_, None)
                        members.pop(s_)
                    own, span = new, got
                    where[i] = d
                    if j >= 0:
                        where[j] = s_
                    moved = True
                    break
            if not moved:
                break
        return span, where, packs, own

    def _tree_moves(self, tree: BuddyTree, members: dict[int, list[int]], thr: list[float], span: float,
                    var: list[list[float]], L: np.ndarray, tried: set) -> list[tuple]:
        """Candidate moves and swaps off the critical paths, best estimated span first.

        Each is ``(estimated span, -length, source node, sample, destination node, swapped sample or -1)``
        (see :meth:`_tree_refine`); ``thr[v]`` is the slowest root-to-leaf path through node ``v``.
        """
        inf = math.inf
        kof = {p: k for k, p in enumerate(self.classes)}
        anc = tree.ancestors
        cut = span * (1 - 1e-12)
        crit = [v for v in members if thr[v] >= cut]
        # per SP size, its least-loaded nodes off the critical paths (destinations)
        light = {p: heapq.nsmallest(3 + len(crit), (u for u in nodes if thr[u] < cut), key=lambda u: (thr[u], u))
                 for p, nodes in tree.level.items() if p in kof}
        cands = []
        for s_ in crit:
            rs = var[kof[tree.size[s_]]]
            mine = sorted(members[s_], key=lambda i: (-rs[i], i))[:TREE_REFINE_WIDTH]
            for p, nodes in light.items():
                rd = var[kof[p]]
                dests = [u for u in nodes if s_ not in anc[u] and u not in anc[s_]][:3]
                for d in dests:
                    theirs = sorted(members.get(d, ()), key=lambda j: (-rd[j], j))[:TREE_REFINE_WIDTH]
                    for i in mine:
                        ti = rd[i]
                        if ti == inf:
                            continue
                        gain = rs[i]
                        est = thr[d] + ti
                        if est < span and (s_, i, d, -1) not in tried:
                            cands.append((max(est, span - gain), -int(L[i]), s_, i, d, -1))
                        for j in theirs:
                            back = rs[j]
                            if back == inf or back >= gain:
                                continue
                            e2 = max(span - gain + back, thr[d] - rd[j] + ti)
                            if e2 < span and (s_, i, d, j) not in tried:
                                cands.append((e2, -int(L[i]), s_, i, d, j))
        cands.sort()
        return cands
