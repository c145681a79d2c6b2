"""Per-layer sharding inside the micro-batch loop (``sharding="hsdp"``): its memory and its time.

:class:`ShardGroupCostModel` is a view of any cost model (the analytic one, a profiled one) for
HSDP / ZeRO-3 on a 2-D mesh: the model states are sharded over the ``K`` ranks of a *shard group*
(default: the GPUs of one node) and replicated across the ``N / K`` groups; ``K = N`` is plain ZeRO-3.

Memory per rank in the micro-batch loop (:func:`~lightning_dcp.planning.state_sharding.state_bytes`,
mode ``"hsdp"``)::

    (W + G + O) / K + B + 2 R + 4 L        with offload:  B + 2 R + 4 L  (the shards live on the host)

``R`` the weight bytes outside the repeated layers (the root unit: embeddings, head; gathered for the
whole micro-batch, with their gradients), ``L`` the largest repeated layer's weight bytes (two layers'
weights and gradients in flight: the running one and the prefetched one).

Time. A micro-batch costs what the base model says plus its round's collectives; the rounds (:mod:`lightning_dcp.planning.rounds`)
run in lockstep inside a shard group, so a round lasts as long as its slowest item, and each round
adds its per-layer collectives: per layer an all-gather of ``L`` before the forward and before the
backward and a reduce-scatter of the layer's gradients, each moving ``(K - 1) / K`` of the bytes at
the intra-node (or, for ``K`` above a node, inter-node) all-reduce bus bandwidth. FSDP2 prefetches the
next layer's all-gather during the running layer's compute, so per layer only the part of the
collectives longer than the layer's compute shows, plus the first layer's all-gather::

    round(t) = max(t, layers * c) + c          c: one layer's all-gathers and reduce-scatter

:meth:`ShardGroupCostModel.item_cost` prices an item as the slowest of its round (``round(t)``), so
the planner sees the collectives a micro-batch brings: when they dominate, fewer and larger
micro-batches win.

Per step (:meth:`ShardGroupCostModel.step_overhead`): the gradient shards meet across the ``N / K``
replicas in one all-reduce of ``G / K`` (inter-node when the group fills a node), then the optimizer
steps one shard. With ``offload``: the sharded states live in host memory (FSDP2's
``CPUOffloadPolicy``), the optimizer steps on the CPU, and every round copies the weight shards to
the device and the gradient shards back: priced at :data:`HOST_BANDWIDTH` and
:data:`HOST_ADAM_PARAMS_PER_S` (estimates, not measured). Pure Python.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from lightning_dcp.planning.cost_model import CostModel, ItemCost, prices_ring_of, ring_kwargs
from lightning_dcp.planning.state_sharding import state_bytes

__all__ = ["HOST_ADAM_PARAMS_PER_S", "HOST_BANDWIDTH", "ShardGroupCostModel", "hsdp_view"]

#: Host <-> device copy bandwidth per GPU (PCIe Gen5 x16 with pinned memory, several GPUs sharing a host): an estimate.
HOST_BANDWIDTH = 25e9
#: Parameters per second one rank's optimizer step updates on the host (torch Adam on a CPU share): an estimate.
HOST_ADAM_PARAMS_PER_S = 2e8


class ShardGroupCostModel(CostModel):
    """``base`` planned for ``sharding="hsdp"``: sharded states in the budget, per-round collectives in the time.

    Args:
        base: the cost model of one micro-batch (its ``item_memory`` includes ``base_state_bytes`` of states).
        world_size: ranks of the world ``N``.
        shard_group_size: ranks ``K`` the states are sharded over (must divide ``N``).
        state_parts: one replica's ``weights``, ``buffers``, ``gradients``, ``optimizer`` bytes.
        layer_bytes: weight bytes of the largest repeated layer.
        root_bytes: weight bytes outside the repeated layers.
        base_state_bytes: state bytes ``base.item_memory`` counts (default ``base.state_bytes``).
        gather_bw, gather_latency: bus bandwidth (bytes/s) and latency (s) of the group's collectives.
        replica_bw, replica_latency: the same for the all-reduce across replicas.
        offload: sharded states on the host (see the module docstring).
        params: parameters of one replica (for the optimizer step on the host, with ``offload``).
        optimizer_step_s: one whole replica's optimizer step on the device (each rank steps ``1 / K`` of it).
    """

    sharding = "hsdp"

    def __init__(self, base: CostModel, *, world_size: int, shard_group_size: int, state_parts: Mapping[str, float],
                 layer_bytes: float, root_bytes: float, gather_bw: float, gather_latency: float, replica_bw: float,
                 replica_latency: float, params: float, optimizer_step_s: float,
                 base_state_bytes: float | None = None, offload: bool = False) -> None:
        n, k = int(world_size), int(shard_group_size)
        if k < 1 or n % k:
            raise ValueError(f"shard_group_size={shard_group_size} must be a positive divisor of world_size={world_size}")
        self.base = base
        self.world_size, self.shard_group_size, self.offload = n, k, bool(offload)
        self.num_layers, self.num_heads = base.num_layers, base.num_heads
        self.gpus_per_node = getattr(base, "gpus_per_node", 8)
        self.state_parts = {key: float(v) for key, v in state_parts.items()}
        self.layer_bytes, self.root_bytes, self.params = float(layer_bytes), float(root_bytes), float(params)
        self.gather_bw, self.gather_latency = float(gather_bw), float(gather_latency)
        self.replica_bw, self.replica_latency = float(replica_bw), float(replica_latency)
        self.optimizer_step_s = float(optimizer_step_s)
        held = base_state_bytes if base_state_bytes is not None else getattr(base, "state_bytes", None)
        if held is None:
            raise ValueError(f"{type(base).__name__} does not say which model-state bytes its item_memory counts; "
                             "pass base_state_bytes=")
        self.base_state_bytes = float(held)
        self.state_bytes = state_bytes("hsdp", n, shard_group_size=k, layer_bytes=self.layer_bytes,
                                       root_bytes=self.root_bytes, offload=self.offload, **self.state_parts)
        """Model-state bytes per rank in the micro-batch loop (what the planner budgets)."""
        self.state_bytes_at_rest = state_bytes("hsdp", n, shard_group_size=k, offload=self.offload, at_rest=True,
                                               **self.state_parts)
        """Model-state bytes per rank between steps."""
        self.workspace_bytes = float(getattr(base, "workspace_bytes", 0.0))
        self.memory_limit = float(base.memory_limit)
        self.memory_limit_source = getattr(base, "memory_limit_source", "")
        # the planner's fast paths (token sums instead of length lists), where the base has them
        shift = self.state_bytes - self.base_state_bytes
        if callable(getattr(base, "attention_work", None)):
            self.attention_work = base.attention_work
        time_sum = getattr(base, "item_time_sum", None)
        if callable(time_sum):
            self.item_time_sum = lambda tokens, sq_sum, n, sp, recompute, **ring: self.round_time(
                time_sum(tokens, sq_sum, n, sp, recompute, **ring))
        mem_tokens = getattr(base, "item_memory_tokens", None)
        if callable(mem_tokens):
            self.item_memory_tokens = lambda tokens, sp, recompute, **ring: mem_tokens(tokens, sp, recompute, **ring) + shift

    # ------------------------------------------------------------------ memory
    @property
    def prices_ring(self) -> bool:  # type: ignore[override]
        return prices_ring_of(self.base)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.base.item_memory(lengths, sp, recompute, **ring_kwargs(ring)) - self.base_state_bytes + self.state_bytes

    # ------------------------------------------------------------------ time
    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        """The base's cost plus the per-layer collectives of a round this item is the slowest of (the
        part compute does not hide, in ``comm``): what the planner balances, and what a lockstep round
        lasts (the simulator takes each round's slowest item)."""
        cost = self.base.item_cost(lengths, sp, recompute, **ring_kwargs(ring))
        return replace(cost, comm=cost.comm + self.round_time(cost.total) - cost.total)

    def item_time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.round_time(self.base.item_time(lengths, sp, recompute, **ring_kwargs(ring)))

    def sp_sizes(self, world_size: int) -> list[int]:
        """SP groups stay inside a shard group: the base's sizes up to ``shard_group_size``."""
        return [p for p in self.base.sp_sizes(world_size) if p <= self.shard_group_size]

    def layer_collective_s(self) -> float:
        """One layer's collectives in one round: two all-gathers of its weights, one reduce-scatter of its
        gradients (``(K-1)/K`` of the bytes each), plus host copies of the shards with ``offload``."""
        k = self.shard_group_size
        if k == 1:
            comm = 0.0
        else:
            comm = 3.0 * (k - 1) / k * self.layer_bytes / self.gather_bw + 3.0 * self.gather_latency
        if self.offload:  # the weight shard to the device twice, the gradient shard back once
            comm += 3.0 * self.layer_bytes / k / HOST_BANDWIDTH
        return comm

    def round_time(self, slowest_item_s: float) -> float:
        """A lockstep round whose slowest item takes ``slowest_item_s`` (a round of dummies only: 0 compute)."""
        c = self.layer_collective_s()
        return max(slowest_item_s, self.num_layers * c) + c

    def step_overhead(self, world_size: int) -> float:
        """The replicas' all-reduce of the gradient shards, then the optimizer over one shard."""
        n, k = int(world_size), self.shard_group_size
        replicas = n // k
        grads = self.state_parts["gradients"] / k
        comm = 0.0
        if replicas > 1:
            comm = 2.0 * (replicas - 1) / replicas * grads / self.replica_bw + 2.0 * self.replica_latency
        if self.offload:
            return comm + self.params / k / HOST_ADAM_PARAMS_PER_S
        return comm + self.optimizer_step_s / k

    def signature(self) -> dict:
        return {"kind": "hsdp", "shard_group_size": self.shard_group_size, "offload": self.offload,
                "state_bytes": self.state_bytes, "base": self.base.signature()}


def hsdp_view(analytic: Any, shard_group_size: int | None = None, *, offload: bool = False) -> ShardGroupCostModel:
    """The :class:`ShardGroupCostModel` of an :class:`~lightning_dcp.planning.analytic.AnalyticCostModel`
    (its model shape, hardware, world size and state bytes); ``shard_group_size`` defaults to a node's GPUs
    (or the world, if smaller)."""
    from lightning_dcp.planning.analytic import OPTIMIZER_BYTES_PER_PARAM

    hw, n = analytic.hardware, analytic.world_size
    k = int(shard_group_size) if shard_group_size is not None else min(n, hw.gpus_per_node)
    db = analytic.dtype_bytes
    model = analytic.model
    intra = k <= hw.gpus_per_node
    base = _unsharded(analytic)
    return ShardGroupCostModel(
        base, world_size=n, shard_group_size=k, state_parts=analytic.full_state_parts,
        layer_bytes=db * model.layer_params(), root_bytes=db * model.edge_params(),
        gather_bw=hw.allreduce_bw_intra if intra else hw.allreduce_bw_inter,
        gather_latency=hw.collective_latency if intra else hw.collective_latency_inter,
        replica_bw=hw.allreduce_bw_inter if n > hw.gpus_per_node else hw.allreduce_bw_intra,
        replica_latency=hw.collective_latency_inter if n > hw.gpus_per_node else hw.collective_latency,
        params=analytic.param_count, offload=offload,
        optimizer_step_s=OPTIMIZER_BYTES_PER_PARAM * analytic.param_count / hw.hbm_bandwidth)


def _unsharded(analytic: Any) -> Any:
    """The analytic model with ``sharding="none"`` (its ``item_memory`` counts one whole replica's states)."""
    if analytic.sharding == "none":
        return analytic
    return analytic.with_sharding({"sharding": "none", "world_size": analytic.world_size, **analytic.full_state_parts})
