"""A shard group's lanes and rounds (:class:`GroupRounds`), paired where the lanes' queues meet.

A *lane* is one rank tuple of the group (an SP group). Lanes are laminar when each lies inside another or beside it
(layout plans with fills, buddy trees): a lane's rounds are then its own items plus its children's rounds side by
side. :func:`merge` pairs lists tallest with tallest: the ``j``-th tallest round of any pairing is at least the
``j``-th tallest item of every list, so for fixed items no pairing has a smaller sum. Each lane's items sit in
consecutive rounds of its queue, so :func:`~lightning_dcp.planning.rounds.lockstep_rounds` (what the runtime runs)
finds exactly these rounds. Lanes that are not laminar get :func:`first_fit`. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from lightning_dcp.planning.plan import WorkItem
from lightning_dcp.planning.round_plan import ItemTime

__all__ = ["GroupRounds", "ItemTime", "first_fit", "lanes_of", "merge"]

Round = list[tuple[int, int]]
"""The ``(lane, item)`` pairs of one round."""


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
    rounds: list[Round] = field(default_factory=list)

    def height(self, rnd: Sequence[tuple[int, int]]) -> float:
        """A round's time: its slowest item's."""
        return max((self.times[lane][k] for lane, k in rnd), default=0.0)

    @property
    def span(self) -> float:
        """The group's time for the step: the sum over its rounds of the round's slowest item."""
        return math.fsum(self.height(r) for r in self.rounds)

    @property
    def samples(self) -> int:
        return sum(len(it.samples) for items in self.items for it in items)

    def ordered_items(self) -> list[WorkItem]:
        """The group's items round by round (lanes in order inside a round)."""
        return [self.items[lane][k] for rnd in self.rounds for lane, k in sorted(rnd)]

    def copy(self) -> "GroupRounds":
        return GroupRounds(self.lanes, self.parent, self.children, [list(x) for x in self.items],
                           [list(x) for x in self.times], [list(r) for r in self.rounds])


def lanes_of(items: Sequence[WorkItem], item_time: ItemTime,
             times: dict[WorkItem, float] | None = None) -> GroupRounds | None:
    """The group's lanes with their laminar tree and the items paired (:func:`merge`); None if two lanes overlap
    without one holding the other. ``times``: known item times."""
    by_ranks: dict[tuple[int, ...], list[WorkItem]] = {}
    for item in items:
        by_ranks.setdefault(item.ranks, []).append(item)
    lanes = sorted(by_ranks, key=lambda r: (-len(r), min(r), r))
    sets = [frozenset(r) for r in lanes]
    parent: list[int | None] = []
    for i, s in enumerate(sets):
        if any(s & sets[j] and not s <= sets[j] for j in range(i)):
            return None
        parent.append(next((j for j in range(i - 1, -1, -1) if s <= sets[j]), None))  # the smallest lane holding it
    children: list[list[int]] = [[] for _ in lanes]
    for i, up in enumerate(parent):
        if up is not None:
            children[up].append(i)
    lane_items = [by_ranks[r] for r in lanes]
    known = times or {}
    group = GroupRounds(lanes, parent, children, lane_items,
                        [[known[it] if it in known else float(item_time(it)) for it in x] for x in lane_items])
    group.rounds = merge(group)
    return group


def merge(g: GroupRounds) -> list[Round]:
    """The group's rounds for its current items, tallest first."""
    return _zip([_subtree(g, lane) for lane in range(len(g.lanes)) if g.parent[lane] is None])


def _subtree(g: GroupRounds, lane: int) -> list[Round]:
    rounds = [[(lane, k)] for k in range(len(g.items[lane]))] + _zip([_subtree(g, c) for c in g.children[lane]])
    heights = [g.height(r) for r in rounds]
    order = sorted(range(len(rounds)), key=lambda i: -heights[i])  # stable: own items first on ties
    return [rounds[i] for i in order]


def _zip(lists: list[list[Round]]) -> list[Round]:
    """Round lists of disjoint rank sets side by side, each tallest first: round ``j`` joins every list's ``j``-th."""
    depth = max((len(x) for x in lists), default=0)
    return [[pair for x in lists if j < len(x) for pair in x[j]] for j in range(depth)]


def first_fit(items: Sequence[WorkItem], item_time: ItemTime) -> GroupRounds:
    """Lanes that are not laminar: every item its own lane, in the rounds ``lockstep_rounds`` finds for the items
    ordered SP items first (largest SP first), then costliest first."""
    times = [float(item_time(it)) for it in items]
    order = sorted(range(len(items)), key=lambda i: (items[i].sp_size == 1, -items[i].sp_size, -times[i],
                                                     items[i].ranks[0], i))
    nxt: dict[int, int] = {}
    rounds: list[Round] = []
    for lane, i in enumerate(order):
        rnd = max(nxt.get(r, 0) for r in items[i].ranks)
        while len(rounds) <= rnd:
            rounds.append([])
        rounds[rnd].append((lane, 0))
        for r in items[i].ranks:
            nxt[r] = rnd + 1
    return GroupRounds([items[i].ranks for i in order], [None] * len(order), [[] for _ in order],
                       [[items[i]] for i in order], [[times[i]] for i in order], rounds)
