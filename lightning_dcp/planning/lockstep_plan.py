"""The round planner of a shard group: lockstep rounds planned, not aligned afterwards (``sharding="hsdp"``).

Under per-layer sharding the ranks of a shard group run their micro-batches in lockstep *rounds*
(:class:`~lightning_dcp.planning.rounds.Lockstep`): a round lasts as long as its slowest item, so a
group's step lasts the sum over its rounds of the round's slowest item. :func:`plan_lockstep` plans
those rounds for a step a policy made (:meth:`Lockstep.plan_step`, the round planner's one entry
point), shard group by shard group. No sample changes its rank tuple (its *lane*: the SP group the
policy chose), so the plan keeps the policy's SP sizes, memory and gradients; what changes is which
items share a round and, when a :class:`~lightning_dcp.planning.round_plan.LanePacker` is given
(dcp), how each lane packs its samples into micro-batches:

1. **Rounds where the queues meet.** The lanes of a group form a laminar family (a lane inside
   another runs after or before it, never beside it: layout plans with fills, buddy trees). A lane's
   rounds are its own items plus its children's rounds run side by side; lists side by side are
   paired sorted, tallest with tallest (:func:`_zip`). Sorted pairing is optimal for fixed items:
   the ``j``-th tallest round of any pairing is at least the ``j``-th tallest item of every list, so
   no pairing has a smaller sum. Each lane's items then sit in consecutive rounds of its queue, so
   :func:`~lightning_dcp.planning.rounds.lockstep_rounds` (what the runtime and the simulator run)
   finds exactly these rounds in the plan's order.
2. **Items paired by cost as they are packed** (with a packer). First every lane is packed into
   micro-batches of one common height ``H`` (a few round counts tried, the policy's own packing
   kept when it is better). Then, lane by lane, a lane is re-packed against the rounds the other
   lanes make (:func:`_targets`): it fills the room under rounds held up by an item that cannot
   shrink (one sample) first, then spreads the rest level under the others' heights, and raises
   rounds only as far as its work needs -- so a lane with a long sample and a lane of short ones
   put equal time in each round instead of the long one's round waiting. A re-packing is kept when
   the group's span, priced exactly, does not grow; the rounds are paired again after each sweep.

A group whose lanes are not laminar keeps the policy's items, paired first-fit tallest first
(:func:`_first_fit`). Every count is in samples and lanes, never in seconds: every rank plans the same
rounds. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.planning.round_plan import LanePacker

__all__ = ["GroupRounds", "SWEEPS", "plan_group", "plan_lockstep"]

SWEEPS = 4
"""Sweeps of lane-by-lane re-packing per shard group (each re-packs every lane once, then pairs the rounds again)."""

ROUND_COUNTS = 3
"""Common-height packings tried on each side of the policy's round count (:func:`_common_height`)."""

PROMOTIONS = 6
"""Promotions tried per shard group (:func:`_promote`: a long sample onto a larger SP group, the group re-packed)."""

PROMOTION_SWEEPS = 2
"""Re-packing sweeps after each promotion tried."""

ItemTime = Callable[[WorkItem], float]


@dataclass
class GroupRounds:
    """A shard group's lanes and rounds.

    ``lanes``: rank tuples, largest first (ties: lowest rank); ``parent``/``children``: the laminar
    tree; ``items[l]``/``times[l]``: lane ``l``'s items and their times; ``rounds``: per round, the
    ``(lane, item)`` pairs in it, tallest round first.
    """

    lanes: list[tuple[int, ...]]
    parent: list[int | None]
    children: list[list[int]]
    items: list[list[WorkItem]]
    times: list[list[float]]
    rounds: list[list[tuple[int, int]]] = field(default_factory=list)

    def height(self, rnd: Sequence[tuple[int, int]]) -> float:
        return max((self.times[lane][k] for lane, k in rnd), default=0.0)

    @property
    def span(self) -> float:
        return math.fsum(self.height(r) for r in self.rounds)

    def ordered_items(self) -> list[WorkItem]:
        """The group's items round by round (lanes in order inside a round)."""
        return [self.items[lane][k] for rnd in self.rounds for lane, k in sorted(rnd)]

    def copy(self) -> "GroupRounds":
        return GroupRounds(self.lanes, self.parent, self.children, [list(x) for x in self.items],
                           [list(x) for x in self.times], [list(r) for r in self.rounds])


