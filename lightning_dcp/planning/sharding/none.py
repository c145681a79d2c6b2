"""``sharding="none"``: full replicas on every rank (``W + B + G + O``); one bucketed all-reduce per step. Pure Python.
"""

from __future__ import annotations

from lightning_dcp.planning.sharding.base import ShardingMode, StateParts

__all__ = ["NoSharding"]


class NoSharding(ShardingMode):
    name = "none"
    runtime = "lightning_dcp.runtime.sharding.replicated:ReplicatedShards"
    summary = "full replicas (default)"
    zero_stage = 0

    def state_bytes(self, parts: StateParts, *, at_rest: bool = False) -> float:
        return parts.replica
