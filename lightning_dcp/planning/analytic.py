"""Analytic cost model: a micro-batch's time and memory from a model shape and a hardware description.

Used when no measured profile exists (planning ahead of a run, the simulator, the CLI). Every term is linear in
the micro-batch's tokens, attention work and sample count (:mod:`~lightning_dcp.planning.linear`); the terms and
their assumptions are in docs/cost-models.md. Pure Python: no torch.
"""

from __future__ import annotations

import math
import operator
from dataclasses import replace
from typing import Any, Mapping, Sequence

from lightning_dcp.planning.cost_model import keep_class
from lightning_dcp.planning.hardware import GiB, HardwareSpec
from lightning_dcp.planning.linear import LinearCost, LinearCostModel, Terms
from lightning_dcp.planning.models import ModelSpec
from lightning_dcp.planning.prices import CollectivePrices
from lightning_dcp.planning.sharding.base import StateParts
from lightning_dcp.planning.sharding.hsdp import HsdpMode
from lightning_dcp.planning.sharding.hsdp_cost import ShardGroupCostModel
from lightning_dcp.planning.sharding.registry import get_mode, resolve_sharding
from lightning_dcp.planning.sp_sizes import kv_repeat, ulysses_sizes
from lightning_dcp.planning.tensor_parallel import TPTerms

ATTN_BWD_RATIO = 2.5
"""FlashAttention's backward does 2.5x the forward FLOPs (5 matmuls against 2; Dao 2023, §3.1/§4)."""
WORKSPACE_BYTES = 1 * GiB
"""Per-device workspace beyond the hardware reserve: cuBLAS/cuDNN, rotary/mask caches, small buffers (estimate)."""
HEAD_LAUNCHES = 6
"""Kernels outside the repeated layers per micro-batch (embedding, final norm, head, loss; fwd and bwd)."""
OPTIMIZER_BYTES_PER_PARAM = 36.0
"""Memory-bound Adam step per local parameter: fp32 master, m, v read+written (24), bf16 grad read and its fp32 copy
written/read (10), bf16 parameter written (2)."""
GRAD_BUCKET_BYTES = 5e8
"""Gradient bucket of DDP/DeepSpeed (~500 MB): one collective (a pair under ZeRO) and its latency each."""


def _positive_int(value: Any, what: str) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        v = 0
    if v < 1 or isinstance(value, bool):
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return v


def _check_dtype_and_model(dtype_bytes: int, model: ModelSpec) -> None:
    """The dtype and model shapes :class:`AnalyticCostModel` can cost (``ValueError`` naming the fix otherwise)."""
    if dtype_bytes not in (1, 2, 4):
        raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {dtype_bytes!r}")
    if model.kind not in ("1d", "2d", "3d"):
        raise ValueError(f"model {model.name!r} has kind {model.kind!r}; the analytic model knows '1d', '2d' and '3d'")
    if model.kind == "2d" and model.spatial_tokens <= 0:
        raise ValueError(f"2d model {model.name!r} needs spatial_tokens > 0 to split a length into frames")
    if model.kind == "3d" and (model.text_len < 0 or (model.text_len > 0) != (model.text_dim > 0)):
        raise ValueError(f"3d model {model.name!r}: text_len ({model.text_len}) and text_dim ({model.text_dim}) must "
                         "both be positive (cross-attention to the text) or both 0 (none)")


def default_activation_factor(model: ModelSpec, dtype_bytes: int = 2) -> float:
    """Bytes stashed for backward per token per attention+MLP block, divided by ``hidden_size``.

    Pre-norm block, flash attention (no ``s^2`` scores kept), no dropout, the block's input excluded (counted
    apart, paper eq. 6): norm output, q, k, v, attention output, residual, second norm (7h); MLP: SwiGLU (1d) 4 x
    ffn, GELU (2d, 3d) 2 x ffn; 3d: the two modulated norm copies (2h), with cross-attention its norm, q, output
    and residual (4h). Transformer-1D in bf16: 35.3 (Korthikanti et al. 2022: 34).
    """
    mlp = 4 if model.kind == "1d" else 2
    extra = (2 if model.kind == "3d" else 0) + (4 if model.cross_attention else 0)
    return dtype_bytes * (7 + extra + mlp * model.ffn_hidden_size / model.hidden_size)


