"""Buddy-tree schedules: aligned power-of-two SP groups that split over the step.

A world block of ``2^m`` ranks is a binary tree of aligned blocks (the *buddy* tree): the root
is the block, each node of ``P`` ranks has two children of ``P/2`` ranks (its halves), the
leaves are single ranks. A schedule puts every unit (sample) on one node whose size is a usable
SP size. A node runs its own micro-batches on all its ranks first, then its halves go on
independently, so every rank's items are its root-to-leaf path, node by node. The step's
compute span is the largest root-to-leaf sum of the nodes' own times -- exactly what the
simulator measures for the plan listed node by node, largest first.

This is the shape of the step bound's best case (every sample on the SP size it needs, the
rest of the ranks busy beside or after it): a long sample gets a large block, whose ranks then
split and run the shorter samples, with no rank waiting for a group it is not in.

:meth:`BuddyTree.assign` is a deadline greedy: units are taken longest first; each goes to the
least-loaded node (largest root-to-leaf sum through it; or, *best fit*, the most loaded one on
which it still ends by ``deadline``) of the SP size that costs the fewest GPU-seconds among
those on which it still ends by ``deadline``; if none does, to the one where it ends earliest. A unit's cost on a node is its own time there plus, when it opens a new
micro-batch (the node is empty, or its open micro-batch has no room), the per-micro-batch
constant. Callers try a few deadlines above the step bound and keep the best exact span.

Pure Python, deterministic.
"""

from __future__ import annotations

import math
from typing import Sequence

from lightning_dcp.planning.layouts import world_blocks


