"""SP-group layouts: how a step (or a block of ranks) splits into SP groups.

A *layout* is the SP sizes of the groups, largest first (e.g. ``(8, 2, 2, 2, 2, 1, ...)``). :func:`place` puts it on
rank tuples, largest first, each at the first offset the placement rule allows
(:mod:`~lightning_dcp.planning.topology`; a plain ``int`` world has no node boundaries). :func:`allocate` sizes a
layout from the work of each SP size (Hydraulis §7, a continuous relaxation rounded to whole groups);
:func:`propose_layouts` builds the dataset's candidates once; :func:`world_blocks` is the aligned power-of-two
decomposition of a world.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from lightning_dcp.planning.topology import Topology

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


def place(layout: Sequence[int], world: "int | Topology", start: int = 0,
          size: int | None = None) -> list[tuple[int, ...]] | None:
    """Concrete rank tuples of ``layout`` (same order as sorted non-increasing) inside ``[start, start + size)``
    (default: the whole world), or None if it does not fit."""
    return Topology.of(world).place(layout, start, size)


def allocate(work: Mapping[int, float], world: "int | Topology", sp_sizes: Sequence[int], must: int,
             min_groups: Mapping[int, int] | None = None, max_groups: Mapping[int, int] | None = None,
             bias: float = 0.0, start: int = 0, size: int | None = None, spill: bool = False) -> Layout:
    """A layout of the block ``[start, start + size)`` (default: the world) whose rank shares follow
    ``work`` (GPU-seconds per SP class).

    ``must`` is an SP size the layout has to contain (the step's largest required SP). Classes
    are filled largest first: class ``p`` gets ``round(share / p + bias)`` groups (at least one
    for ``must``, bounded by what is left and by ``min_groups``/``max_groups``; ``min_groups``
    wins over keeping ranks free for smaller classes, whose work then runs as fills); the smallest
    class takes the remaining ranks. Groups are placed as they are counted (largest first, first
    fit), so what is left for a class is what the placement rule still allows there, and
    :func:`place` puts the result in the same places. ``bias`` shifts the rounding (Hydraulis keeps
    the nearby integer solutions as extra candidates). ``spill``: the work of a class that gets no group (too few
    ranks left for it) moves to the next smaller class, and no rank is kept for the smaller classes (their work
    runs as fills): a block's last ranks become one group of the largest size the spilled work can use.
    """
    topo = Topology.of(world)
    total = sum(max(w, 0.0) for w in work.values())
    sizes = sorted(set(sp_sizes), reverse=True)
    smallest = sizes[-1]
    free = topo.free_runs(start, size)  # free runs; groups placed largest first, first fit
    layout: list[int] = []
    remaining_work = total

    def take(p: int, count: int) -> int:
        got = len(topo.take(free, p, count))
        layout.extend([p] * got)
        return got

    carry = 0.0
    for p in sizes:
        if p == smallest:
            break
        w = max(work.get(p, 0.0), 0.0) + carry
        carry = 0.0
        avail = topo.count(free, p) * p
        if avail <= 0:
            carry = w if spill else 0.0
            continue
        ranks_left = sum(hi - lo for lo, hi in free)
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
        if reserve == 0 and not spill and any(work.get(q, 0.0) > 0 for q in sizes if q < p):
            reserve = min(q for q in sizes if q < p and work.get(q, 0.0) > 0)
        count = min(count, avail // p, max(0, (ranks_left - reserve) // p))
        if min_groups and p in min_groups:  # required groups win over a rank kept for smaller classes
            count = max(count, min(min_groups[p], avail // p))
        if p == must:
            count = max(count, 1)
        if take(p, count) == 0 and spill:
            carry = w
        remaining_work -= w - carry
    take(smallest, topo.count(free, smallest))
    return tuple(layout)


def propose_layouts(class_work: Mapping[int, Mapping[int, float]], world: "int | Topology", sp_sizes: Sequence[int],
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
            lay = allocate(work, world, sp_sizes, m, bias=bias)
            if lay not in cands:
                cands.append(lay)
        out[m] = cands
    return out