class AnalyticCostModel(LinearCostModel):
    """Closed-form time and memory of a DCP micro-batch: Ulysses SP, sharded data parallel, flash attention.

    Per rank, ``t = T / sp`` tokens, attention work ``W`` (:meth:`attention_work`), ``n`` samples, ``r``
    recomputed layers: ``item = L (fwd + bwd) + r fwd + (2L + r) a2a + head``; GEMMs at ``gemm_max_efficiency * t /
    (t + gemm_half_tokens)``, attention at ``attn_max_efficiency`` (backward 2.5x), element-wise passes at
    ``hbm_bandwidth``, launches, Ulysses all-to-alls (not overlapped; 0 at sp 1); rings (1d, 3d) as
    :mod:`~lightning_dcp.planning.ring` says. Memory per rank: ``states + workspace + t (L inp + (L - r) act +
    max(act, head_act))``, the states as ``sharding`` leaves them in the micro-batch loop. Every term:
    docs/cost-models.md.

    Args:
        model: the model shape.
        hardware: the accelerator.
        world_size: ranks sharing the sharded states.
        memory_limit: bytes per device the planner may use; default ``hardware.usable_memory_bytes``.
        dtype_bytes: bytes per parameter/activation element of the compute dtype (2 for bf16).
        sharding: ``"none"``, ``"zero1"`` (default, the DCP paper's; ``DCPStrategy``'s is ``none``), ``"zero2"`` or
            ``"fsdp"`` (:mod:`~lightning_dcp.planning.sharding`).
        zero_stage: older alias: 0, 1, 2 for ``"none"``, ``"zero1"``, ``"zero2"``.
        activation_factor: override :func:`default_activation_factor`.
        state_parts: one replica's ``weights``, ``buffers``, ``gradients``, ``optimizer`` bytes measured elsewhere
            (the runtime's), instead of the estimate from the shape.
        memory_limit_source: where ``memory_limit`` came from, for messages.
    """

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, world_size: int, *,
                 memory_limit: float | None = None, dtype_bytes: int = 2, sharding: str | None = None,
                 zero_stage: int | None = None, activation_factor: float | None = None,
                 state_parts: Mapping[str, float] | None = None, memory_limit_source: str | None = None) -> None:
        world_size = _positive_int(world_size, "world_size")
        self.sharding = resolve_sharding(sharding, zero_stage)
        _check_dtype_and_model(dtype_bytes, model)
        self.model = model
        self.hardware = hardware
        self.world_size = world_size
        self.dtype_bytes = dtype_bytes
        self.mode = get_mode(self.sharding, world_size)
        """The sharding mode's pure counterpart (:mod:`lightning_dcp.planning.sharding`)."""
        self.zero_stage = self.mode.zero_stage
        """0-3 for none, zero1, zero2, fsdp."""
        self.num_layers = model.num_layers
        self.num_heads = model.num_heads
        self.gpus_per_node = hardware.gpus_per_node
        self.memory_limit = float(hardware.usable_memory_bytes if memory_limit is None else memory_limit)
        if not self.memory_limit > 0:
            raise ValueError(f"memory_limit must be positive, got {memory_limit!r}")
        self.memory_limit_source = (memory_limit_source or
                                    (f"hardware {hardware.name!r} usable memory" if memory_limit is None else "memory_limit="))
        self.activation_factor = (default_activation_factor(model, dtype_bytes) if activation_factor is None
                                  else float(activation_factor))
        if not self.activation_factor > 0:
            raise ValueError(f"activation_factor must be positive, got {activation_factor!r}")
        self._square_work = model.kind != "2d"  # attention work l^2 (1d, 3d) or spatial + temporal (2d)
        self._spatial = float(model.spatial_tokens)
        self.prices_ring = model.kind != "2d"  # rings split full self-attention (1d, 3d)
        self.no_ring_reason = f"no ring pricing for the 2d model {model.name!r}; plan it with ring=1"
        self.prices_tp = True  # Megatron TP + sequence parallelism inside an item, at the hardware's collective prices
        LinearCostModel.__init__(self)
        self._init_layer_times()
        self._init_head_times()
        self._init_ideal()
        self._init_memory(state_parts)

    def _init_layer_times(self) -> None:
        """Per-layer, per-rank time coefficients (the SP-independent parts)."""
        model, hw, dtype_bytes = self.model, self.hardware, self.dtype_bytes
        h, blocks, peak = model.hidden_size, model.blocks_per_layer, hw.peak_flops
        kv = model.cross_kv_params()  # 3d: cross-attention k, v projections, on the text
        text = float(model.text_len)
        self._gemm_s_per_token = 2.0 * (model.layer_params() - kv) / (peak * hw.gemm_max_efficiency)  # fwd, per rank-token
        self._gemm_half = float(hw.gemm_half_tokens)
        self._attn_flops_per_work = 4.0 * h * (0.5 if model.causal else 1.0)  # forward, all blocks share W
        self._attn_s_per_work = self._attn_flops_per_work / (peak * hw.attn_max_efficiency)
        # 3d cross-attention: QK^T and AV of each video token against text_len text tokens (forward)
        self._cross_flops_per_token = 4.0 * text * h
        self._cross_s_per_token = self._cross_flops_per_token / (peak * hw.attn_max_efficiency)
        # 3d text keys/values, once per sample on every rank of the group (forward; with the GEMM constant)
        self._kv_s_per_sample = 2.0 * kv * (text + self._gemm_half) / (peak * hw.gemm_max_efficiency) if kv else 0.0
        self._kv_ideal_per_sample = 2.0 * kv * text / (peak * hw.gemm_max_efficiency)
        self.act_bytes_per_token = self.activation_factor * h * blocks       # per layer, per rank-token
        self.input_bytes_per_token = float(h * dtype_bytes)                  # per layer, per rank-token
        self._elem_s_per_token = 2.0 * self.act_bytes_per_token / hw.hbm_bandwidth  # forward
        self._launch = hw.kernel_launch_overhead * blocks                   # forward, per layer
        self._a2a_h_bytes = float(blocks * h * dtype_bytes)
        self._kv_fraction = (model.num_kv_heads or model.num_heads) / model.num_heads  # key/value width / h

    def _init_head_times(self) -> None:
        """Head / embedding time per micro-batch (per token and constant), and 3d's text MLP per sample."""
        model, hw, dtype_bytes = self.model, self.hardware, self.dtype_bytes
        h, peak, text = model.hidden_size, hw.peak_flops, float(model.text_len)
        if model.kind == "1d":
            head_params = h * model.vocab_size
            self.head_bytes_per_token = float(model.vocab_size * (dtype_bytes + 4))
            # logits written (fwd), read by the loss, gradient written: 3 passes over dtype+fp32 bytes
            head_elem = 3.0 * self.head_bytes_per_token / hw.hbm_bandwidth
        else:
            head_params = 2 * h * model.in_channels
            self.head_bytes_per_token = 0.0
            head_elem = 0.0
        self._head_params = head_params
        head_gemm = 3.0 * 2.0 * head_params / (peak * hw.gemm_max_efficiency)
        self._head_s_per_token = head_gemm + head_elem
        self._head_const = head_gemm * self._gemm_half + HEAD_LAUNCHES * hw.kernel_launch_overhead
        # 3d text MLP (text_dim -> h -> h) over the sample's text tokens, forward + backward, per sample
        self._text_params = (model.text_dim + h) * h if model.cross_attention else 0
        text_gemm = 3.0 * 2.0 * self._text_params / (peak * hw.gemm_max_efficiency)
        self._head_s_per_sample = text_gemm * (text + self._gemm_half) if self._text_params else 0.0

    def _init_ideal(self) -> None:
        """The ideal's per-sample coefficients on one device: every layer's GEMMs at ``gemm_max_efficiency`` without
        the small-GEMM constant, attention (fwd + bwd) at ``attn_max_efficiency``, element-wise passes, the head's
        per-token work; no all-to-all, recompute, launches or all-reduce."""
        hw, L, text = self.hardware, self.num_layers, float(self.model.text_len)
        text_gemm = 3.0 * 2.0 * self._text_params / (hw.peak_flops * hw.gemm_max_efficiency)
        self._ideal_s_per_token = (L * 3.0 * (self._gemm_s_per_token + self._elem_s_per_token)
                                   + L * (1.0 + ATTN_BWD_RATIO) * self._cross_s_per_token + self._head_s_per_token)
        self._ideal_s_per_work = L * (1.0 + ATTN_BWD_RATIO) * self._attn_s_per_work
        self._ideal_s_per_sample = L * 3.0 * self._kv_ideal_per_sample + text_gemm * text

    def _init_memory(self, state_parts: Mapping[str, float] | None) -> None:
        """Model-state bytes per rank (estimated from the shape, or ``state_parts``) and the per-token memory terms."""
        model, db, L = self.model, self.dtype_bytes, self.num_layers
        P = model.params()
        self.param_count = P
        master = 4.0 if db < 4 else 0.0
        if state_parts is None:  # fp32 master + Adam m, v; buffers (rotary/mask caches) are in the workspace
            parts = {"weights": db * P, "buffers": 0.0, "gradients": db * P, "optimizer": (master + 8.0) * P}
        else:
            given = state_parts if isinstance(state_parts, StateParts) else StateParts.from_mapping(state_parts)
            parts = {"weights": given.weights, "buffers": given.buffers, "gradients": given.gradients,
                     "optimizer": given.optimizer}
        self.full_state_parts = parts
        """One replica's state bytes (``weights``, ``buffers``, ``gradients``, ``optimizer``)."""
        self.state_bytes = self.mode.state_bytes(StateParts(**parts))
        """Model-state bytes per rank in the micro-batch loop (what the planner budgets)."""
        self.state_bytes_at_rest = self.mode.state_bytes(StateParts(**parts), at_rest=True)
        """Model-state bytes per rank between steps (zero2 and fsdp hold less there)."""
        self.workspace_bytes = float(WORKSPACE_BYTES)
        self._mem_base = self.state_bytes + self.workspace_bytes
        self._transient_per_token = max(self.act_bytes_per_token, self.head_bytes_per_token)
        # per rank-token bytes with r = 0; each recomputed layer removes act_bytes_per_token
        self._mem_per_token_r0 = L * (self.input_bytes_per_token + self.act_bytes_per_token) + self._transient_per_token

    def attention_work(self, length: int) -> float:
        """Attention work of one sample: ``l^2`` for 1d and 3d; for 2d, ``frames = max(1, l / spatial_tokens)``
        frames of ``l / frames`` tokens: spatial ``l^2 / frames`` plus temporal ``l * frames``."""
        if self._square_work:
            return float(length) * length
        fr = length / self._spatial
        if fr < 1.0:
            fr = 1.0
        return length * length / fr + length * fr

    def _sums(self, lengths: Sequence[int]) -> tuple[int, float]:
        if self._square_work:
            return super()._sums(lengths)
        tokens, work, s = 0, 0.0, self._spatial
        for n in lengths:
            tokens += n
            fr = n / s
            if fr < 1.0:
                fr = 1.0
            work += n * n / fr + n * fr
        return tokens, work

    def linear_cost(self, sp: int) -> LinearCost:
        """The per-rank coefficients at SP size ``sp`` (forward per layer ``f*``, backward ``b*``, all-to-all ``a*``,
        head ``o*``; ``*W`` per unit of work, ``*T`` per token, ``*C`` constant, ``*N`` per sample)."""
        sp = _positive_int(sp, "sp")
        if self.num_heads % sp:
            raise ValueError(f"sp={sp} does not divide num_heads={self.num_heads} of model {self.model.name!r}; "
                             f"usable Ulysses SP sizes: {list(ulysses_sizes(self.num_heads, self.num_heads))} (larger "
                             "groups: ring=)")
        hw, L = self.hardware, self.num_layers
        inv = 1.0 / sp
        g, half, la = self._gemm_s_per_token, self._gemm_half, self._launch
        fW = self._attn_s_per_work * inv
        cross = self._cross_s_per_token * inv
        fT = (g + self._elem_s_per_token) * inv + cross
        fC = g * half + la
        fN = self._kv_s_per_sample  # per sample, not split over the group
        bW = ATTN_BWD_RATIO * fW
        bT = 2.0 * (fT - cross) + ATTN_BWD_RATIO * cross
        bC = 2.0 * fC
        bN = 2.0 * fN
        if sp == 1:
            aT = aC = 0.0
        else:  # 4 all-to-alls per block forward: q, k, v in (k, v narrower or repeated), the output back
            intra = sp <= hw.gpus_per_node
            bw = hw.a2a_bw_intra if intra else hw.a2a_bw_inter
            lat = hw.collective_latency if intra else hw.collective_latency_inter
            f = kv_repeat(self.model.num_heads, self.model.num_kv_heads, sp)
            aT = self._a2a_h_bytes * (2.0 + 2.0 * self._kv_fraction * f) * (sp - 1) / sp / bw * inv
            aC = 4 * self.model.blocks_per_layer * lat
        oT = self._head_s_per_token * inv
        oC = self._head_const
        oN = self._head_s_per_sample
        return LinearCost(
            time=Terms(L * (fW + bW), L * (fT + bT + 2 * aT) + oT, L * (fC + bC + 2 * aC) + oC, L * (fN + bN) + oN),
            time_per_layer=Terms(fW, fT + aT, fC + aC, fN),
            compute=Terms(L * (fW + bW), L * (fT + bT), L * (fC + bC), L * (fN + bN)),
            recompute=Terms(fW, fT, fC, fN),
            comm=Terms(0.0, 2 * L * aT, 2 * L * aC), comm_per_layer=Terms(0.0, aT, aC),
            overhead=Terms(0.0, oT, oC, oN),
            ideal=Terms(self._ideal_s_per_work * inv, self._ideal_s_per_token * inv, 0.0, self._ideal_s_per_sample * inv),
            memory=self._mem_base, memory_per_token=self._mem_per_token_r0 * inv,
            memory_per_layer_token=self.act_bytes_per_token * inv, attn_fwd=fW, attn_bwd=bW)

    def kv_bytes_per_token(self, u: int) -> float:
        m = self.model
        kv = 2.0 * m.hidden_size * self._kv_fraction * kv_repeat(m.num_heads, m.num_kv_heads, u) / u
        return m.blocks_per_layer * kv * self.dtype_bytes

    def tp_terms(self) -> TPTerms:
        """TP collectives of this shape: per layer forward an all-gather + reduce-scatter pair per attention and per
        MLP of each block (and one for 3d cross-attention), of ``hidden_size x dtype_bytes`` per token, at the
        hardware's all-reduce bus bandwidth (:mod:`~lightning_dcp.planning.tensor_parallel`)."""
        m = self.model
        pairs = 2 * m.blocks_per_layer + (1 if m.cross_attention else 0)
        return TPTerms(float(m.hidden_size * self.dtype_bytes), pairs, self.collective_prices(), self.num_layers)

    def ring_transfer(self, lengths: Sequence[int], p: int, recompute: int) -> float:
        """:meth:`ring_cost`'s estimated exposed transfers on a pure ring of ``p`` ranks: per layer forward ``p - 1`` steps
        of ``2 (T/p) h_kv dtype_bytes`` bytes at the all-to-all bandwidth, backward twice that, each overlapping
        that step's attention; forward and backward, once more per recomputed layer."""
        hw, m = self.hardware, self.model
        intra = p <= hw.gpus_per_node
        bw = hw.a2a_bw_intra if intra else hw.a2a_bw_inter
        lat = hw.collective_latency if intra else hw.collective_latency_inter
        h_kv = m.hidden_size * (m.num_kv_heads or m.num_heads) / m.num_heads
        fwd_p2p = m.blocks_per_layer * (p - 1) * (2.0 * (sum(lengths) / p) * h_kv * self.dtype_bytes / bw + lat)
        fwd_attn = self._attn_s_per_work * sum(self.attention_work(n) for n in lengths) / p
        exp_f = max(0.0, fwd_p2p - fwd_attn)
        exp_b = max(0.0, 2.0 * fwd_p2p - ATTN_BWD_RATIO * fwd_attn)
        return self.num_layers * (exp_f + exp_b) + recompute * exp_f

    def step_overhead(self, world_size: int) -> float:
        """Gradient reduction over ``world_size`` ranks plus the optimizer step: ``none``/``zero1`` all-reduce
        ``2 (N-1)/N G / busbw``, ``zero2``/``fsdp`` reduce-scatter + all-gather ``(N-1)/N (G + W) / busbw``
        (inter-node bandwidth past a node), a latency per 500 MB bucket (two when sharded); Adam over the local
        shard at ``OPTIMIZER_BYTES_PER_PARAM / hbm_bandwidth`` per parameter. zero1's weight broadcast not charged."""
        hw, N = self.hardware, _positive_int(world_size, "world_size")
        parts = self.full_state_parts
        comm = 0.0
        if N > 1:
            intra = N <= hw.gpus_per_node
            bw = hw.allreduce_bw_intra if intra else hw.allreduce_bw_inter
            lat = hw.collective_latency if intra else hw.collective_latency_inter
            moved, per_bucket = self.mode.step_traffic(StateParts(**parts))
            buckets = math.ceil(parts["gradients"] / GRAD_BUCKET_BYTES)
            comm = (N - 1) / N * moved / bw + per_bucket * buckets * lat
        shard = self.param_count * get_mode(self.sharding, N).optimizer_share()
        return comm + OPTIMIZER_BYTES_PER_PARAM * shard / hw.hbm_bandwidth

    def collective_prices(self) -> CollectivePrices:
        """The hardware's all-reduce bus bandwidths and latencies."""
        return CollectivePrices.from_hardware(self.hardware)

    def with_sharding(self, states: Mapping[str, Any]) -> "AnalyticCostModel":
        """This model, hardware, limit, dtype and activation factor planned for the runtime's ``states["sharding"]``
        on ``states["world_size"]`` ranks, with its measured state bytes when given
        (:meth:`lightning_dcp.runtime.sharding.states.ModelStates.to_dict`)."""
        rebuilt = AnalyticCostModel(self.model, self.hardware, int(states["world_size"]), memory_limit=self.memory_limit,
                                    dtype_bytes=self.dtype_bytes, sharding=states["sharding"],
                                    activation_factor=self.activation_factor,
                                    state_parts=StateParts.from_mapping(states, required=False),
                                    memory_limit_source=self.memory_limit_source)
        return keep_class(self, rebuilt)  # type: ignore[return-value]  # a user's subclass keeps its overrides

    def signature(self) -> dict:
        return {"source": "analytic", "model": self.model.to_dict(), "hardware": self.hardware.to_dict(),
                "world_size": self.world_size, "memory_limit": self.memory_limit, "dtype_bytes": self.dtype_bytes,
                "sharding": self.sharding, "zero_stage": self.zero_stage, "activation_factor": self.activation_factor,
                "state_bytes": self.state_bytes}

    def model_flops(self, lengths: Sequence[int]) -> float:
        """Model FLOPs of one training pass over ``lengths`` (forward + 2x backward, causal attention halved;
        3d: cross-attention per token, text keys/values and text MLP once per sample)."""
        T, W = self._sums(lengths)
        n, L, m = len(lengths), self.num_layers, self.model
        kv, text = m.cross_kv_params(), m.text_len
        layer = 2.0 * (m.layer_params() - kv) * T + self._attn_flops_per_work * W + self._cross_flops_per_token * T
        fwd = L * (layer + 2.0 * kv * text * n) + 2.0 * self._head_params * T + 2.0 * self._text_params * text * n
        return 3.0 * fwd

    def mfu(self, lengths: Sequence[int], sp: int = 1, recompute: int = 0) -> float:
        """Model FLOPs utilization of one micro-batch: model FLOPs / (time * sp * peak)."""
        return self.model_flops(lengths) / (self.item_time(lengths, sp, recompute) * sp * self.hardware.peak_flops)


def replica_parts(analytic: AnalyticCostModel) -> StateParts:
    """The state parts of ``analytic``'s one replica, per layer and outside the layers (a sharding mode's input)."""
    db, model = analytic.dtype_bytes, analytic.model
    return replace(StateParts.from_mapping(analytic.full_state_parts), layer_bytes=db * model.layer_params(),
                   root_bytes=db * model.edge_params(), params=float(analytic.param_count))


def hsdp_view(analytic: AnalyticCostModel, shard_group_size: int | None = None, *,
              offload: bool = False) -> ShardGroupCostModel:
    """The :class:`~lightning_dcp.planning.sharding.hsdp_cost.ShardGroupCostModel` of an analytic model
    (``shard_group_size`` default: the world)."""
    mode = HsdpMode(analytic.world_size, shard_group_size=shard_group_size, offload=offload)
    return mode.plan_with(analytic, replica_parts(analytic))
