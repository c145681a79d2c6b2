"""Shared cases of the round tests (``test_rounds.py``, ``test_lockstep_plan.py``): SP-1 items in a shuffled order,
and the yardstick the round planner is held against (:func:`align_rounds`)."""

from __future__ import annotations

import random
from typing import Callable

from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.planning.rounds import check_shard_groups


def sp1_step(costs: dict[int, list[int]], seed: int) -> StepPlan:
    """One SP-1 item per cost of each rank (its one sample's length is the cost), listed in a shuffled order."""
    order = [(r, c) for r in sorted(costs) for c in costs[r]]
    random.Random(seed).shuffle(order)
    return StepPlan(tuple(WorkItem((r,), (s,), (c,), 0) for s, (r, c) in enumerate(order)))


def best_sp1_span(costs: dict[int, list[int]]) -> int:
    """The shortest rounds' span of :func:`sp1_step`: round ``i`` holds every rank's ``i``-th costliest item."""
    return sum(max((sorted(v, reverse=True)[i] if i < len(v) else 0) for v in costs.values())
               for i in range(max(map(len, costs.values()), default=0)))


def align_rounds(step: StepPlan, world_size: int, shard_group_size: int,
                 item_time: Callable[[WorkItem], float]) -> StepPlan:
    """``step`` with each shard group's items reordered so that lockstep rounds pair items of similar cost (the
    alignment after dispatch that the round planner replaced: its yardstick).

    Inside a group, SP items come first (largest SP, then costliest first), each starting a round on all its ranks;
    then each rank's SP-1 items, costliest first: the ``i``-th costliest of every rank share round ``i``, which
    minimises the sum of the rounds' slowest items when every round holds one SP-1 item per rank (the rearrangement
    inequality). Only the order changes: same gradients.
    """
    check_shard_groups(step, world_size, shard_group_size)
    costs = [float(item_time(item)) for item in step.items]
    order = sorted(range(len(step.items)),
                   key=lambda i: (step.items[i].ranks[0] // int(shard_group_size), step.items[i].sp_size == 1,
                                  -step.items[i].sp_size, -costs[i], step.items[i].ranks[0], i))
    return StepPlan(tuple(step.items[i] for i in order), step.notes)
