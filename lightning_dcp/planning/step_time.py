"""One step's semantics: how long a step plan runs, as :class:`~lightning_dcp.DCPStrategy` executes it.

Every price of a step plan in the package is this module's: the simulator, dcp's choice between its
candidate plans, the round planner's final check, the peers' tuning. Faster forms elsewhere (a buddy
tree's root-to-leaf sums, a shard group's round heights) are property-tested equal to it.

- **Free-running ranks** (every sharding mode but ``hsdp``): each rank runs its items in the plan's
  order; an item starts when all of its ranks are free (an SP group waits for its slowest member) and
  lasts its time divided by its slowest member's speed. A pipeline (``notes.pipelines``, the hydraulis
  peer's ``<TP, PP>``) idles its 1F1B bubble after its last micro-batch. After a barrier
  (``notes.barriers``) every rank waits for the slowest.
- **Lockstep rounds** (``hsdp``, the cost model's :attr:`~lightning_dcp.planning.cost_model.CostModel.rounds`):
  per shard group, the sum over its rounds of the round's slowest item; the slowest group's sum.
- **Step end**: every rank joins the gradient reduction and the optimizer step
  (``cost_model.step_overhead(world_size)``).
- **Planning**: step ``s + 1`` is planned while step ``s`` runs, so step ``s`` lasts at least that long
  (:func:`charge_planning`).

Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from lightning_dcp.planning.cost_model import CostModel, ItemCost
from lightning_dcp.planning.item_pricing import item_cost_of, item_key
from lightning_dcp.planning.plan import Pipeline, StepPlan, WorkItem
from lightning_dcp.planning.round_plan import FREE_RUNNING, RoundPlan
from lightning_dcp.planning.speeds import group_speed

__all__ = ["ItemPrices", "StepTime", "charge_planning", "run_step", "step_time"]

Interval = tuple[int, float, float, int]
"""``(rank, start, end, item index)`` of one item on one rank, seconds from the step's start."""


@dataclass(frozen=True)
class StepTime:
    """What one step costs: its compute span, each rank's busy seconds and the step-end overhead."""

    span: float
    """Seconds until the last rank finishes its last item."""
    busy: tuple[float, ...]
    """Seconds each rank computes (waiting for an SP group's other ranks is idle time)."""
    overhead: float = 0.0
    """The step end: gradient reduction and optimizer step."""
    intervals: tuple[Interval, ...] = ()
    """Each item on each of its ranks (only when asked for)."""

    @property
    def seconds(self) -> float:
        return self.span + self.overhead

    @property
    def idle(self) -> float:
        """Rank-seconds spent waiting during the compute span."""
        return math.fsum(self.span - b for b in self.busy)


class ItemPrices:
    """The cost of plan items on one cost model, memoized (the same micro-batches recur across steps and candidates)."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self._costs: dict[tuple, ItemCost] = {}
        self._overhead: dict[int, float] = {}

    def cost(self, item: WorkItem, pipeline: Pipeline | None = None) -> ItemCost:
        key = item_key(item, pipeline)
        got = self._costs.get(key)
        if got is None:
            got = self._costs[key] = item_cost_of(self.cost_model, item, pipeline)
        return got

    def times(self, step: StepPlan, speeds: Sequence[float] | None = None) -> list[float]:
        """Each item's time at its slowest member's pace, indexed like ``step.items``."""
        pipes = {p.ranks: p for p in step.notes.pipelines}
        return [self.cost(it, pipes.get(it.ranks)).total / group_speed(speeds, it.ranks) for it in step.items]

    def overhead(self, world_size: int) -> float:
        got = self._overhead.get(world_size)
        if got is None:
            got = self._overhead[world_size] = float(self.cost_model.step_overhead(world_size))
        return got


def run_step(step: StepPlan, times: Sequence[float], world_size: int, rounds: RoundPlan = FREE_RUNNING, *,
             intervals: bool = False) -> StepTime:
    """The compute part of ``step`` given each item's time (at its pace, indexed like ``step.items``): the module
    docstring's rules, no step-end overhead."""
    W = int(world_size)
    busy = [0.0] * W
    for item, t in zip(step.items, times):
        for r in item.ranks:
            busy[r] += t
    if rounds.lockstep:
        starts = rounds.starts(step, W, times)
        span = float(rounds.span(step, W, times) or 0.0)
    else:
        starts, span = _free_running(step, times, W)
    out: tuple[Interval, ...] = ()
    if intervals:
        out = tuple((r, s, s + t, i) for i, (item, s, t) in enumerate(zip(step.items, starts, times)) for r in item.ranks)
    return StepTime(span, tuple(busy), 0.0, out)


def _free_running(step: StepPlan, times: Sequence[float], W: int) -> tuple[list[float], float]:
    """Each item's start and the span: every rank's queue in list order, barriers, pipeline bubbles."""
    free = [0.0] * W
    starts = []
    barriers = frozenset(step.notes.barriers)
    pipes = {p.ranks: p for p in step.notes.pipelines}
    stage: dict[tuple[int, ...], list[float]] = {}
    for i, (item, t) in enumerate(zip(step.items, times)):
        start = max(free[r] for r in item.ranks)
        starts.append(start)
        for r in item.ranks:
            free[r] = start + t
        if item.ranks in pipes:
            stage.setdefault(item.ranks, []).append(t)
        if i + 1 in barriers:
            free = [max(free)] * W
    for ranks, ts in stage.items():  # 1F1B warm-up and cool-down: (pp - 1) slowest micro-batches, idle
        bubble = (pipes[ranks].scheme.pp - 1) * max(ts)
        for r in ranks:
            free[r] += bubble
    return starts, max(free, default=0.0)


def step_time(step: StepPlan, cost_model: CostModel, world_size: int, *, prices: ItemPrices | None = None,
              speeds: Sequence[float] | None = None, intervals: bool = False) -> StepTime:
    """What ``step`` costs on ``cost_model`` (the module docstring's rules), with the step-end overhead.

    ``prices``: a memo shared across calls (one per cost model); ``speeds``: per-rank speeds (an item runs at its
    slowest member's); ``intervals``: also each item's start and end on each of its ranks."""
    prices = ItemPrices(cost_model) if prices is None else prices
    out = run_step(step, prices.times(step, speeds), world_size, cost_model.rounds, intervals=intervals)
    return replace(out, overhead=prices.overhead(int(world_size)))


def charge_planning(step_times: Sequence[float], planning_times: Sequence[float] | None) -> list[float]:
    """Each step's charged time: ``max(step_times[s], planning_times[s + 1])``; the last step against the mean
    planning time (the plan of the step after the window overlaps it). The first plan is made before training and
    is not charged. Unchanged without planning times."""
    steps = [float(t) for t in step_times]
    if not planning_times:
        return steps
    plans = [float(x) for x in planning_times]
    if len(plans) != len(steps):
        raise ValueError(f"{len(plans)} planning times for {len(steps)} steps; give one per step of the plan")
    nxt = plans[1:] + [math.fsum(plans) / len(plans)]
    return [max(t, p) for t, p in zip(steps, nxt)]
