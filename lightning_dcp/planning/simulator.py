"""Executes a plan on a cost model, rank by rank, and reports what the run would cost.

Semantics (one step at a time): each rank runs its items in list order; an item starts when
*all* its ranks are free (finished their previous items) and lasts ``cost_model.item_cost(...)
.total`` on each of them (divided by the slowest member's speed, given per-rank speeds: ``rank_speeds``). The step's compute ends when the last rank finishes; then every rank
joins the gradient all-reduce + optimizer step, ``cost_model.step_overhead(world_size)``. Under a
mode with lockstep rounds (``cost_model.rounds``, ``sharding="hsdp"``) the span is the rounds' instead:
per shard group the sum over its rounds of the round's slowest item (a rank without an item runs a
dummy round, which computes nothing: the round lasts max(items, dummies) plus its collectives, which
the cost model's item times include), the slowest group.

Reported (all exact definitions):

- ``step_times[s]`` = ``compute_span[s] + step_overhead``: the step's execution.
- Planning (given ``planning_times``, the seconds the planner took for each step): plans are made
  one step ahead in a background thread, so the plan of step ``s + 1`` is made while step ``s``
  runs and is hidden only while it takes no longer: ``charged_step_times[s] = max(step_times[s],
  planning_times[s + 1])``. The last step of the window overlaps the plan of the step after it,
  which the window does not have: it is charged the window's mean planning time. The first plan is
  made before training starts, once per run, and is not charged. ``planning_wait`` = the sum of
  ``charged - step_times``: the time the GPUs wait on the planner. Without ``planning_times``,
  charged = step times.
- ``total_time`` = the sum of ``charged_step_times``.
- ``tokens_per_s`` = tokens of all items / ``total_time``.
- ``imbalance`` = idle rank-time / available rank-time over the compute spans of all steps:
  ``sum_s sum_r (span_s - busy_{s,r}) / (W * sum_s span_s)`` — the mean fraction of time a rank
  idles (the DCP paper's imbalance ratio), weighted by step duration; ``step_imbalance[s]`` is
  the same for one step. A rank's busy time is the sum of its items' durations; waiting for
  its group's other ranks counts as idle.
- ``icc`` (the blog's Imbalance x Communication x Computation factors, stated as fractions so
  they compose; the blog's own ratios are their inverses):
  ``idle_fraction`` (= imbalance), ``comm_fraction`` (all-to-all rank-time / busy rank-time),
  ``compute_efficiency`` (ideal compute / compute actually spent: layers, recompute and per
  micro-batch overhead, all in rank-time), ``allreduce_fraction`` (step overheads /
  ``total_time``), and ``recompute_fraction`` (recompute rank-time / busy rank-time).
- ``ideal_time`` = sum over samples of ``item_cost([l], 1, 0).ideal`` / W: the issue's bound,
  "perfect balance, no communication, no recomputation": all of the samples' forward + backward
  compute at the model's best achievable rates (GEMMs at maximum efficiency without the
  small-GEMM penalty, attention at maximum efficiency, the element-wise passes, the head's
  per-token work), with no all-to-all, no recomputation, no per-micro-batch constant and no
  all-reduce, spread evenly over the W ranks (see ``ItemCost.ideal``);
  ``fraction_of_ideal = ideal_time / total_time``. Memory can make it unreachable: samples that
  only fit with recomputation pay it in every plan.
- ``step_bounds[s]``: the step's achievable bound (:func:`~lightning_dcp.planning.bound.step_bound`
  of the step's samples: ``max(best-rate work / W, heaviest sample's best time) +
  step_overhead``); ``bound_time`` = their sum; ``fraction_of_bound = bound_time / total_time``
  (time-weighted) and ``mean_step_bound_fraction`` = the mean over steps of ``step_bounds[s] /
  step_times[s]``. Unlike the ideal, the bound honours memory (recompute a sample cannot avoid,
  the SP sizes that hold it) and the longest sample, so 100% is reachable in principle and the
  gap below it is the planner's.
- ``timeline[s]``: ``(rank, start, end, item_index, kind)`` with ``kind`` ``"item"`` for
  micro-batches and ``"allreduce"`` for the step end, times relative to the step start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from lightning_dcp.planning.bound import step_bound
from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.plan import Plan, PlanError, StepPlan, check_deadlock_free
from lightning_dcp.planning.speeds import check_rank_speeds, group_speed, rank_speeds_of
from lightning_dcp.planning.step_time import ItemPrices, charge_planning, step_time


@dataclass
class SimulationResult:
    """What :func:`simulate` measured (see the module docstring for the exact definitions)."""

    world_size: int
    step_times: list[float]
    compute_spans: list[float]
    step_imbalance: list[float]
    total_time: float
    tokens: int
    tokens_per_s: float
    imbalance: float
    icc: dict[str, float]
    ideal_time: float
    fraction_of_ideal: float
    busy: list[list[float]] = field(default_factory=list)
    """``busy[s][r]``: seconds rank ``r`` computed in step ``s``."""
    timeline: list[list[tuple[int, float, float, int, str]]] = field(default_factory=list)
    step_bounds: list[float] = field(default_factory=list)
    """``step_bounds[s]``: step ``s``'s achievable bound (seconds, all-reduce included)."""
    bound_time: float = 0.0
    fraction_of_bound: float = 0.0
    mean_step_bound_fraction: float = 0.0
    planning_times: list[float] = field(default_factory=list)
    """``planning_times[s]``: seconds the planner took for step ``s`` (empty: planning not charged)."""
    charged_step_times: list[float] = field(default_factory=list)
    """``charged_step_times[s]``: ``max(step_times[s], planning time of step s + 1)`` (see the module docstring)."""
    planning_wait: float = 0.0
    """Seconds the run waits on the planner: ``sum(charged_step_times) - sum(step_times)``."""

    def summary(self) -> dict[str, Any]:
        """The scalar figures, JSON-able."""
        return {
            "steps": len(self.step_times), "total_time": self.total_time, "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s, "imbalance": self.imbalance, "ideal_time": self.ideal_time,
            "fraction_of_ideal": self.fraction_of_ideal, "bound_time": self.bound_time,
            "fraction_of_bound": self.fraction_of_bound, "mean_step_bound_fraction": self.mean_step_bound_fraction,
            "planning_s": sum(self.planning_times), "planning_wait_s": self.planning_wait, **{f"icc_{k}": v for k, v in self.icc.items()},
        }


