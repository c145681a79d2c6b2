"""THE tree refiner: moves (and swaps) of samples between the nodes of a buddy-tree schedule, priced exactly.

A schedule puts every sample on a node of a :class:`~lightning_dcp.planning.search.tree.BuddyTree`; a rank's time is
its root-to-leaf sum of node times, the span the largest. A :class:`TreeRefiner` holds one schedule (members, packs
and own time per node) and improves it in two passes on the one move engine
(:func:`~lightning_dcp.planning.search.climb.climb`), sharing its state and its bookkeeping:

- :meth:`TreeRefiner.refine` (small trees): each round, the samples of every node on a longest path are moved to, or
  swapped with a sample of, the three least-loaded unrelated nodes of each size; the first of the best six whose
  exact span is lower (or equal with more even paths) is taken. Each try prices the whole tree.
- :meth:`TreeRefiner.balance` (any tree): adding ``d`` seconds to a node moves every path through it by ``d``, so a
  move of a sample from ``s`` to an unrelated ``t`` changes only the paths through the two; when both end below
  ``thr[s]`` (the longest path through ``s``) no path grows past it and the paths through ``s`` shrink. Nodes wait in
  a max-heap by ``thr``, destinations in one min-heap per SP size (stale entries refreshed when they surface), so a
  move costs its two packs and the nodes above and below the two it changes, not a pass over the tree.

Budgets count rounds and packs, never seconds. Pure Python, deterministic.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from lightning_dcp.planning.search.climb import climb
from lightning_dcp.planning.search.objective import improves
from lightning_dcp.planning.search.problem import Pack
from lightning_dcp.planning.search.tree import BuddyTree

__all__ = ["BALANCE_TRIES", "BALANCE_WIDTH", "REFINE_WIDTH", "TreeRefiner", "TreeSchedule"]

REFINE_WIDTH = 8
""":meth:`TreeRefiner.refine` looks at the largest this-many samples of a node (moves and swaps)."""

BALANCE_WIDTH = 12
""":meth:`TreeRefiner.balance`: a node offers its this-many costliest and this-many cheapest samples."""

BALANCE_TRIES = 6
"""Exact checks (two packs each) per node before it counts as stuck."""

_DESTS = 3
"""Destinations per SP size a node's samples are estimated on: the least-loaded unrelated ones that take one ..."""

_SCAN = 32
"""... among at most this many least-loaded nodes of the size."""

PackFn = Callable[[int, list[int]], tuple[list[Pack], float]]
"""``pack(node, samples)`` -> ``(micro-batches, own seconds)`` of that node running those samples."""


@dataclass
class TreeSchedule:
    """Every sample's node (``where``), every node's micro-batches and own time, and the span (longest path)."""

    span: float
    where: list[int]
    packs: dict[int, list[Pack]]
    own: list[float]
    tree: BuddyTree


