"""LTX-Video (diffusers' ``LTXVideoTransformer3DModel``) under DCP: :func:`adapt_ltx`, its attention
processor, :func:`ltx_video_sample` and :func:`ltx_packed_forward`.

LTX's blocks call ``attn1(norm_x, None, image_rotary_emb=rotary)`` (self-attention, rotary over the
whole ``heads x head_dim`` width after an RMS norm across heads) and
``attn2(x, encoder_hidden_states=text, attention_mask=text_mask)`` (cross-attention to the projected
T5 text, whose padding the mask hides). As for Wan (:mod:`~lightning_dcp.diffusers.families.wan`), the
packed forward (:func:`ltx_packed_forward`) runs the model's own blocks and passes what packing needs
through those arguments:

* self-attention gets a :class:`~lightning_dcp.diffusers.attention.PackedSelfAttention` as
  ``image_rotary_emb`` (cos/sin ``[1, local_tokens, heads*head_dim]`` of this shard's tokens, the
  segment boundaries of the whole packed sequence): q/k/v of the local tokens, the RMS norms and the
  rotation as diffusers does them, then :func:`~lightning_dcp.sp.ulysses.ulysses_attention` over the
  micro-batch's SP group, variable-length within each sample;
* cross-attention gets a :class:`~lightning_dcp.diffusers.attention.PackedText` as
  ``encoder_hidden_states``: each local video token attends to its own sample's text tokens only.
  Samples carry their text *unpadded* (:func:`ltx_video_sample` drops the tokens the pipeline's
  attention mask hides), so no mask is needed: diffusers' ``-10000`` bias gives those tokens weight 0.

Any other call (diffusers' own forward, a pipeline at inference) goes to the processor the module had.

**The packed forward.** Diffusers' ``LTXVideoTransformer3DModel.forward`` takes one ``[B, tokens, C]``
tensor of videos of one shape (one rotary grid, one text mask per batch). :func:`ltx_packed_forward` runs the same model --
``proj_in``, ``time_embed``, ``caption_projection``, its blocks, ``norm_out`` and ``proj_out`` -- on a
packed micro-batch of videos of any sizes (or this rank's SP shard of it):

* tokens are LTX's own patchified latents (``C x pt x p x p`` per token, the pipeline's ``_pack_latents``
  order, which :func:`~lightning_dcp.diffusers.patchify` makes), projected per token by ``proj_in``;
* rotary angles per token: each token's patch-grid position times its sample's
  ``rope_interpolation_scale`` (:data:`ROPE_SCALE`), through the model's own ``rope`` module (its ``video_coords`` input), so samples of different shapes and frame
  rates pack together;
* a timestep per token (``time_embed`` on ``[tokens]``, the per-token ``temb`` the blocks accept, as
  LTX's condition pipeline uses it);
* self-attention within each sample over the SP group, cross-attention of each sample's tokens to
  its own unpadded text (:class:`DCPLTXAttnProcessor`);
* the first ``active_context().recompute`` blocks checkpointed (``model.dcp_recompute``);
* the output in the input layout (``C x pt x p x p`` per token, the pipeline's ``_unpack_latents``).

Batch keys are those of :mod:`lightning_dcp.diffusers.forward` plus the optional per-sample
:data:`ROPE_SCALE` (missing or None: unscaled positions).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from lightning_dcp.diffusers.attention import PackedAttnProcessor, PackedSelfAttention, PackedText, packed_cross_attention
from lightning_dcp.diffusers.forward import (HIDDEN_STATES, TIMESTEP, PackedInputs, check_packed_inputs, concat_tokens,
                                             local_segments)
from lightning_dcp.diffusers.samples import GRID, TEXT, VIDEO_POS, per_sample_embeds, sample_labels, video_sample
from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, active_context
from lightning_dcp.sp.contract import install_contract
from lightning_dcp.sp.recompute import LayerRecompute
from lightning_dcp.sp.ulysses import ulysses_attention

__all__ = ["LTX_PIPELINE_ROPE_SCALE", "ROPE_SCALE", "DCPLTXAttnProcessor", "adapt_ltx", "is_ltx_adapted",
           "ltx_packed_forward", "ltx_patch_size", "ltx_rotary", "ltx_video_sample"]

#: Per-sample key: the sample's ``rope_interpolation_scale`` (3 floats: frames, rows, columns), or None
#: for the model forward's default (unscaled patch-grid positions).
ROPE_SCALE = "rope_interpolation_scale"
#: What ``LTXPipeline`` passes at its default 25 fps: ``(vae temporal compression / frame_rate, vae
#: spatial compression, vae spatial compression)`` = ``(8 / 25, 32, 32)`` with LTX-Video's VAE.
LTX_PIPELINE_ROPE_SCALE = (8 / 25, 32.0, 32.0)


def ltx_patch_size(config: Any) -> tuple[int, int, int]:
    """``(patch_size_t, patch_size, patch_size)`` of an ``LTXVideoTransformer3DModel`` config."""
    return int(config.patch_size_t), int(config.patch_size), int(config.patch_size)


def _rotate(x: torch.Tensor, packed: PackedSelfAttention) -> torch.Tensor:
    from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

    return apply_rotary_emb(x, (packed.cos, packed.sin))


def _self_attention(attn: Any, x: torch.Tensor, packed: PackedSelfAttention) -> torch.Tensor:
    query, key, value = attn.to_q(x), attn.to_k(x), attn.to_v(x)
    query, key = _rotate(attn.norm_q(query), packed), _rotate(attn.norm_k(key), packed)
    query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
    out = ulysses_attention(query[0], key[0], value[0], {CU_SEQLENS: packed.cu_seqlens, MAX_SEQLEN: packed.max_seqlen})
    return attn.to_out[1](attn.to_out[0](out.unsqueeze(0).flatten(2, 3).to(query.dtype)))


def _cross_attention(attn: Any, x: torch.Tensor, packed: PackedText) -> torch.Tensor:
    query = attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1))
    key = attn.norm_k(attn.to_k(packed.text)).unflatten(2, (attn.heads, -1))
    value = attn.to_v(packed.text).unflatten(2, (attn.heads, -1))
    out = packed_cross_attention(query, key, value, packed.segments, 2).flatten(2, 3).to(query.dtype)
    return attn.to_out[1](attn.to_out[0](out))


class DCPLTXAttnProcessor(PackedAttnProcessor):
    """Attention processor for diffusers' ``LTXAttention``: packed and sequence-parallel in
    :func:`ltx_packed_forward`, the original processor elsewhere (:class:`PackedAttnProcessor`)."""

    family = "LTX"
    self_attention = staticmethod(_self_attention)
    cross_attention = staticmethod(_cross_attention)

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: Any = None) -> torch.Tensor:
        return self.dispatch(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def _attentions(model: nn.Module) -> list[tuple[int, Any]]:
    return [(i, attn) for i, block in enumerate(model.transformer_blocks) for attn in (block.attn1, block.attn2)]


def _check_ltx(model: nn.Module) -> None:
    name = type(model).__name__
    for i, attn in _attentions(model):
        processor = attn.processor
        if not isinstance(processor, DCPLTXAttnProcessor) and type(processor).__name__ != "LTXVideoAttnProcessor":
            raise ValueError(f"lightning_dcp.diffusers.adapt: block {i} of {name} uses the attention processor "
                             f"{type(processor).__name__}, not diffusers' LTXVideoAttnProcessor; the packed processor "
                             "replaces that one only (reset it with model.set_attn_processor(LTXVideoAttnProcessor()) "
                             "before adapting)")


def adapt_ltx(model: nn.Module, *, recompute_override: int | None = None) -> nn.Module:
    """Prepare a diffusers ``LTXVideoTransformer3DModel`` (LTX-Video) for DCP, in place.

    As :func:`~lightning_dcp.diffusers.families.wan.adapt_wan` does for Wan: every ``LTXAttention`` gets a
    :class:`DCPLTXAttnProcessor` (packed only inside the packed forward), ``model.dcp_recompute``
    checkpoints the first ``active_context().recompute`` blocks of ``transformer_blocks``,
    ``model.dcp_num_heads``, ``model.dcp_repeated_layers()`` and ``model.dcp_cost_per_sample = True``
    (each sample's cross-attention projects its text). ``state_dict`` keys and the model's own
    ``forward`` are unchanged; calling it again only updates ``recompute_override``.

    Raises:
        ValueError: a model with an attention processor other than diffusers' ``LTXVideoAttnProcessor``.
    """
    _check_ltx(model)
    for _, attn in _attentions(model):
        if not isinstance(attn.processor, DCPLTXAttnProcessor):
            attn.set_processor(DCPLTXAttnProcessor(attn.processor))
    install_contract(model, model.transformer_blocks, num_heads=model.config.num_attention_heads, per_sample_cost=True,
                     recompute_override=recompute_override)
    return model


def is_ltx_adapted(model: nn.Module) -> bool:
    """Whether :func:`adapt_ltx` has prepared ``model``."""
    blocks = getattr(model, "transformer_blocks", None)
    return (isinstance(getattr(model, "dcp_recompute", None), LayerRecompute) and isinstance(blocks, nn.ModuleList)
            and all(isinstance(attn.processor, DCPLTXAttnProcessor) for _, attn in _attentions(model)))


def _rope_scale(value: Any, where: str) -> tuple[float, float, float] | None:
    if value is None:
        return None
    try:
        scale = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        scale = ()
    if len(scale) != 3:
        raise ValueError(f"{where}: rope_interpolation_scale must be 3 numbers (frames, rows, columns), e.g. LTXPipeline's "
                         f"(8 / frame_rate, 32, 32), or None; got {value!r}")
    return scale  # type: ignore[return-value]


def ltx_video_sample(latents: torch.Tensor, encoder_hidden_states: torch.Tensor, patch_size: Sequence[int] = (1, 1, 1),
                     *, encoder_attention_mask: torch.Tensor | None = None,
                     rope_interpolation_scale: Sequence[float] | None = LTX_PIPELINE_ROPE_SCALE,
                     index: int | None = None) -> dict[str, Any]:
    """One LTX-Video training sample: :func:`~lightning_dcp.diffusers.video_sample` with LTX's text and rotary scale.

    Args:
        latents: the (normalised) VAE latent of one video ``[C, F, H, W]``, any size.
        encoder_hidden_states: the T5 embeddings ``[text_tokens, 4096]`` (or ``[1, text_tokens, 4096]``).
        patch_size: :func:`ltx_patch_size` of the model's config (``(1, 1, 1)`` for LTX-Video's releases).
        encoder_attention_mask: the tokenizer's attention mask ``[text_tokens]`` (or ``[1, text_tokens]``):
            only the tokens it keeps are stored, which is what diffusers' masked cross-attention attends to.
            ``None``: every given token is real.
        rope_interpolation_scale: the scale of the rotary positions (frames, rows, columns), as
            ``LTXPipeline`` passes it: ``(8 / frame_rate, 32, 32)``; the default is its 25 fps value.
            ``None``: unscaled patch-grid positions (the model forward's default).
        index: the sample's index in the dataset (see :func:`~lightning_dcp.diffusers.video_sample`).

    Raises:
        ValueError: a mask that does not match the text or keeps no token, a malformed scale, and every
            error of :func:`~lightning_dcp.diffusers.video_sample` -- naming the sample.
    """
    where = "a sample" if index is None else f"sample {index}"
    scale = _rope_scale(rope_interpolation_scale, where)
    text = encoder_hidden_states
    if encoder_attention_mask is not None and isinstance(text, torch.Tensor):
        mask = encoder_attention_mask.reshape(-1).bool()
        if mask.numel() != text.shape[-2] or not bool(mask.any()):
            raise ValueError(f"{where}: encoder_attention_mask has {mask.numel()} entries ({int(mask.sum())} kept) but "
                             f"encoder_hidden_states has {text.shape[-2]} tokens; pass the tokenizer's mask of this "
                             "prompt (at least one token kept)")
        text = text.reshape(*text.shape[-2:])[mask]
    out = video_sample(latents, text, patch_size, text_len=None, index=index)
    out[ROPE_SCALE] = scale
    return out


# ---------------------------------------------------------------------------------------------- packed forward

def _inputs(model: nn.Module) -> PackedInputs:
    config = model.config
    return PackedInputs(
        family="LTX", width=int(config.in_channels),
        takes=f"[tokens, in_channels] = [tokens, {config.in_channels}] (LTX's tokens are its patchified latents)",
        builder="lightning_dcp.diffusers.ltx_video_sample",
        builder_hint=" for this model's patch size (ltx_patch_size(model.config))",
        text_dim=(int(config.caption_channels), "caption_channels"),
        no_image="(LTX-Video) has no image cross-attention; drop them")


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
    check_packed_inputs(_inputs(model), batch, x, grids, labels, ctx.size)
    local = local_segments([math.prod(g) for g in grids], x.shape[0], ctx.size, ctx.rank)

    dtype = model.proj_in.weight.dtype  # inputs are cast to the model's dtype, as diffusers' pipelines do
    texts = [per_sample_embeds(t).to(dtype) for t in batch[TEXT]]
    text, bounds = concat_tokens([texts[j] for j, _, _ in local], texts[0])
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
