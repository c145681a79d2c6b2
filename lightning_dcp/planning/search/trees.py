"""dcp's buddy-tree search: a step as a tree of SP groups that split over the step.

A buddy tree (:class:`~lightning_dcp.planning.search.tree.BuddyTree`) is a hierarchy of legal blocks: a block runs
its own micro-batches on all its ranks, then its children go on independently, to any depth. :class:`TreeSearch`
places every sample on a node by a deadline greedy (the cheapest SP size that still ends by a deadline just above
the step bound), packs each node's samples exactly, and improves the placement -- and the layout plan's, itself a
tree -- by moves and swaps off the critical paths (:func:`refine`, on small worlds or about a sample per rank) and
by balancing (:func:`~lightning_dcp.planning.search.balance.balance`, per move rather than per tree). Pure Python.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lightning_dcp.planning.plan import interleave_items
from lightning_dcp.planning.search.balance import TreeState, balance
from lightning_dcp.planning.search.climb import climb
from lightning_dcp.planning.search.objective import improves
from lightning_dcp.planning.search.problem import Pack, Placed, SearchSpace, StepProblem
from lightning_dcp.planning.search.tree import BuddyTree

__all__ = ["TreeSchedule", "TreeSearch", "TREE_SLACK", "TREE_DEADLINES", "TREE_REFINE_WIDTH"]

TREE_SLACK = 0.005
"""dcp keeps its layout plan without trying buddy trees when that plan is within this fraction of the step bound."""

TREE_DEADLINES = (1.0, 1.02)
"""Deadlines of the greedy, as multiples of the step bound's compute part (past 1.05 the least-loaded greedy repeats
itself and best fit only gets worse)."""

TREE_FIRST_DEADLINES = (1.02,)
"""The deadlines of a step of many samples per rank (1.02 was as good as 1.0 at 256 and 1024 GPUs after balancing)."""

BEST_FIT_MAX_WORLD = 64
"""Worlds of at most this many ranks also try best fit (each unit on the fullest node it still ends on by the
deadline); above, scanning every node of a level per unit costs more than it wins."""

BALANCE_PACKS_PER_NODE = 2
"""Balancing re-packs at most this many nodes per node of the tree (a work budget: the same plan on every rank)."""

TREE_REFINE_MAX_WORLD = 128
"""Refinement (a pass over the tree per round) runs before balancing on worlds of at most this many ranks ..."""

TREE_REFINE_SAMPLES_PER_RANK = 2
"""... and on any world with at most this many samples per rank (a move then needs a swap)."""

TREE_REFINE_WIDTH = 8
"""Refinement looks at the largest this-many samples of a node (moves and swaps)."""


@dataclass
class TreeSchedule:
    """Every sample's node (``where``), every node's micro-batches and own time, and the span (longest path)."""

    span: float
    where: list[int]
    packs: dict[int, list[Pack]]
    own: list[float]
    tree: BuddyTree


class TreeSearch:
    """Buddy-tree schedules of one step (:class:`StepProblem`) in a run's :class:`SearchSpace`."""

    def __init__(self, space: SearchSpace, problem: StepProblem) -> None:
        self.space, self.problem, self.view = space, problem, space.view
        self.world_size = space.world_size
        self.tree = space.tree()
        var, const = [], []
        work = np.asarray(problem.work, dtype=np.float64) if problem.work is not None else None
        for p in space.classes:
            v, c = self.view.split_costs(problem.L, p, work)
            var.append(v.tolist())
            const.append(c.tolist())
        self.var, self.const = var, const

    def search(self, floor: float, many: bool = False) -> TreeSchedule:
        """The greedy's best schedule over a few deadlines (``floor``: the step bound's compute part), refined and
        balanced. ``many`` (many samples per rank): one deadline, balancing alone."""
        tree, Ll = self.tree, self.problem.lengths
        order = np.argsort(-self.problem.L, kind="stable").tolist()
        best = None
        for f in TREE_FIRST_DEADLINES if many else TREE_DEADLINES:
            for best_fit in ((False, True) if self.world_size <= BEST_FIT_MAX_WORLD else (False,)):
                where = tree.assign(self.var, self.const, Ll, self.space.budget, order, floor * f, best_fit=best_fit)
                got = self.realize(tree, where)
                if best is None or improves(got.span, best.span):
                    best = got
            if best.span <= floor * (1 + TREE_SLACK):
                break
        if self.space.refine_rounds:
            if not many and self.refines():
                best = self.refine(best)
            best = self.balance(best)
        return best

    def refines(self) -> bool:
        """Whether schedules are refined before balancing (small worlds, or few samples per rank)."""
        return self.world_size <= TREE_REFINE_MAX_WORLD or len(self.problem.L) <= TREE_REFINE_SAMPLES_PER_RANK * self.world_size

    def of_layout(self, blocks: list[list[Placed]]) -> TreeSchedule | None:
        """A layout plan (its groups, then their fills on sub-blocks: a tree schedule too) refined and balanced as a
        tree: on the search's tree when its groups are nodes of it, else on a tree with them as nodes."""
        if not self.space.refine_rounds:
            return None
        groups = {(it.ranks[0], len(it.ranks)) for blk in blocks for it in blk}
        tree = self.tree if all(self.tree.has_group(a, n) for a, n in groups) else self.space.tree(groups)
        node = {(tree.offset[v], tree.size[v]): v for v in range(len(tree.size))}
        where = [-1] * len(self.problem.L)
        for blk in blocks:
            for it in blk:
                v = node[(it.ranks[0], len(it.ranks))]
                for i in it.members:
                    where[i] = v
        got = self.realize(tree, where)
        if self.refines():
            got = self.refine(got)
        return self.balance(got)

    def pace(self, tree: BuddyTree, v: int) -> float:
        """Node ``v``'s pace: its slowest rank's speed (1.0 without rank speeds)."""
        speeds = self.view.speeds
        return 1.0 if speeds is None else min(speeds[tree.offset[v]:tree.offset[v] + tree.size[v]])

    def node_time(self, tree: BuddyTree, v: int, packs: list[Pack]) -> float:
        return sum(pk.time for pk in packs) / self.pace(tree, v)

    def realize(self, tree: BuddyTree, where: Sequence[int]) -> TreeSchedule:
        """Every node's micro-batches and exact own time for the placement ``where``."""
        members: dict[int, list[int]] = {}
        for i, v in enumerate(where):
            members.setdefault(v, []).append(i)
        own = [0.0] * len(tree.size)
        packs = {}
        for v, mem in members.items():
            packs[v] = self.problem.pack(mem, tree.size[v])
            own[v] = self.node_time(tree, v, packs[v])
        return TreeSchedule(tree.span(own), list(where), packs, own, tree)

    def balance(self, sched: TreeSchedule) -> TreeSchedule:
        """:func:`~lightning_dcp.planning.search.balance.balance` on a schedule (at most ``BALANCE_PACKS_PER_NODE``
        packs per node of the tree)."""
        tree = sched.tree
        members: dict[int, list[int]] = {}
        for i, v in enumerate(sched.where):
            members.setdefault(v, []).append(i)
        state = TreeState(tree, members, dict(sched.packs), list(sched.own))

        def pack(v: int, idx: list[int]) -> tuple[list[Pack], float]:
            got = self.problem.pack(idx, tree.size[v])
            return got, self.node_time(tree, v, got)

        where = sched.where
        if balance(state, pack, self.var, self.const, self.problem.lengths, self.space.budget, self.space.classes,
                   BALANCE_PACKS_PER_NODE * len(tree.size)):
            where = list(where)
            for v, idx in state.members.items():
                for i in idx:
                    where[i] = v
        return TreeSchedule(tree.span(state.own), where, state.packs, state.own, tree)

    def refine(self, sched: TreeSchedule) -> TreeSchedule:
        """Moves and swaps off the critical paths while they lower the exact span (or keep it and even the paths)."""
        return _Refinement(self, sched).run(self.space.refine_rounds)

    @staticmethod
    def levels(sched: TreeSchedule) -> tuple[list[list[Placed]], float, list[int]]:
        """``(items per level, largest SP first; span; SP size of every node that runs items)``."""
        tree = sched.tree
        levels: dict[int, list[list[Placed]]] = {}
        nodes = sorted(sched.packs, key=lambda u: (-tree.size[u], tree.offset[u]))
        for v in nodes:
            ranks = tree.ranks(v)
            levels.setdefault(tree.size[v], []).append([Placed(ranks, pk.members, pk.recompute) for pk in sched.packs[v]])
        return [interleave_items(levels[p]) for p in sorted(levels, reverse=True)], sched.span, [tree.size[v] for v in nodes]


