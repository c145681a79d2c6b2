"""Dispatch of work units (samples or micro-batches) across the SP groups of one step.

Hydraulis App. D, Alg. 1, adapted to groups without pipeline stages: units are taken longest
first and each goes to the group where it *finishes earliest* (current load + its time on that
group's SP size), among the groups whose SP size can hold it. Groups of one SP size are
interchangeable, so each SP class keeps a heap of loads and a unit looks at one head per class:
O(units x classes x log groups). Extra trials repeat the greedy on seeded, slightly perturbed
orders (Hydraulis shuffles); the trial with the lowest makespan wins.

Also here: :func:`fill_costs`, the dispatch costs of units on groups larger than the SP size
they prefer (on all the group's ranks, or as a fill on a sub-group).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lightning_dcp.planning.search.objective import improves, makespan


def lpt_dispatch(cost: np.ndarray, layout: Sequence[int], classes: Sequence[int], order_key: np.ndarray,
                 trials: int = 1, rng: np.random.Generator | None = None,
                 floor: np.ndarray | None = None, costT: list | None = None,
                 floorT_all: list | None = None, chunk: float = 0.0, chunk_groups: int | None = None,
                 chunk_cache: dict | None = None, fills_after_own: bool = False,
                 cutoff: float = float("inf"),
                 group_speed: Sequence[float] | None = None) -> tuple[list[list[int]], list[float], float]:
    """Assign units to the groups of ``layout``.

    Args:
        cost: ``cost[k, i]``, time of unit ``i`` on a group of SP size ``classes[k]`` (``inf``
            where it cannot run there).
        layout: SP size of every group (any order); result lists follow it.
        classes: the SP size of each row of ``cost``.
        order_key: units are dispatched in decreasing ``order_key`` (e.g. length).
        trials: 1 + number of perturbed retries.
        rng: seeded generator for the retries.
        floor: optional ``floor[k, i]``: the group cannot finish before this once it holds unit
            ``i`` (a unit that a group runs on a sub-block of its ranks -- a *fill*, ``floor > 0``
            -- costs the group its spread-out share ``cost``, but still lasts its own time on the
            sub-block). A group's estimated finish is ``max(sum of its costs, largest floor)``;
            with ``fills_after_own`` (dcp: a group runs its own units first, then its fills)
            ``max(sum of its costs, sum of its own units' costs + largest fill floor)``.
        costT, floorT_all: optional ``cost.T.tolist()`` / ``floor.T.tolist()`` computed once by
            a caller that dispatches the same matrices on several layouts (same results, less
            conversion).
        chunk: if > 0, consecutive small units (in dispatch order) are dispatched together, in
            chunks of about ``chunk`` x the mean group load (sum of their cheapest costs / number
            of groups), except the last ones (the smallest, ``4 x chunk`` of the total work):
            those stay single to even out the groups at the end. A chunk's load on a group is
            exactly what its units would add one by one; only the choice is coarser. Fewer
            Python steps for batches of thousands of short samples.
        chunk_groups, chunk_cache: the group count that sizes the chunks (default: this
            layout's) and a dict to keep the chunks of the longest-first order in: a caller that
            dispatches the same matrices on several layouts passes the same pair and cuts once.

        cutoff: give up as soon as a group's load reaches ``cutoff`` (loads only grow, so the
            makespan would too): a caller comparing layouts passes its best makespan so far and
            skips the rest of a losing layout's dispatch. Returns ``(None, None, inf)`` then.
        group_speed: optional pace of every group of ``layout`` (its slowest rank's speed): a unit
            costs ``cost / speed`` there (and its floor ``floor / speed``); groups of one SP size and
            one speed share a heap. None (or all 1.0) dispatches exactly as without speeds.

    Returns:
        ``(members, loads, makespan)``: unit indices per group, estimated busy time per group,
        and the largest load.
    """
    n = cost.shape[1]
    by_class, present, rows, spd = _heap_keys(layout, classes, group_speed)
    colsT = cost.T.tolist() if costT is None else costT  # units x classes as Python floats: fast scalar access
    floorT = None if floor is None else (floorT_all if floorT_all is not None else floor.T.tolist())
    best = None
    cut_any = False
    for t in range(max(1, trials)):
        if t == 0 or rng is None:
            order = np.argsort(-order_key, kind="stable")
        else:
            order = np.argsort(-order_key * rng.uniform(0.85, 1.15, size=n), kind="stable")
        seq = None
        if chunk > 0 and n > 8 * len(layout):
            seq = _trial_chunks(cost, floor, order, chunk_groups or len(layout), chunk, chunk_cache if t == 0 else None)
        units = _unit_sequence(order.tolist(), seq, colsT, floorT)
        units, heap_rows = (units, rows) if spd is None else (_at_speed(units, rows, spd), list(range(len(rows))))
        got = _greedy_pass(units, [[(0.0, g) for g in by_class[p]] for p in present], heap_rows, len(layout),
                           fills_after_own, cutoff)
        if got is None:  # a unit fits no group
            continue
        if got is _CUT:
            cut_any = True
            continue
        members, loads = got
        span = makespan(loads)
        if best is None or improves(span, best[2], 1e-12):
            best = (members, loads, span)
    if best is None:
        if cut_any:
            return None, None, float("inf")  # type: ignore[return-value]
        raise ValueError("a unit fits no group of the layout")
    return best


def _heap_keys(layout: Sequence[int], classes: Sequence[int], group_speed: Sequence[float] | None):
    """``(groups per heap key, heap keys in order, cost row per heap, pace per heap or None)``: one heap per
    SP size, or per (SP size, pace) with uneven group paces."""
    row_of = {p: k for k, p in enumerate(classes)}
    if group_speed is not None and all(x == 1.0 for x in group_speed):
        group_speed = None
    by_class: dict = {}
    for g, p in enumerate(layout):
        by_class.setdefault(p if group_speed is None else (p, float(group_speed[g])), []).append(g)
    present = sorted(by_class)
    rows = [row_of[p] for p in present] if group_speed is None else [row_of[p] for p, _ in present]
    spd = None if group_speed is None else [x for _, x in present]
    return by_class, present, rows, spd


def _trial_chunks(cost: np.ndarray, floor: np.ndarray | None, order: np.ndarray, ngroups: int, chunk: float,
                  chunk_cache: dict | None):
    """:func:`_chunks` of one trial's order, kept in ``chunk_cache`` (the first trial's) when given."""
    if chunk_cache is None:
        return _chunks(cost, floor, order, ngroups, chunk)
    ck = (ngroups, floor is not None)
    if ck not in chunk_cache:
        chunk_cache[ck] = _chunks(cost, floor, order, ngroups, chunk)
    return chunk_cache[ck]


_CUT = object()
"""What :func:`_greedy_pass` returns when a group's load reached the cutoff."""


@dataclass
class _Units:
    """Units in dispatch order: ``cost[u]`` (and ``floor[u]``) per class row; the first ``nhead``
    are chunks with unit lists ``chunk_members``; unit ``u >= nhead`` is ``order[u + shift]``."""

    cost: list
    floor: list | None
    chunk_members: list[list[int]] | None
    nhead: int
    shift: int
    order: list[int]


def _unit_sequence(olist: list[int], seq, colsT: list, floorT: list | None) -> _Units:
    """The dispatch sequence of one trial: ``olist``'s units, its head merged into ``seq``'s chunks if any."""
    if seq is None:
        seq_c = [colsT[i] for i in olist]
        seq_f = [floorT[i] for i in olist] if floorT is not None else None
        seq_m = None
    else:
        head, cc, cf, starts = seq
        seq_c = cc + [colsT[i] for i in olist[head:]]
        seq_f = (cf + [floorT[i] for i in olist[head:]]) if floorT is not None else None
        bounds = starts + [head]
        seq_m = [olist[bounds[j]:bounds[j + 1]] for j in range(len(starts))]
    nhead = len(seq_m) if seq_m is not None else 0
    shift = (seq[0] - nhead) if seq is not None else 0  # seq_c[u], u >= nhead, is unit olist[u + shift]
    return _Units(seq_c, seq_f, seq_m, nhead, shift, olist)


def _at_speed(units: _Units, rows: list[int], spd: list[float]) -> _Units:
    """``units`` with one cost (and floor) column per heap: row ``rows[h]`` divided by ``spd[h]``."""
    pairs = list(zip(rows, spd))
    cost = [[c[r] / x for r, x in pairs] for c in units.cost]
    floor = None if units.floor is None else [[f[r] / x for r, x in pairs] for f in units.floor]
    return _Units(cost, floor, units.chunk_members, units.nhead, units.shift, units.order)


def _greedy_pass(units: _Units, heaps: list[list[tuple[float, int]]], rows: list[int], ngroups: int,
                 fills_after_own: bool, cutoff: float):
    """One longest-first pass: each unit to the group (one heap per SP class) where it finishes earliest.

    Returns ``(members, loads)``, None when a unit fits no group, or ``_CUT`` at the cutoff.
    """
    seq_c, seq_f, seq_m, nhead, shift, olist = (units.cost, units.floor, units.chunk_members, units.nhead,
                                                units.shift, units.order)
    inf = float("inf")
    members: list[list[int]] = [[] for _ in range(ngroups)]
    loads = [0.0] * ngroups
    spread = [0.0] * ngroups
    flo = [0.0] * ngroups
    own = [0.0] * ngroups
    kr = list(enumerate(rows))  # (heap index, row of cost)
    heapreplace = heapq.heapreplace
    for u in range(len(seq_c)):
        c = seq_c[u]
        bk, bval, br = -1, inf, -1
        if seq_f is None:
            for k, r in kr:
                ck = c[r]
                if ck == inf:
                    continue
                v = heaps[k][0][0] + ck
                if v < bval:
                    bk, bval = k, v
        else:
            f = seq_f[u]
            for k, r in kr:
                ck = c[r]
                if ck == inf:
                    continue
                g0 = heaps[k][0][1]
                v = spread[g0] + ck  # max(spread + cost, own units + longest fill)
                fu = f[r]
                fl = flo[g0]
                if not fills_after_own:
                    fv = fu if fu > fl else fl
                elif fu > 0.0:  # a fill: runs after the group's own units
                    fv = own[g0] + (fu if fu > fl else fl)
                else:
                    fv = own[g0] + ck + fl
                if fv > v:
                    v = fv
                if v < bval:
                    bk, bval, br = k, v, r
        if bk < 0:
            return None
        if bval >= cutoff:
            return _CUT
        h = heaps[bk]
        g = h[0][1]
        heapreplace(h, (bval, g))  # pop the head, push it back with its new load
        if u < nhead:
            members[g].extend(seq_m[u])  # type: ignore[index]
        else:
            members[g].append(olist[u + shift])
        loads[g] = bval
        if seq_f is not None:
            spread[g] += c[br]
            fb = f[br]
            if fb > 0.0:
                if fb > flo[g]:
                    flo[g] = fb
            else:
                own[g] += c[br]
    return members, loads


def _chunks(cost: np.ndarray, floor: np.ndarray | None, order: np.ndarray, ngroups: int, chunk: float):
    """``(head, chunk cost lists, chunk floor lists, chunk starts)`` for :func:`lpt_dispatch`, or None.

    Units ``order[:head]`` are cut into consecutive chunks of about ``chunk`` x the mean group
    load (a unit larger than that stays alone); the rest (the smallest units, about
    ``4 x chunk x ngroups`` mean group loads) stay single.
    """
    m = np.min(cost, axis=0)[order]  # cheapest cost on any class: sizes the chunks only
    m = np.where(np.isfinite(m), m, 0.0)
    total = float(m.sum())
    if total <= 0.0:
        return None
    thr = chunk * total / ngroups
    # the single tail: from the end while its cheapest-cost sum stays within 4 x chunk of the total
    rcum = np.cumsum(m[::-1])
    tail = int(np.searchsorted(rcum, 4.0 * chunk * total, side="right"))
    head = len(m) - tail
    if head <= 1:
        return None
    cum = np.cumsum(m[:head])
    cid = np.floor((cum - 0.5 * m[:head]) / thr).astype(np.int64)
    starts = np.flatnonzero(np.r_[True, cid[1:] != cid[:-1]])
    if len(starts) >= head:  # nothing to merge
        return None
    oh = order[:head]
    cc = np.add.reduceat(cost[:, oh], starts, axis=1).T.tolist()
    cf = np.maximum.reduceat(floor[:, oh], starts, axis=1).T.tolist() if floor is not None else None
    return head, cc, cf, starts.tolist()


def fill_costs(times: np.ndarray, pref: np.ndarray, cols: np.ndarray, gpu_s: np.ndarray,
               classes: Sequence[int], fill_ok: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dispatch costs of units on groups of each SP class, and the floors fills impose.

    ``times[k, i]``: unit i's time on a group of ``classes[k]`` ranks; ``pref[i]``: the class it
    prefers; ``gpu_s[i]``: its GPU-seconds at that class. On a larger class than it prefers, a
    unit either runs on all the group's ranks (``times``) or as a fill on a sub-group of its own
    size, costing the group its GPU-seconds spread over the ranks (whichever is cheaper); a fill
    still lasts its own time, returned as the floor ``F``. ``fill_ok[k, c]`` (default: always): a group of
    class ``k`` may run a unit of class ``c`` as a fill (it holds a group of ``c`` ranks wherever it is
    placed). Returns ``(C, F, own_time)``.
    """
    C = times.copy()
    F = np.zeros_like(times)
    own = times[pref, cols]
    for k in range(1, len(classes)):
        fill = pref < k
        if fill_ok is not None:
            fill &= fill_ok[k, pref]
        if fill.any():
            spread = gpu_s[fill] / classes[k]
            use = spread < times[k, fill]
            C[k, fill] = np.where(use, spread, times[k, fill])
            F[k, fill] = np.where(use, own[fill], 0.0)
    return C, F, own
