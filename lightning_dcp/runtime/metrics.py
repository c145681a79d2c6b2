"""Per-step runtime metrics of a DCP step, gathered once per step (never inside the micro-batch loop).

Per rank, the executor measures ``busy`` (wall seconds inside its micro-batch loop, forward +
backward of all its items), its real tokens and micro-batches. One all-gather after the loop
(the point where every rank waits for the slowest before the gradient reduction) brings all
ranks' numbers to every rank; from them:

- ``idle_i = max_j busy_j - busy_i``: what rank ``i`` waits at the gradient reduction;
- imbalance ratio ``= mean_i idle_i / max_j busy_j`` (the DCP paper's per-iteration imbalance,
  0 = perfectly balanced);
- tokens/s ``=`` global real tokens / step seconds (wall time between consecutive step starts,
  data loading and optimizer included);
- from the step plan: SP sizes used, micro-batches per rank, recompute counts;
- ``step_bound_fraction = step_bound_s / step_s``, where ``step_bound_s`` is
  :func:`lightning_dcp.planning.bound.plan_step_bound` of the step plan on the planner's cost
  model (the step's achievable bound; NaN, not logged, when the strategy gives none).

:class:`StepMetricsTracker` keeps torchmetrics running aggregates over the epoch (computed
without any distributed sync: every rank holds the same gathered values).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from lightning_dcp.planning.plan import StepPlan
from lightning_dcp.runtime.row import StepRow

__all__ = ["CalibrationMetrics", "StepMetrics", "StepMetricsTracker", "format_plan", "log_step_metrics", "plan_summary", "step_metrics"]


@dataclass
class CalibrationMetrics:
    """Predicted vs measured time of one step (:mod:`lightning_dcp.runtime.calibration`): the slowest rank's
    summed item seconds under the factors the step was planned with, under the uncalibrated cost
    model, and as measured; the rank speeds and refits so far."""

    predicted_s: float
    base_predicted_s: float
    measured_s: float
    rank_speeds: list[float] = field(default_factory=list)
    refits: int = 0
    overhead_s: float = 0.0
    """Predicted seconds of the step outside the micro-batch loop (the measured overhead once refitted)."""

    @property
    def predicted_step_s(self) -> float:
        """The predicted step: the slowest rank's items and the step overhead."""
        return self.predicted_s + self.overhead_s

    @property
    def error(self) -> float:
        """``(measured - predicted) / measured`` (positive: the plan expected the step to be faster)."""
        return (self.measured_s - self.predicted_s) / self.measured_s if self.measured_s > 0 else 0.0

    def as_log_dict(self) -> dict[str, float]:
        out = {"dcp/predicted_s": self.predicted_s, "dcp/measured_s": self.measured_s,
               "dcp/predicted_step_s": self.predicted_step_s,
               "dcp/prediction_error": self.error, "dcp/calibration_refits": float(self.refits)}
        if self.rank_speeds:
            out["dcp/rank_speed_min"] = min(self.rank_speeds)
            if len(self.rank_speeds) <= 64:
                out.update({f"dcp/rank_speed/{r}": s for r, s in enumerate(self.rank_speeds)})
        return out


@dataclass
class StepMetrics:
    """What one DCP step did, for every rank (lists are indexed by global rank)."""

    epoch: int
    step: int
    busy_s: list[float]
    idle_s: list[float]
    tokens: list[int]
    microbatches: list[int]
    step_s: float
    imbalance: float
    global_tokens: int
    tokens_per_s: float
    sp_sizes: list[int] = field(default_factory=list)
    recompute: list[int] = field(default_factory=list)
    loss: float = float("nan")
    step_bound_s: float = float("nan")
    """The plan's achievable bound (cost-model seconds, all-reduce included); NaN when unknown."""
    calibration: CalibrationMetrics | None = None
    """Predicted vs measured time and rank speeds (``None`` with ``calibration="off"``)."""
    dummy_rounds: int = 0
    """Rank-rounds without an item (lockstep rounds, ``sharding="hsdp"``): each ran only its collectives."""
    dummy_tokens: int = 0
    """Tokens the dummy rounds ran: 0, they run no sample (:mod:`lightning_dcp.runtime.sharding.dummy`)."""

    @property
    def step_bound_fraction(self) -> float:
        """``step_bound_s / step_s`` (NaN when either is unknown)."""
        return self.step_bound_s / self.step_s if self.step_s > 0 else float("nan")

    def as_log_dict(self) -> dict[str, float]:
        """Scalars logged through Lightning (``dcp/...``); ``dcp/step_bound_fraction`` only when the bound is known."""
        out = {
            "dcp/imbalance": self.imbalance,
            "dcp/tokens_per_s": self.tokens_per_s,
            "dcp/busy_s_max": max(self.busy_s),
            "dcp/idle_s_mean": sum(self.idle_s) / len(self.idle_s),
            "dcp/step_s": self.step_s,
            "dcp/microbatches_max": float(max(self.microbatches)),
            "dcp/sp_size_max": float(max(self.sp_sizes, default=1)),
            "dcp/num_sp_sizes": float(len(self.sp_sizes)),
            "dcp/dummy_rounds": float(self.dummy_rounds),
            "dcp/dummy_tokens": float(self.dummy_tokens),
        }
        if self.step_bound_s == self.step_bound_s:  # not NaN
            out["dcp/step_bound_fraction"] = self.step_bound_fraction
        if self.calibration is not None:
            out.update(self.calibration.as_log_dict())
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_summary(plan: StepPlan, world_size: int) -> dict[str, Any]:
    """SP sizes, micro-batches per rank and recompute counts of a step plan."""
    per_rank = [0] * world_size
    sizes, recompute = set(), set()
    for item in plan.items:
        sizes.add(item.sp_size)
        recompute.add(item.recompute)
        for r in item.ranks:
            per_rank[r] += 1
    return {"sp_sizes": sorted(sizes), "microbatches": per_rank, "recompute": sorted(recompute),
            "items": len(plan.items)}


