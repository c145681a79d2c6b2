"""Balancing a buddy-tree schedule by moves that shrink its critical paths, in time per move, not per tree.

A tree schedule (:mod:`~lightning_dcp.planning.policies.tree`) puts every sample on a node; a rank's
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

from lightning_dcp.planning.policies.tree import BuddyTree

__all__ = ["BALANCE_WIDTH", "BALANCE_TRIES", "TreeState", "balance"]

BALANCE_WIDTH = 12
"""A node offers its this-many costliest samples (at its own SP size) for moves."""

BALANCE_TRIES = 6
"""Exact checks (two packs each) per node before it counts as stuck."""

_DESTS = 3
"""Destinations per SP size a sample is estimated on (the least-loaded ones unrelated to its node)."""


@dataclass
class TreeState:
    """A tree schedule: ``members[v]`` (samples), ``packs[v]`` (micro-batches) and ``own[v]`` (seconds) per node."""

    tree: BuddyTree
    members: dict[int, list[int]]
    packs: dict[int, list]
    own: list[float]


def _paths(tree: BuddyTree, own: Sequence[float]) -> tuple[list[float], list[float]]:
    """``(down, up)`` per node: the longest path from it down (its own time included) and its ancestors' own
    times."""
    n = len(tree.size)
    down = [0.0] * n
    for v in range(n - 1, -1, -1):  # children have larger ids than their parent
        k = tree.kids[v]
        down[v] = own[v] + (max(down[c] for c in k) if k else 0.0)
    up = [0.0] * n
    for v in range(n):
        p = tree.parent[v]
        if p >= 0:
            up[v] = up[p] + own[p]
    return down, up


@dataclass
class _Costs:
    """What :func:`balance` estimates and packs with (see its arguments)."""

    pack: Callable[[int, list[int]], tuple[list, float]]
    var: Sequence[Sequence[float]]
    const: Sequence[Sequence[float]]
    lengths: Sequence[int]
    budget: Sequence[int]
    kof: dict[int, int]


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
    tree, own, members = state.tree, state.own, state.members
    kof = {p: k for k, p in enumerate(classes)}
    costs = _Costs(pack, var, const, lengths, mb_budget, kof)
    down, up = _paths(tree, own)
    thr = [u + d for u, d in zip(up, down)]
    crit = [(-thr[v], v) for v in members]
    heapq.heapify(crit)
    light = {p: [(thr[v], v) for v in nodes] for p, nodes in tree.level.items() if p in kof}
    for h in light.values():
        heapq.heapify(h)
    roots = [v for v in range(len(tree.size)) if tree.parent[v] < 0]
    span = max(down[r] for r in roots)
    stuck: set[int] = set()
    moves = 0
    while crit and budget > 0:
        t_s, s = crit[0]
        t_s = -t_s
        if t_s != thr[s] or s not in members:  # stale: refreshed when it surfaces
            heapq.heappop(crit)
            if s in members:
                heapq.heappush(crit, (-thr[s], s))
            continue
        if t_s < span * (1 - 1e-12):  # every node on a longest path is stuck: the span stays
            break
        heapq.heappop(crit)
        if s in stuck:
            continue
        tries, move = _best_move(state, s, t_s, thr, light, costs, budget)
        budget -= 2 * tries
        if move is None:
            stuck.add(s)
            continue
        i, t, ps, os_, pt, ot = move
        _apply(state, s, t, i, ps, os_, pt, ot, down, up, thr, crit, light)
        stuck.discard(t)
        moves += 1
        span = max(down[r] for r in roots)
    return moves


def _least(heap: list, thr: list[float], count: int, skip: Callable[[int], bool]) -> list[int]:
    """The ``count`` nodes of lowest ``thr`` in ``heap`` that ``skip`` does not reject (stale entries refreshed)."""
    out, back = [], []
    while heap and len(out) < count:
        val, v = heapq.heappop(heap)
        if val != thr[v]:
            heapq.heappush(heap, (thr[v], v))
            continue
        back.append((val, v))
        if not skip(v):
            out.append(v)
    for item in back:
        heapq.heappush(heap, item)
    return out


def _opens(tokens: int, mbs: int, budget: int) -> bool:
    """Whether a node of ``mbs`` micro-batches holding ``tokens`` needs one more for ``tokens`` more (estimate:
    the packer makes ``ceil(tokens / budget)`` of them)."""
    return mbs == 0 or tokens > mbs * budget


def _best_move(state: TreeState, s: int, t_s: float, thr: list[float], light: dict, costs: "_Costs", budget: int):
    """``(exact checks made, (sample, destination, packs and own time of both) or None)`` for node ``s``."""
    tree, own, members, packs = state.tree, state.own, state.members, state.packs
    anc = tree.ancestors
    inf = math.inf
    ks = costs.kof[tree.size[s]]
    rs, cs, lens, bs = costs.var[ks], costs.const[ks], costs.lengths, costs.budget[ks]
    mem = sorted(members[s], key=lambda i: (-rs[i], i))
    mine = mem if len(mem) <= 2 * BALANCE_WIDTH else mem[:BALANCE_WIDTH] + mem[-BALANCE_WIDTH:]
    tok_s, nmb_s = sum(lens[i] for i in mem), len(packs[s])
    cands = []
    for p, heap in light.items():
        k = costs.kof[p]
        rd, cd, bd = costs.var[k], costs.const[k], costs.budget[k]
        dests = _least(heap, thr, _DESTS, lambda u: u == s or s in anc[u] or u in anc[s])
        for d in dests:
            tok_d = sum(lens[i] for i in members.get(d, ()))
            nmb_d = len(packs.get(d, ()))
            for i in mine:
                ti = rd[i]
                if ti == inf:
                    continue
                li = lens[i]
                if _opens(tok_d + li, nmb_d, bd):
                    ti += cd[i]
                gain = rs[i] + (cs[i] if nmb_s > 1 and tok_s - li <= (nmb_s - 1) * bs else 0.0)
                est = max(thr[d] + ti, t_s - gain)
                if est < t_s:
                    cands.append((est, i, d))
    cands.sort()
    tries = 0
    for _, i, d in cands:
        if tries >= BALANCE_TRIES or 2 * tries >= budget:
            break
        tries += 1
        pt, ot = costs.pack(d, members.get(d, []) + [i])
        if thr[d] + ot - own[d] >= t_s:
            continue
        rest = [x for x in members[s] if x != i]
        ps, os_ = costs.pack(s, rest) if rest else ([], 0.0)
        if t_s + os_ - own[s] < t_s:
            return tries, (i, d, ps, os_, pt, ot)
    return tries, None


def _apply(state: TreeState, s: int, t: int, i: int, ps: list, os_: float, pt: list, ot: float, down: list[float],
           up: list[float], thr: list[float], crit: list, light: dict) -> None:
    """Move sample ``i`` from node ``s`` to node ``t`` and update the path tables and heaps of every node it moves."""
    tree, own, members, packs = state.tree, state.own, state.members, state.packs
    members[s] = [x for x in members[s] if x != i]
    if members[s]:
        packs[s] = ps
    else:
        del members[s]
        packs.pop(s, None)
    members.setdefault(t, []).append(i)
    packs[t] = pt
    changed = []
    for v, new in ((s, os_), (t, ot)):
        d = new - own[v]
        own[v] = new
        down[v] += d
        for a in tree.ancestors[v]:  # the longest path below each ancestor
            down[a] = own[a] + max(down[c] for c in tree.kids[a])
        stack = list(tree.kids[v])
        sub = []
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
                heapq.heappush(crit, (-val, v))
            h = light.get(tree.size[v])
            if h is not None:
                heapq.heappush(h, (val, v))
