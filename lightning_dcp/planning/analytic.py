"""Analytic cost model: time and memory of a micro-batch from a model shape and a hardware description.

Used when no measured profile exists (planning ahead of a run, the simulator, the CLI). Every
term is a closed form, linear in three sums over the micro-batch: its token count, its attention
work (``sum l_i^2`` for 1d models) and a constant, so the planner's inner loop costs a handful of
multiplications. See :class:`AnalyticCostModel` for the terms and the assumptions.

Pure Python: no torch, no numpy needed.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Mapping, Sequence

from lightning_dcp.planning.cost_model import CostModel, ItemCost, keep_class
from lightning_dcp.planning.hardware import GiB, HardwareSpec
from lightning_dcp.planning.models import ModelSpec
from lightning_dcp.planning.prices import CollectivePrices
from lightning_dcp.planning.sharding.base import StateParts
from lightning_dcp.planning.sharding.registry import get_mode, resolve_sharding
from lightning_dcp.planning.ring import RingPriced, RingTerms, hardware_ring_terms
from lightning_dcp.planning.sp_sizes import kv_repeat, ulysses_sizes

# FlashAttention's backward recomputes the score matrix: 5 matmuls against the forward's 2, so the
# backward kernel does 2.5x the forward FLOPs (Dao 2023, FlashAttention-2 §3.1/§4).
ATTN_BWD_RATIO = 2.5
# Fixed per-device workspace beyond the hardware reserve: cuBLAS/cuDNN workspaces, rotary/mask
# caches, the embedding output, small buffers (estimate).
WORKSPACE_BYTES = 1 * GiB
# Kernels outside the repeated layers per micro-batch (embedding, final norm, head, loss; forward
# and backward), charged at the hardware's per-block launch overhead.
HEAD_LAUNCHES = 6
# Optimizer step bytes moved per parameter of the local shard (memory-bound Adam): read+write fp32
# master (8), m (8), v (8), read the bf16 grad and write/read its fp32 copy (2+4+4), write the
# bf16 parameter (2) = 36 bytes.
OPTIMIZER_BYTES_PER_PARAM = 36.0
# Gradient buckets: DeepSpeed/DDP reduce in ~500 MB buckets; each bucket is one collective (or a
# reduce-scatter + all-gather pair under ZeRO) and pays the collective latency.
GRAD_BUCKET_BYTES = 5e8


def _positive_int(value, what: str) -> int:
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

    Counted tensor by tensor for a pre-norm block with flash attention (no ``s^2`` score matrix is
    kept, only the output and a per-head log-sum-exp), no dropout, the block's input excluded
    (the layer input is counted separately, kept even when checkpointed, paper eq. 6):

    * attention half: norm output (h), q, k, v (3h), attention output (h), residual sum (h),
      second norm output (h) = 7h elements;
    * MLP: SwiGLU (1d) keeps gate, up, silu(gate), silu(gate)*up = 4 x ffn; GELU (2d, 3d) keeps
      fc1 output and gelu output = 2 x ffn;
    * 3d only: the timestep-modulated copies of the two modulated norm outputs (2h), and with
      cross-attention its norm output, q, attention output and residual sum (4h).

    For the Transformer-1D (h=3072, ffn=8192, bf16) that is 2*(7 + 4*8192/3072) = 35.3 bytes per
    hidden unit, next to the 34 of Korthikanti et al. 2022 (their 4h GELU MLP with dropout masks,
    flash attention removing the 5as term).
    """
    mlp = 4 if model.kind == "1d" else 2
    extra = (2 if model.kind == "3d" else 0) + (4 if model.cross_attention else 0)
    return dtype_bytes * (7 + extra + mlp * model.ffn_hidden_size / model.hidden_size)


