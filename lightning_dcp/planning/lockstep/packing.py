"""Items paired by cost as they are packed: each lane's samples re-packed for the rounds of its shard group.

First every lane is packed into micro-batches of one common height (:func:`common_height`); then, lane by lane
(:func:`sweep`), re-packed against the others' rounds (:func:`targets`), so a lane with a long sample and a lane of
short ones put equal time in each round instead of the short ones' waiting. A re-packing is kept when the group's span
does not grow. Samples keep their lane here. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lightning_dcp.planning.lockstep.groups import GroupRounds, ItemTime, merge
from lightning_dcp.planning.plan import WorkItem
from lightning_dcp.planning.round_plan import LanePacker

__all__ = ["LaneSamples", "Pricer", "ROUND_COUNTS", "SWEEPS", "common_height", "free_rounds", "lane_samples", "place",
           "repack", "repacked", "sweep"]

SWEEPS = 4
"""Sweeps of lane-by-lane re-packing per shard group."""

ROUND_COUNTS = 3
"""Common-height packings tried on each side of the policy's round count (:func:`common_height`)."""


class Pricer:
    """The items a re-packing makes, priced by the packer (its fast path, at the lane's pace) with the fewest
    recomputed layers that fit; the group's final items are priced with ``item_time``."""

    def __init__(self, packer: LanePacker, item_time: ItemTime) -> None:
        self.packer, self.item_time = packer, item_time

    def item(self, ranks: tuple[int, ...], samples: Sequence[int], lengths: Sequence[int]) -> tuple[WorkItem, float] | None:
        """The micro-batch as an item on its fastest split, with its time; None if no split and recompute fits it."""
        got = self.packer.setting(lengths, len(ranks))
        if got is None:
            return None
        return (WorkItem(ranks, tuple(samples), tuple(lengths), got.recompute, got.ring, got.tp),
                float(got.time) / self.packer.speed(ranks))


@dataclass
class LaneSamples:
    """One lane's samples (longest estimate first), their estimated times at its pace, and a micro-batch's token
    capacity on it."""

    ranks: tuple[int, ...]
    samples: list[int]
    lengths: list[int]
    est: list[float]
    cap: int

    @property
    def work(self) -> float:
        return math.fsum(self.est)


def lane_samples(g: GroupRounds, packer: LanePacker) -> list[LaneSamples | None]:
    """Per lane its :class:`LaneSamples` (each re-packed micro-batch then takes its own fastest split)."""
    out: list[LaneSamples | None] = []
    for ranks, items in zip(g.lanes, g.items):
        sp = len(ranks)
        pairs = sorted(((s, n) for it in items for s, n in zip(it.samples, it.lengths)), key=lambda x: (-x[1], x[0]))
        lengths = [n for _, n in pairs]
        est = (np.asarray(packer.item_estimator(sp)(np.asarray(lengths, dtype=np.int64)), dtype=np.float64)
               / packer.speed(ranks)).tolist()
        out.append(LaneSamples(ranks, [s for s, _ in pairs], lengths, est, int(packer.item_capacities(sp)[-1])))
    return out


def _pack(lane: LaneSamples, targets: Sequence[float], place: Sequence[int] | None = None) -> list[list[int]] | None:
    """Sample indices per bin: those ``place`` puts in a bin there, then the others longest estimate first, each to
    the bin furthest below its target with token room (ties: the first); None if a sample finds no room."""
    n = len(targets)
    load, tokens = [0.0] * n, [0] * n
    bins: list[list[int]] = [[] for _ in targets]
    rest = []
    for i in range(len(lane.est)):
        b = place[i] if place is not None else -1
        if b < 0:
            rest.append(i)
            continue
        bins[b].append(i)
        load[b] += lane.est[i]
        tokens[b] += lane.lengths[i]
    cap = lane.cap
    for i in sorted(rest, key=lambda i: (-lane.est[i], i)):
        size = lane.lengths[i]
        best, gap = -1, -math.inf
        for b in range(n):
            if tokens[b] + size <= cap and targets[b] - load[b] > gap:
                best, gap = b, targets[b] - load[b]
        if best < 0:
            return None
        bins[best].append(i)
        load[best] += lane.est[i]
        tokens[best] += size
    return bins


