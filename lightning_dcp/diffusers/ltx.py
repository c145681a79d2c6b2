"""LTX-Video (diffusers' ``LTXVideoTransformer3DModel``) under DCP: :func:`adapt_ltx`, its attention
processor and :func:`ltx_video_sample`.

LTX's blocks call ``attn1(norm_x, None, image_rotary_emb=rotary)`` (self-attention, rotary over the
whole ``heads x head_dim`` width after an RMS norm across heads) and
``attn2(x, encoder_hidden_states=text, attention_mask=text_mask)`` (cross-attention to the projected
T5 text, whose padding the mask hides). As for Wan (:mod:`~lightning_dcp.diffusers.attention`), the
packed forward (:func:`~lightning_dcp.diffusers.ltx_forward.ltx_packed_forward`) runs the model's own
blocks and passes what packing needs through those arguments:

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
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from lightning_dcp.diffusers.attention import PackedSelfAttention, PackedText, packed_cross_attention
from lightning_dcp.diffusers.samples import video_sample
from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN
from lightning_dcp.sp.recompute import LayerRecompute, RepeatedLayers
from lightning_dcp.sp.ulysses import ulysses_attention

__all__ = ["LTX_PIPELINE_ROPE_SCALE", "ROPE_SCALE", "DCPLTXAttnProcessor", "adapt_ltx", "is_ltx_adapted",
           "ltx_patch_size", "ltx_video_sample"]

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


class DCPLTXAttnProcessor:
    """Attention processor for diffusers' ``LTXAttention``: packed and sequence-parallel in
    :func:`~lightning_dcp.diffusers.ltx_forward.ltx_packed_forward`, the original processor elsewhere.

    Args:
        fallback: the processor the module had before (used for every unpacked call).
    """

    def __init__(self, fallback: Any) -> None:
        self.fallback = fallback

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: Any = None) -> torch.Tensor:
        packed = isinstance(image_rotary_emb, PackedSelfAttention) or isinstance(encoder_hidden_states, PackedText)
        if not packed:
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if attention_mask is not None:
            raise ValueError("lightning_dcp's packed LTX attention takes no attention_mask: packed samples carry their "
                             "text unpadded (ltx_video_sample) and are described by cu_seqlens and PackedText.segments")
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
            raise ValueError(f"packed LTX attention expects hidden states [1, local_tokens, dim], got "
                             f"{tuple(hidden_states.shape)}")
        if isinstance(encoder_hidden_states, PackedText):
            return _cross_attention(attn, hidden_states, encoder_hidden_states)
        return _self_attention(attn, hidden_states, image_rotary_emb)


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

    As :func:`~lightning_dcp.diffusers.adapt.adapt_wan` does for Wan: every ``LTXAttention`` gets a
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
    blocks = model.transformer_blocks
    switch = getattr(model, "dcp_recompute", None)
    if isinstance(switch, LayerRecompute) and len(switch) == len(blocks):
        switch.recompute_override = recompute_override
    else:
        switch = LayerRecompute(len(blocks), recompute_override=recompute_override)
    model.dcp_recompute = switch
    model.dcp_num_heads = int(model.config.num_attention_heads)
    model.dcp_cost_per_sample = True
    model.dcp_repeated_layers = RepeatedLayers(blocks)
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
