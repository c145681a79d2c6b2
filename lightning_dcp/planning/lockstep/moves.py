"""Moves between a shard group's lanes, where a step has few samples per rank (videos; long documents).

Re-packing (:mod:`~lightning_dcp.planning.lockstep.packing`) keeps every sample in its lane; with few
samples per rank a lane holds one or two, and its rounds are set by them. Two moves, each priced
exactly and kept only if it shortens the group's span:

- :func:`promote`: a long sample that holds a round up alone goes to a larger SP group -- the next
  larger legal block of ranks holding its lane that cuts no other lane -- where it runs shorter;
- :func:`dissolve`: a low round is emptied into the group's other rounds: each of its samples joins
  an item of its SP size where it fits under that round's height, else where it raises it least
  (the per-round collectives and the short items' floors are paid once instead of in every round).

Each counts its tries (never seconds), so every rank plans the same rounds. Pure Python.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lightning_dcp.planning.lockstep.groups import GroupRounds, lanes_of
from lightning_dcp.planning.lockstep.packing import Pricer, common_height, lane_samples, sweep
from lightning_dcp.planning.plan import WorkItem

__all__ = ["DISSOLVES", "DISSOLVE_WIDTH", "MOVES_MAX_SAMPLES_PER_RANK", "PROMOTIONS", "PROMOTION_SWEEPS", "dissolve",
           "promote"]

MOVES_MAX_SAMPLES_PER_RANK = 4
"""A shard group tries moves when it has at most this many samples per rank (with more, re-packing has the
freedom the moves give, and the moves re-plan the whole group each: too slow)."""

PROMOTIONS = 6
"""Promotions tried per shard group (:func:`promote`)."""

PROMOTION_SWEEPS = 2
"""Re-packing sweeps after each promotion tried."""

DISSOLVES = 6
"""Rounds a shard group tries to empty into its other rounds (:func:`dissolve`)."""

DISSOLVE_WIDTH = 3
"""... among its this-many lowest rounds at a time."""

Move = list[tuple[int, int, tuple[int, ...]]]
"""``(lane, item, new ranks)`` per one-sample item moved."""


def promote(g: GroupRounds, pricer: Pricer) -> GroupRounds:
    """Move long samples that hold a round up onto larger SP groups while that shortens the group's span.

    Tallest round first: the tallest item of the round, when it is one sample on fewer ranks than the group, and
    every one-sample item of the round taller than its tallest packed item, each to its next larger block
    (:func:`_block`); the group is then paired and re-packed again. At most :data:`PROMOTIONS` tries."""
    tries = 0
    tried: set[tuple] = set()
    while tries < PROMOTIONS:
        moves = _promotions(g, pricer, tried)
        if not moves:
            break
        best = None
        for move in moves[: PROMOTIONS - tries]:
            tries += 1
            cand = _moved(g, move, pricer)
            if cand is not None and cand.span < (best or g).span * (1 - 1e-9):
                best = cand
        if best is not None:
            g = best
    return g


def _promotions(g: GroupRounds, pricer: Pricer, tried: set[tuple]) -> list[Move]:
    """Candidate moves from the tallest round that has one (see :func:`promote`)."""
    group = sorted({r for lane in g.lanes for r in lane})
    for rnd in g.rounds:
        singles = [(g.times[x][k], x, k) for x, k in rnd if len(g.items[x][k].samples) == 1]
        if not singles:
            continue
        packed = max((g.times[x][k] for x, k in rnd if len(g.items[x][k].samples) > 1), default=0.0)
        out = []
        for chosen in [[max(singles)]] + ([sorted(s for s in singles if s[0] > packed)] if packed > 0 else []):
            move = [(x, k, block) for _, x, k in chosen
                    for block in [_block(g, x, pricer, group)] if block is not None]
            key = tuple((g.items[x][k].samples, b) for x, k, b in move)
            if move and key not in tried:
                tried.add(key)
                out.append(move)
        if out:
            return out
    return []


def _block(g: GroupRounds, lane: int, pricer: Pricer, group: Sequence[int]) -> tuple[int, ...] | None:
    """The smallest legal block of consecutive ranks of the group (first by start) larger than ``lane`` that
    holds it and cuts no other lane; None if none."""
    ranks = g.lanes[lane]
    lo, hi = min(ranks), max(ranks)
    first, last = group[0], group[-1]
    sets = [frozenset(r) for r in g.lanes]
    for p in pricer.packer.sp_sizes:
        if p <= len(ranks) or p > last - first + 1:
            continue
        for start in range(max(first, hi + 1 - p), min(lo, last + 1 - p) + 1):
            block = frozenset(range(start, start + p))
            if pricer.packer.topology.legal(start, p) and all(s <= block or block <= s or not s & block for s in sets):
                return tuple(range(start, start + p))
    return None


def _moved(g: GroupRounds, move: Move, pricer: Pricer) -> GroupRounds | None:
    """``g`` with the one-sample items of ``move`` on their new ranks, paired and re-packed again; None if one
    does not fit there."""
    gone = {(x, k) for x, k, _ in move}
    times = {it: t for x in range(len(g.lanes)) for k, (it, t) in enumerate(zip(g.items[x], g.times[x]))
             if (x, k) not in gone}
    for x, k, block in move:
        old = g.items[x][k]
        got = pricer.item(block, old.samples, old.lengths, pricer.packer.ring_of(len(block)))
        if got is None:
            return None
        times[got[0]] = got[1]
    cand = lanes_of(list(times), pricer.item_time, times)
    if cand is None:
        return None
    data = lane_samples(cand, pricer.packer)
    cand = common_height(cand, data, pricer)
    for _ in range(PROMOTION_SWEEPS):
        if not sweep(cand, data, pricer):
            break
    return cand


def dissolve(g: GroupRounds, pricer: Pricer) -> GroupRounds:
    """Empty the group's lowest rounds into its other rounds while that shortens its span (:func:`_emptied`).
    At most :data:`DISSOLVES` tries, among the :data:`DISSOLVE_WIDTH` lowest rounds at a time."""
    tries = 0
    while tries < DISSOLVES and len(g.rounds) > 1:
        order = sorted(range(len(g.rounds)), key=lambda j: (g.height(g.rounds[j]), j))
        better = None
        for j in order[: min(DISSOLVE_WIDTH, DISSOLVES - tries)]:
            tries += 1
            cand = _emptied(g, j, pricer)
            if cand is not None and cand.span < g.span * (1 - 1e-9):
                better = cand
                break
        if better is None:
            break
        g = better
    return g


def _emptied(g: GroupRounds, j: int, pricer: Pricer) -> GroupRounds | None:
    """``g`` without round ``j``: each of its samples (longest first) joins the item of its SP size in another
    round that it fits best under that round's height, else the one that raises its round least (estimated
    times); the changed items priced, the rounds paired and re-packed again. None if a sample finds no room."""
    slots = [[x, k, list(g.items[x][k].samples), list(g.items[x][k].lengths), g.times[x][k], r]
             for r, rnd in enumerate(g.rounds) if r != j for x, k in rnd]
    height = {r: g.height(rnd) for r, rnd in enumerate(g.rounds) if r != j}
    orphans = sorted(((s, n, len(g.lanes[x])) for x, k in g.rounds[j]
                      for s, n in zip(g.items[x][k].samples, g.items[x][k].lengths)), key=lambda o: (-o[1], o[0]))
    packer = pricer.packer
    est = {p: packer.estimator(p) for p in {o[2] for o in orphans}}
    changed: set[int] = set()
    for s, n, p in orphans:
        e = float(est[p](np.asarray([n], dtype=np.int64))[0])
        cap = packer.capacities(p)[-1]
        best, key = -1, None
        for i, (x, _, _, lengths, t, r) in enumerate(slots):
            if len(g.lanes[x]) != p or sum(lengths) + n > cap:
                continue
            rise = t + e - height[r]
            k = (0, -rise) if rise <= 0 else (1, rise)  # fits under: the fullest; else the least rise
            if key is None or k < key:
                best, key = i, k
        if best < 0:
            return None
        slot = slots[best]
        slot[2].append(s)
        slot[3].append(n)
        slot[4] += e
        height[slot[5]] = max(height[slot[5]], slot[4])
        changed.add(best)
    times: dict[WorkItem, float] = {}
    for i, (x, k, samples, lengths, _, _) in enumerate(slots):
        if i not in changed:
            times[g.items[x][k]] = g.times[x][k]
            continue
        order = sorted(range(len(samples)), key=lambda q: (-lengths[q], samples[q]))
        got = pricer.item(g.lanes[x], [samples[q] for q in order], [lengths[q] for q in order], g.items[x][k].ring)
        if got is None:
            return None
        times[got[0]] = got[1]
    cand = lanes_of(list(times), pricer.item_time, times)
    if cand is not None:
        sweep(cand, lane_samples(cand, packer), pricer)
    return cand