def format_plan(plan: StepPlan, world_size: int) -> str:
    """One line: ``items=6 sp={1:4, 2:1} mb/rank=[3,2] recompute=[0,2]``."""
    counts: dict[int, int] = {}
    for item in plan.items:
        counts[item.sp_size] = counts.get(item.sp_size, 0) + 1
    s = plan_summary(plan, world_size)
    sp = ", ".join(f"{k}:{v}" for k, v in sorted(counts.items()))
    return f"items={s['items']} sp={{{sp}}} mb/rank={s['microbatches']} recompute={s['recompute']}"


def step_metrics(rows: Sequence[StepRow], *, epoch: int, step: int, step_s: float, plan: StepPlan,
                 global_tokens: int, loss: float = float("nan"), step_bound_s: float = float("nan"),
                 dummy_rounds: int = 0) -> StepMetrics:
    """Build :class:`StepMetrics` from the step-end rows (one :class:`~lightning_dcp.runtime.row.StepRow` per rank).

    ``loss``: the step's global loss; ``step_bound_s``: :func:`lightning_dcp.planning.bound.plan_step_bound`
    of ``plan`` (optional); ``dummy_rounds``: the plan's rank-rounds without an item (lockstep rounds).
    """
    busy = [float(r.busy_s) for r in rows]
    world = len(busy)
    top = max(busy) if busy else 0.0
    idle = [top - b for b in busy]
    imbalance = (sum(idle) / world / top) if top > 0 else 0.0
    summary = plan_summary(plan, world)
    step_s = step_s if step_s > 0 else top
    return StepMetrics(
        epoch=epoch, step=step, busy_s=busy, idle_s=idle, tokens=[int(r.tokens) for r in rows],
        microbatches=[int(r.items) for r in rows], step_s=step_s, imbalance=imbalance,
        global_tokens=int(global_tokens), tokens_per_s=(global_tokens / step_s) if step_s > 0 else 0.0,
        sp_sizes=summary["sp_sizes"], recompute=summary["recompute"], loss=float(loss),
        step_bound_s=float(step_bound_s), dummy_rounds=int(dummy_rounds),
    )


class StepMetricsTracker:
    """Running epoch aggregates (torchmetrics, no distributed sync: values are already global)."""

    def __init__(self) -> None:
        from torchmetrics import MaxMetric, MeanMetric, SumMetric

        kw = dict(sync_on_compute=False)
        self.imbalance = MeanMetric(**kw)
        self.tokens_per_s = MeanMetric(**kw)
        self.busy_max = MaxMetric(**kw)
        self.steps = SumMetric(**kw)
        self.history: list[StepMetrics] = []
        self.keep_history = 10_000
        self._epoch: int | None = None

    def record(self, m: StepMetrics) -> None:
        """Add one step's metrics; a step of a new epoch first resets the epoch aggregates."""
        if self._epoch != m.epoch:
            self.reset()
            self._epoch = m.epoch
        self.update(m)

    def update(self, m: StepMetrics) -> None:
        self.imbalance.update(m.imbalance)
        self.tokens_per_s.update(m.tokens_per_s)
        self.busy_max.update(max(m.busy_s))
        self.steps.update(1.0)
        if len(self.history) < self.keep_history:
            self.history.append(m)

    def compute(self) -> dict[str, float]:
        if int(self.steps.compute()) == 0:
            return {}
        return {
            "dcp/epoch_imbalance": float(self.imbalance.compute()),
            "dcp/epoch_tokens_per_s": float(self.tokens_per_s.compute()),
            "dcp/epoch_busy_s_max": float(self.busy_max.compute()),
        }

    def reset(self) -> None:
        for m in (self.imbalance, self.tokens_per_s, self.busy_max, self.steps):
            m.reset()

    def mean_imbalance(self, skip: int = 0) -> float:
        vals = [m.imbalance for m in self.history[skip:]]
        return sum(vals) / len(vals) if vals else float("nan")


def log_step_metrics(module: Any, m: StepMetrics, oom_replans: int) -> None:
    """Log ``m`` (and ``dcp/oom_replans``) through ``module.log`` on step; without a logger only the
    progress bar's ``dcp/imbalance`` and ``dcp/oom_replans`` (for ``callback_metrics``)."""
    if module is None or getattr(module, "_trainer", None) is None:
        return
    has_logger = bool(module.trainer.loggers)
    values = dict(m.as_log_dict(), **{"dcp/oom_replans": float(oom_replans)})
    for key, value in values.items():
        if has_logger or key in ("dcp/imbalance", "dcp/oom_replans"):
            module.log(key, value, on_step=True, on_epoch=False, prog_bar=key == "dcp/imbalance",
                       logger=has_logger, batch_size=1, sync_dist=False)
