"""Pipeline parallelism, priced only: what the run's global batches would cost on ``<TP, PP>`` pipelines.

No runtime runs pipelines; this estimate says for which model and world they would beat a plan (``lightning-dcp
simulate --pp``). For a PP degree ``pp`` (a power of two dividing the layers), every TP degree ``tp`` (a power of two
dividing a node's GPUs and the heads) whose pipelines of ``tp x pp`` ranks tile the world gives one homogeneous
strategy: ``world / (tp pp)`` identical pipelines, each ``pp`` stages of ``L / pp`` layers split ``tp`` ways
(:mod:`~lightning_dcp.planning.parallel_costs`: the stage time, its TP all-reduces and pipeline sends, the 1F1B
bubble, Hydraulis' state sharding: 16-bit weights and gradients split over the pipeline, the fp32 states over the
world). Each global batch is assigned as the ``hydraulis`` peer assigns (its randomized greedy dispatch over the
pipelines and balanced packing in each, recomputing the fewest layers a micro-batch needs), then priced by the
simulator's rules (:func:`~lightning_dcp.planning.step_time.step_time`: a pipeline's micro-batches plus its bubble)
with the pipelines' step end (:func:`~lightning_dcp.planning.parallel_costs.pipeline_step_overhead`). The fastest
``tp`` is the PP degree's estimate.

The pipelines are priced on the cost model of one replica (a sharding view's base): pipeline stages shard the
states themselves. Pure Python + numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_dcp.planning.cost_model import CostModel, DelegatingCostModel
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.parallel_costs import Scheme, pipeline_step_overhead, scheme_capacities
from lightning_dcp.planning.peers.hydraulis import HydraulisPolicy
from lightning_dcp.planning.step_time import ItemPrices, step_time
from lightning_dcp.planning.view import CostView

__all__ = ["PipelineEstimate", "estimate_pipelines", "pipeline_degrees", "replica_cost_model"]


@dataclass(frozen=True)
class PipelineEstimate:
    """The run's global batches on ``pipelines`` pipelines of ``scheme``."""

    scheme: Scheme
    pipelines: int
    step_times: tuple[float, ...]
    """Each global batch's step: the slowest pipeline (micro-batches and bubble) plus the step end."""
    tokens: int
    idle: float
    """Share of rank-time idle in the steps' compute spans (bubbles and imbalance)."""

    @property
    def pp(self) -> int:
        return self.scheme.pp

    @property
    def total_time(self) -> float:
        return sum(self.step_times)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_time if self.total_time > 0 else 0.0


def replica_cost_model(cost_model: CostModel) -> CostModel:
    """The cost model of one full replica under ``cost_model``'s sharding views (``hsdp``'s shard groups, a
    calibration): the one whose model states pipeline stages split."""
    while isinstance(cost_model, DelegatingCostModel) and not hasattr(cost_model, "full_state_parts"):
        cost_model = cost_model.base
    return cost_model


def pipeline_degrees(cost_model: CostModel, world_size: int, max_pp: int = 16) -> list[int]:
    """PP degrees to price: powers of two from 2 to ``max_pp`` that divide the layers, at most the world."""
    out, pp = [], 2
    while pp <= min(int(max_pp), int(world_size)):
        if cost_model.num_layers % pp == 0:
            out.append(pp)
        pp *= 2
    return out


def _tp_degrees(cost_model: CostModel) -> list[int]:
    node = int(cost_model.gpus_per_node or 1)
    out, tp = [], 1
    while tp <= node:
        if node % tp == 0 and cost_model.num_heads % tp == 0:
            out.append(tp)
        tp *= 2
    return out


def estimate_pipelines(batches: Sequence[Sequence[int]], cost_model: CostModel, world_size: int, pp: int, *,
                       seed: int = 0) -> PipelineEstimate | None:
    """The fastest homogeneous ``<tp, pp>`` strategy for ``batches`` (each a global batch's lengths; module
    docstring), or None when no TP degree's pipelines tile the world and hold the longest sample."""
    base = replica_cost_model(cost_model)
    W = int(world_size)
    longest = max((max(b) for b in batches if b), default=0)
    tokens = sum(sum(b) for b in batches)
    schemes = [Scheme(tp, int(pp)) for tp in _tp_degrees(base)]
    schemes = [s for s in schemes if base.num_layers % s.pp == 0 and W % s.size == 0
               and scheme_capacities(base, s)[-1] >= longest]
    if not schemes:
        return None
    try:  # Hydraulis' tables for every scheme up to the largest pipeline: its dispatch and packing
        policy = HydraulisPolicy(W, CostView(base, max(s.size for s in schemes), world_size=W, ring=False), seed=seed)
    except PlanningError:
        return None
    best: PipelineEstimate | None = None
    for scheme in schemes:
        if scheme not in policy.table.schemes or policy.table.max_len(scheme) < longest:
            continue
        policy.strategies = [((scheme, W // scheme.size),)]
        prices = ItemPrices(base)
        steps, idle, span_total = [], 0.0, 0.0
        end = pipeline_step_overhead(base, scheme, W)
        for k, lengths in enumerate(batches):
            plan = policy.plan_with("homogeneous", list(range(len(lengths))), list(lengths), k)[0]
            st = step_time(plan, base, W, prices=prices)
            steps.append(st.span + end)
            idle += st.idle
            span_total += st.span
        got = PipelineEstimate(scheme, W // scheme.size, tuple(steps), tokens,
                               idle / (W * span_total) if span_total > 0 else 0.0)
        if best is None or got.total_time < best.total_time:
            best = got
    return best