class _Refinement:
    """Each round: the samples of the nodes on the slowest paths, moved to (or swapped with a sample of) the three
    least-loaded nodes of each SP size that holds them off those paths, ranked by the pair's estimated span; the
    first of the best six that lowers the exact span (both nodes re-packed), or keeps it and evens the paths."""

    def __init__(self, search: TreeSearch, sched: TreeSchedule) -> None:
        self.search, self.tree = search, sched.tree
        self.where, self.packs, self.own = list(sched.where), sched.packs, sched.own
        self.members: dict[int, list[int]] = {}
        for i, v in enumerate(self.where):
            self.members.setdefault(v, []).append(i)
        self.span, self.spread = self.tree.span(self.own), self.tree.spread(self.own)
        self.tried: set[tuple[int, int, int, int]] = set()

    def run(self, rounds: int) -> TreeSchedule:
        climb(self, lambda st: (st.span, st.spread), self.moves, self.attempt, width=6, rounds=rounds,
              better=lambda new, old: improves(new[0], old[0]) or (new[0] <= old[0] and improves(new[1], old[1])))
        return TreeSchedule(self.span, self.where, self.packs, self.own, self.tree)

    def moves(self, _state: "_Refinement") -> list[tuple]:
        """``(estimated span, -length, source, sample, destination, swapped sample or -1)``, best first."""
        tree, members, span, var = self.tree, self.members, self.span, self.search.var
        L = self.search.problem.L
        thr = tree.through(self.own)
        inf = math.inf
        kof = self.search.space.kof
        anc = tree.ancestors
        cut = span * (1 - 1e-12)
        crit = [v for v in members if thr[v] >= cut]
        light = {p: heapq.nsmallest(3 + len(crit), (u for u in nodes if thr[u] < cut), key=lambda u: (thr[u], u))
                 for p, nodes in tree.level.items() if p in kof}
        cands = []
        for s_ in crit:
            rs = var[kof[tree.size[s_]]]
            mine = sorted(members[s_], key=lambda i: (-rs[i], i))[:TREE_REFINE_WIDTH]
            for p, nodes in light.items():
                rd = var[kof[p]]
                for d in [u for u in nodes if s_ not in anc[u] and u not in anc[s_]][:3]:
                    theirs = sorted(members.get(d, ()), key=lambda j: (-rd[j], j))[:TREE_REFINE_WIDTH]
                    for i in mine:
                        ti = rd[i]
                        if ti == inf:
                            continue
                        gain = rs[i]
                        est = thr[d] + ti
                        if est < span and (s_, i, d, -1) not in self.tried:
                            cands.append((max(est, span - gain), -int(L[i]), s_, i, d, -1))
                        for j in theirs:
                            back = rs[j]
                            if back == inf or back >= gain:
                                continue
                            e2 = max(span - gain + back, thr[d] - rd[j] + ti)
                            if e2 < span and (s_, i, d, j) not in self.tried:
                                cands.append((e2, -int(L[i]), s_, i, d, j))
        cands.sort()
        return cands

    def attempt(self, _state: "_Refinement", move: tuple):
        _, _, s_, i, d, j = move
        self.tried.add((s_, i, d, j))
        tree, search = self.tree, self.search
        src = [x for x in self.members[s_] if x != i] + ([j] if j >= 0 else [])
        dst = [x for x in self.members.get(d, []) if x != j] + [i]
        ps = search.problem.pack(src, tree.size[s_]) if src else []
        pd = search.problem.pack(dst, tree.size[d])
        new = list(self.own)
        new[s_] = search.node_time(tree, s_, ps)
        new[d] = search.node_time(tree, d, pd)
        got, sq = tree.span(new), tree.spread(new)

        def take() -> "_Refinement":
            self.members[s_], self.members[d] = src, dst
            self.packs[d] = pd
            if src:
                self.packs[s_] = ps
            else:
                self.packs.pop(s_, None)
                self.members.pop(s_)
            self.own, self.span, self.spread = new, got, sq
            self.where[i] = d
            if j >= 0:
                self.where[j] = s_
            return self

        return (got, sq), take
