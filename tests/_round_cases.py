"""Shared cases of the round tests (``test_rounds.py``, ``test_lockstep_plan.py``): SP-1 items in a shuffled order."""

from __future__ import annotations

import random

from lightning_dcp.planning.plan import StepPlan, WorkItem


def sp1_step(costs: dict[int, list[int]], seed: int) -> StepPlan:
    """One SP-1 item per cost of each rank (its one sample's length is the cost), listed in a shuffled order."""
    order = [(r, c) for r in sorted(costs) for c in costs[r]]
    random.Random(seed).shuffle(order)
    return StepPlan(tuple(WorkItem((r,), (s,), (c,), 0) for s, (r, c) in enumerate(order)))


def best_sp1_span(costs: dict[int, list[int]]) -> int:
    """The shortest rounds' span of :func:`sp1_step`: round ``i`` holds every rank's ``i``-th costliest item."""
    return sum(max((sorted(v, reverse=True)[i] if i < len(v) else 0) for v in costs.values())
               for i in range(max(map(len, costs.values()), default=0)))
