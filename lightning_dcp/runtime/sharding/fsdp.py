"""``sharding="fsdp"`` at run time: sharded weights between steps (:class:`~lightning_dcp.runtime.sharding.gathered.GatheredShards`).

The weights are all-gathered once at each step's start and freed after the optimizer step; evaluation
gathers them once (:meth:`~lightning_dcp.runtime.sharding.gathered.GatheredShards.unshard`) and frees them
after (:mod:`lightning_dcp.planning.sharding.fsdp`).
"""

from __future__ import annotations

from lightning_dcp.runtime.sharding.gathered import GatheredShards

__all__ = ["FsdpShards"]


class FsdpShards(GatheredShards):
    """Weights, gradients and optimizer state sharded at rest."""

    def at_rest(self) -> None:
        """Free the full weights (local, no collective)."""
        self.reshard()
