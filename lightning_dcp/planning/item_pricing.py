"""What one plan item costs, whatever parallelism runs it: the simulator's, the plan check's and the peers' pricing.

Three kinds of item (:func:`item_cost_of`): an SP group's micro-batch (Ulysses, or a ring when ``WorkItem.ring > 1``:
:meth:`~lightning_dcp.planning.cost_model.CostModel.ring_cost`: ``item_cost``, or on a model that prices no ring
the generic estimate of a peer's pure ring; with tensor parallelism inside, ``WorkItem.tp > 1``:
:meth:`~lightning_dcp.planning.cost_model.CostModel.tp_cost`); and a micro-batch of a pipeline the step
declares (``StepPlan.notes.pipelines``, hydraulis' ``<TP, PP>``: :func:`~lightning_dcp.planning.parallel_costs.scheme_cost`).
Pure Python: no torch.
"""

from __future__ import annotations

from lightning_dcp.planning.cost_model import CostModel, ItemCost
from lightning_dcp.planning.parallel_costs import scheme_cost, scheme_memory
from lightning_dcp.planning.plan import Pipeline, WorkItem

__all__ = ["item_cost_of", "item_key", "item_memory_of"]


def item_cost_of(cost_model: CostModel, item: WorkItem, pipeline: Pipeline | None = None) -> ItemCost:
    """Cost of ``item``: a pipeline micro-batch's stage time, or an SP group's micro-batch (ring or not)."""
    if pipeline is not None:
        return scheme_cost(cost_model, item.lengths, pipeline.scheme, item.recompute)
    if item.tp > 1:
        return cost_model.tp_cost(item.lengths, item.sp_size, item.recompute, item.ring, item.tp)
    return cost_model.ring_cost(item.lengths, item.sp_size, item.recompute, item.ring)


def item_memory_of(cost_model: CostModel, item: WorkItem, pipeline: Pipeline | None = None) -> float:
    """Peak bytes per rank of ``item`` (the kinds of :func:`item_cost_of`)."""
    if pipeline is not None:
        return scheme_memory(cost_model, item.tokens, pipeline.scheme, item.recompute)
    if item.tp > 1:
        return cost_model.tp_memory(item.lengths, item.sp_size, item.recompute, item.ring, item.tp)
    return cost_model.ring_memory(item.lengths, item.sp_size, item.recompute, item.ring)


def item_key(item: WorkItem, pipeline: Pipeline | None = None) -> tuple:
    """Cache key of an item's cost: ``(lengths, sp, recompute)`` for plain SP items, with the ring degree or the
    pipeline scheme appended otherwise."""
    if pipeline is not None:
        return (item.lengths, item.sp_size, item.recompute, "pp", pipeline.scheme.tp, pipeline.scheme.pp)
    if item.tp > 1:
        return (item.lengths, item.sp_size, item.recompute, "tp", item.ring, item.tp)
    if item.ring > 1:
        return (item.lengths, item.sp_size, item.recompute, "ring", item.ring)
    return (item.lengths, item.sp_size, item.recompute)