def repack(lane: LaneSamples, bins: Sequence[Sequence[int]], pricer: Pricer) -> list[tuple[WorkItem, float] | None] | None:
    """The bins as items (samples longest first) with their times (None: an empty bin); None if a bin fits no
    recompute."""
    out: list[tuple[WorkItem, float] | None] = []
    for b in bins:
        if not b:
            out.append(None)
            continue
        idx = sorted(b, key=lambda i: (-lane.lengths[i], lane.samples[i]))
        got = pricer.item(lane.ranks, [lane.samples[i] for i in idx], [lane.lengths[i] for i in idx])
        if got is None:
            return None
        out.append(got)
    return out


def common_height(g: GroupRounds, data: list[LaneSamples | None], pricer: Pricer) -> GroupRounds:
    """The policy's items, or every lane packed into micro-batches of one common height (the busiest rank's load
    over ``R`` rounds, ``R`` within :data:`ROUND_COUNTS` of the policy's round count): whichever span is shortest."""
    busy: dict[int, float] = {}
    for ranks, times in zip(g.lanes, g.times):
        for r in ranks:
            busy[r] = busy.get(r, 0.0) + math.fsum(times)
    top = max(busy.values(), default=0.0)
    best = g.copy()
    r0 = len(g.rounds)
    for count in range(max(1, r0 - ROUND_COUNTS), r0 + ROUND_COUNTS + 1):
        h = top / count
        cand = g.copy()
        for lane, d in enumerate(data):
            if d is None:
                continue
            n = max(1, math.ceil(sum(d.lengths) / d.cap), round(d.work / h) if h > 0 else 1)
            bins = _pack(d, [h] * n)
            got = None if bins is None else repack(d, bins, pricer)
            if got is None:
                continue
            kept = [x for x in got if x is not None]
            cand.items[lane], cand.times[lane] = [it for it, _ in kept], [t for _, t in kept]
        cand.rounds = merge(cand)
        if cand.span < best.span * (1 - 1e-12):
            best = cand
    return best


def level(lo: Sequence[float], hi: Sequence[float], total: float) -> list[float]:
    """``clamp(x, lo_j, hi_j)`` per bin at the level ``x`` where they sum to ``total`` (``lo`` or ``hi`` outside)."""
    if math.fsum(hi) <= total:
        return list(hi)
    if math.fsum(lo) >= total:
        return list(lo)

    def at(x: float) -> float:
        return math.fsum(min(max(x, a), b) for a, b in zip(lo, hi))

    points = sorted(set(lo) | set(hi))
    values = [at(x) for x in points]
    k = next(i for i, v in enumerate(values) if v >= total)  # values[0] = sum(lo) < total <= values[-1]
    x0, x1, v0, v1 = points[k - 1], points[k], values[k - 1], values[k]
    x = x1 if v1 == v0 else x0 + (total - v0) * (x1 - x0) / (v1 - v0)
    return [min(max(x, a), b) for a, b in zip(lo, hi)]


