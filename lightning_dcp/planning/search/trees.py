"""dcp's buddy-tree search: a step as a tree of SP groups that split over the step.

A buddy tree (:class:`~lightning_dcp.planning.search.tree.BuddyTree`) is a hierarchy of legal blocks: a block runs
its own micro-batches on all its ranks, then its children go on independently, to any depth. :class:`TreeSearch`
places every sample on a node by a deadline greedy (the cheapest SP size that still ends by a deadline just above
the step bound), packs each node's samples exactly, and improves the placement -- and the layout plan's, itself a
tree -- with the tree refiner (:mod:`~lightning_dcp.planning.search.refine`). Pure Python.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from lightning_dcp.planning.plan import interleave_items
from lightning_dcp.planning.search.objective import improves
from lightning_dcp.planning.search.problem import Pack, Placed, SearchSpace, StepProblem
from lightning_dcp.planning.search.refine import TreeRefiner, TreeSchedule
from lightning_dcp.planning.search.tree import BuddyTree

__all__ = ["TreeSchedule", "TreeSearch", "TREE_SLACK", "TREE_DEADLINES"]

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
        levels = [k for k, p in enumerate(space.classes) if p in self.tree.level]
        self.holds_all = all(any(math.isfinite(var[k][i]) for k in levels) for i in range(len(problem.L)))
        """Every sample fits some size of the tree (a size off the tree, 3 of 4 ranks, may be the only one that
        holds a sample when rings on 4 hold less than Ulysses on 3)."""

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
        return self.improve(best, refine=not many and self.refines()) if self.space.refine_rounds else best

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
        return self.improve(self.realize(tree, where), refine=self.refines())

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

    def improve(self, sched: TreeSchedule, refine: bool) -> TreeSchedule:
        """The tree refiner on a schedule: the exact pass first when ``refine``, then balancing (at most
        ``BALANCE_PACKS_PER_NODE`` packs per node of the tree)."""
        tree = sched.tree

        def pack(v: int, idx: list[int]) -> tuple[list[Pack], float]:
            got = self.problem.pack(idx, tree.size[v])
            return got, self.node_time(tree, v, got)

        refiner = TreeRefiner(sched, pack, self.var, self.const, self.problem.lengths, self.space.budget,
                              self.space.classes)
        if refine:
            refiner.refine(self.space.refine_rounds)
        refiner.balance(BALANCE_PACKS_PER_NODE * len(tree.size))
        return refiner.schedule()

    @staticmethod
    def levels(sched: TreeSchedule) -> tuple[list[list[Placed]], float, list[int]]:
        """``(items per level, largest SP first; span; SP size of every node that runs items)``."""
        tree = sched.tree
        levels: dict[int, list[list[Placed]]] = {}
        nodes = sorted(sched.packs, key=lambda u: (-tree.size[u], tree.offset[u]))
        for v in nodes:
            ranks = tree.ranks(v)
            levels.setdefault(tree.size[v], []).append([Placed(ranks, pk.members, pk.recompute, pk.ring, pk.tp)
                                                      for pk in sched.packs[v]])
        return [interleave_items(levels[p]) for p in sorted(levels, reverse=True)], sched.span, [tree.size[v] for v in nodes]