class TreeRefiner:
    """One schedule being improved (see the module docstring).

    ``var[k][i]`` / ``const[k][i]``: sample ``i``'s estimated own time on SP size ``classes[k]`` and the micro-batch
    constant it pays when it opens one; ``mb_budget[k]``: a micro-batch's token budget there.
    """

    def __init__(self, sched: TreeSchedule, pack: PackFn, var: Sequence[Sequence[float]],
                 const: Sequence[Sequence[float]], lengths: Sequence[int], mb_budget: Sequence[int],
                 classes: Sequence[int]) -> None:
        self.tree, self.pack, self.var, self.const, self.lens, self.mb = sched.tree, pack, var, const, lengths, mb_budget
        self.kof = {p: k for k, p in enumerate(classes)}
        self.where, self.packs, self.own = list(sched.where), dict(sched.packs), list(sched.own)
        self.members: dict[int, list[int]] = {}
        for i, v in enumerate(self.where):
            self.members.setdefault(v, []).append(i)

    def schedule(self) -> TreeSchedule:
        return TreeSchedule(self.tree.span(self.own), list(self.where), self.packs, self.own, self.tree)

    def _set(self, v: int, mem: list[int], packs: list[Pack], own: float) -> None:
        """Node ``v`` now runs ``mem`` (the bookkeeping both passes share)."""
        if mem:
            self.members[v], self.packs[v] = mem, packs
            for i in mem:
                self.where[i] = v
        else:
            self.members.pop(v, None)
            self.packs.pop(v, None)
        self.own[v] = own

    # -- the exact pass --------------------------------------------------------------------
    def refine(self, rounds: int) -> "TreeRefiner":
        """Moves and swaps off the critical paths while they lower the exact span (or keep it with more even paths)."""
        self._span, self._spread = self.tree.span(self.own), self.tree.spread(self.own)
        self._tried: set[tuple[int, int, int, int]] = set()
        climb(self, lambda st: (st._span, st._spread), self._refine_moves, self._refine_attempt, width=6,
              rounds=rounds, better=lambda new, old: improves(new[0], old[0]) or (new[0] <= old[0] and
                                                                                   improves(new[1], old[1])))
        return self

    def _refine_moves(self, _state: "TreeRefiner") -> list[tuple]:
        """``(estimated span, -length, source, sample, destination, swapped sample or -1)``, best first."""
        tree, members, span, var, L = self.tree, self.members, self._span, self.var, self.lens
        thr = tree.through(self.own)
        inf, kof, anc = math.inf, self.kof, tree.ancestors
        cut = span * (1 - 1e-12)
        crit = [v for v in members if thr[v] >= cut]
        light = {p: heapq.nsmallest(3 + len(crit), (u for u in nodes if thr[u] < cut), key=lambda u: (thr[u], u))
                 for p, nodes in tree.level.items() if p in kof}
        cands = []
        for s_ in crit:
            rs = var[kof[tree.size[s_]]]
            mine = sorted(members[s_], key=lambda i: (-rs[i], i))[:REFINE_WIDTH]
            for p, nodes in light.items():
                rd = var[kof[p]]
                for d in [u for u in nodes if s_ not in anc[u] and u not in anc[s_]][:3]:
                    theirs = sorted(members.get(d, ()), key=lambda j: (-rd[j], j))[:REFINE_WIDTH]
                    for i in mine:
                        ti = rd[i]
                        if ti == inf:
                            continue
                        gain = rs[i]
                        est = thr[d] + ti
                        if est < span and (s_, i, d, -1) not in self._tried:
                            cands.append((max(est, span - gain), -int(L[i]), s_, i, d, -1))
                        for j in theirs:
                            back = rs[j]
                            if back == inf or back >= gain:
                                continue
                            e2 = max(span - gain + back, thr[d] - rd[j] + ti)
                            if e2 < span and (s_, i, d, j) not in self._tried:
                                cands.append((e2, -int(L[i]), s_, i, d, j))
        cands.sort()
        return cands

    def _refine_attempt(self, _state: "TreeRefiner", move: tuple):
        _, _, s_, i, d, j = move
        self._tried.add((s_, i, d, j))
        tree = self.tree
        src = [x for x in self.members[s_] if x != i] + ([j] if j >= 0 else [])
        dst = [x for x in self.members.get(d, []) if x != j] + [i]
        ps, os_ = self.pack(s_, src) if src else ([], 0.0)
        pd, od = self.pack(d, dst)
        new = list(self.own)
        new[s_], new[d] = os_, od
        got, sq = tree.span(new), tree.spread(new)

        def take() -> "TreeRefiner":
            self._set(s_, src, ps, os_)
            self._set(d, dst, pd, od)
            self._span, self._spread = got, sq
            return self

        return (got, sq), take

    # -- the path-local pass -----------------------------------------------------------------
    def balance(self, budget: int) -> int:
        """Balance until no node on a longest path can shed a sample, or ``budget`` packs are spent; the moves made."""
        tree, own, n = self.tree, self.own, len(self.tree.size)
        self.members = {}
        for i, v in enumerate(self.where):  # by sample, as the placement lists them
            self.members.setdefault(v, []).append(i)
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
        self.tokens = {v: sum(self.lens[i] for i in m) for v, m in self.members.items()}
        self.crit = [(-self.thr[v], v) for v in self.members]  # nodes that hold samples, longest path first
        heapq.heapify(self.crit)
        self.light = {p: [(self.thr[v], v) for v in nodes] for p, nodes in tree.level.items() if p in self.kof}
        for h in self.light.values():  # per SP size, least-loaded first
            heapq.heapify(h)
        self.roots = [v for v in range(n) if tree.parent[v] < 0]
        self.budget, self.stuck, self.moves_made = budget, set(), 0
        self.span = max(self.down[r] for r in self.roots)
        climb(self, lambda st: None, self._proposals, self._attempt, width=BALANCE_TRIES, keep_going=True,
              better=lambda new, old: True)
        return self.moves_made

    def _proposals(self, _state: "TreeRefiner") -> list[tuple[float, int, int, int, float]]:
        """The moves off the next node on a longest path that is not stuck (it is stuck unless one is taken)."""
        members, thr, crit = self.members, self.thr, self.crit
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

    def _attempt(self, _state: "TreeRefiner", move: tuple[float, int, int, int, float]):
        """The move if its exact packs shorten the paths through the source without lengthening any past them."""
        _, i, d, s, t_s = move
        if self.budget <= 0:
            return None
        self.budget -= 2
        members, own, thr = self.members, self.own, self.thr
        there = members.get(d, []) + [i]
        pt, ot = self.pack(d, there)
        if thr[d] + ot - own[d] >= t_s:
            return None
        rest = [x for x in members[s] if x != i]
        ps, os_ = self.pack(s, rest) if rest else ([], 0.0)
        if t_s + os_ - own[s] >= t_s:
            return None

        def take() -> "TreeRefiner":
            self._apply(s, rest, ps, os_, d, there, pt, ot)
            self.stuck.discard(s)
            self.stuck.discard(d)
            self.moves_made += 1
            self.span = max(self.down[r] for r in self.roots)
            return self

        return None, take

    def _candidates(self, s: int, t_s: float) -> list[tuple[float, int, int]]:
        """``(estimated longest path of the pair after it, sample, destination)`` of the moves off ``s`` whose
        estimate is under ``t_s``, best first."""
        tree, members, packs, thr, lens = self.tree, self.members, self.packs, self.thr, self.lens
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

    def _apply(self, s: int, rest: list[int], ps: list, os_: float, t: int, there: list[int], pt: list,
               ot: float) -> None:
        """Nodes ``s`` and ``t`` now run ``rest`` and ``there``; update the path tables and heaps of every node it
        moves."""
        tree, own, members = self.tree, self.own, self.members
        down, up, thr = self.down, self.up, self.thr
        changed = []
        for v, mem, pk, new in ((s, rest, ps, os_), (t, there, pt, ot)):
            d = new - own[v]
            self._set(v, mem, pk, new)
            if mem:
                self.tokens[v] = sum(self.lens[x] for x in mem)
            else:
                self.tokens.pop(v, None)
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