class AnalyticCostModel(RingPriced, CostModel):
    """Closed-form time and memory of a DCP micro-batch: Ulysses SP, sharded data parallel, flash attention.

    Time of one micro-batch with ``T`` tokens, per-rank tokens ``t = T / sp``, attention work ``W``
    (``sum l_i^2`` over the packed samples for 1d and 3d; see :meth:`attention_work` for 2d), ``n``
    samples, on an SP group of ``sp`` ranks with ``r`` recomputed layers::

        item = L * (fwd + bwd) + r * fwd + (2 L + r) * a2a + head

    per repeated layer (every term per rank):

    * GEMMs: ``2 * layer_params * t`` FLOPs forward, twice that backward, at efficiency
      ``gemm_max_efficiency * t / (t + gemm_half_tokens)`` -- which makes GEMM time exactly
      ``2 * layer_params * (t + half) / (peak * max_eff)``: small per-rank batches pay a constant.
    * attention: ``4 h W / sp`` FLOPs forward (halved for a causal mask), 2.5x that backward, at
      ``attn_max_efficiency`` (Ulysses gives each rank ``heads/sp`` heads of the full sequence).
    * element-wise (norms, activations, residuals, rotary): memory-bound, each stashed activation
      written once and read once forward (``2 * activation bytes``), twice that backward, at
      ``hbm_bandwidth``.
    * launch latency: ``kernel_launch_overhead`` per block forward, twice backward.
    * Ulysses all-to-all (``a2a``): ``4`` per block forward (q, k, v in; output back), of ``t * h *
      dtype_bytes`` bytes each (k and v: ``kv_heads * f / heads`` of that, grouped-query heads repeated
      as :func:`~lightning_dcp.planning.sp_sizes.kv_repeat` says), ``(sp-1)/sp`` leaving the rank, at ``a2a_bw_intra``
      when ``sp <= gpus_per_node`` else ``a2a_bw_inter``, plus a collective latency each; the
      backward does the same, every recomputed layer repeats its forward's. Zero for ``sp == 1``.
      Not overlapped with compute (DeepSpeed Ulysses does not overlap them).
    * ring (``ring > 1``, kinds 1d and 3d): the item on its Ulysses subgroup with ``1/ring`` of the
      tokens, plus the later ring steps, each the larger of its attention compute and its key/value
      transfer at the hardware's P2P bandwidth (:mod:`~lightning_dcp.planning.ring`).
    * recompute: one extra forward (compute and its all-to-alls) per recomputed layer.
    * 3d (Wan-like) cross-attention, per layer: every video token attends to its sample's
      ``text_len`` text tokens: ``2 * 2 * t * text_len * h`` FLOPs forward (``QK^T`` and ``AV``,
      all heads, the rank's own tokens), ``ATTN_BWD_RATIO`` x that backward, at
      ``attn_max_efficiency``; its q and o projections are in the per-token GEMMs
      (``2 * (layer_params - 2 h^2) * t``). The key and value projections act on the text, once
      per sample: ``2 * 2 h^2 * (text_len + gemm_half_tokens)`` FLOPs forward per sample, on every
      rank of the SP group (the text is not split: cross-attention runs sequence-parallel on each
      rank's own query tokens with the whole text, no all-to-all -- as diffusers' Wan
      context-parallel plan does). The timestep modulation is element-wise, per token.
    * head: for 1d the vocabulary GEMM (``2 t h V`` forward, 3x with backward) and the loss's
      element-wise passes over ``t x V`` logits; for 2d and 3d the patch embedding and output
      projection (3d adds the text-projection MLP, ``text_dim -> h -> h`` over ``text_len``
      tokens, once per sample on every rank of the group); plus ``HEAD_LAUNCHES`` kernel launches.

    No sharding mode adds time per micro-batch: the runtime runs no world collective inside the
    micro-batch loop (the weights are gathered once per step; see :meth:`step_overhead`).

    Memory per rank::

        M = states + workspace + t * (L * inp + (L - r) * act + max(act, head_act))

    * ``states`` (mixed-precision Adam): ``dtype_bytes`` weights and grads, fp32 master weights
      and Adam m, v (4+4+4 bytes/param, the optimizer state ``O``), no buffers -- or the bytes
      ``state_parts`` gives (the runtime's measured ones: :meth:`with_sharding`) -- per rank as
      ``sharding`` leaves them in the micro-batch loop
      (:mod:`~lightning_dcp.planning.sharding`): ``none`` replicates
      everything; ``zero1`` shards ``O`` over ``world_size``; ``zero2`` and ``fsdp`` shard ``O``
      too and hold the full weights and full local gradients during the step, plus FSDP's weight
      shard beside them (``W/N`` more than ``zero1``); they hold less only between steps
      (:attr:`state_bytes_at_rest`). The fp32 gradient partition of the optimizer step exists only
      inside that step, when activations are freed, so it is not in the peak.
    * ``inp = h * dtype_bytes``: each layer's input, kept whether checkpointed or not (paper eq. 6).
    * ``act = activation_factor * h * blocks_per_layer``: stashed activations of an un-checkpointed
      layer (see :func:`default_activation_factor`).
    * transient: the larger of one layer's activations rematerialized/gradients in flight during
      backward, and (1d) the logits: ``V * (dtype_bytes + 4)`` per token (bf16 logits and the fp32
      log-softmax of the loss).
    * ``workspace``: ``WORKSPACE_BYTES``. It also covers, for 3d, each sample's text keys and
      values (``text_len * 2h`` per layer per sample, on every rank of the group; memory here is a
      function of tokens only): 94 MB per sample for Wan-1.3B, as much as 41 video tokens.

    Everything is linear in ``T`` and ``W`` and in ``r``, which gives the closed forms of
    :meth:`min_recompute` and :meth:`max_length`.

    Ideal (``ItemCost.ideal``, the simulator's "perfect balance, no communication, no
    recomputation" bound): all of the samples' forward + backward compute at the model's best
    achievable rates -- GEMMs at ``gemm_max_efficiency`` with no small-GEMM penalty (the
    ``gemm_half_tokens`` constant is left out), attention at ``attn_max_efficiency`` (backward
    ``ATTN_BWD_RATIO`` x forward), the memory-bound element-wise passes at ``hbm_bandwidth`` and
    the head's per-token GEMM and loss passes -- with no all-to-all, no recomputation, no
    per-micro-batch constant (launch latency, head constant), no all-reduce, divided by ``sp``.
    It is linear in ``T``, ``W`` and (3d: the text's key/value projections and text MLP, counted
    once per sample) ``n`` only, so the ideal of a set of samples does not depend on how they are
    packed: ``ideal = L (fW + bW) W + (L (fT + bT) + oT) T + (L (fN + bN) + oN) n`` with the
    per-rank coefficients above at ``sp``.

    Args:
        model: the model shape.
        hardware: the accelerator.
        world_size: ranks sharing the sharded states (all ranks: SP groups are data-parallel
            replicas of one model).
        memory_limit: bytes per device the planner may use; default ``hardware.usable_memory_bytes``.
        dtype_bytes: bytes per parameter/activation element of the compute dtype (2 for bf16).
        sharding: ``"none"``, ``"zero1"`` (default), ``"zero2"`` or ``"fsdp"``: how the model states
            are sharded over the world (see ``states`` above and
            :mod:`~lightning_dcp.planning.sharding`). The default is zero1, the DCP paper's
            setting; ``DCPStrategy``'s own default is ``none``.
        zero_stage: older alias: 0, 1, 2 for ``"none"``, ``"zero1"``, ``"zero2"``.
        activation_factor: override :func:`default_activation_factor` (bytes per token per block
            divided by ``hidden_size``).
        state_parts: the full model's ``weights``, ``buffers``, ``gradients`` and ``optimizer`` bytes
            measured elsewhere (the runtime's), instead of the estimate from the model shape.
        memory_limit_source: where ``memory_limit`` came from, for messages (default: ``"memory_limit="``
            when given, else the hardware's usable memory).
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
        self._causal = model.causal
        self._is_1d = model.kind == "1d"
        self._square_work = model.kind != "2d"  # attention work l^2 (1d, 3d) or spatial + temporal (2d)
        self._spatial = float(model.spatial_tokens)
        self._init_layer_times()
        self._init_head_times()
        self._init_ideal()
        self._init_memory(world_size, state_parts)
        self._coef: dict[int, tuple] = {}

    def _init_layer_times(self) -> None:
        """Per-layer, per-rank time coefficients (the SP-independent parts)."""
        model, hw, dtype_bytes = self.model, self.hardware, self.dtype_bytes
        h, blocks, peak = model.hidden_size, model.blocks_per_layer, hw.peak_flops
        layer_params = model.layer_params()
        kv = model.cross_kv_params()  # 3d: cross-attention k, v projections, on the text
        text = float(model.text_len)
        self._gemm_s_per_token = 2.0 * (layer_params - kv) / (peak * hw.gemm_max_efficiency)  # fwd, per rank-token
        self._gemm_half = float(hw.gemm_half_tokens)
        attn_flops_per_work = 4.0 * h * (0.5 if model.causal else 1.0)  # forward, all blocks share W
        self._attn_flops_per_work = attn_flops_per_work
        self._attn_s_per_work = attn_flops_per_work / (peak * hw.attn_max_efficiency)
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
        self._a2a_per_layer = 4 * blocks                                     # forward all-to-alls
        self._a2a_h_bytes = float(blocks * h * dtype_bytes)
        self._kv_fraction = (model.num_kv_heads or model.num_heads) / model.num_heads  # key/value width / h
        self.prices_ring = model.kind != "2d"  # rings split full self-attention (1d, 3d)

    def _init_head_times(self) -> None:
        """Head / embedding time per micro-batch (per token and constant), and 3d's text MLP per sample."""
        model, hw, dtype_bytes = self.model, self.hardware, self.dtype_bytes
        h, peak, text = model.hidden_size, hw.peak_flops, float(model.text_len)
        if self._is_1d:
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
        """The ideal's coefficients (the simulator's bound; see the class docstring): per sample, on one device."""
        hw, L, text = self.hardware, self.num_layers, float(self.model.text_len)
        text_gemm = 3.0 * 2.0 * self._text_params / (hw.peak_flops * hw.gemm_max_efficiency)
        # every layer's forward + backward GEMMs at gemm_max_efficiency with no small-GEMM penalty,
        # attention (forward + ATTN_BWD_RATIO x forward) at attn_max_efficiency, element-wise
        # passes at hbm_bandwidth, and the head's per-token GEMM + loss passes; no all-to-all, no
        # recompute, no launch/per-micro-batch constant, no all-reduce. Divided by sp below.
        self._ideal_s_per_token = (L * 3.0 * (self._gemm_s_per_token + self._elem_s_per_token)
                                   + L * (1.0 + ATTN_BWD_RATIO) * self._cross_s_per_token + self._head_s_per_token)
        self._ideal_s_per_work = L * (1.0 + ATTN_BWD_RATIO) * self._attn_s_per_work
        self._ideal_s_per_sample = L * 3.0 * self._kv_ideal_per_sample + text_gemm * text

    def _init_memory(self, world_size: int, state_parts: Mapping[str, float] | None) -> None:
        """Model-state bytes per rank (estimated from the shape, or ``state_parts``) and the per-token memory terms."""
        model, dtype_bytes, L = self.model, self.dtype_bytes, self.num_layers
        P = model.params()
        self.param_count = P
        db = dtype_bytes
        master = 4.0 if dtype_bytes < 4 else 0.0
        if state_parts is None:  # fp32 master + Adam m, v; buffers (rotary/mask caches) are in the workspace
            parts = {"weights": db * P, "buffers": 0.0, "gradients": db * P, "optimizer": (master + 8.0) * P}
        else:
            given = state_parts if isinstance(state_parts, StateParts) else StateParts.from_mapping(state_parts)
            parts = {"weights": given.weights, "buffers": given.buffers, "gradients": given.gradients,
                     "optimizer": given.optimizer}
        self.full_state_parts = parts
        """One replica's state bytes (``weights``, ``buffers``, ``gradients``, ``optimizer``)."""
        states = self.mode.state_bytes(StateParts(**parts))
        self.state_bytes = states
        """Model-state bytes per rank in the micro-batch loop (what the planner budgets)."""
        self.state_bytes_at_rest = self.mode.state_bytes(StateParts(**parts), at_rest=True)
        """Model-state bytes per rank between steps (zero2 and fsdp hold less there)."""
        self.workspace_bytes = float(WORKSPACE_BYTES)
        self._mem_base = states + self.workspace_bytes
        self._transient_per_token = max(self.act_bytes_per_token, self.head_bytes_per_token)
        # per rank-token bytes with r = 0; each recomputed layer removes act_bytes_per_token
        self._mem_per_token_r0 = L * (self.input_bytes_per_token + self.act_bytes_per_token) + self._transient_per_token

    # ------------------------------------------------------------------ helpers

    def attention_work(self, length: int) -> float:
        """Attention work of one sample: ``l^2`` for 1d and 3d; for 2d spatial + temporal attention.

        2d approximation: a sample of ``l`` tokens is ``frames = max(1, l / spatial_tokens)`` frames
        of ``l / frames`` tokens (continuous, not rounded). Spatial attention within each frame costs
        ``frames * (l/frames)^2 = l^2 / frames``; temporal attention across frames at each spatial
        position costs ``(l/frames) * frames^2 = l * frames``. Sum: ``l^2/frames + l*frames``.
        """
        if self._square_work:
            return float(length) * length
        fr = length / self._spatial
        if fr < 1.0:
            fr = 1.0
        return length * length / fr + length * fr

    def ring_terms(self, sp: int, ring: int) -> RingTerms:
        """The ring's per-step terms at Ulysses size ``sp / ring`` (:mod:`~lightning_dcp.planning.ring`)."""
        if not self.prices_ring:
            raise ValueError(f"no ring pricing for the 2d model {self.model.name!r}; plan it with ring=1")
        u, m = sp // ring, self.model
        c = self._coefficients(u)
        kv = 2.0 * m.hidden_size * self._kv_fraction * kv_repeat(m.num_heads, m.num_kv_heads, u) / u
        return hardware_ring_terms(self.hardware, sp, c[0], c[3], m.blocks_per_layer * kv * self.dtype_bytes, self.num_layers)

    def _sums(self, lengths: Sequence[int]) -> tuple[int, float]:
        tokens = 0
        work = 0.0
        if self._square_work:
            for n in lengths:
                tokens += n
                work += n * n
        else:
            s = self._spatial
            for n in lengths:
                tokens += n
                fr = n / s
                if fr < 1.0:
                    fr = 1.0
                work += n * n / fr + n * fr
        return tokens, work

    def _coefficients(self, sp: int) -> tuple:
        """Per-sp coefficients of time = (wA + r wR) W + (tA + r tR) T + (cA + r cR); cached."""
        c = self._coef.get(sp)
        if c is not None:
            return c
        sp = _positive_int(sp, "sp")
        if self.num_heads % sp:
            raise ValueError(f"sp={sp} does not divide num_heads={self.num_heads} of model {self.model.name!r}; "
                             f"usable Ulysses SP sizes: {list(ulysses_sizes(self.num_heads, self.num_heads))} (larger "
                             "groups: ring=)")
        hw, L = self.hardware, self.num_layers
        inv = 1.0 / sp
        g, half, la = self._gemm_s_per_token, self._gemm_half, self._launch
        # forward compute per layer: fW*W + fT*T + fC
        fW = self._attn_s_per_work * inv
        cross = self._cross_s_per_token * inv
        fT = (g + self._elem_s_per_token) * inv + cross
        fC = g * half + la
        fN = self._kv_s_per_sample  # per sample, not split over the group
        bW = ATTN_BWD_RATIO * fW
        bT = 2.0 * (fT - cross) + ATTN_BWD_RATIO * cross
        bC = 2.0 * fC
        bN = 2.0 * fN
        # all-to-all per layer forward: aT*T + aC
        if sp == 1:
            aT = aC = 0.0
        else:
            intra = sp <= hw.gpus_per_node
            bw = hw.a2a_bw_intra if intra else hw.a2a_bw_inter
            lat = hw.collective_latency if intra else hw.collective_latency_inter
            n = self._a2a_per_layer
            f = kv_repeat(self.model.num_heads, self.model.num_kv_heads, sp)  # q, output; k, v (repeated)
            aT = self._a2a_h_bytes * (2.0 + 2.0 * self._kv_fraction * f) * (sp - 1) / sp / bw * inv
            aC = n * lat
        oT = self._head_s_per_token * inv
        oC = self._head_const
        oN = self._head_s_per_sample
        c = (
            fW, fT, fC, bW, bT, bC, aT, aC, oT, oC,
            # item-time coefficients, r = 0 and per recomputed layer
            L * (fW + bW), L * (fT + bT + 2 * aT) + oT, L * (fC + bC + 2 * aC) + oC,
            fW, fT + aT, fC + aC,
            # memory per global token: base + T * (m0 - r * m1)
            self._mem_per_token_r0 * inv, self.act_bytes_per_token * inv,
            # ideal
            self._ideal_s_per_work * inv, self._ideal_s_per_token * inv,
            # per sample (3d text): forward per layer, item time r = 0 and per recomputed layer, ideal
            fN, L * (fN + bN) + oN, fN, self._ideal_s_per_sample * inv,
        )
        self._coef[sp] = c
        return c

    # ------------------------------------------------------------------ fast paths

    def item_time_sum(self, tokens: int, sq_sum: float, n: int, sp: int, recompute: int, ring: int = 1,
                      ring_exposed: bool = True) -> float:
        """Item time from precomputed sums: ``tokens`` = sum of lengths, ``sq_sum`` = sum of
        :meth:`attention_work` over the samples (``sum l^2`` for 1d models), ``n`` samples.

        Same value as ``item_time(lengths, sp, recompute, ring)``; costs eight multiplications (ring 1).
        ``ring_exposed=False``: a ring's transfers counted as hidden (a lower bound, for the step bound).
        """
        if ring != 1:
            return self._ring_time_sum(tokens, sq_sum, n, sp, recompute, ring, ring_exposed)
        c = self._coef.get(sp) or self._coefficients(sp)
        r = recompute
        return (c[10] + r * c[13]) * sq_sum + (c[11] + r * c[14]) * tokens + c[12] + r * c[15] + (c[21] + r * c[22]) * n

    def item_memory_tokens(self, tokens: int, sp: int, recompute: int, ring: int = 1) -> float:
        """Peak bytes per device of a micro-batch of ``tokens`` total tokens (memory depends on nothing else)."""
        if ring != 1:
            return self._ring_memory_tokens(tokens, sp, recompute, ring)
        c = self._coef.get(sp) or self._coefficients(sp)
        return self._mem_base + tokens * (c[16] - recompute * c[17])

    def min_recompute_tokens(self, tokens: int, sp: int) -> int | None:
        """:meth:`min_recompute` for a micro-batch of ``tokens`` total tokens."""
        c = self._coef.get(sp) or self._coefficients(sp)
        L, limit = self.num_layers, self.memory_limit
        if self._mem_base + tokens * (c[16] - L * c[17]) > limit:
            return None
        if tokens <= 0:
            return 0
        # base + T*(m0 - r m1) <= limit  <=>  r >= (base + T m0 - limit) / (T m1)
        r = math.ceil((self._mem_base + tokens * c[16] - limit) / (tokens * c[17]))
        r = min(max(r, 0), L)
        # guard against rounding at the boundary so the answer equals the bisection's
        while r > 0 and self._mem_base + tokens * (c[16] - (r - 1) * c[17]) <= limit:
            r -= 1
        while r < L and self._mem_base + tokens * (c[16] - r * c[17]) > limit:
            r += 1
        return r

    # ------------------------------------------------------------------ CostModel

    def item_time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        tokens, work = self._sums(lengths)
        return self.item_time_sum(tokens, work, len(lengths), sp, recompute, ring)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.item_memory_tokens(sum(lengths), sp, recompute, ring)

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        if not 0 <= recompute <= self.num_layers:
            raise ValueError(f"recompute must be in [0, {self.num_layers}] (the model's layers), got {recompute!r}")
        T, W = self._sums(lengths)
        if ring != 1:
            return self._ring_cost(T, W, len(lengths), sp, recompute, ring)
        return self._cost_sums(T, W, len(lengths), sp, recompute)

    def _cost_sums(self, T: float, W: float, n: int, sp: int, recompute: int) -> ItemCost:
        """:meth:`item_cost` (ring 1) from the sums: ``T`` tokens, ``W`` attention work, ``n`` samples."""
        c = self._coefficients(sp)
        L, r = self.num_layers, recompute
        fW, fT, fC, bW, bT, bC, aT, aC, oT, oC = c[:10]
        fN = c[20]
        fwd = fW * W + fT * T + fC + fN * n
        bwd = bW * W + bT * T + bC + 2.0 * fN * n
        a2a = aT * T + aC
        return ItemCost(
            compute=L * (fwd + bwd),
            recompute=r * fwd,
            comm=(2 * L + r) * a2a,
            overhead=oT * T + oC + self._head_s_per_sample * n,
            ideal=c[18] * W + c[19] * T + c[23] * n,
        )

    def step_overhead(self, world_size: int) -> float:
        """Gradient reduction over ``world_size`` ranks plus the optimizer step.

        Reduction: ``none`` and ``zero1`` ring all-reduce the gradients, ``2 (N-1)/N * G / busbw``;
        ``zero2`` and ``fsdp`` reduce-scatter the gradients and all-gather the weights once per step,
        ``(N-1)/N * (G + W) / busbw`` -- the all-reduce's volume when ``W == G``; inter-node bus
        bandwidth when ``N > gpus_per_node``, plus one collective latency per 500 MB bucket (two
        for the sharded modes). Not charged: ``zero1``'s broadcast of the updated weight shards
        (``ZeroRedundancyOptimizer``). Optimizer: memory-bound Adam over the local shard,
        ``OPTIMIZER_BYTES_PER_PARAM * params / N / hbm_bandwidth`` (unsharded for ``none``).
        """
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
        """This model, hardware, memory limit, dtype and activation factor planned for the runtime's
        ``states["sharding"]`` on ``states["world_size"]`` ranks, with the runtime's measured
        ``weights``/``buffers``/``gradients``/``optimizer`` bytes when ``states`` has them (then
        :attr:`state_bytes` is the runtime's ``step_bytes``). ``states`` is
        :meth:`lightning_dcp.runtime.sharding.states.ModelStates.to_dict`."""
        rebuilt = AnalyticCostModel(self.model, self.hardware, int(states["world_size"]), memory_limit=self.memory_limit,
                                    dtype_bytes=self.dtype_bytes, sharding=states["sharding"],
                                    activation_factor=self.activation_factor,
                                    state_parts=StateParts.from_mapping(states, required=False),
                                    memory_limit_source=self.memory_limit_source)
        return keep_class(self, rebuilt)  # a user's subclass keeps its overrides

    def signature(self) -> dict:
        return {
            "source": "analytic",
            "model": self.model.to_dict(),
            "hardware": self.hardware.to_dict(),
            "world_size": self.world_size,
            "memory_limit": self.memory_limit,
            "dtype_bytes": self.dtype_bytes,
            "sharding": self.sharding,
            "zero_stage": self.zero_stage,
            "activation_factor": self.activation_factor,
            "state_bytes": self.state_bytes,
        }

    # ------------------------------------------------------------------ closed forms

    def min_recompute(self, lengths: Sequence[int], sp: int, ring: int = 1) -> int | None:
        """Fewest recomputed layers that fit (closed form of eq. 6), ``None`` if full recompute does not."""
        if ring != 1:
            return CostModel.min_recompute(self, lengths, sp, ring)
        return self.min_recompute_tokens(sum(lengths), sp)

    def max_length(self, sp: int, recompute: int | None = None, ring: int = 1) -> int:
        """Longest single sequence that fits on ``sp`` ranks with ``recompute`` layers (default all); 0 if none."""
        if ring != 1:
            return CostModel.max_length(self, sp, recompute, ring)
        r = self.num_layers if recompute is None else recompute
        c = self._coefficients(sp)
        per_token = c[16] - r * c[17]
        room = self.memory_limit - self._mem_base
        if room < 0:
            return 0
        n = int(room / per_token)
        while n > 0 and self.item_memory_tokens(n, sp, r) > self.memory_limit:
            n -= 1
        while self.item_memory_tokens(n + 1, sp, r) <= self.memory_limit:
            n += 1
        return n if n >= sp else 0

    # ------------------------------------------------------------------ reporting helpers

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
