"""Buddy-tree schedules: SP groups that split over the step, on any placement the topology allows.

A *split tree* of the world: every node is a legal SP group (:mod:`~lightning_dcp.planning.topology`),
a node's children split its ranks into smaller groups, the leaves are single ranks. For power-of-two
sizes this is the classic *buddy* tree of aligned blocks (each node of ``P`` ranks has two children
of ``P/2`` ranks). A schedule puts every unit (sample) on one node whose size is a usable SP size. A
node runs its own micro-batches on all its ranks first, then its children go on independently, so
every rank's items are its root-to-leaf path, node by node. The step's compute span is the largest
root-to-leaf sum of the nodes' own times (:func:`~lightning_dcp.planning.search.objective.makespan`)
-- exactly what the simulator measures for the plan listed node by node, largest first.

Which nodes: a *chain* of sizes ``c_0 > c_1 > ... > 1`` (each dividing the one before; sizes that
are not usable SP sizes only pass their ranks through). A run of ranks is covered by as many groups
of the largest chain size that fits as first fit places, the rest of the run recursively; a node of
``c_i`` ranks is split the same way by the smaller chain sizes. The world itself is such a run (a
non-power-of-two world is a forest: W=13 has roots of 8, 4 and 1 ranks). :func:`best_chain` picks
the chain whose tree covers the most ranks at usable SP sizes; ``groups`` forces given groups to be
nodes (a layout plan's groups and their fills, refined as a tree).

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

import bisect
import heapq
import math
from typing import Iterable, Sequence

import numpy as np

from lightning_dcp.planning.search.objective import makespan
from lightning_dcp.planning.topology import Topology


VECTOR_LEAVES = 64
"""Trees of more leaves than this sum their root-to-leaf paths with numpy (:meth:`BuddyTree.paths`)."""

HEAP_LEVEL = 64
"""A tree level with more nodes than this finds its least-loaded node with a heap in :meth:`BuddyTree.assign`."""


def chains(classes: Sequence[int], world_size: int) -> list[tuple[int, ...]]:
    """The maximal divisibility chains from the largest class (at most the world) down to 1, largest
    steps first; above the top class, its doublings up to the world pass ranks through (as the
    aligned blocks of a power-of-two world do)."""
    usable = sorted({int(p) for p in classes if p <= world_size} | {1}, reverse=True)
    top = usable[0]
    above = []
    q = top * 2
    while q <= world_size:
        above.insert(0, q)
        q *= 2
    out: list[tuple[int, ...]] = []

    def walk(chain: list[int]) -> None:
        cur = chain[-1]
        if cur == 1:
            out.append(tuple(above + chain))
            return
        divs = [c for c in usable if c < cur and cur % c == 0]
        # maximal steps only: no usable size strictly between c and cur that c divides and that divides cur
        for c in divs:
            if not any(c < m < cur and m % c == 0 and cur % m == 0 for m in divs):
                walk(chain + [c])

    walk([top])
    return out


def best_chain(classes: Sequence[int], topology: Topology) -> tuple[int, ...]:
    """The chain (:func:`chains`) whose tree covers the most ranks at usable sizes (summed over the
    sizes); ties: the first."""
    best, best_score = None, -1.0
    usable = set(classes)
    for chain in chains(classes, topology.world_size):
        tree = BuddyTree(topology, classes, chain=chain, index=False)
        score = sum(tree.size[v] for v in range(len(tree.size)) if tree.size[v] in usable)
        if score > best_score:
            best, best_score = chain, score
    return best  # type: ignore[return-value]


def _by_gpu_seconds(var: Sequence[Sequence[float]], sizes: Sequence[int], rows: Sequence[int]) -> list[list[int]]:
    """Per unit: the rows ``rows`` (SP sizes ``sizes``) where it fits, by GPU-seconds (size x own time) ascending,
    ties by row."""
    if not rows:
        return [[] for _ in range(len(var[0]) if var else 0)]
    V = np.asarray([var[k] for k in rows], dtype=np.float64)
    G = V * np.asarray(sizes, dtype=np.float64)[:, None]
    order = np.argsort(G, axis=0, kind="stable")
    fits = np.isfinite(np.take_along_axis(G, order, axis=0))
    ids = np.asarray(rows, dtype=np.int64)[order]
    if fits.all():
        return ids.T.tolist()
    return [r[:c] for r, c in zip(ids.T.tolist(), fits.sum(axis=0).tolist())]


class BuddyTree:
    """A split tree of the world (see the module docstring), with its usable SP sizes.

    Args:
        world: the world size (no node boundaries) or a :class:`~lightning_dcp.planning.topology.Topology`.
        classes: usable SP sizes, ascending; a node of another size holds no units (its ranks only pass
            through to its children).
        chain: the sizes that split runs and nodes (default :func:`best_chain`).
        groups: ``(start, size)`` pairs that must be nodes (laminar: two either nest or are disjoint).
        index: build the tables :meth:`assign` and the path sums need (False: the nodes only).
    """

    def __init__(self, world: "int | Topology", classes: Sequence[int], *, chain: Sequence[int] | None = None,
                 groups: Iterable[tuple[int, int]] = (), index: bool = True):
        self.topology = Topology.of(world)
        self.classes = list(classes)
        self.chain = tuple(chain) if chain is not None else best_chain(self.classes, self.topology)
        self.offset: list[int] = []
        self.size: list[int] = []
        self.parent: list[int] = []
        self.kids: list[list[int]] = []
        self._fixed = sorted({(int(a), int(n)) for a, n in groups}, key=lambda g: (g[0], -g[1]))
        self._fixed_starts = [a for a, _ in self._fixed]
        self._groups: set[tuple[int, int]] | None = None
        self._cols: list[np.ndarray] | None = None
        self._cover(0, self.topology.world_size, -1, self.topology.world_size + 1)
        if index:
            self._index()

    # -- construction ----------------------------------------------------------------------
    def _node(self, offset: int, size: int, parent: int) -> None:
        v = len(self.offset)
        self.offset.append(offset)
        self.size.append(size)
        self.parent.append(parent)
        self.kids.append([])
        if parent >= 0:
            self.kids[parent].append(v)
        if size > 1:
            self._cover(offset, offset + size, v, size)

    def _cover(self, lo: int, hi: int, parent: int, below: int) -> None:
        """Cover the run ``[lo, hi)`` with nodes (children of ``parent``) of sizes below ``below``: the
        maximal given groups inside it, then the largest chain size first fit places, then the rest."""
        top = []
        if self._fixed:  # the maximal given groups inside the run (sorted by start, larger first: a sweep)
            end = lo
            for j in range(bisect.bisect_left(self._fixed_starts, lo), bisect.bisect_left(self._fixed_starts, hi)):
                a, n = self._fixed[j]
                if n < below and a + n <= hi and a >= end:
                    top.append((a, n))
                    end = a + n
        if top:
            pos = lo
            for a, n in top:
                if a > pos:
                    self._cover(pos, a, parent, below)
                self._node(a, n, parent)
                pos = a + n
            if pos < hi:
                self._cover(pos, hi, parent, below)
            return
        for c in self.chain:
            if c >= below or c > hi - lo:
                continue
            free = [[lo, hi]]
            placed = self.topology.take(free, c, hi - lo)
            if not placed:
                continue
            pieces = sorted([(g[0], len(g), True) for g in placed] + [(a, b - a, False) for a, b in free])
            for a, n, is_node in pieces:
                if is_node:
                    self._node(a, n, parent)
                else:
                    self._cover(a, a + n, parent, below)
            return
        for r in range(lo, hi):  # no chain size fits (a chain always ends in 1): single ranks
            self._node(r, 1, parent)

    def _index(self) -> None:
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
        sizes = sorted(self.level, reverse=True)
        offs = {q: [self.offset[u] for u in self.level[q]] for q in sizes}
        self.below: list[list[tuple[int, int, int]]] = []
        for v in range(n):
            lo_r, hi_r = self.offset[v], self.offset[v] + self.size[v]
            d = []
            for q in sizes:
                if q >= self.size[v]:
                    continue
                lo, hi = bisect.bisect_left(offs[q], lo_r), bisect.bisect_left(offs[q], hi_r)
                if hi > lo:
                    d.append((q, lo, hi))
            self.below.append(d)
        self.leaves = self.level.get(1, [])

    def has_group(self, start: int, size: int) -> bool:
        """Whether ranks ``[start, start + size)`` are a node."""
        if self._groups is None:
            self._groups = set(zip(self.offset, self.size))
        return (start, size) in self._groups

    def ranks(self, v: int) -> tuple[int, ...]:
        """Global ranks of node ``v``."""
        return tuple(range(self.offset[v], self.offset[v] + self.size[v]))

    def paths(self, own: Sequence[float]) -> list[float]:
        """Every root-to-leaf sum of ``own`` (seconds per node): each rank's busy time."""
        if len(self.leaves) > VECTOR_LEAVES:
            return self._path_array(own).tolist()
        out = []
        for v in self.leaves:
            s = own[v]
            for a in self.ancestors[v]:
                s += own[a]
            out.append(s)
        return out

    def _path_array(self, own: Sequence[float]) -> np.ndarray:
        """:meth:`paths` as an array, summed in the same order (leaf, then its ancestors upwards): the same values."""
        if self._cols is None:  # column j: every leaf's j-th node upwards (padding: the extra zero at the end)
            n = len(self.offset)
            chains = [[v] + self.ancestors[v] for v in self.leaves]
            depth = max(len(c) for c in chains)
            self._cols = [np.array([c[j] if j < len(c) else n for c in chains], dtype=np.int64) for j in range(depth)]
        o = np.append(np.asarray(own, dtype=np.float64), 0.0)
        out = o[self._cols[0]]
        for col in self._cols[1:]:
            out += o[col]
        return out

    def span(self, own: Sequence[float]) -> float:
        """Largest root-to-leaf sum of ``own`` (seconds per node): the compute span."""
        if len(self.leaves) > VECTOR_LEAVES:
            return float(self._path_array(own).max())
        return makespan(self.paths(own))

    def spread(self, own: Sequence[float]) -> float:
        """Sum of squared root-to-leaf sums: lower when the paths are shorter or more even (a tie-breaker
        for equal spans)."""
        if len(self.leaves) > VECTOR_LEAVES:
            p = self._path_array(own)
            return float(np.dot(p, p))
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
        # levels of many nodes find their least-loaded node with a heap (values only grow: a stale entry is
        # refreshed when it surfaces); the same node as min() then index(), ties to the lowest offset
        heaps = {p: [(0.0, j) for j in range(len(nodes))] for p, nodes in self.level.items()
                 if len(nodes) > HEAP_LEVEL and not best_fit}
        opts = {k: (p, val[p], self.level[p], heaps.get(p), var[k], const[k])
                for k, p in enumerate(self.classes) if p in self.level}
        prefs = _by_gpu_seconds(var, [self.classes[k] for k in opts], list(opts))
        heapreplace = heapq.heapreplace
        for i in order:
            ln = lengths[i]
            best = None
            bg = math.inf  # GPU-seconds of the best size that ends by the deadline so far
            for k in prefs[i]:  # sizes by GPU-seconds, ascending: past the best one that ends in time, none wins
                p, lv, nodes, hp, vk, ck = opts[k]
                t = vk[i]
                if p * t > bg:
                    break
                if hp is not None:
                    m, j = hp[0]
                    while m != lv[j]:
                        heapreplace(hp, (lv[j], j))
                        m, j = hp[0]
                    v = nodes[j]
                else:
                    m = min(lv)
                    if best_fit:  # the fullest node it still fits by the deadline
                        lim = deadline - t
                        for x in lv:
                            if m < x <= lim:
                                m = x
                    v = nodes[lv.index(m)]
                if room[v] < ln:
                    t += ck[i]
                fin = m + t
                key = (0, p * t, fin, k) if fin <= deadline else (1, fin, p * t, k)
                if best is None or key < best[0]:
                    best = (key, k, v, t)
                    if fin <= deadline:
                        bg = p * t
            assert best is not None, "a unit fits no SP size of the tree"
            _, k, v, t = best
            where[i] = v
            if room[v] < ln:
                room[v] = budget[k] - ln if ln < budget[k] else 0
            else:
                room[v] -= ln
            self._charge(v, t, own, down, val)
        return where

    def _charge(self, v: int, t: float, own: list[float], down: list[float], val: dict[int, list[float]]) -> None:
        """Node ``v`` runs ``t`` more seconds: its own time, the longest path below each ancestor, and the path
        value through every node above and below it."""
        kids, anc, below, size, pos = self.kids, self.ancestors, self.below, self.size, self.pos
        own[v] += t
        down[v] += t
        val[size[v]][pos[v]] += t
        for q, lo, hi in below[v]:  # every path through a descendant grows by t
            lq = val[q]
            for j in range(lo, hi):
                lq[j] += t
        for a in anc[v]:  # longest path below each ancestor (once one is unchanged, so are those above it) and the
            k = kids[a]  # path value through it, which moves with it (the own times above it are unchanged)
            if len(k) == 2:
                d0, d1 = down[k[0]], down[k[1]]
                d = own[a] + (d0 if d0 > d1 else d1)
            else:
                d = own[a] + max([down[c] for c in k])
            if d == down[a]:
                break
            val[size[a]][pos[a]] += d - down[a]
            down[a] = d
