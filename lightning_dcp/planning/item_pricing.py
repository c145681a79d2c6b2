"""What one plan item costs, whatever parallelism runs it: the simulator's and the peer policies' pricing.

Three kinds of item (:func:`item_cost_of`):

- a **sequence-parallel group** (Ulysses): ``cost_model.item_cost(lengths, sp, recompute)``;
- a **ring** item (``WorkItem.ring > 1``: ring attention over ``ring`` Ulysses subgroups, as
  Megatron-Core's context parallel runs it): ``cost_model.item_cost(lengths, sp, recompute,
  ring=ring)`` when the cost model takes ``ring=`` (the interface the SP-of-any-size work adds to
  the cost models); otherwise :func:`ring_cost_fallback` prices it here;
- a micro-batch of a **pipeline** the step declares (``StepPlan.notes.pipelines``, the
  ``hydraulis`` policy's ``<TP, PP>`` pipelines): :func:`~lightning_dcp.planning.parallel_costs.scheme_cost`.

FALLBACK (until the cost models take ``ring=``): :func:`ring_cost_fallback` prices ring attention
over ``p`` ranks as the per-rank ``1/p`` share of the micro-batch's work at SP 1 (its sample terms
divided by ``p``, its per-micro-batch constants not) plus the *exposed* ring point-to-point time.
Each layer's forward passes every rank's key/value block around the ring, ``p - 1`` steps of
``2 * (T / p) * h_kv * dtype_bytes`` bytes (``h_kv``: the key/value width, smaller under
grouped-query attention); the backward passes keys/values and their gradients, twice that; each
step overlaps with that step's attention compute (as TransformerEngine's ring attention does), so
only ``max(0, p2p - attention)`` is charged, forward and backward, and once more per recomputed
layer. Bandwidth: the all-to-all bus bandwidth inside a node, the inter-node one when the ring
spans nodes (every step then crosses a node boundary somewhere). Without a model and hardware
description the P2P volume is scaled from the same micro-batch's Ulysses all-to-all time at the
largest SP size the heads allow, not overlapped.

Pure Python: no torch.
"""

from __future__ import annotations

from typing import Any, Sequence

from lightning_dcp.planning.cost_model import CostModel, ItemCost
from lightning_dcp.planning.parallel_costs import scheme_cost, scheme_memory
from lightning_dcp.planning.plan import Pipeline, WorkItem
from lightning_dcp.planning.ring_support import ring_memory, supports_ring

__all__ = ["supports_ring", "ring_cost", "ring_memory", "ring_cost_fallback", "item_cost_of", "item_memory_of",
           "item_key"]

def ring_cost(cost_model: CostModel, lengths: Sequence[int], sp: int, recompute: int, ring: int) -> ItemCost:
    """Cost of a ring item: the cost model's own ring pricing when it has one, else :func:`ring_cost_fallback`."""
    if supports_ring(cost_model):
        return cost_model.item_cost(lengths, sp, recompute, ring=ring)  # type: ignore[call-arg]
    return ring_cost_fallback(cost_model, lengths, sp, recompute, ring)


def _constants(cost_model: CostModel, recompute: int) -> ItemCost:
    try:
        return cost_model.item_cost([], 1, recompute)
    except (ValueError, ZeroDivisionError, IndexError):
        return ItemCost(0.0, 0.0, 0.0, 0.0, 0.0)


def ring_cost_fallback(cost_model: CostModel, lengths: Sequence[int], sp: int, recompute: int, ring: int) -> ItemCost:
    """Ring attention over ``sp`` ranks priced here (see the module docstring; FALLBACK until the cost
    models take ``ring=``). ``ring`` must equal ``sp`` (pure ring, Ulysses size 1) or be 1."""
    p = int(sp)
    if ring <= 1 or p <= 1:
        return cost_model.item_cost(lengths, p, recompute)
    if ring != p:
        raise ValueError(f"the ring fallback prices pure ring attention (ring == sp); got ring {ring} on {sp} ranks")
    one = cost_model.item_cost(lengths, 1, recompute)
    c0 = _constants(cost_model, recompute)

    def share(a: float, b: float) -> float:
        return b + (a - b) / p

    comm = _ring_p2p(cost_model, lengths, p, recompute)
    return ItemCost(compute=share(one.compute, c0.compute), recompute=share(one.recompute, c0.recompute), comm=comm,
                    overhead=share(one.overhead, c0.overhead), ideal=one.ideal / p)