# --------------------------------------------------------------------------------------------- entry point
def plan_lockstep(step: StepPlan, world_size: int, shard_group_size: int, item_time: ItemTime,
                  packer: LanePacker | None = None) -> StepPlan:
    """``step`` with each shard group's items in planned rounds (see the module docstring).

    ``item_time``: an item's time (its round's collectives included, at its slowest rank's pace);
    ``packer``: re-pack each lane's samples (None: keep the policy's items, only pair them).
    Items are listed round by round per group; ``extra["estimated_time"]`` becomes the slowest
    group's span and ``extra["rounds"]`` each group's round count.
    """
    k = int(shard_group_size)
    by_group: dict[int, list[WorkItem]] = {}
    for item in step.items:
        by_group.setdefault(item.ranks[0] // k, []).append(item)
    if packer is not None and not packer.exact_memory:
        packer = None  # its token capacities are estimates: re-packing would need the memory checked again
    planned = {g: plan_group(items, item_time, packer) for g, items in sorted(by_group.items())}
    out: list[WorkItem] = []
    depth = max((len(p.rounds) for p in planned.values()), default=0)
    per_group = {g: [[p.items[lane][i] for lane, i in sorted(rnd)] for rnd in p.rounds] for g, p in planned.items()}
    for j in range(depth):  # round j of every group, groups in order (disjoint ranks: any order is deadlock-free)
        for g in sorted(per_group):
            if j < len(per_group[g]):
                out.extend(per_group[g][j])
    extra = dict(step.extra)
    if planned:
        extra["estimated_time"] = max(p.span for p in planned.values())
        extra["rounds"] = [len(planned[g].rounds) if g in planned else 0 for g in range(int(world_size) // k)]
    return StepPlan(tuple(out), extra)


def plan_group(items: Sequence[WorkItem], item_time: ItemTime, packer: LanePacker | None = None) -> GroupRounds:
    """The rounds of one shard group's ``items`` (see the module docstring)."""
    group = _lanes(items, item_time)
    if group is None:
        return _first_fit(items, item_time)
    group.rounds = _merge(group)
    if packer is None:
        return group
    data = _lane_data(group, packer)
    best = _common_height(group, data, packer, item_time)
    for _ in range(SWEEPS):
        moved = _sweep(best, data, packer, item_time)
        best.rounds = _merge(best)
        if not moved:
            break
    return _promote(best, packer, item_time)


# ---------------------------------------------------------------------------------------------- lanes, pairing
def _lanes(items: Sequence[WorkItem], item_time: ItemTime) -> GroupRounds | None:
    """The group's lanes (largest first, then by lowest rank) and their laminar tree; None if two lanes
    overlap without one holding the other."""
    by_ranks: dict[tuple[int, ...], list[WorkItem]] = {}
    for item in items:
        by_ranks.setdefault(item.ranks, []).append(item)
    lanes = sorted(by_ranks, key=lambda r: (-len(r), min(r), r))
    sets = [frozenset(r) for r in lanes]
    parent: list[int | None] = []
    for i, s in enumerate(sets):
        up = None
        for j in range(i - 1, -1, -1):  # the smallest earlier lane holding it
            if s <= sets[j]:
                up = j
                break
        for j in range(i):
            if s & sets[j] and not s <= sets[j]:
                return None
        parent.append(up)
    children: list[list[int]] = [[] for _ in lanes]
    for i, up in enumerate(parent):
        if up is not None:
            children[up].append(i)
    lane_items = [by_ranks[r] for r in lanes]
    return GroupRounds(lanes, parent, children, lane_items, [[float(item_time(it)) for it in x] for x in lane_items])


def _merge(g: GroupRounds) -> list[list[tuple[int, int]]]:
    """The group's rounds for its current items: each lane's own items beside nothing of its subtree, its
    children's rounds side by side (:func:`_zip`); tallest first."""
    return _zip([_subtree(g, lane) for lane in range(len(g.lanes)) if g.parent[lane] is None])


def _subtree(g: GroupRounds, lane: int) -> list[list[tuple[int, int]]]:
    own = [[(lane, k)] for k in range(len(g.items[lane]))]
    rounds = own + _zip([_subtree(g, c) for c in g.children[lane]])
    heights = [g.height(r) for r in rounds]
    order = sorted(range(len(rounds)), key=lambda i: -heights[i])  # stable: own items first on ties
    return [rounds[i] for i in order]


def _zip(lists: list[list[list[tuple[int, int]]]]) -> list[list[tuple[int, int]]]:
    """Round lists of disjoint rank sets side by side, each tallest first: round ``j`` joins every list's ``j``-th."""
    depth = max((len(x) for x in lists), default=0)
    return [[pair for x in lists if j < len(x) for pair in x[j]] for j in range(depth)]


def _first_fit(items: Sequence[WorkItem], item_time: ItemTime) -> GroupRounds:
    """Lanes that are not laminar: every item its own lane, in rounds as :func:`lockstep_rounds` runs the items
    ordered SP first, then costliest first (:func:`~lightning_dcp.planning.rounds.align_rounds`' order)."""
    times = [float(item_time(it)) for it in items]
    order = sorted(range(len(items)), key=lambda i: (items[i].sp_size == 1, -items[i].sp_size, -times[i],
                                                     items[i].ranks[0], i))
    nxt: dict[int, int] = {}
    rounds: list[list[tuple[int, int]]] = []
    for lane, i in enumerate(order):
        rnd = max(nxt.get(r, 0) for r in items[i].ranks)
        while len(rounds) <= rnd:
            rounds.append([])
        rounds[rnd].append((lane, 0))
        for r in items[i].ranks:
            nxt[r] = rnd + 1
    lanes = [items[i].ranks for i in order]
    return GroupRounds(lanes, [None] * len(order), [[] for _ in order], [[items[i]] for i in order],
                       [[times[i]] for i in order], rounds)


# ---------------------------------------------------------------------------------------------- re-packing
@dataclass
class _Lane:
    """What re-packing one lane needs: its samples (longest estimate first), their estimated times at the
    lane's pace, the token capacity of a micro-batch on it, and its ring degree."""

    ranks: tuple[int, ...]
    samples: list[int]
    lengths: list[int]
    est: list[float]
    cap: int
    ring: int

    @property
    def work(self) -> float:
        return math.fsum(self.est)



def _lane_data(g: GroupRounds, packer: LanePacker) -> list[_Lane | None]:
    """Per lane its :class:`_Lane`, or None when it cannot be re-packed (its items differ in ring degree)."""
    out: list[_Lane | None] = []
    for ranks, items in zip(g.lanes, g.items):
        rings = {it.ring for it in items}
        if len(rings) != 1:
            out.append(None)
            continue
        sp = len(ranks)
        pairs = sorted(((s, n) for it in items for s, n in zip(it.samples, it.lengths)), key=lambda x: (-x[1], x[0]))
        lengths = [n for _, n in pairs]
        est = (np.asarray(packer.estimator(sp)(np.asarray(lengths, dtype=np.int64)), dtype=np.float64)
               / packer.speed(ranks)).tolist()
        out.append(_Lane(ranks, [s for s, _ in pairs], lengths, est, int(packer.capacities(sp)[-1]), rings.pop()))
    return out


def _pack(lane: _Lane, targets: Sequence[float], place: Sequence[int] | None = None) -> list[list[int]] | None:
    """Sample indices of ``lane`` per bin: those ``place`` puts in a bin there, then the others longest estimate
    first, each to the bin furthest below its target that has token room (ties: the first); None if a sample
    finds no room."""
    load = [0.0] * len(targets)
    tokens = [0] * len(targets)
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
    for i in sorted(rest, key=lambda i: (-lane.est[i], i)):
        n = lane.lengths[i]
        best, gap = -1, -math.inf
        for b in range(len(targets)):
            if tokens[b] + n <= lane.cap and targets[b] - load[b] > gap:
                best, gap = b, targets[b] - load[b]
        if best < 0:
            return None
        bins[best].append(i)
        load[best] += lane.est[i]
        tokens[best] += n
    return bins


def _realize(lane: _Lane, bins: Sequence[Sequence[int]], packer: LanePacker,
             item_time: ItemTime) -> list[tuple[WorkItem, float] | None] | None:
    """The bins as items with the fewest recomputed layers that fit, and their times (None for an empty bin);
    None if a bin fits no recompute."""
    sp = len(lane.ranks)
    out: list[tuple[WorkItem, float] | None] = []
    for b in bins:
        if not b:
            out.append(None)
            continue
        idx = sorted(b, key=lambda i: (-lane.lengths[i], lane.samples[i]))
        lengths = tuple(lane.lengths[i] for i in idx)
        rec = packer.min_recompute(sum(lengths), sp)
        if rec is None:
            return None
        item = WorkItem(lane.ranks, tuple(lane.samples[i] for i in idx), lengths, rec, lane.ring)
        out.append((item, float(item_time(item))))
    return out


def _common_height(g: GroupRounds, data: list[_Lane | None], packer: LanePacker, item_time: ItemTime) -> GroupRounds:
    """The policy's items, or every lane packed into micro-batches of one common height ``H`` (the busiest
    rank's load over ``R`` rounds, ``R`` within :data:`ROUND_COUNTS` of the policy's round count): whichever
    pairs into the shortest span."""
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
            got = None if bins is None else _realize(d, bins, packer, item_time)
            if got is None:
                continue
            kept = [x for x in got if x is not None]
            cand.items[lane], cand.times[lane] = [it for it, _ in kept], [t for _, t in kept]
        cand.rounds = _merge(cand)
        if cand.span < best.span * (1 - 1e-12):
            best = cand
    return best


def _level(lo: Sequence[float], hi: Sequence[float], total: float) -> list[float]:
    """``clamp(x, lo_j, hi_j)`` per bin at the level ``x`` where they sum to ``total`` (``hi`` where they cannot)."""
    if math.fsum(hi) <= total:
        return list(hi)
    if math.fsum(lo) >= total:
        return list(lo)
    a, b = min(lo), max(hi)
    for _ in range(60):
        x = 0.5 * (a + b)
        if math.fsum(min(max(x, l), h) for l, h in zip(lo, hi)) < total:
            a = x
        else:
            b = x
    return [min(max(b, l), h) for l, h in zip(lo, hi)]


def _targets(lane: _Lane, others: Sequence[float], rigid: Sequence[float]) -> tuple[list[float], list[int]]:
    """A lane's estimated time per round it may use, and the round of each of its long samples (-1: none), given
    the other lanes' tallest item there (``others``) and their tallest one-sample item (``rigid``: a height no
    re-packing lowers).

    The lane's samples longer than its mean per round go alone, longest with the tallest round of the others.
    Then its other samples fill: the room under a rigid item first (it costs nothing and blocks nothing), then
    the room under the others' items, level (a lane with room to spare stays out of the tall rounds, which their
    own lanes may lower), and past that the rounds rise level, as far as the work needs. A round holds at most
    the lane's token capacity."""
    n = len(others)
    share = lane.work / n if n else math.inf
    long_ = [i for i in range(min(n, len(lane.est))) if lane.est[i] > share]  # samples are longest estimate first
    place = [-1] * len(lane.est)
    base, room = [0.0] * n, [float(lane.cap)] * n
    for i, j in zip(long_, sorted(range(n), key=lambda j: (-others[j], j))):
        place[i], base[j], room[j] = j, lane.est[i], float(lane.cap - lane.lengths[i])
    rest = [i for i in range(len(lane.est)) if place[i] < 0]
    tokens = sum(lane.lengths[i] for i in rest)
    rate = math.fsum(lane.est[i] for i in rest) / tokens if tokens else 0.0
    work = math.fsum(lane.est[i] for i in rest)
    full = [b + rate * max(r, 0.0) for b, r in zip(base, room)]
    hard = [max(min(x, f), b) for x, f, b in zip(rigid, full, base)]
    soft = [max(min(o, f), h) for o, f, h in zip(others, full, hard)]
    more = [max(f, s) for f, s in zip(full, soft)]
    for lo, hi in ((base, hard), (hard, soft), (soft, more)):
        if math.fsum(hi) - math.fsum(base) >= work or hi is more:
            return _level(lo, hi, work + math.fsum(base)), place
    raise AssertionError("unreachable")


def _sweep(g: GroupRounds, data: list[_Lane | None], packer: LanePacker, item_time: ItemTime) -> bool:
    """Re-pack each lane in turn against the rounds of the others (:func:`_targets`), keeping a re-packing that
    does not lengthen the group's span (exact times, the rounds fixed); whether any lane changed."""
    sets = [frozenset(r) for r in g.lanes]
    moved = False
    for lane, d in enumerate(data):
        if d is None:
            continue
        mine = sets[lane]
        free, others, rigid, span_out = [], [], [], 0.0
        for j, rnd in enumerate(g.rounds):
            rest = [(x, k) for x, k in rnd if x != lane]
            if any(sets[x] & mine for x, _ in rest):
                span_out += g.height(rnd)
                continue
            free.append(j)
            others.append(max((g.times[x][k] for x, k in rest), default=0.0))
            rigid.append(max((g.times[x][k] for x, k in rest if len(g.items[x][k].samples) == 1), default=0.0))
        targets, place = _targets(d, others, rigid)
        bins = _pack(d, targets, place)
        got = None if bins is None else _realize(d, bins, packer, item_time)
        if got is None:
            continue
        span = span_out + math.fsum(max(o, x[1] if x is not None else 0.0) for o, x in zip(others, got))
        if span > g.span * (1 + 1e-12):
            continue
        old = ([(k, t) for k, t in zip(g.items[lane], g.times[lane])])
        new = [(x[0], x[1]) for x in got if x is not None]
        if [it for it, _ in old] == [it for it, _ in new]:
            continue
        g.items[lane], g.times[lane] = [it for it, _ in new], [t for _, t in new]
        slot = iter(range(len(new)))
        for j, x in zip(free, got):
            g.rounds[j] = [(y, k) for y, k in g.rounds[j] if y != lane] + ([(lane, next(slot))] if x is not None else [])
        g.rounds = [r for r in g.rounds if r]
        moved = True
    return moved


# ---------------------------------------------------------------------------------------------- promotion
def _promote(g: GroupRounds, packer: LanePacker, item_time: ItemTime) -> GroupRounds:
    """Move long samples that hold a round up onto larger SP groups while that shortens the group's span.

    Tallest round first: the tallest item of the round, when it is one sample on fewer ranks than the group,
    and every one-sample item of the round taller than its tallest packed item, each to the next larger legal
    block of ranks holding its lane that cuts no lane (:func:`_block`); the group is then re-packed
    (:func:`_sweep`) and kept if its span is shorter. At most :data:`PROMOTIONS` tries."""
    tries = 0
    tried: set[tuple] = set()
    while tries < PROMOTIONS:
        moves = _promotions(g, packer, tried)
        if not moves:
            break
        best = None
        for move in moves:
            tries += 1
            cand = _moved(g, move, packer, item_time)
            if cand is not None and cand.span < (best or g).span * (1 - 1e-9):
                best = cand
            if tries >= PROMOTIONS:
                break
        if best is None:
            continue
        g = best
    return g


def _promotions(g: GroupRounds, packer: LanePacker, tried: set[tuple]) -> list[list[tuple[int, int, tuple[int, ...]]]]:
    """Candidate moves ``[(lane, item, new ranks), ...]`` from the tallest round with one (see :func:`_promote`)."""
    span_ranks = sorted({r for lane in g.lanes for r in lane})
    for rnd in g.rounds:
        singles = [(g.times[x][k], x, k) for x, k in rnd if len(g.items[x][k].samples) == 1]
        if not singles:
            continue
        top = max(singles)
        packed = max((g.times[x][k] for x, k in rnd if len(g.items[x][k].samples) > 1), default=0.0)
        sets = [[top]] + ([sorted(s for s in singles if s[0] > packed)] if packed > 0 else [])
        out = []
        for chosen in sets:
            move = []
            for _, x, k in chosen:
                block = _block(g, x, packer, span_ranks)
                if block is not None:
                    move.append((x, k, block))
            key = tuple((g.items[x][k].samples, b) for x, k, b in move)
            if move and key not in tried:
                tried.add(key)
                out.append(move)
        if out:
            return out
    return []


def _block(g: GroupRounds, lane: int, packer: LanePacker, group: Sequence[int]) -> tuple[int, ...] | None:
    """The smallest legal block of consecutive ranks of the group (first by start) larger than ``lane`` that
    holds it and cuts no other lane; None if none."""
    ranks = g.lanes[lane]
    lo, hi = min(ranks), max(ranks)
    first, last = group[0], group[-1]
    sets = [frozenset(r) for r in g.lanes]
    for p in packer.sp_sizes:
        if p <= len(ranks) or p > last - first + 1:
            continue
        for start in range(max(first, hi + 1 - p), min(lo, last + 1 - p) + 1):
            if not packer.topology.legal(start, p):
                continue
            block = frozenset(range(start, start + p))
            if all(s <= block or block <= s or not (s & block) for s in sets):
                return tuple(range(start, start + p))
    return None


def _moved(g: GroupRounds, move: Sequence[tuple[int, int, tuple[int, ...]]], packer: LanePacker,
           item_time: ItemTime) -> GroupRounds | None:
    """``g`` with the one-sample items of ``move`` on their new ranks, re-paired and re-packed; None if one
    does not fit there."""
    gone = {(x, k) for x, k, _ in move}
    items = [it for x in range(len(g.lanes)) for k, it in enumerate(g.items[x]) if (x, k) not in gone]
    for x, k, block in move:
        old = g.items[x][k]
        rec = packer.min_recompute(old.tokens, len(block))
        if rec is None:
            return None
        items.append(WorkItem(block, old.samples, old.lengths, rec, packer.ring_of(len(block))))
    cand = _lanes(items, item_time)
    if cand is None:
        return None
    cand.rounds = _merge(cand)
    data = _lane_data(cand, packer)
    cand = _common_height(cand, data, packer, item_time)
    for _ in range(PROMOTION_SWEEPS):
        moved = _sweep(cand, data, packer, item_time)
        cand.rounds = _merge(cand)
        if not moved:
            break
    return cand