def simulate(plan: Plan, cost_model: CostModel, *, timeline: bool = True, check: bool = True,
             max_sp_size: int | None = None, rank_speeds: Sequence[float] | None = None,
             planning_times: Sequence[float] | None = None) -> SimulationResult:
    """Run ``plan`` on ``cost_model`` (see module docstring). ``check`` verifies the item order first.

    ``planning_times``: the planner's seconds per step (one per step of ``plan``): a step lasts at
    least as long as the next step's planning (see the module docstring).

    ``max_sp_size``: the SP cap the plan was made under, for the step bounds (default: the
    world; a smaller cap only raises the bound).
    ``rank_speeds``: the ranks' true speeds (:mod:`~lightning_dcp.planning.speeds`): an item on
    ranks ``R`` lasts its cost-model time divided by ``min(speed[r] for r in R)`` (its time parts
    likewise, for the ICC fractions); the step bounds spread the work over the speeds' sum.
    Default: the cost model's ``rank_speeds``, else all 1.0.
    """
    W = plan.world_size
    speeds = check_rank_speeds(rank_speeds if rank_speeds is not None else rank_speeds_of(cost_model), W)
    prices = ItemPrices(cost_model)
    step_times, spans, step_imb, busy_all, lines = [], [], [], [], []
    totals = _Totals()
    busy_total = 0.0
    idle_total = 0.0
    overhead = 0.0
    for s_idx, step in enumerate(plan.steps):
        if check:
            try:
                check_deadlock_free(step, W)
            except PlanError as err:
                raise PlanError(f"step {s_idx}: {err}") from None
        st = step_time(step, cost_model, W, prices=prices, speeds=speeds, intervals=timeline)
        _add_totals(step, prices, speeds, totals)
        overhead, span = st.overhead, st.span
        idle_total += st.idle
        busy_total += sum(st.busy)
        spans.append(span)
        step_imb.append(st.idle / (W * span) if span > 0 else 0.0)
        step_times.append(st.seconds)
        busy_all.append(list(st.busy))
        if timeline:
            line = [(r, a, b, i, "item") for r, a, b, i in st.intervals]
            line.extend((r, span, span + overhead, -1, "allreduce") for r in range(W))
            lines.append(line)
    ideal_compute = _ideal_compute(plan, cost_model, {})
    tokens, comm, rec, comp = totals.tokens, totals.comm, totals.rec, totals.comp
    charged = charge_planning(step_times, planning_times)
    total = sum(charged)
    span_total = sum(spans)
    ideal_time = ideal_compute / W if W else 0.0
    icc = {
        "idle_fraction": idle_total / (W * span_total) if span_total > 0 else 0.0,
        "comm_fraction": comm / busy_total if busy_total > 0 else 0.0,
        "compute_efficiency": ideal_compute / (comp + rec) if comp + rec > 0 else 1.0,
        "recompute_fraction": rec / busy_total if busy_total > 0 else 0.0,
        "allreduce_fraction": overhead * len(step_times) / total if total > 0 else 0.0,
    }
    # step_bound keeps one StepBounder per (cost model, world size, SP cap): the simulator, the
    # simulate command's run bound and every policy simulated on this cost model share it
    bounds = [step_bound([n for it in st.items for n in it.lengths], cost_model, W, max_sp_size, speeds) if W else 0.0
              for st in plan.steps]
    bound_time = sum(bounds)
    per_step = [b / t for b, t in zip(bounds, charged) if t > 0]
    return SimulationResult(
        planning_times=[float(x) for x in planning_times or ()], charged_step_times=charged,
        planning_wait=total - sum(step_times),
        step_bounds=bounds, bound_time=bound_time, fraction_of_bound=bound_time / total if total > 0 else 0.0,
        mean_step_bound_fraction=sum(per_step) / len(per_step) if per_step else 0.0,
        world_size=W, step_times=step_times, compute_spans=spans, step_imbalance=step_imb, total_time=total,
        tokens=tokens, tokens_per_s=tokens / total if total > 0 else 0.0, imbalance=icc["idle_fraction"], icc=icc,
        ideal_time=ideal_time, fraction_of_ideal=ideal_time / total if total > 0 else 0.0, busy=busy_all,
        timeline=lines if timeline else [],
    )