def _ring_p2p(cost_model: Any, lengths: Sequence[int], p: int, recompute: int) -> float:
    """Exposed ring P2P time of the item over ``p`` ranks, all layers (see the module docstring)."""
    L = cost_model.num_layers
    tokens = sum(lengths)
    attn = getattr(cost_model, "_attn_s_per_work", None)
    if all(hasattr(cost_model, a) for a in ("model", "hardware", "dtype_bytes")) and attn is not None:
        hw, m = cost_model.hardware, cost_model.model
        intra = p <= hw.gpus_per_node
        bw = hw.a2a_bw_intra if intra else hw.a2a_bw_inter
        lat = hw.collective_latency if intra else hw.collective_latency_inter
        kv = m.num_kv_heads or m.num_heads
        h_kv = m.hidden_size * kv / m.num_heads
        step_bytes = 2.0 * (tokens / p) * h_kv * cost_model.dtype_bytes
        fwd_p2p = m.blocks_per_layer * (p - 1) * (step_bytes / bw + lat)
        work = sum(cost_model.attention_work(n) for n in lengths)
        fwd_attn = attn * work / p
        bwd_attn = 2.5 * fwd_attn  # FlashAttention's backward, as the analytic model charges it
        exp_f = max(0.0, fwd_p2p - fwd_attn)
        exp_b = max(0.0, 2.0 * fwd_p2p - bwd_attn)
        return L * (exp_f + exp_b) + recompute * exp_f
    q = max([s for s in cost_model.sp_sizes(p) if s <= p] or [1])
    if q <= 1:
        return 0.0
    ulysses = cost_model.item_cost(lengths, q, recompute).comm
    # per-rank bytes: ring 2 (p-1)/p T h (keys and values), Ulysses 4 (q-1)/q (T/q) h
    return ulysses * (2.0 * (p - 1) / p) / (4.0 * (q - 1) / q / q)


def item_cost_of(cost_model: CostModel, item: WorkItem, pipeline: Pipeline | None = None) -> ItemCost:
    """Cost of ``item``: a pipeline micro-batch's stage time, a ring item, or an SP group's micro-batch."""
    if pipeline is not None:
        return scheme_cost(cost_model, item.lengths, pipeline.scheme, item.recompute)
    if item.ring > 1:
        return ring_cost(cost_model, item.lengths, item.sp_size, item.recompute, item.ring)
    return cost_model.item_cost(item.lengths, item.sp_size, item.recompute)


def item_memory_of(cost_model: CostModel, item: WorkItem, pipeline: Pipeline | None = None) -> float:
    """Peak bytes per rank of ``item`` (see :func:`item_cost_of` for the three kinds)."""
    if pipeline is not None:
        return scheme_memory(cost_model, item.tokens, pipeline.scheme, item.recompute)
    if item.ring > 1:
        return ring_memory(cost_model, item.lengths, item.sp_size, item.recompute, item.ring)
    return cost_model.item_memory(item.lengths, item.sp_size, item.recompute)


def item_key(item: WorkItem, pipeline: Pipeline | None = None) -> tuple:
    """Cache key of an item's cost: ``(lengths, sp, recompute)`` for plain SP items (the simulator's
    historic key), with the ring degree or the pipeline scheme appended otherwise."""
    if pipeline is not None:
        return (item.lengths, item.sp_size, item.recompute, "pp", pipeline.scheme.tp, pipeline.scheme.pp)
    if item.ring > 1:
        return (item.lengths, item.sp_size, item.recompute, "ring", item.ring)
    return (item.lengths, item.sp_size, item.recompute)
