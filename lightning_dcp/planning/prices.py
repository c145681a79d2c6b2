"""What the collectives a sharding mode adds cost: :class:`CollectivePrices`, from a hardware spec or a profile.

Never a fixed accelerator: the analytic model prices with its own hardware
(:meth:`CollectivePrices.from_hardware`), a profiled model with the bus bandwidth of the all-reduce it
measured, the runtime with the device's hardware spec where the registry describes it, and a cost
model that knows none leaves the collectives unpriced. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.hardware import HardwareSpec

__all__ = ["CollectivePrices"]


@dataclass(frozen=True)
class CollectivePrices:
    """Bus bandwidths and latencies of the collectives a mode adds, and where they came from.

    Time of a ring all-gather or reduce-scatter of ``b`` bytes over ``n`` ranks: ``(n-1)/n * b / bw +
    latency``; of an all-reduce: twice that. ``bw`` / ``latency`` are the intra-node ones when the ranks
    fit in one node (``gpus_per_node``), else the inter-node ones.

    Args:
        intra_bw, inter_bw: bus bandwidth inside a node and across nodes (bytes/s).
        intra_latency, inter_latency: fixed cost of one collective inside / across nodes (s).
        gpus_per_node: ranks sharing the fast fabric.
        hbm_bandwidth: device memory bandwidth (an optimizer step on the device); 0: unknown.
        source: where the prices came from, for messages.
    """

    intra_bw: float
    inter_bw: float
    intra_latency: float = 0.0
    inter_latency: float = 0.0
    gpus_per_node: int = 8
    hbm_bandwidth: float = 0.0
    source: str = ""

    @classmethod
    def from_hardware(cls, hw: "HardwareSpec") -> "CollectivePrices":
        """The analytic model's prices: its hardware's all-reduce bus bandwidths and latencies."""
        return cls(hw.allreduce_bw_intra, hw.allreduce_bw_inter, hw.collective_latency, hw.collective_latency_inter,
                   hw.gpus_per_node, hw.hbm_bandwidth, f"hardware {hw.name!r}")

    def ring(self, nbytes: float, ranks: int, extent: int | None = None) -> float:
        """One all-gather or reduce-scatter of ``nbytes`` (the full tensor) over ``ranks`` ranks (0 for one rank);
        ``extent``: the span of consecutive ranks the group covers (a strided group spans more than its size)."""
        n = int(ranks)
        if n <= 1:
            return 0.0
        intra = (n if extent is None else int(extent)) <= self.gpus_per_node
        bw, lat = (self.intra_bw, self.intra_latency) if intra else (self.inter_bw, self.inter_latency)
        return (n - 1) / n * nbytes / bw + lat

    def allreduce(self, nbytes: float, ranks: int, extent: int | None = None) -> float:
        """One ring all-reduce of ``nbytes`` over ``ranks`` ranks."""
        return 2.0 * self.ring(nbytes, ranks, extent)
