"""Moves between a shard group's lanes, for steps of few samples per rank (videos, long documents).

Re-packing keeps every sample in its lane; with one or two samples per lane its rounds are set by them. Two moves,
each priced exactly and kept only if it shortens the group's span: :func:`promote` (a long sample holding a round up
alone goes to a larger SP group) and :func:`dissolve` (a low round is emptied into the others, so its collectives and
short items' floors are paid once). Each counts tries, never seconds, so every rank plans the same rounds.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from lightning_dcp.planning.lockstep.groups import GroupRounds, lanes_of
from lightning_dcp.planning.lockstep.packing import Pricer, free_rounds, lane_samples, place, repacked, sweep
from lightning_dcp.planning.plan import WorkItem
from lightning_dcp.planning.search.climb import climb

__all__ = ["DISSOLVES", "DISSOLVES_MANY", "DISSOLVE_WIDTH", "FILL", "MOVES_MAX_SAMPLES_PER_RANK", "PROMOTIONS",
           "PROMOTION_SWEEPS", "dissolve", "promote"]

MOVES_MAX_SAMPLES_PER_RANK = 4
"""At most this many samples per rank: promotions and :data:`DISSOLVES`; more: :data:`DISSOLVES_MANY` only (re-packing
has the freedom promotions give, and each move re-packs the whole group)."""

PROMOTIONS = 6
"""Promotions tried per shard group."""

PROMOTION_SWEEPS = 2
"""Re-packing sweeps after each promotion tried."""

DISSOLVES = 6
"""Rounds a shard group tries to empty into its other rounds."""

DISSOLVES_MANY = 2
"""Rounds a shard group of many samples per rank tries to empty."""

DISSOLVE_WIDTH = 3
"""... among its this-many lowest rounds at a time."""

FILL = 0.97
"""When a round is emptied a lane keeps at most this share of the tokens its free rounds hold; its shortest samples
beyond go to lanes with room."""

Move = list[tuple[int, int, tuple[int, ...]]]
"""``(lane, item, new ranks)`` per one-sample item moved."""


def promote(g: GroupRounds, pricer: Pricer) -> GroupRounds:
    """Move long samples that hold a round up onto larger SP groups while that shortens the group's span.

    Tallest round first: its tallest one-sample item, and all its one-sample items taller than its tallest packed
    item, each to its next larger block (:func:`_block`), then the group paired and re-packed again. The best of each
    round's tries is kept; at most :data:`PROMOTIONS` tries."""
    tried: set[tuple] = set()
    tries = [0]

    def moves(state: GroupRounds) -> list[Move]:
        return _promotions(state, pricer, tried)[: PROMOTIONS - tries[0]] if tries[0] < PROMOTIONS else []

    def attempt(state: GroupRounds, move: Move):
        tries[0] += 1
        cand = _moved(state, move, pricer)
        return None if cand is None else (cand.span, lambda: cand)

    return climb(g, lambda st: st.span, moves, attempt, better=_shorter, best_of_round=True, keep_going=True)


def _promotions(g: GroupRounds, pricer: Pricer, tried: set[tuple]) -> list[Move]:
    """Candidate moves from the tallest round that has one."""
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
    """``g`` with the items of ``move`` on their new ranks, paired and re-packed again; None if one does not fit."""
    gone = {(x, k) for x, k, _ in move}
    times = {it: t for x in range(len(g.lanes)) for k, (it, t) in enumerate(zip(g.items[x], g.times[x]))
             if (x, k) not in gone}
    for x, k, block in move:
        old = g.items[x][k]
        got = pricer.item(block, old.samples, old.lengths)
        if got is None:
            return None
        times[got[0]] = got[1]
    cand = lanes_of(list(times), pricer.item_time, times)
    return None if cand is None else repacked(cand, pricer, PROMOTION_SWEEPS)


def dissolve(g: GroupRounds, pricer: Pricer, limit: int = DISSOLVES) -> GroupRounds:
    """Empty the group's lowest rounds into its other rounds while that shortens its span; at most ``limit`` tries,
    among the :data:`DISSOLVE_WIDTH` lowest rounds at a time."""
    tries = [0]

    def moves(state: GroupRounds) -> list[int]:
        if tries[0] >= limit or len(state.rounds) <= 1:
            return []
        order = sorted(range(len(state.rounds)), key=lambda j: (state.height(state.rounds[j]), j))
        return order[: min(DISSOLVE_WIDTH, limit - tries[0])]

    def attempt(state: GroupRounds, j: int):
        tries[0] += 1
        cand = _emptied(state, j, pricer)
        return None if cand is None else (cand.span, lambda: cand)

    return climb(g, lambda st: st.span, moves, attempt, better=_shorter)


