"""Executes a plan on a cost model, rank by rank, and reports what the run would cost.

One step at a time (:func:`~lightning_dcp.planning.step_time.step_time`): each rank runs its items in list order; an
item starts when all its ranks are free and lasts ``cost_model.item_cost(...).total`` divided by its slowest member's
speed (``rank_speeds``); under lockstep rounds (``cost_model.rounds``) the span is the rounds'. Then every rank joins
the step end, ``cost_model.step_overhead(world_size)``. Reported (exact definitions):

- ``step_times[s] = compute_spans[s] + step_overhead``.
- Planning (``planning_times``, the planner's seconds per step): the plan of step ``s + 1`` is made in a background
  thread while step ``s`` runs, so ``charged_step_times[s] = max(step_times[s], planning_times[s + 1])``; the last
  step is charged the window's mean planning time, the first plan (made before training) nothing.
  ``planning_wait = sum(charged) - sum(step_times)``. Without ``planning_times``, charged = step times.
- ``total_time = sum(charged_step_times)``; ``tokens_per_s`` = tokens of all items / ``total_time``.
- ``imbalance`` = ``sum_s sum_r (span_s - busy_{s,r}) / (W * sum_s span_s)``: the mean fraction of time a rank idles
  (the DCP paper's imbalance ratio, weighted by step duration; waiting for an SP group's other ranks is idle);
  ``step_imbalance[s]`` the same for one step.
- ``icc`` (the blog's Imbalance x Communication x Computation factors as fractions, the inverses of its ratios):
  ``idle_fraction`` (= imbalance), ``comm_fraction`` (all-to-all / busy rank-time), ``compute_efficiency`` (ideal
  compute / compute spent: layers, recompute and per-micro-batch overhead), ``allreduce_fraction`` (step overheads /
  ``total_time``), ``recompute_fraction`` (recompute / busy rank-time).
- ``ideal_time`` = sum over samples of ``item_cost([l], 1, 0).ideal`` / W: perfect balance, no communication, no
  recomputation, every sample at the model's best rates (``ItemCost.ideal``); ``fraction_of_ideal = ideal_time /
  total_time``. Memory can make it unreachable (samples that only fit with recomputation).
- ``step_bounds[s]``: :func:`~lightning_dcp.planning.bound.step_bound` of the step's samples (docs/planner.md, "The
  step bound": the gap below it is the planner's); ``bound_time`` their sum, ``fraction_of_bound = bound_time /
  total_time``, ``mean_step_bound_fraction`` the mean of ``step_bounds[s] / charged_step_times[s]``.
- ``timeline[s]``: ``(rank, start, end, item_index, kind)``, ``kind`` ``"item"`` or ``"allreduce"`` (the step end),
  relative to the step start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from lightning_dcp.planning.bound import step_bound
from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.plan import Plan, PlanError, StepPlan
from lightning_dcp.planning.checks import check_deadlock_free
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
    bound_time: float = 0.0
    fraction_of_bound: float = 0.0
    mean_step_bound_fraction: float = 0.0
    planning_times: list[float] = field(default_factory=list)
    """Empty: planning not charged."""
    charged_step_times: list[float] = field(default_factory=list)
    planning_wait: float = 0.0

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
             planning_times: Sequence[float] | None = None, max_tp_size: int | None = None) -> SimulationResult:
    """Run ``plan`` on ``cost_model`` (module docstring). ``check`` verifies the item order first.

    ``max_sp_size``: the SP cap the plan was made under, for the step bounds (default: the world).
    ``rank_speeds``: the ranks' true speeds (:mod:`~lightning_dcp.planning.speeds`; default: the cost model's,
    else all 1.0); the step bounds spread the work over their sum. ``planning_times``: one per step of ``plan``.
    ``max_tp_size``: the TP degree the plan was made under, for the step bounds (default 1: no TP).
    """
    W = plan.world_size
    speeds = check_rank_speeds(rank_speeds if rank_speeds is not None else rank_speeds_of(cost_model), W)
    prices = ItemPrices(cost_model)
    step_times, spans, step_imb, busy_all, lines = [], [], [], [], []
    totals = _Totals()
    busy_total = idle_total = overhead = 0.0
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
    ideal_compute = _ideal_compute(plan, cost_model)
    comm, rec, comp = totals.comm, totals.rec, totals.comp
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
    # step_bound keeps one StepBounder per (cost model, world size, SP cap), shared by every policy simulated on it
    bounds = [step_bound([n for it in st.items for n in it.lengths], cost_model, W, max_sp_size, speeds, max_tp_size)
              if W else 0.0
              for st in plan.steps]
    bound_time = sum(bounds)
    per_step = [b / t for b, t in zip(bounds, charged) if t > 0]
    return SimulationResult(
        planning_times=[float(x) for x in planning_times or ()], charged_step_times=charged,
        planning_wait=total - sum(step_times),
        step_bounds=bounds, bound_time=bound_time, fraction_of_bound=bound_time / total if total > 0 else 0.0,
        mean_step_bound_fraction=sum(per_step) / len(per_step) if per_step else 0.0,
        world_size=W, step_times=step_times, compute_spans=spans, step_imbalance=step_imb, total_time=total,
        tokens=totals.tokens, tokens_per_s=totals.tokens / total if total > 0 else 0.0, imbalance=icc["idle_fraction"],
        icc=icc, ideal_time=ideal_time, fraction_of_ideal=ideal_time / total if total > 0 else 0.0, busy=busy_all,
        timeline=lines if timeline else [],
    )


@dataclass
class _Totals:
    """Rank-time sums over the run's items (each item's part times its SP size), in run order."""

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


def _ideal_compute(plan: Plan, cost_model: CostModel) -> float:
    """Sum over the plan's samples of their ideal time on one device (``item_cost([l], 1, 0).ideal``)."""
    ideal_compute = 0.0
    cache: dict[int, float] = {}
    for step in plan.steps:
        for item in step.items:
            for n in item.lengths:
                if n not in cache:
                    cache[n] = cost_model.item_cost([n], 1, 0).ideal
                ideal_compute += cache[n]
    return ideal_compute
