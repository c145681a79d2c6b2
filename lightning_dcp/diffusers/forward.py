"""The packed forward of an adapted Wan transformer: :func:`wan_packed_forward`.

Every family, looked up: :func:`~lightning_dcp.diffusers.dispatch.packed_forward`.

Diffusers' ``WanTransformer3DModel.forward`` takes one ``[B, C, F, H, W]`` tensor, so every video
of a batch must have the same shape. :func:`packed_forward` runs the same model -- its own patch
embedding weights, condition embedder, blocks, output norm and projection -- on a packed micro-batch
of videos of any sizes (and on this rank's SP shard of it):

* patch embedding per token: the ``Conv3d`` (kernel = stride = patch) as one matrix product with
  its weight flattened, on the patch-flattened tokens (:func:`~lightning_dcp.diffusers.samples.patchify`);
* rotary angles per token from each token's grid position (:mod:`~lightning_dcp.diffusers.rope`);
* per-token timestep embedding (diffusers' 4-D ``temb`` path, as Wan 2.2 TI2V uses it), so every
  sample -- and every token -- has its own timestep;
* self-attention within each sample over the SP group, cross-attention of each sample's tokens
  to its own text (:mod:`~lightning_dcp.diffusers.attention`);
* the first ``active_context().recompute`` blocks checkpointed (``model.dcp_recompute``);
* the output in diffusers' patch layout (``pt x ph x pw x C`` per token);
  :func:`~lightning_dcp.diffusers.samples.unpack_output` unpatchifies a whole batch.

Batch keys read (besides :func:`~lightning_dcp.sp.packing.pack_samples`' ``cu_seqlens``/``max_seqlen``):
:data:`HIDDEN_STATES` and :data:`TIMESTEP` (per token; :class:`~lightning_dcp.diffusers.VideoDiffusionModule`
adds them from the clean latents), :data:`~lightning_dcp.diffusers.samples.VIDEO_POS` (per token),
:data:`~lightning_dcp.diffusers.samples.GRID` and :data:`~lightning_dcp.diffusers.samples.TEXT`
(per sample, whole on every SP rank), optionally :data:`~lightning_dcp.diffusers.samples.IMAGE`.
Shards are contiguous token chunks (:func:`lightning_dcp.sp.tokens.shard_batch`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dcp.diffusers.attention import PackedSelfAttention, PackedText
from lightning_dcp.diffusers.rope import packed_rotary
from lightning_dcp.diffusers.samples import GRID, IMAGE, TEXT, VIDEO_POS, per_sample_embeds, sample_labels
from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, active_context

__all__ = ["HIDDEN_STATES", "TIMESTEP", "wan_packed_forward"]

#: The model's input tokens ``[tokens, in_channels*pt*ph*pw]`` (input layout): noisy latents (+ condition channels).
HIDDEN_STATES = "hidden_states"
#: Per-token diffusion timestep (float ``[tokens]``, in the scheduler's ``[0, num_train_timesteps]`` units).
TIMESTEP = "timestep"


def _local_segments(lengths: list[int], local: int, sp_size: int, sp_rank: int) -> list[tuple[int, int, int]]:
    """``(sample, start, end)`` in this shard's local token indices, for every sample with tokens here."""
    lo, out, start = sp_rank * local, [], 0
    for j, n in enumerate(lengths):
        a, b = max(start, lo), min(start + n, lo + local)
        if b > a:
            out.append((j, a - lo, b - lo))
        start += n
    return out


def _check_batch(model: nn.Module, batch: Mapping[str, Any], x: torch.Tensor, grids: list[tuple[int, int, int]],
                 labels: list[str], sp_size: int) -> None:
    config = model.config
    patch = math.prod(config.patch_size)
    if x.dim() != 2 or x.shape[1] != config.in_channels * patch:
        raise ValueError(f"packed Wan forward: {HIDDEN_STATES!r} has shape {tuple(x.shape)}, but the model takes "
                         f"[tokens, in_channels x patch] = [tokens, {config.in_channels} x {patch}]; build samples with "
                         "lightning_dcp.diffusers.video_sample for this model's patch size (I2V models take the noisy "
                         "latents plus condition_latents channels)")
    for key in (VIDEO_POS, TIMESTEP):
        value = batch.get(key)
        if not isinstance(value, torch.Tensor) or value.shape[0] != x.shape[0]:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"packed Wan forward: {key!r} must be a per-token tensor with {x.shape[0]} rows like "
                             f"{HIDDEN_STATES!r}, got {got}")
    limit = int(model.rope.max_seq_len)  # table rows 0..limit-1: a grid side of exactly limit fits, as in diffusers
    for label, grid in zip(labels, grids):
        if max(grid) > limit:
            raise ValueError(f"{label}: patch grid (frames, rows, columns) = {grid} is longer than the model's rotary "
                             f"table (rope_max_seq_len={limit} positions per axis); use a smaller video or a model "
                             "configured with a larger rope_max_seq_len")
    total = sum(math.prod(g) for g in grids)
    if total > x.shape[0] * sp_size:
        raise ValueError(f"packed Wan forward: the samples' grids {grids} hold {total} tokens but the SP group holds "
                         f"{x.shape[0]} x {sp_size}; the batch must be packed from these samples (pack_samples) and "
                         "sharded in contiguous chunks (lightning_dcp.sp.tokens.shard_batch)")
    texts = batch.get(TEXT)
    missing = [label for j, label in enumerate(labels) if texts is None or j >= len(texts) or texts[j] is None]
    if missing:
        raise ValueError(f"{', '.join(missing)}: no text embeddings ({TEXT!r}); every sample needs its text encoder "
                         "output (an empty prompt's for unconditional samples): build samples with "
                         "lightning_dcp.diffusers.video_sample(latents, encoder_hidden_states, ...)")
    image_model = getattr(model.blocks[0].attn2, "add_k_proj", None) is not None
    images = batch.get(IMAGE)
    if image_model and (images is None or any(im is None for im in images)):
        raise ValueError(f"{type(model).__name__} is image-conditioned (Wan 2.1 I2V: image_dim/added_kv_proj_dim set) "
                         f"but {', '.join(labels)} carry no image embeddings; pass encoder_hidden_states_image to "
                         "video_sample for every sample")
    if not image_model and images is not None:
        raise ValueError(f"the batch has image embeddings ({IMAGE!r}) but {type(model).__name__} has no image "
                         "cross-attention (added_kv_proj_dim is None); drop them or use an I2V model")


