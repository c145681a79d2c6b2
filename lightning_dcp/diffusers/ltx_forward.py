"""The packed forward of an adapted LTX-Video transformer: :func:`ltx_packed_forward`.

Diffusers' ``LTXVideoTransformer3DModel.forward`` takes one ``[B, tokens, C]`` tensor of videos of one
shape (one rotary grid, one text mask per batch). :func:`ltx_packed_forward` runs the same model --
``proj_in``, ``time_embed``, ``caption_projection``, its blocks, ``norm_out`` and ``proj_out`` -- on a
packed micro-batch of videos of any sizes (or this rank's SP shard of it):

* tokens are LTX's own patchified latents (``C x pt x p x p`` per token, the pipeline's ``_pack_latents``
  order, which :func:`~lightning_dcp.diffusers.patchify` makes), projected per token by ``proj_in``;
* rotary angles per token: each token's patch-grid position times its sample's
  ``rope_interpolation_scale`` (:data:`~lightning_dcp.diffusers.ltx.ROPE_SCALE`), through the
  model's own ``rope`` module (its ``video_coords`` input), so samples of different shapes and frame
  rates pack together;
* a timestep per token (``time_embed`` on ``[tokens]``, the per-token ``temb`` the blocks accept, as
  LTX's condition pipeline uses it);
* self-attention within each sample over the SP group, cross-attention of each sample's tokens to
  its own unpadded text (:class:`~lightning_dcp.diffusers.ltx.DCPLTXAttnProcessor`);
* the first ``active_context().recompute`` blocks checkpointed (``model.dcp_recompute``);
* the output in the input layout (``C x pt x p x p`` per token, the pipeline's ``_unpack_latents``).

Batch keys are those of :func:`~lightning_dcp.diffusers.forward.wan_packed_forward` plus the optional
per-sample :data:`~lightning_dcp.diffusers.ltx.ROPE_SCALE` (missing or None: unscaled positions).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from lightning_dcp.diffusers.attention import PackedSelfAttention, PackedText
from lightning_dcp.diffusers.forward import HIDDEN_STATES, TIMESTEP, _concat, _local_segments
from lightning_dcp.diffusers.ltx import ROPE_SCALE, is_ltx_adapted
from lightning_dcp.diffusers.samples import GRID, IMAGE, TEXT, VIDEO_POS, per_sample_embeds, sample_labels
from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, active_context

__all__ = ["ltx_packed_forward", "ltx_rotary"]


def _check_batch(model: nn.Module, batch: Mapping[str, Any], x: torch.Tensor, grids: list[tuple[int, int, int]],
                 labels: list[str], sp_size: int) -> None:
    config = model.config
    if x.dim() != 2 or x.shape[1] != config.in_channels:
        raise ValueError(f"packed LTX forward: {HIDDEN_STATES!r} has shape {tuple(x.shape)}, but the model takes "
                         f"[tokens, in_channels] = [tokens, {config.in_channels}] (LTX's tokens are its patchified "
                         "latents); build samples with lightning_dcp.diffusers.ltx_video_sample for this model's patch "
                         "size (ltx_patch_size(model.config))")
    for key in (VIDEO_POS, TIMESTEP):
        value = batch.get(key)
        if not isinstance(value, torch.Tensor) or value.shape[0] != x.shape[0]:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"packed LTX forward: {key!r} must be a per-token tensor with {x.shape[0]} rows like "
                             f"{HIDDEN_STATES!r}, got {got}")
    total = sum(math.prod(g) for g in grids)
    if total > x.shape[0] * sp_size:
        raise ValueError(f"packed LTX forward: the samples' grids {grids} hold {total} tokens but the SP group holds "
                         f"{x.shape[0]} x {sp_size}; the batch must be packed from these samples (pack_samples) and "
                         "sharded in contiguous chunks (lightning_dcp.sp.tokens.shard_batch)")
    texts = batch.get(TEXT)
    missing = [label for j, label in enumerate(labels) if texts is None or j >= len(texts) or texts[j] is None]
    if missing:
        raise ValueError(f"{', '.join(missing)}: no text embeddings ({TEXT!r}); every sample needs its T5 output (an "
                         "empty prompt's for unconditional samples): build samples with "
                         "lightning_dcp.diffusers.ltx_video_sample(latents, encoder_hidden_states, ...)")
    wrong = [label for j, label in enumerate(labels) if per_sample_embeds(texts[j]).shape[-1] != config.caption_channels]
    if wrong:
        raise ValueError(f"{', '.join(wrong)}: text embeddings must have caption_channels={config.caption_channels} "
                         "features (the T5 encoder's width)")
    if batch.get(IMAGE) is not None:
        raise ValueError(f"the batch has image embeddings ({IMAGE!r}) but LTX-Video has no image cross-attention; "
                         "drop them")


def _rope_coords(model: nn.Module, batch: Mapping[str, Any], local: list[tuple[int, int, int]]) -> torch.Tensor:
    """``[3, tokens]`` coordinates for the rope's ``video_coords`` input, so that ``coords / base`` is what diffusers'
    forward computes from ``(num_frames, height, width, rope_interpolation_scale)`` for each token's sample."""
    rope = model.rope
    pos = batch[VIDEO_POS].to(torch.float32)
    base = torch.tensor([rope.base_num_frames, rope.base_height, rope.base_width], dtype=torch.float32)
    patch = (rope.patch_size_t, rope.patch_size, rope.patch_size)
    coords = pos * base  # unscaled: (g * base) / base == g exactly (integer g)
    scales = batch.get(ROPE_SCALE)
    for j, a, b in local:
        scale = None if scales is None else scales[j]
        if scale is not None:  # diffusers: grid * scale * patch / base, in fp32
            coords[a:b] = torch.stack([pos[a:b, axis] * scale[axis] * patch[axis] for axis in range(3)], dim=-1)
    return coords.T.unsqueeze(0)