def targets(lane: LaneSamples, others: Sequence[float], rigid: Sequence[float]) -> tuple[list[float], list[int]]:
    """A lane's estimated time per round it may use, and the round of each of its long samples (-1: none), given
    the other lanes' tallest item there (``others``) and tallest one-sample item (``rigid``: no re-packing lowers it).

    Samples longer than the lane's mean per round go alone, longest with the others' tallest round. The rest fill
    the room under a rigid item first (it costs nothing), then under the others' items, level (the tall rounds'
    own lanes may lower them), then the rounds rise level as far as the work needs; at most the token capacity."""
    n = len(others)
    share = lane.work / n if n else math.inf
    long_ = [i for i in range(min(n, len(lane.est))) if lane.est[i] > share]  # samples are longest estimate first
    place = [-1] * len(lane.est)
    base, room = [0.0] * n, [float(lane.cap)] * n
    for i, j in zip(long_, sorted(range(n), key=lambda j: (-others[j], j))):
        place[i], base[j], room[j] = j, lane.est[i], float(lane.cap - lane.lengths[i])
    rest = [i for i in range(len(lane.est)) if place[i] < 0]
    tokens = sum(lane.lengths[i] for i in rest)
    work = math.fsum(lane.est[i] for i in rest)
    rate = work / tokens if tokens else 0.0
    full = [b + rate * max(r, 0.0) for b, r in zip(base, room)]
    hard = [max(min(x, f), b) for x, f, b in zip(rigid, full, base)]
    soft = [max(min(o, f), h) for o, f, h in zip(others, full, hard)]
    more = [max(f, s) for f, s in zip(full, soft)]
    total = work + math.fsum(base)
    for lo, hi in ((base, hard), (hard, soft)):
        if math.fsum(hi) >= total:
            return level(lo, hi, total), place
    return level(soft, more, total), place


def sweep(g: GroupRounds, data: list[LaneSamples | None], pricer: Pricer) -> bool:
    """Re-pack each lane in turn against the others' rounds (:func:`place`), then pair the rounds again; whether any
    lane changed."""
    moved = False
    for lane, d in enumerate(data):
        if d is not None and place(g, lane, d, pricer):
            moved = True
    g.rounds = merge(g)
    return moved


def free_rounds(g: GroupRounds, lane: int) -> list[int]:
    """The rounds ``lane`` may run an item in: no item of another lane on its ranks."""
    mine = frozenset(g.lanes[lane])
    return [j for j, rnd in enumerate(g.rounds) if not any(x != lane and mine & frozenset(g.lanes[x]) for x, _ in rnd)]


def place(g: GroupRounds, lane: int, d: LaneSamples, pricer: Pricer, force: bool = False) -> bool:
    """Re-pack ``lane``'s samples into its free rounds against the other lanes' items there (:func:`targets`), kept
    if the group's span does not grow (``force``: whenever every sample finds room, empty rounds kept for the lanes
    placed next); whether it changed. The rounds stay where they are."""
    free = free_rounds(g, lane)
    keep = set(free)
    span_out = math.fsum(g.height(rnd) for j, rnd in enumerate(g.rounds) if j not in keep)
    others, rigid = [], []
    for j in free:
        rest = [(x, k) for x, k in g.rounds[j] if x != lane]
        others.append(max((g.times[x][k] for x, k in rest), default=0.0))
        rigid.append(max((g.times[x][k] for x, k in rest if len(g.items[x][k].samples) == 1), default=0.0))
    goal, where = targets(d, others, rigid)
    bins = _pack(d, goal, where)
    got = None if bins is None else repack(d, bins, pricer)
    if got is None:
        return False
    new = [x for x in got if x is not None]
    if not force:
        span = span_out + math.fsum(max(o, x[1] if x is not None else 0.0) for o, x in zip(others, got))
        if span > g.span * (1 + 1e-12) or [it for it, _ in new] == g.items[lane]:
            return False
    g.items[lane], g.times[lane] = [it for it, _ in new], [t for _, t in new]
    slot = iter(range(len(new)))
    for j, x in zip(free, got):
        g.rounds[j] = [(y, k) for y, k in g.rounds[j] if y != lane] + ([(lane, next(slot))] if x is not None else [])
    if not force:
        g.rounds = [r for r in g.rounds if r]
    return True


def repacked(g: GroupRounds, pricer: Pricer, sweeps: int) -> GroupRounds:
    """``g`` packed at a common height, then re-packed lane by lane for at most ``sweeps`` sweeps."""
    data = lane_samples(g, pricer.packer)
    best = common_height(g, data, pricer)
    for _ in range(sweeps):
        if not sweep(best, data, pricer):
            break
    return best
