"""Packing the samples of one SP group into micro-batches under the memory limit.

Two packers:

- :func:`pack_time_balanced` (dcp): Hydraulis §6.1 without pipeline stages. A group's time is
  the *sum* of its micro-batch times, so the number of micro-batches ``V`` is the fewest that
  keeps each within the group's best token budget (:meth:`CostView.pack_target`, large enough
  for GEMM efficiency, with little or no recompute), and the samples are spread over the ``V``
  micro-batches longest first, each to the least-loaded (by estimated time) micro-batch that
  still has room — balanced micro-batches, none over budget. A sample longer than the budget
  runs alone. Every micro-batch then recomputes the fewest layers that fit it.
- :func:`pack_ffd` (packed baseline): first-fit decreasing by tokens into a fixed budget.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence



def pack_time_balanced(lengths: Sequence[int], est: Sequence[float], budget: int) -> list[list[int]]:
    """Indices (into ``lengths``) of each micro-batch; no micro-batch over ``budget`` tokens except lone samples."""
    # longest first, ties by index (a reverse sort is stable: equal lengths keep index order)
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    bins: list[list[int]] = []
    small = order
    if order and lengths[order[0]] >= budget:
        small = []
        for i in order:
            if lengths[i] >= budget:
                bins.append([i])
            else:
                small.append(i)
    if not small:
        return bins
    total = sum([lengths[i] for i in small])
    v = max(1, math.ceil(total / budget))
    heap = [(0.0, b) for b in range(v)]
    room = [budget] * v
    packs: list[list[int]] = [[] for _ in range(v)]
    heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for i in small:
        ln = lengths[i]
        if heap:  # fast path: the least-loaded micro-batch has room
            load, b = heap[0]
            if room[b] >= ln:
                packs[b].append(i)
                room[b] -= ln
                heapreplace(heap, (load + est[i], b))
                continue
        popped = []
        placed = False
        while heap:
            load, b = heappop(heap)
            if room[b] >= ln:
                packs[b].append(i)
                room[b] -= ln
                heappush(heap, (load + est[i], b))
                placed = True
                break
            popped.append((load, b))
            if len(popped) > 8:
                break
        for item in popped:
            heapq.heappush(heap, item)
        if not placed:  # no room in the least-loaded bins: first fit over all, else a new bin
            for b in range(len(packs)):
                if room[b] >= ln:
                    break
            else:
                packs.append([])
                room.append(budget)
                b = len(packs) - 1
                heap.append((0.0, b))
                heapq.heapify(heap)
            packs[b].append(i)
            room[b] -= ln
            heap = [(ld + (est[i] if bb == b else 0.0), bb) for ld, bb in heap]
            heapq.heapify(heap)
    return bins + [p for p in packs if p]


def pack_ffd(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing by tokens; samples over ``budget`` run alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    room: list[int] = []
    for i in order:
        ln = lengths[i]
        for b in range(len(packs)):
            if room[b] >= ln:
                packs[b].append(i)
                room[b] -= ln
                break
        else:
            packs.append([i])
            room.append(budget - ln)
    return packs
