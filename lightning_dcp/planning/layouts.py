"""SP-group layouts: how one step splits the world into aligned power-of-two groups.

A *layout* is a multiset of SP sizes, e.g. ``{8: 1, 2: 4, 1: 16}`` (one group of 8 ranks, four
of 2, sixteen of 1). :func:`place` turns it into concrete rank blocks: groups are laid out
largest first, each at the next free offset of a *world block*, so every group is an aligned
power-of-two block (the runtime pre-creates a process group for each such block).

World blocks: a power-of-two world is one block. Any other world size is split into its binary
digits, largest first: W=6 has blocks ``[0-3]`` and ``[4-5]``, W=13 has ``[0-7]``, ``[8-11]``,
``[12]``. No SP group crosses a block boundary, so the largest SP size is the largest block.

:func:`allocate` sizes a layout from the work each SP class has to do (Hydraulis §7 with a
continuous relaxation: ranks proportional to GPU-seconds, rounded to whole groups),
:func:`propose_layouts` builds the candidate set once from the dataset's lengths.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

Layout = tuple[int, ...]
"""Group SP sizes in placement order (non-increasing)."""


def world_blocks(world_size: int) -> list[tuple[int, int]]:
    """Aligned power-of-two blocks ``(start, size)`` a world splits into, largest first."""
    if world_size <= 0:
        raise ValueError(f"world size must be positive, got {world_size}")
    out, start = [], 0
    for bit in reversed(range(world_size.bit_length())):
        size = 1 << bit
        if world_size & size:
            out.append((start, size))
            start += size
    return out


def place(layout: Sequence[int], world_size: int) -> list[tuple[int, ...]] | None:
    """Concrete rank tuples of ``layout`` (same order as sorted non-increasing), or None if it does not fit."""
    free = [[start, start + size] for start, size in world_blocks(world_size)]  # [next free, end]
    groups = []
    for p in sorted(layout, reverse=True):
        for blk in free:
            if blk[1] - blk[0] >= p:
                groups.append(tuple(range(blk[0], blk[0] + p)))
                blk[0] += p
                break
        else:
            return None
    return groups


def capacity_ok(layout: Sequence[int], world_size: int) -> bool:
    return place(layout, world_size) is not None


def allocate(work: Mapping[int, float], world_size: int, sp_sizes: Sequence[int], must: int,
             min_groups: Mapping[int, int] | None = None, max_groups: Mapping[int, int] | None = None,
             bias: float = 0.0) -> Layout:
    """A layout whose rank shares follow ``work`` (GPU-seconds per SP class).

    ``must`` is an SP size the layout has to contain (the step's largest required SP). Classes
    are filled largest first: class ``p`` gets ``round(share / p + bias)`` groups (at least one
    for ``must``, bounded by what is left and by ``min_groups``/``max_groups``; ``min_groups``
    wins over keeping ranks free for smaller classes, whose work then runs as fills); the smallest
    class takes the remaining ranks of every world block. ``bias`` shifts the rounding
    (Hydraulis keeps the nearby integer solutions as extra candidates).
    """
    total = sum(max(w, 0.0) for w in work.values())
    sizes = sorted(set(sp_sizes), reverse=True)
    smallest = sizes[-1]
    blocks = [size for _, size in world_blocks(world_size)]
    free = list(blocks)  # free ranks per block; groups placed largest first stay aligned
    layout: list[int] = []
    remaining_work = total

    def take(p: int, count: int) -> int:
        got = 0
        for i in range(len(free)):
            while got < count and free[i] >= p:
                free[i] -= p
                layout.append(p)
                got += 1
        return got

    for p in sizes:
        if p == smallest:
            break
        avail = sum(f // p for f in free) * p
        if avail <= 0:
            continue
        w = max(work.get(p, 0.0), 0.0)
        ranks_left = sum(free)
        share = ranks_left * (w / remaining_work) if remaining_work > 0 else 0.0
        count = int(math.floor(share / p + 0.5 + bias)) if w > 0 else 0
        if p == must:
            count = max(count, 1)
        if min_groups and p in min_groups:
            count = max(count, min_groups[p])
        if max_groups and p in max_groups:
            count = min(count, max_groups[p])
        # keep room for the smaller classes that must exist (min_groups) or have work
        reserve = sum((min_groups or {}).get(q, 0) * q for q in sizes if q < p)
        if reserve == 0 and any(work.get(q, 0.0) > 0 for q in sizes if q < p):
            reserve = min(q for q in sizes if q < p and work.get(q, 0.0) > 0)
        count = min(count, avail // p, max(0, (ranks_left - reserve) // p))
        if min_groups and p in min_groups:  # required groups win over a rank kept for smaller classes
            count = max(count, min(min_groups[p], avail // p))
        if p == must:
            count = max(count, 1)
        take(p, count)
        remaining_work -= w
    take(smallest, sum(free) // smallest)
    return tuple(layout)


def fit_must(layout: Sequence[int], must: int, world_size: int) -> Layout:
    """``layout`` changed minimally so that it holds a group of size ``must``."""
    if any(p >= must for p in layout):
        return tuple(sorted(layout, reverse=True))
    groups = sorted(layout)  # merge the smallest groups until a block of ``must`` is free
    work = {p: 0.0 for p in set(groups)}
    work[must] = 1.0
    return allocate(work, world_size, sorted(set(groups) | {must}), must)


def propose_layouts(class_work: Mapping[int, Mapping[int, float]], world_size: int, sp_sizes: Sequence[int],
                    max_candidates: int = 3) -> dict[int, list[Layout]]:
    """Candidate layouts per "largest SP a step needs" (Hydraulis §7, continuous relaxation).

    ``class_work[m]`` is the dataset's GPU-seconds per preferred SP class counting only samples
    that fit SP ``m`` (the distribution restricted to lengths ``<= MaxLen(m)``). For each ``m``
    the rank shares follow that work; the rounded solution and its neighbours (rounding biased
    down / up) are the candidates, duplicates removed.
    """
    out: dict[int, list[Layout]] = {}
    for m, work in class_work.items():
        cands: list[Layout] = []
        for bias in (0.0, -0.35, 0.35)[:max_candidates]:
            lay = allocate(work, world_size, sp_sizes, m, bias=bias)
            if lay not in cands:
                cands.append(lay)
        out[m] = cands
    return out
