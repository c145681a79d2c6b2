"""``sharding="zero2"`` at run time: full weights between steps (:class:`~lightning_dcp.runtime.sharding.gathered.GatheredShards`).

After the optimizer step one all-gather per unit makes the weights full again, so between steps and
in evaluation the module holds full weights beside its shards; the optimizer state and the gradients
between steps stay sharded (:mod:`lightning_dcp.planning.sharding.zero2`).
"""

from __future__ import annotations

from lightning_dcp.runtime.sharding.gathered import GatheredShards

__all__ = ["Zero2Shards"]


class Zero2Shards(GatheredShards):
    """ZeRO-2 on FSDP2: the weights are full at rest."""

    def at_rest(self) -> None:
        """Full weights (an all-gather per unit that is sharded; a no-op where they are full)."""
        self.unshard()
