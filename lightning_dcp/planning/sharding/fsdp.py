"""``sharding="fsdp"``: ``"zero2"`` that also frees the full weights between steps (all-gathered once per step before
the loop): in the loop as ``"zero2"``, between steps only the shards, ``(W + G + O)/N + B`` (evaluation, co-resident
models, sharded checkpoints). Pure Python.
"""

from __future__ import annotations

from lightning_dcp.planning.sharding.base import StateParts
from lightning_dcp.planning.sharding.zero2 import Zero2

__all__ = ["Fsdp"]


class Fsdp(Zero2):
    name = "fsdp"
    runtime = "lightning_dcp.runtime.sharding.fsdp:FsdpShards"
    summary = "weights too sharded between steps, gathered once per step (full during the step)"
    zero_stage = 3

    def state_bytes(self, parts: StateParts, *, at_rest: bool = False) -> float:
        if self.world_size <= 1 or not at_rest:
            return super().state_bytes(parts, at_rest=at_rest)
        return (parts.weights + parts.gradients + parts.optimizer) / self.world_size + parts.buffers
