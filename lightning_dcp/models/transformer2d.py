"""Transformer-2D: a video DiT-like model for packed any-size latent videos, sequence-parallel by frames.

Input layout: a micro-batch packs several videos; sample ``s`` has latent shape
``(frames_s, h_s, w_s)`` and contributes ``frames_s*h_s*w_s`` tokens, flattened frame-major
(``t, y, x``). ``batch["shapes"]`` lists the per-sample shapes (unsharded, one entry per real
sample), ``batch["timesteps"]`` the per-sample diffusion time in ``[0, 1]``.

Each repeated layer is a *spatial* block (attention among the tokens of one frame, 2-D RoPE over
``y, x``) followed by a *temporal* block (attention among the tokens at one spatial position of
one video across its frames, 1-D RoPE over ``t``); each block is self-attention + GELU MLP with
adaLN modulation (shift/scale/gate) from the sample's timestep embedding.

Sequence parallelism (SP) by frames -- the design:

* :func:`shard_video_batch` (the ``dcp_shard_batch`` hook of
  :class:`~lightning_dcp.models.DCPTransformerModule`) lists all frames of all samples in order
  (frames of different samples may have different ``h*w``) and cuts that list into ``sp``
  contiguous chunks of *whole frames*, minimising the largest chunk's token count
  ``P`` (exact linear partition by binary search). Ulysses all-to-all needs the same token count
  on every rank, so every rank's chunk is padded at its end to ``P`` tokens with a padding
  segment (LOSS_MASK False, SEGMENT_IDS -1, labels -100, other keys 0). A frame is never split,
  so one frame larger than ``total / sp`` costs padding on the other ranks -- the price of
  local spatial attention; the planner's cost model sees ``lengths`` as usual.
* Spatial attention is purely local: ``varlen_attention`` over this rank's frames (each frame a
  segment; the pad block its own segment) -- no communication.
* Temporal attention switches axis: one ``seq_all_to_all`` of the stacked q/k/v scatters heads
  and gathers the token dimension, so each rank holds all ``sp*P`` tokens (in the padded
  layout) for ``heads/sp`` heads; a precomputed permutation gathers the real tokens into
  temporal order (per sample, per spatial position, frames in order), ``varlen_attention`` runs
  over those per-position segments, the result is scattered back into the layout and a second
  ``seq_all_to_all`` returns the local tokens with all heads.

Padding tokens never influence real tokens (their own spatial segment, excluded from temporal
attention, zero adaLN modulation), so outputs and gradients equal the SP=1 run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dcp.sp.attention import varlen_attention
from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, active_context
from lightning_dcp.sp.packing import DEFAULT_PAD_VALUES
from lightning_dcp.models.transformer1d import _init_weights, apply_rope, rope_tables
from lightning_dcp.planning.models import ModelSpec, get_model
from lightning_dcp.sp.recompute import RecomputeLayers
from lightning_dcp.sp.ulysses import seq_all_to_all

__all__ = [
    "FRAME_LAYOUT", "FrameLayout", "Transformer2D", "VideoBlock", "VideoLayer", "frame_layout", "partition_frames",
    "shard_video_batch", "timestep_embedding", "video_shapes",
]

#: Batch key set by :func:`shard_video_batch`: ``(sp_size, tokens_per_rank)`` of the frame layout.
FRAME_LAYOUT = "frame_layout"
#: Per-sample metadata keys of a video batch (never treated as token tensors).
_METADATA_KEYS = ("shapes", "timesteps")


# ---------------------------------------------------------------------------------------------
# frame layout
# ---------------------------------------------------------------------------------------------

def video_shapes(shapes: Any) -> list[tuple[int, int, int]]:
    """Normalise ``batch["shapes"]`` (list of triples, an int tensor ``[S, 3]``, or one triple)."""
    if isinstance(shapes, torch.Tensor):
        shapes = shapes.reshape(-1, 3).tolist()
    shapes = list(shapes)
    if len(shapes) == 3 and all(isinstance(d, int) for d in shapes):
        shapes = [tuple(shapes)]
    out = []
    for s in shapes:
        s = tuple(int(d) for d in (s.tolist() if isinstance(s, torch.Tensor) else s))
        if len(s) != 3 or min(s) < 1:
            raise ValueError(f"each video shape is (frames, h, w) of positive ints, got {s!r}")
        out.append(s)
    if not out:
        raise ValueError("batch['shapes'] is empty: a video micro-batch needs at least one sample")
    return out


def partition_frames(frame_sizes: Sequence[int], sp_size: int) -> tuple[list[int], int]:
    """Cut a list of frames into ``sp_size`` contiguous chunks minimising the largest chunk.

    Args:
        frame_sizes: tokens of each frame, in packed order.
        sp_size: number of chunks (ranks).

    Returns:
        ``(bounds, largest)``: frame-index bounds ``[0, ..., len(frame_sizes)]`` (``sp_size + 1``
        entries; trailing chunks may be empty) and the largest chunk's token count.
    """
    n, total = len(frame_sizes), sum(frame_sizes)
    if sp_size < 1:
        raise ValueError(f"sp_size must be >= 1, got {sp_size}")
    if sp_size == 1 or n == 0:
        return [0] + [n] * sp_size, total

    def fill(cap: int) -> list[int]:
        bounds, current = [0], 0
        for i, size in enumerate(frame_sizes):
            if current + size > cap:
                bounds.append(i)
                current = 0
            current += size
        return bounds

    lo, hi = max(max(frame_sizes), -(-total // sp_size)), total
    while lo < hi:
        mid = (lo + hi) // 2
        if len(fill(mid)) <= sp_size:
            hi = mid
        else:
            lo = mid + 1
    bounds = fill(lo)
    bounds += [n] * (sp_size + 1 - len(bounds))
    return bounds, lo


@dataclass
class FrameLayout:
    """Where every token of a packed video micro-batch lives under SP by frames.

    The *layout* is the concatenation of the ranks' chunks, each ``tokens_per_rank`` long (real
    frames, then padding). Local tensors (``[tokens_per_rank]``) describe this rank's chunk;
    ``temporal_*`` describe the gathered layout (``[sp_size * tokens_per_rank]``).
    """

    sp_size: int
    sp_rank: int
    tokens_per_rank: int
    num_tokens: int
    frame_bounds: list[int]
    token_bounds: list[int]
    segment_ids: torch.Tensor  # [P] sample index, -1 on padding
    frame_t: torch.Tensor  # [P] frame index inside the sample (0 on padding)
    pos_y: torch.Tensor  # [P]
    pos_x: torch.Tensor  # [P]
    spatial_cu: torch.Tensor  # int32: frames of this chunk (+ the pad block)
    spatial_max: int
    temporal_index: torch.Tensor  # [num_tokens] layout positions in temporal order
    temporal_cu: torch.Tensor  # int32: one segment per (sample, y, x)
    temporal_max: int

    def to(self, device: torch.device | str) -> "FrameLayout":
        """This layout with its tensors on ``device``."""
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return FrameLayout(**kw)


def frame_layout(shapes: Any, sp_size: int = 1, sp_rank: int = 0, tokens_per_rank: int | None = None,
                 device: torch.device | str | None = None) -> FrameLayout:
    """Build the :class:`FrameLayout` of a video micro-batch for rank ``sp_rank`` of ``sp_size``.

    ``tokens_per_rank`` defaults to the largest chunk of :func:`partition_frames`; a larger value
    pads every chunk further (at SP size 1 that is how a batch with trailing padding is described).
    """
    shapes = video_shapes(shapes)
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} is outside an SP group of size {sp_size}")
    f = torch.tensor([s[0] for s in shapes])
    hw = torch.tensor([s[1] * s[2] for s in shapes])
    w = torch.tensor([s[2] for s in shapes])
    num_samples, num_frames = len(shapes), int(f.sum())
    frame_sample = torch.repeat_interleave(torch.arange(num_samples), f)
    frame_t = torch.arange(num_frames) - (torch.cumsum(f, 0) - f)[frame_sample]
    frame_size = hw[frame_sample]
    frame_w = w[frame_sample]
    frame_start = torch.cumsum(frame_size, 0) - frame_size
    total = int(frame_size.sum())

    fb, largest = partition_frames(frame_size.tolist(), sp_size)
    P = largest if tokens_per_rank is None else int(tokens_per_rank)
    if P < largest:
        raise ValueError(f"tokens_per_rank={P} is smaller than the largest frame chunk ({largest} tokens) for shapes "
                         f"{shapes} at SP size {sp_size}; shard the batch with shard_video_batch")
    tb = [0] + torch.cumsum(frame_size, 0).tolist()
    tb = [tb[i] for i in fb]

    # this rank's chunk
    lo, hi = fb[sp_rank], fb[sp_rank + 1]
    n_local = tb[sp_rank + 1] - tb[sp_rank]
    pad = P - n_local
    tok_frame = torch.repeat_interleave(torch.arange(lo, hi), frame_size[lo:hi])
    p = torch.arange(n_local) + tb[sp_rank] - frame_start[tok_frame]
    fill = torch.zeros(pad, dtype=torch.int64)
    segment_ids = torch.cat([frame_sample[tok_frame], fill - 1])
    t_loc = torch.cat([frame_t[tok_frame], fill])
    y_loc = torch.cat([p // frame_w[tok_frame], fill])
    x_loc = torch.cat([p % frame_w[tok_frame], fill])
    seg = frame_size[lo:hi].tolist() + ([pad] if pad else [])
    spatial_cu = torch.tensor([0] + seg, dtype=torch.int64).cumsum(0).to(torch.int32)

    # the gathered layout, in temporal order
    rank_of_frame = torch.repeat_interleave(torch.arange(sp_size), torch.tensor(fb).diff())
    offset = torch.arange(sp_size) * P - torch.tensor(tb[:-1])
    token_frame = torch.repeat_interleave(torch.arange(num_frames), frame_size)
    real_to_layout = torch.arange(total) + offset[rank_of_frame[token_frame]]
    sample_start = (torch.cumsum(f * hw, 0) - f * hw).tolist()
    order = torch.cat([  # per sample: spatial position major, frame minor
        sample_start[s] + (torch.arange(int(hw[s]))[:, None] + torch.arange(int(f[s]))[None, :] * int(hw[s])).reshape(-1)
        for s in range(num_samples)])
    temporal_cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.repeat_interleave(f, hw).cumsum(0)]).to(torch.int32)
    layout = FrameLayout(
        sp_size=sp_size, sp_rank=sp_rank, tokens_per_rank=P, num_tokens=total, frame_bounds=fb, token_bounds=tb,
        segment_ids=segment_ids, frame_t=t_loc, pos_y=y_loc, pos_x=x_loc,
        spatial_cu=spatial_cu, spatial_max=max(seg) if seg else 0,
        temporal_index=real_to_layout[order], temporal_cu=temporal_cu, temporal_max=int(f.max()),
    )
    return layout if device is None else layout.to(device)


def shard_video_batch(batch: Mapping[str, Any], sp_rank: int, sp_size: int,
                      pad_values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Give rank ``sp_rank`` of an SP group of ``sp_size`` its whole frames of a packed video batch.

    ``batch`` is the full packed micro-batch (as :func:`~lightning_dcp.sp.packing.pack_samples` makes
    it; trailing padding allowed). Every tensor whose first dimension is the packed token
    dimension is re-laid out: the real tokens of this rank's frame chunk, then padding up to
    ``tokens_per_rank`` (pad values: :data:`~lightning_dcp.sp.packing.DEFAULT_PAD_VALUES`, overridden
    by ``pad_values``, else 0). ``CU_SEQLENS``/``MAX_SEQLEN`` are replaced by the spatial
    segments (frames and pad blocks) of the whole layout; :data:`FRAME_LAYOUT` records
    ``(sp_size, tokens_per_rank)``. Metadata (``shapes``, ``timesteps``, ints, lists) is kept.
    """
    if "latents" not in batch or "shapes" not in batch:
        raise ValueError(f"shard_video_batch needs 'latents' and 'shapes' in the batch, got keys {sorted(batch)}")
    shapes = video_shapes(batch["shapes"])
    full = int(batch["latents"].shape[0])
    total = sum(f * h * w for f, h, w in shapes)
    if full < total:
        raise ValueError(f"batch['latents'] has {full} tokens but shapes {shapes} need {total}; the shapes must "
                         "describe the packed latents (frame-major, samples in order)")
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} is outside an SP group of size {sp_size}")
    pads = dict(DEFAULT_PAD_VALUES)
    if pad_values:
        pads.update(pad_values)
    f_sizes = [h * w for f, h, w in shapes for _ in range(f)]
    fb, P = partition_frames(f_sizes, sp_size)
    starts = [0]
    for s in f_sizes:
        starts.append(starts[-1] + s)
    tb = [starts[i] for i in fb]
    a, b = tb[sp_rank], tb[sp_rank + 1]
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if (key not in (CU_SEQLENS, *_METADATA_KEYS) and isinstance(value, torch.Tensor) and value.dim() >= 1
                and value.shape[0] == full):
            local = value[a:b]
            if P > b - a:
                local = torch.cat([local, torch.full((P - (b - a), *value.shape[1:]), pads.get(key, 0),
                                                     dtype=value.dtype, device=value.device)])
            out[key] = local
        else:
            out[key] = value
    segs: list[int] = []
    for r in range(sp_size):
        segs += f_sizes[fb[r]:fb[r + 1]]
        if P > tb[r + 1] - tb[r]:
            segs.append(P - (tb[r + 1] - tb[r]))
    out[CU_SEQLENS] = torch.tensor([0] + segs, dtype=torch.int64).cumsum(0).to(torch.int32)
    out[MAX_SEQLEN] = max(segs)
    out[FRAME_LAYOUT] = (sp_size, P)
    return out


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------