def _concat(parts: list[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Concatenate ``[1, n_i, d]`` tensors along tokens; also the running offsets (``len(parts) + 1``)."""
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + int(p.shape[1]))
    if not parts:
        return like[:, :0], bounds
    return torch.cat(parts, dim=1), bounds


def wan_packed_forward(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Velocity (or noise) prediction ``[local_tokens, out_channels*pt*ph*pw]`` of an adapted Wan model.

    Args:
        model: a ``WanTransformer3DModel`` prepared by :func:`~lightning_dcp.diffusers.adapt`.
        batch: a packed micro-batch (see the module docstring), whole or this SP rank's shard.

    Returns:
        This shard's tokens' predictions in the output layout ``pt x ph x pw x C``; the shard's
        padding tokens get finite values that nothing else depends on.

    Raises:
        ValueError: a malformed batch (wrong feature count, a grid past the rotary table, a
            sample without text, ...), naming the sample.
    """
    from lightning_dcp.diffusers.adapt import is_wan_adapted

    if not is_wan_adapted(model):
        raise ValueError(f"packed_forward needs a model prepared by lightning_dcp.diffusers.adapt; {type(model).__name__} "
                         "is not (call adapt(model) once, before training)")
    x = batch[HIDDEN_STATES]
    ctx = active_context()
    grids = [tuple(int(v) for v in g) for g in batch[GRID]]
    labels = sample_labels(batch)
    _check_batch(model, batch, x, grids, labels, ctx.size)
    local = _local_segments([math.prod(g) for g in grids], x.shape[0], ctx.size, ctx.rank)

    texts, images = batch[TEXT], batch.get(IMAGE)
    dtype = model.patch_embedding.weight.dtype  # inputs are cast to the model's dtype, as diffusers' pipelines do
    texts = [per_sample_embeds(t).to(dtype) for t in texts]
    text, text_bounds = _concat([texts[j] for j, _, _ in local], texts[0])
    if images is None:
        image, image_bounds = None, [0] * (len(local) + 1)
    else:
        images = [per_sample_embeds(im).to(dtype) for im in images]
        image, image_bounds = _concat([images[j] for j, _, _ in local], images[0])
    segments = tuple((a, b, text_bounds[i], text_bounds[i + 1], image_bounds[i], image_bounds[i + 1])
                     for i, (_, a, b) in enumerate(local))

    tokens = x.shape[0]
    temb, timestep_proj, text, image = model.condition_embedder(batch[TIMESTEP].reshape(-1), text, image,
                                                                timestep_seq_len=tokens)
    timestep_proj = timestep_proj.unflatten(2, (6, -1))  # [1, tokens, 6, dim]: the block's 4-D temb path

    conv = model.patch_embedding
    hidden = F.linear(x.to(dtype), conv.weight.flatten(1), conv.bias).unsqueeze(0)
    cos, sin = packed_rotary(model.rope, batch[VIDEO_POS])
    self_info = PackedSelfAttention(cos, sin, batch[CU_SEQLENS].to(hidden.device), int(batch[MAX_SEQLEN]))
    text_info = PackedText(text, image, segments)
    switch = model.dcp_recompute
    for i, block in enumerate(model.blocks):
        hidden = switch.call(i, block, hidden, text_info, timestep_proj, self_info)

    # output norm and projection, as diffusers' forward does for a per-token temb [1, tokens, dim]
    shift, scale = (model.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
    shift, scale = shift.squeeze(2).to(hidden.device), scale.squeeze(2).to(hidden.device)
    hidden = (model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    return model.proj_out(hidden)[0]
