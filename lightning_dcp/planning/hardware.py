"""Accelerator descriptions for the analytic cost model: peak rates, memory, interconnect, efficiencies.

Every constant cites its source: datasheet numbers exact, achieved efficiencies public measurements rounded to one
or two digits, *estimate* where no direct measurement was at hand (a measured profile always wins). Units: FLOP/s,
bytes, bytes/s, seconds; memory is what ``nvidia-smi`` reports (MiB), what the CUDA allocator's limit is measured
against, not the datasheet's marketing GB. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from lightning_dcp.planning.units import format_bytes

GiB = 1 << 30


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator type and the interconnect around it, as the analytic cost model sees it.

    Bandwidths are achieved *bus* bandwidths (nccl-tests: all-to-all ``bytes * (n-1)/n / busbw``, all-reduce
    ``2 (n-1)/n * bytes / busbw``); ``*_inter``: per GPU when the group spans nodes.

    Args:
        name: registry name.
        peak_flops: dense bf16 tensor-core FLOP/s (datasheet, no sparsity).
        memory_bytes: device memory as ``nvidia-smi`` reports it.
        usable_memory_bytes: default planning limit: ``memory_bytes`` minus the CUDA context, every SP group's NCCL
            buffers and allocator fragmentation.
        hbm_bandwidth: device memory bandwidth (datasheet; memory-bound element-wise ops, optimizer step).
        a2a_bw_intra, a2a_bw_inter: all-to-all bus bandwidth inside a node / across nodes.
        allreduce_bw_intra, allreduce_bw_inter: all-reduce bus bandwidth inside a node / across nodes.
        gpus_per_node: GPUs sharing the fast intra-node fabric.
        collective_latency, collective_latency_inter: fixed cost of one collective inside / across nodes (s).
        kernel_launch_overhead: launch/tail latency of one repeated block's forward kernels per micro-batch (s);
            backward is charged twice this, a recomputed forward once more.
        gemm_half_tokens: tokens per rank at which a block's GEMMs reach half of ``gemm_max_efficiency``
            (``eff = max * t / (t + half)``).
        gemm_max_efficiency: fraction of ``peak_flops`` large bf16 GEMMs reach.
        attn_max_efficiency: fraction of ``peak_flops`` flash attention reaches (forward; backward 2.5x the FLOPs).
        p2p_bw_intra, p2p_bw_inter: point-to-point bandwidth of one ring-attention hop, one direction, inside a node /
            across nodes (:mod:`~lightning_dcp.planning.ring`); 0: that fabric's all-to-all figure.
    """

    name: str
    peak_flops: float
    memory_bytes: float
    usable_memory_bytes: float
    hbm_bandwidth: float
    a2a_bw_intra: float
    a2a_bw_inter: float
    allreduce_bw_intra: float
    allreduce_bw_inter: float
    gpus_per_node: int = 8
    collective_latency: float = 20e-6
    collective_latency_inter: float = 40e-6
    kernel_launch_overhead: float = 40e-6
    gemm_half_tokens: float = 512.0
    gemm_max_efficiency: float = 0.75
    attn_max_efficiency: float = 0.55
    p2p_bw_intra: float = 0.0
    p2p_bw_inter: float = 0.0

    def __post_init__(self) -> None:
        for f in ("peak_flops", "memory_bytes", "usable_memory_bytes", "hbm_bandwidth", "a2a_bw_intra",
                  "a2a_bw_inter", "allreduce_bw_intra", "allreduce_bw_inter"):
            v = getattr(self, f)
            if not v > 0:
                raise ValueError(f"HardwareSpec {self.name!r}: {f} must be positive, got {v!r}")
        if self.usable_memory_bytes > self.memory_bytes:
            raise ValueError(f"HardwareSpec {self.name!r}: usable_memory_bytes {format_bytes(self.usable_memory_bytes)} exceeds "
                             f"memory_bytes {format_bytes(self.memory_bytes)}; lower the usable limit")
        for f in ("gemm_max_efficiency", "attn_max_efficiency"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ValueError(f"HardwareSpec {self.name!r}: {f} is a fraction of peak in (0, 1], got {v!r}")
        if self.gpus_per_node < 1:
            raise ValueError(f"HardwareSpec {self.name!r}: gpus_per_node must be >= 1, got {self.gpus_per_node!r}")
        for f in ("collective_latency", "collective_latency_inter", "kernel_launch_overhead", "gemm_half_tokens",
                  "p2p_bw_intra", "p2p_bw_inter"):
            if getattr(self, f) < 0:
                raise ValueError(f"HardwareSpec {self.name!r}: {f} must be non-negative, got {getattr(self, f)!r}")

    def to_dict(self) -> dict:
        return asdict(self)


# Reserve subtracted from device memory for the default planning limit: CUDA context (~0.5 GiB),
# NCCL buffers for every power-of-two SP group the strategy creates up front (a few hundred MiB
# per communicator on NVLink), cuBLAS/cuDNN workspaces and caching-allocator fragmentation.
# 8 GiB on 80 GiB parts is our estimate (~10 %, the margin Hydraulis App. B.1 calls "a safety margin").
_RESERVE = 8 * GiB

HARDWARE: dict[str, HardwareSpec] = {
    "h100": HardwareSpec(
        name="h100",
        # NVIDIA H100 SXM datasheet: 989.4 TFLOPS dense BF16 tensor core (1979 with sparsity).
        peak_flops=989.4e12,
        # Datasheet: 80 GB HBM3; the driver reports 81559 MiB (nvidia-smi) ~= 79.6 GiB.
        memory_bytes=81559 * (1 << 20),
        usable_memory_bytes=81559 * (1 << 20) - _RESERVE,
        # Datasheet: 3.35 TB/s HBM3.
        hbm_bandwidth=3.35e12,
        # NVLink 4: 900 GB/s bidirectional; NOTES.md: all-to-all ~370 GB/s bus bandwidth (nccl-tests alltoall_perf).
        a2a_bw_intra=370e9,
        # DGX H100: 8x ConnectX-7 400 Gb/s = 50 GB/s per GPU; all-to-all ~80 % of line rate (estimate).
        a2a_bw_inter=40e9,
        # nccl-tests all_reduce_perf on DGX H100 (NVLS): ~450-480 GB/s bus bandwidth; we take 450e9.
        allreduce_bw_intra=450e9,
        # Ring all-reduce across nodes is bounded by the 50 GB/s NIC per GPU; ~90 % achieved (estimate).
        allreduce_bw_inter=45e9,
        gpus_per_node=8,
        # NCCL small-message latency (nccl-tests, 8 bytes): ~10-20 us in an NVLink node, 30-50 us across IB.
        collective_latency=20e-6,
        collective_latency_inter=40e-6,
        # A block's forward: ~20-30 kernels at ~1.5-2 us launch+tail each when tiny, no CUDA graphs (estimate).
        kernel_launch_overhead=40e-6,
        # cuBLAS bf16 GEMMs of width 3072-8192: ~700-750 TFLOPS at M >= 8k (NVIDIA "Deep Learning Performance"
        # guide; Megatron-Core's ~50-55 % MFU at 4k-8k context, reproduced here). Half rate at ~512 tokens per rank:
        # M=512 x 3072 x 3072 fills under one wave of 128x128 tiles on 132 SMs (estimate; ~40 % layer MFU at 1k,
        # ~56 % at 8k). Ignores the width: narrower models (h=1152) saturate later -- optimistic there.
        gemm_half_tokens=512.0,
        gemm_max_efficiency=0.75,
        # FlashAttention-3 (Shah et al. 2024): 55-75 % forward, lower for head dim 64 and causal; FlashAttention-2
        # ~35-40 %; PyTorch's SDPA in between.
        attn_max_efficiency=0.55,
        # Ring hops (estimates): NVLink 4 at most 450 GB/s each way, taken at the all-to-all's 370; across nodes
        # the 50 GB/s NIC, ~90 % achieved.
        p2p_bw_intra=370e9,
        p2p_bw_inter=45e9,
    ),
    "a100": HardwareSpec(
        name="a100",
        # NVIDIA A100 SXM 80GB datasheet: 312 TFLOPS dense BF16.
        peak_flops=312e12,
        # Datasheet: 80 GB HBM2e; the driver reports 81920 MiB.
        memory_bytes=81920 * (1 << 20),
        usable_memory_bytes=81920 * (1 << 20) - _RESERVE,
        # Datasheet: 2,039 GB/s.
        hbm_bandwidth=2.039e12,
        # NVLink 3: 600 GB/s bidirectional: the H100's 370 GB/s scaled by 600/900 (estimate).
        a2a_bw_intra=245e9,
        # DGX A100: 8x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU; ~80 % achieved (estimate).
        a2a_bw_inter=20e9,
        # nccl-tests all_reduce_perf on DGX A100: ~230 GB/s bus bandwidth.
        allreduce_bw_intra=230e9,
        allreduce_bw_inter=22e9,
        # latencies and launches as the H100's (the defaults); A100 bf16 GEMMs reach ~250-270 TFLOPS (0.80-0.87 of peak) at large sizes; a smaller
        # peak saturates at fewer tokens (estimate 384).
        gemm_half_tokens=384.0,
        gemm_max_efficiency=0.80,
        # FlashAttention-2 paper (Dao 2023): 50-73 % of peak forward on A100; we use 0.60.
        attn_max_efficiency=0.60,
        # Ring hops (estimates, as for the H100): the all-to-all figure, ~90 % of the 25 GB/s NIC.
        p2p_bw_intra=245e9,
        p2p_bw_inter=22e9,
    ),
}

# NVIDIA H200 SXM: the H100's die, fabric and NICs (HGX H200 reference), so its compute and network figures;
# datasheet memory 141 GB HBM3e (the driver reports 143771 MiB) at 4.8 TB/s. The DCP paper (§4) ran H200s with
# memory limited to 80 GB: "h200-80gb" (or ``memory_limit=80e9``).
HARDWARE["h200"] = replace(HARDWARE["h100"], name="h200", memory_bytes=143771 * (1 << 20),
                           usable_memory_bytes=143771 * (1 << 20) - 12 * GiB, hbm_bandwidth=4.8e12)
HARDWARE["h200-80gb"] = replace(HARDWARE["h200"], name="h200-80gb", usable_memory_bytes=80e9 - _RESERVE)


def get_hardware(name: str) -> HardwareSpec:
    """The :class:`HardwareSpec` registered as ``name``; the error lists the known names."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known hardware: {', '.join(sorted(HARDWARE))}") from None


def hardware_named(device_name: str) -> HardwareSpec | None:
    """The registered spec whose name the device's name contains (``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``;
    an H200 is the full-memory ``"h200"``), or ``None`` for a device this registry does not describe."""
    name = device_name.lower().replace("-", "").replace(" ", "")
    for key in ("h200", "h100", "a100"):
        if key in name:
            return HARDWARE[key]
    return None