@dataclass
class _Totals:
    """Rank-time sums over every item of the run (each item's part times its SP size), in run order."""

    tokens: int = 0
    comm: float = 0.0
    rec: float = 0.0
    comp: float = 0.0


def _add_totals(step: StepPlan, prices: ItemPrices, speeds: Sequence[float] | None, totals: _Totals) -> None:
    """Add the step's items' rank-time parts (at their pace) to ``totals``."""
    pipes = {p.ranks: p for p in step.notes.pipelines}
    for item in step.items:
        cost = prices.cost(item, pipes.get(item.ranks))
        scale = item.sp_size / group_speed(speeds, item.ranks)
        totals.comm += cost.comm * scale
        totals.rec += cost.recompute * scale
        totals.comp += (cost.compute + cost.overhead) * scale
        totals.tokens += item.tokens


def _ideal_compute(plan: Plan, cost_model: CostModel, cache: dict) -> float:
    """Sum over the plan's samples of their ideal time on one device (``item_cost([l], 1, 0).ideal``)."""
    ideal_compute = 0.0
    for step in plan.steps:
        for item in step.items:
            for n in item.lengths:
                c = cache.get(("ideal", n))
                if c is None:
                    c = cost_model.item_cost([n], 1, 0).ideal
                    cache[("ideal", n)] = c
                ideal_compute += c
    return ideal_compute
