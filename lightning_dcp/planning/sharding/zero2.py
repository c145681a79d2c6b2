"""``sharding="zero2"``: optimizer state, its update and the gradients between steps sharded (``fully_shard``):
``W + W/N + B + G + O/N`` per rank in the loop, ``W + W/N + B + G/N + O/N`` between steps.

No collective inside the micro-batch loop: the weights stay full (FSDP keeps each rank's shard beside them, ``W/N``),
each rank accumulates its full gradients, one reduce-scatter after the loop leaves its shard, the optimizer steps it
and one all-gather per unit after the step makes the weights full again: the all-reduce's bytes. Pure Python.
"""

from __future__ import annotations

from lightning_dcp.planning.sharding.base import ShardingMode, StateParts

__all__ = ["Zero2"]


class Zero2(ShardingMode):
    name = "zero2"
    runtime = "lightning_dcp.runtime.sharding.zero2:Zero2Shards"
    summary = "optimizer state and gradients sharded between steps (fully_shard), full weights kept"
    shards_weights = True
    zero_stage = 2

    def state_bytes(self, parts: StateParts, *, at_rest: bool = False) -> float:
        if self.world_size <= 1:
            return parts.replica
        n = float(self.world_size)
        gradients = parts.gradients / n if at_rest else parts.gradients
        return parts.weights + parts.weights / n + parts.buffers + gradients + parts.optimizer / n

    def step_traffic(self, parts: StateParts) -> tuple[float, int]:
        return parts.gradients + parts.weights, 2

    def optimizer_share(self) -> float:
        return 1.0 / self.world_size