def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding ``[S, dim]`` of diffusion times ``t`` in ``[0, 1]`` (scaled by 1000, as DiT)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * 1000.0 * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, dim - 2 * half))


def _temporal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: FrameLayout) -> torch.Tensor:
    qkv = torch.stack([q, k, v])  # [3, P, H, D]: one all-to-all for q, k and v ("batch" of 3)
    if layout.sp_size > 1:  # scatter heads, gather tokens: [3, sp*P, H/sp, D]
        qkv = seq_all_to_all(qkv, scatter_dim=2, gather_dim=1)
    q, k, v = qkv.index_select(1, layout.temporal_index).unbind(0)
    out = varlen_attention(q, k, v, layout.temporal_cu, layout.temporal_max)
    full = out.new_zeros(qkv.shape[1], *out.shape[1:]).index_copy(0, layout.temporal_index, out)
    if layout.sp_size > 1:  # scatter tokens, gather heads: [P, H, D]
        full = seq_all_to_all(full, scatter_dim=0, gather_dim=1)
    return full


class VideoBlock(nn.Module):
    """adaLN block: modulated LayerNorm -> self-attention (spatial or temporal) -> gate; same for a GELU MLP."""

    def __init__(self, spec: ModelSpec, axis: str):
        super().__init__()
        if axis not in ("spatial", "temporal"):
            raise ValueError(f"axis must be 'spatial' or 'temporal', got {axis!r}")
        h = spec.hidden_size
        self.axis, self.num_heads, self.head_dim = axis, spec.num_heads, spec.head_dim
        self.norm1 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(h, spec.ffn_hidden_size), nn.GELU(approximate="tanh"), nn.Linear(spec.ffn_hidden_size, h))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(h, 6 * h))

    def forward(self, x: torch.Tensor, cond: torch.Tensor, layout: FrameLayout) -> torch.Tensor:
        mod = self.ada(cond)
        mod = torch.cat([mod.new_zeros(1, mod.shape[1]), mod])[layout.segment_ids + 1]  # padding: no modulation
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=-1)
        qkv = self.qkv(self.norm1(x) * (1 + scale1) + shift1)
        q, k, v = qkv.unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)
        if self.axis == "spatial":
            half = self.head_dim // 2
            cy, sy = rope_tables(layout.pos_y, half, dtype=q.dtype)
            cx, sx = rope_tables(layout.pos_x, half, dtype=q.dtype)
            q, k = (torch.cat([apply_rope(t[..., :half], cy, sy), apply_rope(t[..., half:], cx, sx)], -1) for t in (q, k))
            attn = varlen_attention(q, k, v, layout.spatial_cu, layout.spatial_max)
        else:
            ct, st = rope_tables(layout.frame_t, self.head_dim, dtype=q.dtype)
            attn = _temporal_attention(apply_rope(q, ct, st), apply_rope(k, ct, st), v, layout)
        x = x + gate1 * self.proj(attn.flatten(1))
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class VideoLayer(nn.Module):
    """One repeated layer: a spatial :class:`VideoBlock` then a temporal one. ``layer(x, cond, layout)``."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spatial = VideoBlock(spec, "spatial")
        self.temporal = VideoBlock(spec, "temporal")

    def forward(self, x: torch.Tensor, cond: torch.Tensor, layout: FrameLayout) -> torch.Tensor:
        return self.temporal(self.spatial(x, cond, layout), cond, layout)


class Transformer2D(nn.Module):
    """Video DiT-like model from a ``"2d"`` :class:`~lightning_dcp.planning.models.ModelSpec` (or its name).

    ``forward(batch)`` takes ``batch["latents"]`` (local tokens ``[local_tokens, in_channels]``),
    ``batch["shapes"]`` (per-sample ``(frames, h, w)``, unsharded) and ``batch["timesteps"]``
    (per-sample floats) and returns the prediction ``[local_tokens, in_channels]`` (e.g. the
    flow-matching velocity). Under SP size > 1 the batch must come from
    :func:`shard_video_batch` (the module's ``dcp_shard_batch`` hook); at SP size 1 any packed
    batch whose real tokens come first (trailing padding allowed) works.

    ``embed_inputs(batch) -> (x, (cond, layout))``, ``layers(x, cond, layout)`` and
    ``final(x, cond, layout)`` are the pieces of ``forward`` (profilers can run ``layers`` alone).
    """

    def __init__(self, spec: ModelSpec | str):
        super().__init__()
        spec = get_model(spec) if isinstance(spec, str) else spec
        if spec.kind != "2d":
            raise ValueError(f"Transformer2D needs a '2d' spec, got {spec.name!r} of kind {spec.kind!r}; use Transformer1D")
        if spec.in_channels <= 0:
            raise ValueError(f"Transformer2D needs in_channels > 0, spec {spec.name!r} has {spec.in_channels}")
        if spec.hidden_size % spec.num_heads or spec.head_dim % 4:
            raise ValueError(f"spec {spec.name!r}: hidden_size {spec.hidden_size} must split into {spec.num_heads} heads "
                             f"with head_dim a multiple of 4 for 2-D RoPE (got {spec.hidden_size / spec.num_heads:g})")
        h = spec.hidden_size
        self.spec = spec
        self.x_embed = nn.Linear(spec.in_channels, h)
        self.t_embed = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, h))
        self.layers = RecomputeLayers(nn.ModuleList([VideoLayer(spec) for _ in range(spec.num_layers)]))
        self.final_norm = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(h, 2 * h))
        self.out = nn.Linear(h, spec.in_channels)
        self.apply(_init_weights)

    def layout(self, batch: Mapping[str, Any]) -> FrameLayout:
        """The :class:`FrameLayout` of ``batch`` for the active SP context."""
        ctx = active_context()
        tokens = int(batch["latents"].shape[0])
        if ctx.size > 1:
            marker = batch.get(FRAME_LAYOUT)
            if marker is None or tuple(marker) != (ctx.size, tokens):
                raise ValueError(
                    f"Transformer2D under SP size {ctx.size} needs a batch sharded by whole frames "
                    f"({FRAME_LAYOUT}={marker!r}, local tokens {tokens}); give the LightningModule a dcp_shard_batch "
                    "hook that calls lightning_dcp.models.transformer2d.shard_video_batch (DCPTransformerModule has one)")
        return frame_layout(batch["shapes"], ctx.size, ctx.rank, tokens_per_rank=tokens, device=batch["latents"].device)

    def embed_inputs(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, tuple[torch.Tensor, FrameLayout]]:
        """``(x, (cond, layout))``: the first layer's input and the extra arguments of every layer."""
        latents = batch["latents"]
        layout = self.layout(batch)
        ts = torch.as_tensor(batch["timesteps"], dtype=torch.float32, device=latents.device).reshape(-1)
        num_samples = len(video_shapes(batch["shapes"]))
        if ts.numel() != num_samples:
            raise ValueError(f"got {ts.numel()} timesteps for {num_samples} samples (shapes); give one per sample")
        cond = self.t_embed(timestep_embedding(ts, self.spec.hidden_size).to(latents.dtype))
        return self.x_embed(latents), (cond, layout)

    def final(self, x: torch.Tensor, cond: torch.Tensor, layout: FrameLayout) -> torch.Tensor:
        mod = self.final_ada(cond)
        shift, scale = torch.cat([mod.new_zeros(1, mod.shape[1]), mod])[layout.segment_ids + 1].chunk(2, dim=-1)
        return self.out(self.final_norm(x) * (1 + scale) + shift)

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        x, (cond, layout) = self.embed_inputs(batch)
        return self.final(self.layers(x, cond, layout), cond, layout)
