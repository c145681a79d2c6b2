"""``sharding="zero1"``: the optimizer state and its update sharded over the world (``ZeroRedundancyOptimizer``).

``W + B + G + O/N`` per rank; the gradients are all-reduced as under ``"none"`` and each rank's updated weight shard
sent to the others after the step (two collectives per bucket). Of the modes without collectives in the loop, the
most room for activations. Pure Python.
"""

from __future__ import annotations

from lightning_dcp.planning.sharding.base import ShardingMode, StateParts

__all__ = ["Zero1"]


class Zero1(ShardingMode):
    name = "zero1"
    runtime = "lightning_dcp.runtime.sharding.zero1:Zero1Shards"
    summary = "optimizer state sharded (ZeroRedundancyOptimizer): the most room for activations in the loop"
    zero_stage = 1

    def state_bytes(self, parts: StateParts, *, at_rest: bool = False) -> float:
        if self.world_size <= 1:
            return parts.replica
        return parts.weights + parts.buffers + parts.gradients + parts.optimizer / self.world_size

    def step_traffic(self, parts: StateParts) -> tuple[float, int]:
        return 2.0 * parts.gradients, 2

    def optimizer_share(self) -> float:
        return 1.0 / self.world_size