def ltx_rotary(model: nn.Module, batch: Mapping[str, Any], local: list[tuple[int, int, int]],
               like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[1, tokens, heads*head_dim]`` of this shard's tokens, from the model's own ``rope``."""
    coords = _rope_coords(model, batch, local).to(like.device)
    return model.rope(like, video_coords=coords)


def ltx_packed_forward(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Velocity prediction ``[local_tokens, out_channels]`` of an adapted ``LTXVideoTransformer3DModel``.

    Args:
        model: prepared by :func:`~lightning_dcp.diffusers.adapt`.
        batch: a packed micro-batch (see the module docstring), whole or this SP rank's shard.

    Returns:
        This shard's tokens' predictions in the input layout; the shard's padding tokens get finite
        values that nothing else depends on.

    Raises:
        ValueError: a malformed batch (wrong feature count, a sample without text, ...), naming the sample.
    """
    if not is_ltx_adapted(model):
        raise ValueError(f"packed_forward needs a model prepared by lightning_dcp.diffusers.adapt; {type(model).__name__} "
                         "is not (call adapt(model) once, before training)")
    x = batch[HIDDEN_STATES]
    ctx = active_context()
    grids = [tuple(int(v) for v in g) for g in batch[GRID]]
    labels = sample_labels(batch)
    _check_batch(model, batch, x, grids, labels, ctx.size)
    local = _local_segments([math.prod(g) for g in grids], x.shape[0], ctx.size, ctx.rank)

    dtype = model.proj_in.weight.dtype  # inputs are cast to the model's dtype, as diffusers' pipelines do
    texts = [per_sample_embeds(t).to(dtype) for t in batch[TEXT]]
    text, bounds = _concat([texts[j] for j, _, _ in local], texts[0])
    segments = tuple((a, b, bounds[i], bounds[i + 1], 0, 0) for i, (_, a, b) in enumerate(local))

    hidden = model.proj_in(x.to(dtype)).unsqueeze(0)
    temb, embedded = model.time_embed(batch[TIMESTEP].reshape(-1), batch_size=1, hidden_dtype=hidden.dtype)
    temb, embedded = temb.view(1, -1, temb.size(-1)), embedded.view(1, -1, embedded.size(-1))  # per token
    text = model.caption_projection(text).view(1, -1, hidden.size(-1))
    cos, sin = ltx_rotary(model, batch, local, hidden)
    self_info = PackedSelfAttention(cos, sin, batch[CU_SEQLENS].to(hidden.device), int(batch[MAX_SEQLEN]))
    text_info = PackedText(text, None, segments)
    switch = model.dcp_recompute
    for i, block in enumerate(model.transformer_blocks):
        hidden = switch.call(i, block, hidden, text_info, temb, self_info)

    # output norm and projection, as diffusers' forward does for a per-token embedded timestep
    shift_scale = model.scale_shift_table[None, None] + embedded[:, :, None]
    shift, scale = shift_scale[:, :, 0], shift_scale[:, :, 1]
    hidden = model.norm_out(hidden) * (1 + scale) + shift
    return model.proj_out(hidden)[0]