def _shorter(new: float, old: float) -> bool:
    return new < old * (1 - 1e-9)


def _emptied(g: GroupRounds, j: int, pricer: Pricer) -> GroupRounds | None:
    """``g`` without round ``j``; None if a sample finds no room.

    Its samples join a pool, with the shortest samples of each lane of their SP size past :data:`FILL`; the pool
    (longest first) goes to the lane of its SP size (else a larger one) with token room and the most time to spare in
    its free rounds. Every lane that lost or got samples is re-packed into its free rounds, then the group."""
    cand = g.copy()
    gone = cand.rounds.pop(j)
    pool = [(s, n, len(g.lanes[x])) for x, k in gone for s, n in zip(g.items[x][k].samples, g.items[x][k].lengths)]
    sizes = {len(g.lanes[x]) for x, _ in gone}
    packer = pricer.packer
    est = {p: packer.item_estimator(p) for p in {len(r) for r in cand.lanes}}
    held: dict[int, list[tuple[int, int]]] = {}
    room: dict[int, list] = {}
    for x in range(len(cand.lanes)):
        p = len(cand.lanes[x])
        if p < min(sizes):
            continue
        free = free_rounds(cand, x)
        mine = sorted(((s, n) for k, it in enumerate(cand.items[x]) if (x, k) not in gone
                       for s, n in zip(it.samples, it.lengths)), key=lambda q: (q[1], q[0]))
        count = len(mine)
        limit = FILL * len(free) * packer.item_capacities(p)[-1]
        tokens = sum(n for _, n in mine)
        while p in sizes and mine and tokens > limit:  # the shortest samples leave a lane too full for its rounds
            pool.append((*mine.pop(0), p))
            tokens -= pool[-1][1]
        if len(mine) < count:
            held[x] = mine
        work = math.fsum(est[p](np.asarray([n for _, n in mine], dtype=np.int64)).tolist()) if mine else 0.0
        room[x] = [math.fsum(cand.height(cand.rounds[r]) for r in free) - work, limit - tokens, mine]
    for s, n, p in sorted(pool, key=lambda q: (-q[1], q[0])):
        fits = [x for x in room if len(cand.lanes[x]) == p and room[x][1] >= n] or \
            [x for x in room if len(cand.lanes[x]) > p and room[x][1] >= n]
        if not fits:
            return None
        left = {x: room[x][0] - float(est[len(cand.lanes[x])](np.asarray([n], dtype=np.int64))[0]) for x in fits}
        x = max(fits, key=lambda y: (left[y], -len(cand.lanes[y]), -y))
        room[x][0], room[x][1] = left[x], room[x][1] - n
        held.setdefault(x, list(room[x][2])).append((s, n))
    _drop(cand, set(gone) | {(x, k) for x in held for k in range(len(cand.items[x]))})
    for x, pairs in held.items():  # a lane's samples ride on an item in no round until it is re-packed
        if pairs:
            cand.items[x] = [WorkItem(cand.lanes[x], tuple(s for s, _ in pairs), tuple(n for _, n in pairs), 0)]
            cand.times[x] = [0.0]
    data = lane_samples(cand, packer)
    for x in sorted(held, key=lambda y: (len(cand.lanes[y]), y)):  # the smaller lanes first: the larger hold them
        if held[x] and (data[x] is None or not place(cand, x, data[x], pricer, force=True)):
            return None
    cand.rounds = [r for r in cand.rounds if r]
    sweep(cand, data, pricer)
    return cand


def _drop(g: GroupRounds, pairs: set[tuple[int, int]]) -> None:
    """Remove the items ``pairs`` from their lanes (the rounds' indices follow; a round left empty stays)."""
    remap: dict[tuple[int, int], tuple[int, int]] = {}
    for x in range(len(g.lanes)):
        keep = [k for k in range(len(g.items[x])) if (x, k) not in pairs]
        remap.update({(x, k): (x, i) for i, k in enumerate(keep)})
        g.items[x] = [g.items[x][k] for k in keep]
        g.times[x] = [g.times[x][k] for k in keep]
    g.rounds = [[remap[p] for p in rnd if p in remap] for rnd in g.rounds]
