"""``sharding="hsdp"``: per-layer sharding in the micro-batch loop over shard groups of ``K`` consecutive ranks,
replicated across the ``N / K`` groups (``K = N``: plain ZeRO-3): ``(W + G + O)/K + B + 2R + 4L`` per rank in the
loop, ``(W + G + O)/K + B`` between steps; with ``offload`` (the shards on the host) ``B + 2R + 4L`` and ``B``.

``R`` is gathered for the whole micro-batch with its gradients, ``L`` twice over (the running and the prefetched
layer, weights and gradients). Each layer's collectives run inside the loop, so a group's ranks run lockstep rounds
(:class:`~lightning_dcp.planning.rounds.Lockstep`); an SP group may span shard groups, whose rounds then meet. Time:
:class:`~lightning_dcp.planning.sharding.hsdp_cost.ShardGroupCostModel`. Pure Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from lightning_dcp.planning.prices import CollectivePrices
from lightning_dcp.planning.round_plan import RoundPlan
from lightning_dcp.planning.rounds import Lockstep
from lightning_dcp.planning.sharding.base import ShardingMode, StateParts, UnplannableCostModel
from lightning_dcp.planning.sharding.hsdp_cost import ShardGroupCostModel

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.cost_model import CostModel

__all__ = ["HsdpMode"]


class HsdpMode(ShardingMode):
    """Per-layer sharding (HSDP on a ``(N/K, K)`` mesh); ``shard_group_size``: ``K``, a positive divisor of ``N``
    (default ``N``); ``offload``: the sharded states on the host (FSDP2's ``CPUOffloadPolicy``)."""

    name = "hsdp"
    runtime = "lightning_dcp.runtime.sharding.hsdp:HsdpShards"
    summary = ("per-layer sharding inside the loop over shard groups of K ranks (lockstep rounds): models whose "
               "states do not fit one device")
    options = ("shard_group_size", "offload")
    shards_weights = True

    def __init__(self, world_size: int, *, shard_group_size: int | None = None, offload: bool = False) -> None:
        super().__init__(world_size, shard_group_size=shard_group_size, offload=offload)
        k = self.world_size if shard_group_size is None else int(shard_group_size)
        if k < 1 or self.world_size % k:
            raise ValueError(f"shard_group_size={shard_group_size} must be a positive divisor of the world size "
                             f"({self.world_size}); use e.g. the GPUs of one node, or the world for plain ZeRO-3")
        self.shard_group_size = k
        self.sp_domain = self.world_size
        """SP groups lie inside blocks of this many ranks: the world (an SP group may span shard groups; the rounds of
        the groups it spans meet, :mod:`~lightning_dcp.planning.rounds`)."""

    def __repr__(self) -> str:
        return f"HsdpMode(world_size={self.world_size}, shard_group_size={self.shard_group_size}, offload={self.offload})"

    def state_bytes(self, parts: StateParts, *, at_rest: bool = False) -> float:
        held = parts.buffers if self.offload else (parts.weights + parts.gradients + parts.optimizer) / \
            self.shard_group_size + parts.buffers
        return held if at_rest else held + 2.0 * parts.root_bytes + 4.0 * parts.layer_bytes

    def step_traffic(self, parts: StateParts) -> tuple[float, int]:
        """The replicas' all-reduce of the gradient shards (the per-layer collectives are the rounds')."""
        return 2.0 * parts.gradients / self.shard_group_size, 1

    def optimizer_share(self) -> float:
        return 1.0 / self.shard_group_size

    @property
    def rounds(self) -> RoundPlan:
        return Lockstep(self.shard_group_size, domain=self.sp_domain)

    def describe(self) -> str:
        return f"sharding hsdp over shard groups of {self.shard_group_size}" + (", offload" if self.offload else "")

    def plan_with(self, cost_model: "CostModel", parts: StateParts | None, prices: CollectivePrices | None = None,
                  measured: Mapping[str, Any] | None = None) -> "CostModel":
        """``cost_model`` (its memory counting one full replica) seen through ``ShardGroupCostModel``: the sharded
        states in the budget, the per-round collectives in the time, priced by the cost model's own prices, else
        ``prices``. :class:`UnplannableCostModel` when the states' bytes are unknown, or its memory is in bytes but
        says nothing of the states it counts."""
        if parts is None:
            raise UnplannableCostModel("sharding='hsdp' needs the model-state bytes (weights, gradients, optimizer, "
                                       "the largest layer's and the root unit's) to plan its memory")
        hook = getattr(cost_model, "with_sharding", None)
        if callable(hook):  # the cost model of one full replica
            base = hook({**(dict(measured) if measured is not None else {}), **parts.to_dict(), "sharding": "none",
                         "world_size": self.world_size})
        else:
            base = cost_model
        if base.memory_in_bytes and base.state_bytes is None:
            raise UnplannableCostModel(
                f"{type(cost_model).__name__} cannot plan sharding='hsdp': its item_memory is in bytes but it does not "
                "say which model-state bytes it counts. Give it a state_bytes attribute (the states one replica holds "
                "in its item_memory) or a with_sharding(states) method, or use sharding='zero1'")
        own = base.collective_prices()  # a profile measured here, or the analytic model's hardware, before a fallback
        return ShardGroupCostModel(base, self, parts, prices=own if own is not None else prices)

