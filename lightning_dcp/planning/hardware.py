"""Accelerator descriptions for the analytic cost model: peak rates, memory, interconnect, efficiencies.

Every constant cites where it comes from. Datasheet numbers are exact; achieved-efficiency numbers
are public measurements rounded to one or two digits, and marked *estimate* where no direct
measurement of that exact quantity was at hand. The analytic model is a planning aid, not a
simulator of silicon: a measured profile (:class:`~lightning_dcp.planning.profiled.ProfiledCostModel`)
always wins where one exists.

Units: FLOP/s, bytes, bytes/s, seconds. "GB" on datasheets for HBM capacity is the marketing
figure; we store the total that ``nvidia-smi`` reports (MiB), which is what the CUDA allocator's
limit is measured against (``torch.cuda.mem_get_info`` sees slightly less after the context).

Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from lightning_dcp.planning.units import format_bytes

GiB = 1 << 30


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator type and the interconnect around it, as the analytic cost model sees it.

    Args:
        name: registry name.
        peak_flops: dense bf16 tensor-core FLOP/s (datasheet, no sparsity).
        memory_bytes: device memory as ``nvidia-smi`` reports it.
        usable_memory_bytes: default memory limit for planning: ``memory_bytes`` minus a reserve for
            the CUDA context, NCCL communicator buffers of every SP group and allocator
            fragmentation.
        hbm_bandwidth: device memory bandwidth (datasheet), bytes/s; used for memory-bound work
            (element-wise ops, optimizer step).
        a2a_bw_intra: achieved all-to-all *bus* bandwidth inside one node, bytes/s (nccl-tests
            convention: time = bytes * (n-1)/n / busbw).
        a2a_bw_inter: achieved all-to-all bus bandwidth per GPU when the group spans nodes.
        allreduce_bw_intra: achieved all-reduce bus bandwidth inside a node (time = 2(n-1)/n * bytes / busbw).
        allreduce_bw_inter: achieved all-reduce bus bandwidth across nodes, per GPU.
        gpus_per_node: GPUs sharing the fast intra-node fabric.
        collective_latency: fixed cost of one collective inside a node (s).
        collective_latency_inter: fixed cost of one collective that crosses nodes (s).
        kernel_launch_overhead: launch/tail latency of one repeated block's forward kernels for one
            micro-batch (s); backward is charged twice this, a recomputed forward once more.
        gemm_half_tokens: tokens per rank at which the GEMMs of a block reach half of
            ``gemm_max_efficiency`` (``eff = max * t / (t + half)``).
        gemm_max_efficiency: fraction of ``peak_flops`` that large bf16 GEMMs reach.
        attn_max_efficiency: fraction of ``peak_flops`` that flash attention reaches (forward; the
            backward is charged 2.5x the forward FLOPs at the same rate, see analytic.py).
        p2p_bw_intra: achieved point-to-point (send/receive) bandwidth between two GPUs of a node,
            one direction, bytes/s: a ring-attention hop (:mod:`~lightning_dcp.planning.ring`); 0: the
            all-to-all figure of that fabric.
        p2p_bw_inter: the same between GPUs of two nodes (per GPU, its NIC); 0: the all-to-all figure.
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
        # NVLink 4 is 900 GB/s bidirectional (450 GB/s each way); NOTES.md: all-to-all measured at
        # ~370 GB/s bus bandwidth on H100 NVLink (nccl-tests alltoall_perf, large messages).
        a2a_bw_intra=370e9,
        # DGX H100 / HGX reference: 8x ConnectX-7 400 Gb/s per node = 50 GB/s per GPU; all-to-all
        # across nodes reaches ~80 % of line rate in nccl-tests (estimate) -> 40 GB/s.
        a2a_bw_inter=40e9,
        # nccl-tests all_reduce_perf on DGX H100 (NVLS): ~450-480 GB/s bus bandwidth; we take 450e9.
        allreduce_bw_intra=450e9,
        # Ring all-reduce across nodes is bounded by the 50 GB/s NIC per GPU; ~90 % achieved (estimate).
        allreduce_bw_inter=45e9,
        gpus_per_node=8,
        # NCCL small-message latency: ~10-20 us inside an NVLink node, 30-50 us across IB
        # (nccl-tests, 8-byte messages); we use 20 us / 40 us.
        collective_latency=20e-6,
        collective_latency_inter=40e-6,
        # A transformer block's forward is ~20-30 kernels at ~1.5-2 us launch+tail each when the
        # kernels are tiny (CUDA launch latency, no CUDA graphs): ~40 us (estimate).
        kernel_launch_overhead=40e-6,
        # cuBLAS bf16 GEMMs of width 3072-8192 reach ~700-750 TFLOPS (~0.72-0.76 of peak) on H100
        # when M >= 8k (NVIDIA "Deep Learning Performance" GEMM guide; Megatron-Core reports ~50-55 %
        # end-to-end MFU for GPT-class models at 4k-8k context on H100, which this model reproduces
        # once attention and element-wise time are added). Half of the large-M rate at ~512 tokens
        # per rank: an M=512 x 3072 x 3072 GEMM fills under one wave of 128x128 tiles on 132 SMs
        # (estimate; gives ~40 % layer MFU at 1k tokens, ~56 % at 8k). The curve ignores the
        # hidden size: narrower models (2d, h=1152) saturate later in reality -- optimistic there.
        gemm_half_tokens=512.0,
        gemm_max_efficiency=0.75,
        # FlashAttention-3 paper (Shah et al. 2024): 540-740 TFLOPS bf16 forward on H100 (55-75 %),
        # lower for head dim 64 and causal masks; FlashAttention-2 on H100 ~35-40 %. PyTorch's
        # SDPA (cuDNN/flash backends) sits in between; we use 0.55.
        attn_max_efficiency=0.55,
        # Ring-attention hops (estimates): a send/receive between two NVLink-4 GPUs moves at most 450 GB/s
        # each way; we take the all-to-all's achieved 370 GB/s. Across nodes one 400 Gb/s NIC per GPU
        # (50 GB/s each way), ~90 % achieved as for the all-reduce: 45 GB/s.
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
        # NVLink 3: 600 GB/s bidirectional; nccl-tests alltoall on DGX A100 ~ 2/3 of the H100 figure
        # (estimate: scaled by NVLink bandwidth 600/900 from the 370 GB/s H100 measurement).
        a2a_bw_intra=245e9,
        # DGX A100: 8x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU; ~80 % achieved (estimate).
        a2a_bw_inter=20e9,
        # nccl-tests all_reduce_perf on DGX A100: ~230 GB/s bus bandwidth.
        allreduce_bw_intra=230e9,
        allreduce_bw_inter=22e9,
        gpus_per_node=8,
        collective_latency=20e-6,
        collective_latency_inter=40e-6,
        kernel_launch_overhead=40e-6,
        # A100 bf16 GEMMs reach ~250-270 TFLOPS (0.80-0.87 of peak) at large sizes; a smaller
        # peak saturates at fewer tokens (estimate 384).
        gemm_half_tokens=384.0,
        gemm_max_efficiency=0.80,
        # FlashAttention-2 paper (Dao 2023): 50-73 % of peak forward on A100; we use 0.60.
        attn_max_efficiency=0.60,
        # Ring hops (estimates, as for the H100): the all-to-all figure inside a node, ~90 % of the
        # 25 GB/s HDR NIC across nodes.
        p2p_bw_intra=245e9,
        p2p_bw_inter=22e9,
    ),
}

# The DCP paper's setting (§4, "H200 GPUs with memory limited to 80 GB").
# NVIDIA H200 SXM: the same GH100 die, tensor cores, NVLink 4 / NVSwitch fabric and NICs as the
# H100 SXM (HGX H200 reference), so every compute and network figure is the H100's; what differs
# is memory. Datasheet: 141 GB HBM3e (the driver reports 143771 MiB) at 4.8 TB/s. NOTE: the DCP
# paper ran its H200 experiments with memory limited to 80 GB: use the "h200-80gb" entry (or
# ``memory_limit=80e9``) to reproduce that.
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
