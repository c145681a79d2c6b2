"""Balancing a buddy-tree schedule by moves that shrink its critical paths, in time per move, not per tree.

A tree schedule (:mod:`~lightning_dcp.planning.search.tree`) puts every sample on a node; a rank's
time is the sum of its root-to-leaf path of node times, the step's span the largest such sum. Adding
``d`` seconds to a node's own time moves *every* path through it by ``d``, so the longest path
through a node ``v`` (``thr[v]``, its ancestors' own times plus the longest path down from it) moves
by exactly ``d`` as well. A move of one sample from node ``s`` to a node ``t`` unrelated to it
(neither is the other's ancestor) changes only the paths through ``s`` and through ``t``. When both
end below ``thr[s]``:

    thr[s] + (new own of s - own of s)  <  thr[s]   and   thr[t] + (new own of t - own of t)  <  thr[s],

no path gets longer than ``thr[s]`` and the paths through ``s`` get shorter: starting from the node
on the longest path, the number of longest paths shrinks and the span never grows. That is the whole
rule of :func:`balance`, checked with exact times (both nodes re-packed) after an estimate ranks the
candidates. Nodes wait in a max-heap by ``thr``; destinations come from one min-heap per SP size
(entries refreshed lazily: a stale one is re-pushed when it surfaces), so a move costs its two packs
and a few heap operations plus the nodes above and below the two it changes -- not a pass over the
tree as :meth:`BuddyTree.span` is. It stops when no node on the longest path can shed a sample that
way, or after its work budget (counted in packs, never in seconds: the plan is the same on every rank).

Pure Python, deterministic.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from lightning_dcp.planning.search.climb import climb
from lightning_dcp.planning.search.tree import BuddyTree

__all__ = ["BALANCE_WIDTH", "BALANCE_TRIES", "TreeState", "balance"]

BALANCE_WIDTH = 12
"""A node offers its this-many costliest and this-many cheapest samples (at its own SP size) for moves."""

BALANCE_TRIES = 6
"""Exact checks (two packs each) per node before it counts as stuck."""

_DESTS = 3
"""Destinations per SP size a node's samples are estimated on: the least-loaded ones unrelated to it that take one
of them by the estimate ..."""

_SCAN = 32
"""... among at most this many least-loaded nodes of the size."""


@dataclass
class TreeState:
    """A tree schedule: ``members[v]`` (samples), ``packs[v]`` (micro-batches) and ``own[v]`` (seconds) per node."""

    tree: BuddyTree
    members: dict[int, list[int]]
    packs: dict[int, list]
    own: list[float]


def balance(state: TreeState, pack: Callable[[int, list[int]], tuple[list, float]], var: Sequence[Sequence[float]],
            const: Sequence[Sequence[float]], lengths: Sequence[int], mb_budget: Sequence[int],
            classes: Sequence[int], budget: int) -> int:
    """Move samples off the longest paths of ``state`` (in place) as the module docstring says; returns the moves.

    Args:
        state: the schedule, changed in place.
        pack: ``pack(node, samples)`` -> ``(micro-batches, own seconds)`` of that node running those samples.
        var: ``var[k][i]``: sample ``i``'s estimated own time on SP size ``classes[k]`` (``inf``: does not fit).
        const: ``const[k][i]``: the per-micro-batch constant it pays there when it opens one.
        lengths: tokens of every sample.
        mb_budget: token budget of one micro-batch per SP size (the estimate of when a node needs one more).
        classes: the SP sizes of ``var``'s rows.
        budget: packs the search may spend (each exact check costs two).
    """
    return _Balancer(state, pack, var, const, lengths, mb_budget, classes).run(budget)


class _Balancer:
    """The path tables and heaps of one :func:`balance` call."""

    def __init__(self, state: TreeState, pack, var, const, lengths, mb_budget, classes):
        self.state, self.pack, self.var, self.const, self.lens, self.mb = state, pack, var, const, lengths, mb_budget
        tree = self.tree = state.tree
        self.kof = {p: k for k, p in enumerate(classes)}
        own, n = state.own, len(tree.size)
        down = [0.0] * n
        for v in range(n - 1, -1, -1):  # children have larger ids than their parent
            k = tree.kids[v]
            down[v] = own[v] + (max(down[c] for c in k) if k else 0.0)
        up = [0.0] * n
        for v in range(n):
            if tree.parent[v] >= 0:
                up[v] = up[tree.parent[v]] + own[tree.parent[v]]
        self.down, self.up = down, up
        self.thr = [u + d for u, d in zip(up, down)]  # the longest path through each node
        self.tokens = {v: sum(lengths[i] for i in m) for v, m in state.members.items()}
        self.crit = [(-self.thr[v], v) for v in state.members]  # nodes that hold samples, longest path first
        heapq.heapify(self.crit)
        self.light = {p: [(self.thr[v], v) for v in nodes] for p, nodes in tree.level.items() if p in self.kof}
        for h in self.light.values():  # per SP size, least-loaded first
            heapq.heapify(h)
        self.roots = [v for v in range(n) if tree.parent[v] < 0]

    def run(self, budget: int) -> int:
        """Balance until no node on a longest path can shed a sample, or ``budget`` packs are spent; the moves made."""
        self.budget, self.stuck, self.moves_made = budget, set(), 0
        self.span = max(self.down[r] for r in self.roots)
        climb(self, lambda st: None, self._proposals, self._attempt, width=BALANCE_TRIES, keep_going=True,
              better=lambda new, old: True)
        return self.moves_made

    def _proposals(self, _state: "_Balancer") -> list[tuple[float, int, int, int, float]]:
        """The moves off the next node on a longest path that is not stuck (it is stuck unless one is taken)."""
        members, thr, crit = self.state.members, self.thr, self.crit
        while crit and self.budget > 0:
            t_s, s = crit[0]
            t_s = -t_s
            if t_s != thr[s] or s not in members:  # stale: refreshed when it surfaces
                heapq.heappop(crit)
                if s in members:
                    heapq.heappush(crit, (-thr[s], s))
                continue
            if t_s < self.span * (1 - 1e-12):  # every node on a longest path is stuck: the span stays
                return []
            heapq.heappop(crit)
            if s in self.stuck:
                continue
            self.stuck.add(s)
            cands = self._candidates(s, t_s)
            if cands:
                return [(e, i, d, s, t_s) for e, i, d in cands]
        return []

    def _attempt(self, _state: "_Balancer", move: tuple[float, int, int, int, float]):
        """The move if its exact packs shorten the paths through the source without lengthening any past them."""
        _, i, d, s, t_s = move
        if self.budget <= 0:
            return None
        self.budget -= 2
        members, own, thr = self.state.members, self.state.own, self.thr
        pt, ot = self.pack(d, members.get(d, []) + [i])
        if thr[d] + ot - own[d] >= t_s:
            return None
        rest = [x for x in members[s] if x != i]
        ps, os_ = self.pack(s, rest) if rest else ([], 0.0)
        if t_s + os_ - own[s] >= t_s:
            return None

        def take() -> "_Balancer":
            self._apply(s, i, d, ps, os_, pt, ot)
            self.stuck.discard(s)
            self.stuck.discard(d)
            self.moves_made += 1
            self.span = max(self.down[r] for r in self.roots)
            return self

        return None, take

    def _candidates(self, s: int, t_s: float) -> list[tuple[float, int, int]]:
        """``(estimated longest path of the pair after it, sample, destination)`` of the moves off ``s`` whose
        estimate is under ``t_s``, best first."""
        tree, members, packs, thr, lens = self.tree, self.state.members, self.state.packs, self.thr, self.lens
        inf = math.inf
        ks = self.kof[tree.size[s]]
        rs, cs, bs = self.var[ks], self.const[ks], self.mb[ks]
        mem = sorted(members[s], key=lambda i: (-rs[i], i))
        mine = mem if len(mem) <= 2 * BALANCE_WIDTH else mem[:BALANCE_WIDTH] + mem[-BALANCE_WIDTH:]
        tok_s, nmb_s = self.tokens[s], len(packs[s])
        # each sample's source estimate: its own time off, and a micro-batch fewer when the tokens left allow it
        after = [(i, lens[i], t_s - rs[i] - (cs[i] if nmb_s > 1 and tok_s - lens[i] <= (nmb_s - 1) * bs else 0.0))
                 for i in mine]
        lo_s, hi_s, off, size = tree.offset[s], tree.offset[s] + tree.size[s], tree.offset, tree.size

        def skip(u: int) -> bool:  # related to s: one's ranks hold the other's
            return off[u] < hi_s and lo_s < off[u] + size[u]

        cands = []
        for p, heap in self.light.items():
            if p > 2 * tree.size[s]:  # a larger group runs a sample at more GPU-seconds: rarely a move that helps
                continue
            k = self.kof[p]
            rd, cd, bd = self.var[k], self.const[k], self.mb[k]
            opts = [(rd[i], cd[i], li, a, i) for i, li, a in after if rd[i] != inf]
            if not opts:
                continue
            found = 0
            for d in _least(heap, thr, _SCAN, skip, t_s - min(o[0] for o in opts)):
                room = len(packs.get(d, ())) * bd - self.tokens.get(d, 0)  # tokens before it needs a micro-batch more
                base, n0 = thr[d], len(cands)
                for ti, ci, li, a, i in opts:
                    e = base + ti + (ci if li > room or room <= 0 else 0.0)
                    if e < a:
                        e = a
                    if e < t_s:
                        cands.append((e, i, d))
                found += len(cands) > n0
                if found >= _DESTS:
                    break
        cands.sort()
        return cands

    def _apply(self, s: int, i: int, t: int, ps: list, os_: float, pt: list, ot: float) -> None:
        """Move sample ``i`` from node ``s`` to node ``t``; update the tables and heaps of every node it moves."""
        tree, own, members, packs = self.tree, self.state.own, self.state.members, self.state.packs
        down, up, thr = self.down, self.up, self.thr
        members[s] = [x for x in members[s] if x != i]
        self.tokens[s] -= self.lens[i]
        if members[s]:
            packs[s] = ps
        else:
            del members[s], self.tokens[s]
            packs.pop(s, None)
        members.setdefault(t, []).append(i)
        self.tokens[t] = self.tokens.get(t, 0) + self.lens[i]
        packs[t] = pt
        changed = []
        for v, new in ((s, os_), (t, ot)):
            d = new - own[v]
            own[v] = new
            down[v] += d
            for a in tree.ancestors[v]:  # the longest path below each ancestor
                down[a] = own[a] + max(down[c] for c in tree.kids[a])
            stack, sub = list(tree.kids[v]), []
            while stack:  # every node below moves with v's own time
                u = stack.pop()
                up[u] += d
                sub.append(u)
                stack.extend(tree.kids[u])
            changed.extend([v] + tree.ancestors[v] + sub)
        for v in dict.fromkeys(changed):
            val = up[v] + down[v]
            if val != thr[v]:
                thr[v] = val
                if v in members:
                    heapq.heappush(self.crit, (-val, v))
                h = self.light.get(tree.size[v])
                if h is not None:
                    heapq.heappush(h, (val, v))


def _least(heap: list, thr: list[float], count: int, skip: Callable[[int], bool], below: float) -> list[int]:
    """Up to ``count`` nodes of lowest ``thr`` (under ``below``) in ``heap`` that ``skip`` does not reject, in that
    order (stale entries refreshed)."""
    out, back = [], []
    while heap and len(out) < count:
        val, v = heapq.heappop(heap)
        if val != thr[v]:
            heapq.heappush(heap, (thr[v], v))
            continue
        back.append((val, v))
        if val >= below:
            break
        if not skip(v):
            out.append(v)
    for item in back:
        heapq.heappush(heap, item)
    return out