class BuddyTree:
    """The buddy trees of a world's aligned power-of-two blocks, with their usable SP sizes.

    Args:
        world_size: ranks; a non-power-of-two world is a forest, one tree per block of
            :func:`~lightning_dcp.planning.layouts.world_blocks`.
        classes: usable SP sizes, ascending (powers of two); a node of another size holds no
            units (its ranks only pass through to its halves).
    """

    def __init__(self, world_size: int, classes: Sequence[int]):
        self.classes = list(classes)
        self.offset: list[int] = []
        self.size: list[int] = []
        self.parent: list[int] = []
        self.kids: list[list[int]] = []
        for start, size in world_blocks(world_size):
            self._build(start, size, -1)
        n = len(self.offset)
        self.level: dict[int, list[int]] = {}
        for v in range(n):
            self.level.setdefault(self.size[v], []).append(v)
        for p in self.level:
            self.level[p].sort(key=self.offset.__getitem__)
        self.pos = [0] * n
        for p, nodes in self.level.items():
            for j, v in enumerate(nodes):
                self.pos[v] = j
        self.ancestors: list[list[int]] = []
        for v in range(n):
            a, u = [], self.parent[v]
            while u >= 0:
                a.append(u)
                u = self.parent[u]
            self.ancestors.append(a)
        # descendants of v at each smaller size: a contiguous slice of that level (sorted by offset)
        self.below: list[list[tuple[int, int, int]]] = []
        for v in range(n):
            lo_r, hi_r = self.offset[v], self.offset[v] + self.size[v]
            d = []
            q = self.size[v] // 2
            while q >= 1:
                nodes = self.level.get(q, [])
                js = [j for j, u in enumerate(nodes) if lo_r <= self.offset[u] < hi_r]
                if js:
                    d.append((q, js[0], js[-1] + 1))
                q //= 2
            self.below.append(d)
        self.leaves = self.level.get(1, [])

    def _build(self, offset: int, size: int, parent: int) -> None:
        v = len(self.offset)
        self.offset.append(offset)
        self.size.append(size)
        self.parent.append(parent)
        self.kids.append([])
        if parent >= 0:
            self.kids[parent].append(v)
        if size > 1:
            self._build(offset, size // 2, v)
            self._build(offset + size // 2, size // 2, v)

    def ranks(self, v: int) -> tuple[int, ...]:
        """Global ranks of node ``v``."""
        return tuple(range(self.offset[v], self.offset[v] + self.size[v]))

    def span(self, own: Sequence[float]) -> float:
        """Largest root-to-leaf sum of ``own`` (seconds per node): the compute span."""
        best = 0.0
        for v in self.leaves:
            s = own[v]
            for a in self.ancestors[v]:
                s += own[a]
            if s > best:
                best = s
        return best

    def spread(self, own: Sequence[float]) -> float:
        """Sum of squared root-to-leaf sums: lower when the paths are shorter or more even (a tie-breaker
        for equal spans)."""
        tot = 0.0
        for v in self.leaves:
            s = own[v]
            for a in self.ancestors[v]:
                s += own[a]
            tot += s * s
        return tot

    def through(self, own: Sequence[float]) -> list[float]:
        """Per node: the largest root-to-leaf sum of ``own`` over the paths through it."""
        n = len(self.offset)
        down = [0.0] * n  # own + longest path below, children before parents (larger ids are deeper)
        for v in range(n - 1, -1, -1):
            k = self.kids[v]
            down[v] = own[v] + (max(down[c] for c in k) if k else 0.0)
        out = [0.0] * n
        for v in range(n):
            up = 0.0
            for a in self.ancestors[v]:
                up += own[a]
            out[v] = up + down[v]
        return out

    def assign(self, var: Sequence[Sequence[float]], const: Sequence[Sequence[float]], lengths: Sequence[int],
               budget: Sequence[int], order: Sequence[int], deadline: float, best_fit: bool = False) -> list[int]:
        """Node of every unit by the deadline greedy (see the module docstring).

        Args:
            var: ``var[k][i]``: unit ``i``'s own time on SP size ``classes[k]`` (``inf``: does not fit).
            const: ``const[k][i]``: the per-micro-batch constant it pays there when it opens one.
            lengths: tokens of every unit.
            budget: token budget of one micro-batch per class.
            order: units in the order to place them (longest first).
            deadline: the target compute span (seconds).
            best_fit: among the nodes of one SP size, take the most loaded one the unit still ends
                by the deadline on (default: the least loaded).
        """
        n = len(self.offset)
        own = [0.0] * n
        down = [0.0] * n
        room = [0] * n  # tokens left in the node's open micro-batch
        val = {p: [0.0] * len(nodes) for p, nodes in self.level.items()}
        where = [-1] * len(lengths)
        inf = math.inf
        opts = [(k, p, val[p], self.level[p]) for k, p in enumerate(self.classes) if p in self.level]
        kids, anc, below, size, pos = self.kids, self.ancestors, self.below, self.size, self.pos
        for i in order:
            ln = lengths[i]
            best = None
            for k, p, lv, nodes in opts:
                t = var[k][i]
                if t == inf:
                    continue
                m = min(lv)
                if best_fit:  # the fullest node it still fits by the deadline
                    lim = deadline - t
                    for x in lv:
                        if m < x <= lim:
                            m = x
                v = nodes[lv.index(m)]
                if room[v] < ln:
                    t += const[k][i]
                fin = m + t
                key = (0, p * t, fin) if fin <= deadline else (1, fin, p * t)
                if best is None or key < best[0]:
                    best = (key, k, v, t)
            assert best is not None, "a unit fits no SP size of the tree"
            _, k, v, t = best
            where[i] = v
            if room[v] < ln:
                room[v] = budget[k] - ln if ln < budget[k] else 0
            else:
                room[v] -= ln
            own[v] += t
            down[v] += t
            val[size[v]][pos[v]] += t
            for q, lo, hi in below[v]:  # every path through a descendant grows by t
                lq = val[q]
                for j in range(lo, hi):
                    lq[j] += t
            for a in anc[v]:  # longest path below each ancestor (binary: two halves)
                c0, c1 = kids[a]
                d0, d1 = down[c0], down[c1]
                down[a] = own[a] + (d0 if d0 > d1 else d1)
            up = 0.0
            for a in reversed(anc[v]):  # then the path value through it
                val[size[a]][pos[a]] = up + down[a]
                up += own[a]
        return where
