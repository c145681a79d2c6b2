"""``sharding="none"``: full replicas on every rank; one bucketed all-reduce of the gradients per step.

Per rank, in the micro-batch loop and between steps: ``W + B + G + O``. Pure Python.
"""

from __future__ import annotations

from lightning_dcp.planning.sharding.base import ShardingMode, StateParts

__all__ = ["NoSharding"]


class NoSharding(ShardingMode):
    """Full replicas (the default): what plain data-parallel training holds."""

    name = "none"
    runtime = "lightning_dcp.runtime.sharding.replicated:ReplicatedShards"
    summary = "full replicas (default)"
    zero_stage = 0

    def state_bytes(self, parts: StateParts, *, at_rest: bool = False) -> float:
        return parts.replica
