"""Dispatch of units (samples or micro-batches) over a layout's SP groups, and the costs of fills.

:func:`lpt_dispatch` is Hydraulis App. D, Alg. 1 without pipeline stages: units longest first, each to the group
where it finishes earliest among those whose SP size holds it. Groups of one size (and pace) are interchangeable,
so each keeps a heap of loads: O(units x classes x log groups). Extra trials perturb the order (Hydraulis
shuffles); the lowest makespan wins. :func:`fill_costs` prices a unit on a group larger than it prefers.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from lightning_dcp.planning.search.objective import improves, makespan

__all__ = ["fill_costs", "lpt_dispatch"]

_CUT = object()
"""What :func:`_greedy_pass` returns when a group's load reached the cutoff."""


def lpt_dispatch(cost: np.ndarray, layout: Sequence[int], classes: Sequence[int], order_key: np.ndarray,
                 trials: int = 1, rng: np.random.Generator | None = None, floor: np.ndarray | None = None,
                 costT: list | None = None, floorT: list | None = None, fills_after_own: bool = False,
                 cutoff: float = float("inf"),
                 group_speed: Sequence[float] | None = None) -> tuple[list[list[int]], list[float], float]:
    """``(members, loads, makespan)``: the units of every group of ``layout`` (unit indices, in layout order), its
    estimated busy time and the largest.

    ``cost[k, i]``: unit ``i``'s time on a group of size ``classes[k]`` (``inf``: it cannot run there); units go in
    decreasing ``order_key``. ``floor[k, i] > 0`` marks a *fill*: it costs the group ``cost`` (its GPU-seconds spread
    over the group's ranks) but the group cannot finish before ``floor``: its finish is ``max(sum of costs, largest
    floor)``, or with ``fills_after_own`` (own units first, then the fills) ``max(sum of costs, own units + largest
    floor)``. ``costT`` / ``floorT``: the transposed lists, when a caller dispatches the same matrices on several
    layouts. ``cutoff``: give up once a load reaches it (returns ``(None, None, inf)``). ``group_speed``: each
    group's pace; a unit costs ``cost / pace`` there. Raises ValueError when a unit fits no group.
    """
    n = cost.shape[1]
    by_key, keys, rows, spd = _heap_keys(layout, classes, group_speed)
    colsT = cost.T.tolist() if costT is None else costT  # Python floats: fast scalar access
    floorT = None if floor is None else (floorT if floorT is not None else floor.T.tolist())
    if spd is not None:  # one cost (and floor) column per heap, at its pace
        colsT = [[c[r] / x for r, x in zip(rows, spd)] for c in colsT]
        floorT = None if floorT is None else [[f[r] / x for r, x in zip(rows, spd)] for f in floorT]
        rows = list(range(len(rows)))
    best, cut_any = None, False
    for t in range(max(1, trials)):
        key = order_key if t == 0 or rng is None else order_key * rng.uniform(0.85, 1.15, size=n)
        order = np.argsort(-key, kind="stable").tolist()
        got = _greedy_pass(order, colsT, floorT, [[(0.0, g) for g in by_key[p]] for p in keys], rows, len(layout),
                           fills_after_own, cutoff)
        if got is None:
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
    """``(groups per heap key, keys in order, cost row per heap, pace per heap or None)``: one heap per SP size, or
    per (size, pace) with uneven paces."""
    row_of = {p: k for k, p in enumerate(classes)}
    if group_speed is not None and all(x == 1.0 for x in group_speed):
        group_speed = None
    by_key: dict = {}
    for g, p in enumerate(layout):
        by_key.setdefault(p if group_speed is None else (p, float(group_speed[g])), []).append(g)
    keys = sorted(by_key)
    if group_speed is None:
        return by_key, keys, [row_of[p] for p in keys], None
    return by_key, keys, [row_of[p] for p, _ in keys], [x for _, x in keys]


def _greedy_pass(order: list[int], colsT: list, floorT: list | None, heaps: list[list[tuple[float, int]]],
                 rows: list[int], ngroups: int, fills_after_own: bool, cutoff: float):
    """One pass in ``order``: each unit to the heap head where it finishes earliest. ``(members, loads)``, None when a
    unit fits no group, or ``_CUT`` at the cutoff."""
    inf = float("inf")
    members: list[list[int]] = [[] for _ in range(ngroups)]
    loads = [0.0] * ngroups
    spread, flo, own = [0.0] * ngroups, [0.0] * ngroups, [0.0] * ngroups
    kr = list(enumerate(rows))  # (heap index, row of cost)
    heapreplace = heapq.heapreplace
    for u in order:
        c = colsT[u]
        bk, bval, br = -1, inf, -1
        if floorT is None:
            for k, r in kr:
                ck = c[r]
                if ck == inf:
                    continue
                v = heaps[k][0][0] + ck
                if v < bval:
                    bk, bval = k, v
        else:
            f = floorT[u]
            for k, r in kr:
                ck = c[r]
                if ck == inf:
                    continue
                g0 = heaps[k][0][1]
                v = spread[g0] + ck  # max(spread + cost, own units + longest fill)
                fu, fl = f[r], flo[g0]
                if not fills_after_own:
                    fv = fu if fu > fl else fl
                elif fu > 0.0:  # a fill runs after the group's own units
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
        members[g].append(u)
        loads[g] = bval
        if floorT is not None:
            spread[g] += c[br]
            fb = f[br]
            if fb > 0.0:
                if fb > flo[g]:
                    flo[g] = fb
            else:
                own[g] += c[br]
    return members, loads


def fill_costs(times: np.ndarray, pref: np.ndarray, cols: np.ndarray, gpu_s: np.ndarray,
               classes: Sequence[int], fill_ok: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(C, F, own_time)``: each unit's dispatch cost and floor on every class, and its time at its preferred one.

    ``times[k, i]``: unit ``i``'s time on ``classes[k]`` ranks; ``pref[i]``: its preferred class; ``gpu_s[i]``: its
    GPU-seconds there. On a larger class a unit runs on all the group's ranks (``times``) or as a fill on a sub-group
    of its own size, costing its GPU-seconds spread over the group (the cheaper) and lasting its own time (``F``).
    ``fill_ok[k, c]``: a group of class ``k`` holds a group of class ``c`` wherever it is placed (default: always).
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
