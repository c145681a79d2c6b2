"""Dispatch of work units (samples or micro-batches) across the SP groups of one step.

Hydraulis App. D, Alg. 1, adapted to groups without pipeline stages: units are taken longest
first and each goes to the group where it *finishes earliest* (current load + its time on that
group's SP size), among the groups whose SP size can hold it. Groups of one SP size are
interchangeable, so each SP class keeps a heap of loads and a unit looks at one head per class:
O(units x classes x log groups). Extra trials repeat the greedy on seeded, slightly perturbed
orders (Hydraulis shuffles); the trial with the lowest makespan wins.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np


def lpt_dispatch(cost: np.ndarray, layout: Sequence[int], classes: Sequence[int], order_key: np.ndarray,
                 trials: int = 1, rng: np.random.Generator | None = None,
                 floor: np.ndarray | None = None) -> tuple[list[list[int]], list[float], float]:
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
            ``i`` (a unit that a group runs on a sub-block of its ranks costs the group its
            spread-out share ``cost``, but still lasts its own time on the sub-block). A group's
            estimated finish is ``max(sum of its costs, largest floor)``.

    Returns:
        ``(members, loads, makespan)``: unit indices per group, estimated busy time per group,
        and the largest load.
    """
    n = cost.shape[1]
    row_of = {p: k for k, p in enumerate(classes)}
    by_class: dict[int, list[int]] = {}
    for g, p in enumerate(layout):
        by_class.setdefault(p, []).append(g)
    present = sorted(by_class)
    rows = [row_of[p] for p in present]
    sub = cost[rows]  # classes present x units
    colsT = sub.T.tolist()  # units x classes as Python floats: fast scalar access
    floorT = floor[rows].T.tolist() if floor is not None else None
    inf = float("inf")
    best = None
    for t in range(max(1, trials)):
        if t == 0 or rng is None:
            order = np.argsort(-order_key, kind="stable")
        else:
            order = np.argsort(-order_key * rng.uniform(0.85, 1.15, size=n), kind="stable")
        heaps = [[(0.0, g) for g in by_class[p]] for p in present]
        members: list[list[int]] = [[] for _ in layout]
        loads = [0.0] * len(layout)
        spread = [0.0] * len(layout)
        flo = [0.0] * len(layout)
        ok = True
        kr = range(len(present))
        for i in order.tolist():
            c = colsT[i]
            bk, bval = -1, inf
            if floorT is None:
                for k in kr:
                    ck = c[k]
                    if ck == inf:
                        continue
                    v = heaps[k][0][0] + ck
                    if v < bval:
                        bk, bval = k, v
            else:
                f = floorT[i]
                for k in kr:
                    ck = c[k]
                    if ck == inf:
                        continue
                    g0 = heaps[k][0][1]
                    v = max(spread[g0] + ck, flo[g0], f[k])
                    if v < bval:
                        bk, bval = k, v
            if bk < 0:
                ok = False
                break
            _, g = heapq.heappop(heaps[bk])
            heapq.heappush(heaps[bk], (bval, g))
            members[g].append(i)
            loads[g] = bval
            if floorT is not None:
                spread[g] += c[bk]
                if floorT[i][bk] > flo[g]:
                    flo[g] = floorT[i][bk]
        if not ok:
            continue
        span = max(loads) if loads else 0.0
        if best is None or span < best[2] * (1 - 1e-12):
            best = (members, loads, span)
    if best is None:
        raise ValueError("a unit fits no group of the layout")
    return best
