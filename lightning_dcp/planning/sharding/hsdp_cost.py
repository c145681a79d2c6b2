"""Per-layer sharding inside the micro-batch loop (``sharding="hsdp"``): its memory and its time.

:class:`ShardGroupCostModel` is a view of any cost model for HSDP / ZeRO-3 on a 2-D mesh: the states are sharded
over the ``K`` ranks of a *shard group* and replicated across the ``N / K`` groups (``K = N``: ZeRO-3).

Memory per rank: the base's, its one replica of states replaced by the mode's ``state_bytes`` (``(W + G + O)/K + B +
2R + 4L``; a base whose memory is not bytes keeps its own). A dummy round (:mod:`lightning_dcp.runtime.sharding.dummy`)
holds the states and the units in flight, below any item's peak.

A tensor-parallel item (``WorkItem.tp``) holds ``1 / t`` of each layer in flight and pulls and pushes ``1 / t`` of
it per rank (:mod:`~lightning_dcp.planning.tensor_parallel`); a round lasts as long as its slowest item, so a round
whose items all run TP gathers less (a dummy rank pulls no more than the round's items).

Time: a shard group's rounds run in lockstep (:class:`~lightning_dcp.planning.rounds.Lockstep`), each as long as its
slowest item, plus per layer an all-gather of the weights before the forward and the backward and a reduce-scatter
of the gradients (``(K - 1) / K`` of the bytes each, at the hardware's or the profile's
:class:`~lightning_dcp.planning.prices.CollectivePrices`). FSDP2 prefetches the next layer's all-gather during the
running layer, so ``round(t) = max(t, layers * c) + c`` with ``c`` one layer's collectives: what
:meth:`ShardGroupCostModel.item_cost` charges an item (a round of dummies: ``round(0)``). Per step: the replicas'
all-reduce of ``G / K``, the optimizer over one shard. With ``offload`` the shards live in host memory (FSDP2's
``CPUOffloadPolicy``): every round copies them at :data:`HOST_BANDWIDTH`, the optimizer steps on the CPU at
:data:`HOST_ADAM_PARAMS_PER_S` (estimates). Pure Python (numpy for the planner's vectorized round times).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

import numpy as np

from lightning_dcp.planning.cost_model import CostModel, DelegatingCostModel, ItemCost
from lightning_dcp.planning.prices import CollectivePrices
from lightning_dcp.planning.rounds import Lockstep
from lightning_dcp.planning.sharding.base import ShardingMode, StateParts

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.cost_model import Num

__all__ = ["HOST_ADAM_PARAMS_PER_S", "HOST_BANDWIDTH", "ShardGroupCostModel"]

#: Host <-> device copy bandwidth per GPU (PCIe Gen5 x16 with pinned memory, several GPUs sharing a host): an estimate.
HOST_BANDWIDTH = 25e9
#: Parameters per second one rank's optimizer step updates on the host (torch Adam on a CPU share): an estimate.
HOST_ADAM_PARAMS_PER_S = 2e8


class ShardGroupCostModel(DelegatingCostModel):
    """``base`` planned for ``sharding="hsdp"``: sharded states in the budget, per-round collectives in the time.

    Args:
        base: the cost model of one micro-batch holding one full replica's states (``base.state_bytes`` of
            them in its ``item_memory``; a base whose memory is not in bytes keeps its memory).
        mode: the mode's pure counterpart (``hsdp``'s: world ``N``, shard group ``K``, offload).
        parts: one replica's state bytes, with the largest layer's and the root unit's weight bytes.
        prices: the collectives' bandwidths and latencies (``None``: unpriced, the collectives cost 0).
    """

    def __init__(self, base: CostModel, mode: ShardingMode, parts: StateParts,
                 prices: CollectivePrices | None = None) -> None:
        super().__init__(base)
        self.mode, self.parts, self.prices = mode, parts, prices
        self.sharding = mode.name
        self.world_size, self.shard_group_size, self.offload = mode.world_size, mode.shard_group_size, mode.offload
        self.layer_bytes, self.root_bytes = parts.layer_bytes, parts.root_bytes
        self.state_parts = {"weights": parts.weights, "buffers": parts.buffers, "gradients": parts.gradients,
                            "optimizer": parts.optimizer}
        self.state_bytes = mode.state_bytes(parts)
        """Model-state bytes per rank in the micro-batch loop (what the planner budgets)."""
        self.state_bytes_at_rest = mode.state_bytes(parts, at_rest=True)
        """Model-state bytes per rank between steps."""
        self.workspace_bytes = float(getattr(base, "workspace_bytes", 0.0))  # the analytic model's
        self._collective_s: dict[int, float] = {}
        self.rounds = Lockstep(self.shard_group_size, dummy_round_s=self.round_time(0.0), domain=mode.sp_domain)
        self._shift = self.state_bytes - base.state_bytes if base.memory_in_bytes else 0.0

    def collective_prices(self) -> CollectivePrices | None:
        return self.prices

    # ------------------------------------------------------------------ memory
    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.base.item_memory(lengths, sp, recompute, ring) + self._shift

    def item_memory_tokens(self, tokens: Num, sp: int, recompute: Num, ring: int = 1) -> Num:
        return self.base.item_memory_tokens(tokens, sp, recompute, ring) + self._shift

    def tp_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1, tp: int = 1) -> float:
        return self.base.tp_memory(lengths, sp, recompute, ring, tp) + self._tp_shift(tp)

    def tp_memory_tokens(self, tokens: Num, sp: int, recompute: Num, ring: int = 1, tp: int = 1) -> Num:
        return self.base.tp_memory_tokens(tokens, sp, recompute, ring, tp) + self._tp_shift(tp)

    def _tp_shift(self, tp: int) -> float:
        """The states' shift for a ``tp``-way TP item: its layers in flight (``4L``) are ``1 / tp`` of a layer."""
        if not self.base.memory_in_bytes:
            return 0.0
        return self._shift - 4.0 * self.layer_bytes * (1.0 - 1.0 / max(int(tp), 1))

    def dummy_memory(self) -> float:
        """Peak bytes of a dummy round (the collectives only, no activation): the states with the units in flight
        and the workspace, at most any item's; 0 for a base whose memory is not in bytes."""
        return self.state_bytes + self.workspace_bytes if self.memory_in_bytes else 0.0

    # ------------------------------------------------------------------ time
    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        """The base's cost plus the per-layer collectives of a round this item is the slowest of (the
        part compute does not hide, in ``comm``): what the planner balances, and what a lockstep round
        lasts (the simulator takes each round's slowest item)."""
        cost = self.base.item_cost(lengths, sp, recompute, ring)
        return replace(cost, comm=cost.comm + self.round_time(cost.total) - cost.total)

    def item_time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.round_time(self.base.item_time(lengths, sp, recompute, ring))

    def item_time_lower(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.round_time(self.base.item_time_lower(lengths, sp, recompute, ring))

    def item_time_sum(self, tokens: Num, sq_sum: Num, n: Num, sp: int, recompute: Num, ring: int = 1,
                      ring_exposed: bool = True) -> Num:
        return self.round_time(self.base.item_time_sum(tokens, sq_sum, n, sp, recompute, ring, ring_exposed))

    def tp_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1, tp: int = 1) -> ItemCost:
        """:meth:`item_cost` of a ``tp``-way TP item: each rank pulls and pushes ``1 / tp`` of every layer."""
        cost = self.base.tp_cost(lengths, sp, recompute, ring, tp)
        return replace(cost, comm=cost.comm + self.round_time(cost.total, tp) - cost.total)

    def tp_time_sum(self, tokens: Num, sq_sum: Num, n: Num, sp: int, recompute: Num, ring: int = 1, tp: int = 1,
                    ring_exposed: bool = True) -> Num:
        return self.round_time(self.base.tp_time_sum(tokens, sq_sum, n, sp, recompute, ring, tp, ring_exposed), tp)

    def sp_sizes(self, world_size: int) -> list[int]:
        """SP groups stay inside a block of the rounds' ``domain`` (:attr:`HsdpMode.sp_domain`, the world: an SP group
        may span shard groups, whose rounds then meet): the base's sizes up to it."""
        return [p for p in self.base.sp_sizes(world_size) if p <= self.rounds.domain]

    def layer_collective_s(self, tp: int = 1) -> float:
        """One layer's collectives in one round: two all-gathers of its weights, one reduce-scatter of its
        gradients, plus host copies of the shards with ``offload``. A rank of a ``tp``-way TP item pulls and pushes
        only its ``1 / tp`` slice of the layer (its TP group's other ranks hold the rest)."""
        got = self._collective_s.get(tp)
        if got is None:
            k, layer = self.shard_group_size, self.layer_bytes / max(int(tp), 1)
            got = 3.0 * self.prices.ring(layer, k) if self.prices is not None else 0.0
            if self.offload:  # the weight shard to the device twice, the gradient shard back once
                got += 3.0 * layer / k / HOST_BANDWIDTH
            self._collective_s[tp] = got
        return got

    def round_time(self, slowest_item_s: Num, tp: int = 1) -> Num:
        """A lockstep round whose slowest item takes ``slowest_item_s`` (a round of dummies only: 0 compute; an array:
        each its own round); ``tp``: that item's TP degree (its ranks pull ``1 / tp`` of each layer)."""
        c = self.layer_collective_s(tp)
        if isinstance(slowest_item_s, np.ndarray):
            return np.maximum(slowest_item_s, self.num_layers * c) + c
        return max(slowest_item_s, self.num_layers * c) + c

    def step_overhead(self, world_size: int) -> float:
        """The replicas' all-reduce of the gradient shards, then the optimizer over one shard (``1 / K`` of the
        base's optimizer step on one rank; with ``offload`` on the host)."""
        n, k = int(world_size), self.shard_group_size
        replicas = n // k
        comm = 0.0
        if replicas > 1 and self.prices is not None:
            comm = self.prices.allreduce(self.parts.gradients / k, replicas, extent=n)
        if self.offload:
            return comm + self.parts.params / k / HOST_ADAM_PARAMS_PER_S
        return comm + self.base.step_overhead(1) * self.mode.optimizer_share()

    def signature(self) -> dict:
        return {"kind": self.mode.name, "shard_group_size": self.shard_group_size, "offload": self.offload,
                "state_bytes": self.state_bytes, "prices": None if self.prices is None else self.prices.source,
                "base": self.base.signature()}

