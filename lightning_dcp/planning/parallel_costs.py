"""Tensor and pipeline parallel costs: what a micro-batch costs on a ``<TP, PP>`` pipeline.

The DCP planner only runs sequence-parallel groups; this module prices the other two parallel
methods so that the ``hydraulis`` peer policy (heterogeneous ``<TP, PP>`` pipelines, Li et al.,
*Hydraulis*, §5 and App. B) can be planned and simulated on the same cost model as everyone else.

A **scheme** ``<tp, pp>`` is one pipeline (a data-parallel replica) of ``tp * pp`` ranks: ``pp``
stages of ``num_layers / pp`` layers each, every stage split ``tp`` ways (Megatron tensor parallel
with sequence parallel on the norms). A pipeline's ranks are an aligned power-of-two block; the
tensor-parallel groups are its consecutive ``tp`` ranks (inside a node when ``tp <= gpus_per_node``).

**Stage time of one micro-batch** (:func:`scheme_cost`, what the simulator charges per micro-batch
on every rank of the pipeline, all stages working in the pipeline's steady state):

- compute, recompute and the per-micro-batch head: those of the same micro-batch on a
  sequence-parallel group of ``tp`` ranks (TP splits the heads and the GEMMs' weights ``tp`` ways,
  so each rank does ``1/tp`` of the FLOPs -- the same per-rank work, GEMM sizes and element-wise
  bytes as Ulysses SP of ``tp``), divided by ``pp`` (each stage runs ``L / pp`` layers; the
  embedding and head are taken as spread evenly over the stages, the balance Megatron users reach
  by giving the outer stages fewer layers);
- **TP all-reduces** (:func:`tp_comm_time`): per block, two all-reduces of the micro-batch's
  activations (``T * h * dtype_bytes`` bytes: after attention and after the MLP; with sequence
  parallel an all-gather + reduce-scatter pair of the same volume) in the forward, two in the
  backward, two more per recomputed layer; each ``2 (tp-1)/tp * bytes / busbw + latency`` at the
  hardware's all-reduce bus bandwidth (inter-node when ``tp > gpus_per_node``); not overlapped
  with compute (as the Ulysses all-to-alls are not), divided by ``pp`` like the layers;
- **point-to-point sends** (:func:`p2p_time`, ``pp > 1``): per micro-batch each stage receives its
  input activations and sends its output forward, and the same backward: two transfers of
  ``T * h * dtype_bytes / tp`` bytes (scattered over the TP ranks) on the stage's critical path, at
  the all-to-all bus bandwidth inside a node, the inter-node one when the pipeline spans nodes,
  plus a collective latency each.

**Pipeline time** (:func:`pipeline_time`): with 1F1B scheduling, ``sum_j t_j + (pp - 1) max_j t_j``
over the pipeline's micro-batch stage times ``t_j`` (Hydraulis eq. 2's bound, eq. 1 for equal
micro-batches): the warm-up and cool-down bubble is ``pp - 1`` slowest micro-batches long, during
which a stage idles. The simulator adds it after a pipeline's last micro-batch, as idle time.

**Step end** (:func:`pipeline_step_overhead`): each rank's ``1 / (tp pp)`` of the gradients all-reduced over the
``world / (tp pp)`` replicas (a distributed optimizer's reduce-scatter and all-gather move the same bytes), then
the optimizer over the rank's ``1 / world`` of the fp32 states.

**Memory** (:func:`scheme_memory`, Hydraulis App. B.1): activations of a micro-batch of ``T``
tokens are those of SP ``tp`` (``T / tp`` tokens per rank through every layer: with 1F1B the first
stage holds ``pp`` micro-batches of ``L / pp`` layers); the model states are Hydraulis' own: fp32
parameters and optimizer states fully sharded over the world, the 16-bit weights and gradients
split ``tp * pp`` ways: ``(weights + buffers + gradients) / (tp * pp) + optimizer / world_size``.

For cost models without a model and hardware description (a profiled or test model), TP
communication is estimated from the same micro-batch's Ulysses all-to-all time at ``tp`` (TP moves
``tp`` times the bytes per rank of Ulysses), and the memory is that of SP ``tp`` with the cost
model's own states.

Pure Python: no torch.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from lightning_dcp.planning.cost_model import CostModel, ItemCost
from lightning_dcp.planning.plan import Pipeline, Scheme

__all__ = ["Scheme", "Pipeline", "schemes_for", "scheme_cost", "scheme_memory", "scheme_capacities",
           "pipeline_time", "pipeline_step_overhead", "tp_comm_time", "p2p_time"]


def schemes_for(cost_model: CostModel, size: int) -> list[Scheme]:
    """The ``<tp, pp>`` schemes of ``size`` ranks the model allows: ``tp`` divides the heads, ``pp``
    divides the layers (Hydraulis' scheme space restricted to one pipeline size), largest ``tp`` first."""
    out = []
    tp = size
    while tp >= 1:
        pp = size // tp
        if cost_model.num_heads % tp == 0 and cost_model.num_layers % pp == 0:
            out.append(Scheme(tp, pp))
        tp //= 2
    return out


def _analytic(cost_model: Any) -> bool:
    return all(hasattr(cost_model, a) for a in ("model", "hardware", "dtype_bytes", "full_state_parts", "state_bytes"))


def tp_comm_time(cost_model: CostModel, tokens: float, tp: int, recompute: int, lengths: Sequence[int] = ()) -> float:
    """TP all-reduce time of a micro-batch of ``tokens`` through all ``L`` layers (forward, backward and
    ``recompute`` recomputed forwards), before the division over pipeline stages."""
    if tp <= 1:
        return 0.0
    L = cost_model.num_layers
    if _analytic(cost_model):
        hw, m = cost_model.hardware, cost_model.model
        intra = tp <= hw.gpus_per_node
        bw = hw.allreduce_bw_intra if intra else hw.allreduce_bw_inter
        lat = hw.collective_latency if intra else hw.collective_latency_inter
        nbytes = tokens * m.hidden_size * cost_model.dtype_bytes
        one = 2.0 * (tp - 1) / tp * nbytes / bw + lat
        return (2 * L + recompute) * 2 * m.blocks_per_layer * one
    # no hardware description: TP moves tp times the bytes per rank of Ulysses SP over tp ranks
    lens = list(lengths) or [int(tokens)]
    return tp * cost_model.item_cost(lens, tp, recompute).comm


def p2p_time(cost_model: CostModel, tokens: float, scheme: Scheme) -> float:
    """Point-to-point activation sends of one micro-batch on one stage (forward + backward); 0 for ``pp == 1``."""
    if scheme.pp <= 1:
        return 0.0
    if _analytic(cost_model):
        hw, m = cost_model.hardware, cost_model.model
        intra = scheme.size <= hw.gpus_per_node
        bw = hw.a2a_bw_intra if intra else hw.a2a_bw_inter
        lat = hw.collective_latency if intra else hw.collective_latency_inter
        nbytes = tokens * m.hidden_size * cost_model.dtype_bytes / scheme.tp
        return 2.0 * (nbytes / bw + lat)
    return 0.0


def scheme_cost(cost_model: CostModel, lengths: Sequence[int], scheme: Scheme, recompute: int) -> ItemCost:
    """Stage time of one micro-batch of ``lengths`` on a ``scheme`` pipeline (see the module docstring).

    ``ideal`` is the samples' ideal compute divided by the pipeline's ``tp * pp`` ranks, as the
    simulator's ICC sums expect (``ItemCost.ideal`` is per rank of the group)."""
    tp, pp = scheme.tp, scheme.pp
    base = cost_model.item_cost(lengths, tp, recompute)
    tokens = sum(lengths)
    comm = tp_comm_time(cost_model, tokens, tp, recompute, lengths) / pp + p2p_time(cost_model, tokens, scheme)
    return ItemCost(compute=base.compute / pp, recompute=base.recompute / pp, comm=comm,
                    overhead=base.overhead / pp, ideal=base.ideal / pp)


def _states(cost_model: Any, scheme: Scheme) -> float:
    parts = cost_model.full_state_parts
    world = max(int(getattr(cost_model, "world_size", 1)), 1)
    return (parts["weights"] + parts.get("buffers", 0.0) + parts["gradients"]) / scheme.size + parts["optimizer"] / world


def scheme_memory(cost_model: CostModel, tokens: int, scheme: Scheme, recompute: int) -> float:
    """Peak bytes per rank of a micro-batch of ``tokens`` on a ``scheme`` pipeline (see the module docstring)."""
    sp_mem = (cost_model.item_memory_tokens(tokens, scheme.tp, recompute) if cost_model.fast_paths
              else cost_model.item_memory([max(int(tokens), 1)], scheme.tp, recompute))
    if _analytic(cost_model):
        return sp_mem - cost_model.state_bytes + _states(cost_model, scheme)
    return sp_mem


def scheme_capacities(cost_model: CostModel, scheme: Scheme) -> list[int]:
    """``caps[r]``: the most tokens one micro-batch on ``scheme`` holds with ``r`` recomputed layers
    (non-decreasing in ``r``; 0 where not even one token fits)."""
    limit = cost_model.memory_limit
    caps = []
    for r in range(cost_model.num_layers + 1):
        if scheme_memory(cost_model, 1, scheme, r) > limit:
            caps.append(0)
            continue
        lo, hi = 1, 2
        while scheme_memory(cost_model, hi, scheme, r) <= limit:
            lo, hi = hi, hi * 2
            if hi > 1 << 42:
                break
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if scheme_memory(cost_model, mid, scheme, r) <= limit:
                lo = mid
            else:
                hi = mid
        caps.append(lo)
    for r in range(1, len(caps)):
        caps[r] = max(caps[r], caps[r - 1])
    return caps


def pipeline_time(stage_times: Iterable[float], pp: int) -> float:
    """1F1B pipeline time of micro-batches with these stage times: ``sum + (pp - 1) * max`` (0 when none)."""
    ts = list(stage_times)
    if not ts:
        return 0.0
    return sum(ts) + (pp - 1) * max(ts)


def pipeline_step_overhead(cost_model: CostModel, scheme: Scheme, world_size: int) -> float:
    """Step end of ``world_size / scheme.size`` pipelines of ``scheme`` (see the module docstring); a cost model
    without a model and hardware description keeps its own :meth:`~CostModel.step_overhead`."""
    W = int(world_size)
    if not _analytic(cost_model):
        return float(cost_model.step_overhead(W))
    replicas = max(W // scheme.size, 1)
    comm = 0.0
    if replicas > 1:
        comm = cost_model.collective_prices().allreduce(cost_model.full_state_parts["gradients"] / scheme.size,
                                                         replicas, extent=W)
    return comm + float(cost_model.step_overhead(1)) / W  # one rank's optimizer step over all states, shared by W
