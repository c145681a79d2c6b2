"""Wan 2.1 / 2.2 (diffusers' ``WanTransformer3DModel``) under DCP: :func:`adapt_wan`, its attention processor
and :func:`wan_packed_forward`.

Diffusers' ``WanTransformer3DModel.forward`` takes one ``[B, C, F, H, W]`` tensor, so every video
of a batch must have the same shape. :func:`wan_packed_forward` runs the same model -- its own patch
embedding weights, condition embedder, blocks, output norm and projection -- on a packed micro-batch
of videos of any sizes (and on this rank's SP shard of it):

* patch embedding per token: the ``Conv3d`` (kernel = stride = patch) as one matrix product with
  its weight flattened, on the patch-flattened tokens (:func:`~lightning_dcp.diffusers.samples.patchify`);
* rotary angles per token from each token's grid position (:func:`packed_rotary`): diffusers'
  ``WanRotaryPosEmbed`` builds them for one grid shape per batch, here every token looks up its own
  (frame, row, column), so samples of different shapes pack together and any SP shard gets exactly
  its tokens' angles;
* per-token timestep embedding (diffusers' 4-D ``temb`` path, as Wan 2.2 TI2V uses it), so every
  sample -- and every token -- has its own timestep;
* self-attention within each sample over the SP group, cross-attention of each sample's tokens
  to its own text (:class:`DCPWanAttnProcessor`, :mod:`~lightning_dcp.diffusers.attention`): diffusers'
  Wan block calls ``attn1(x, None, None, rotary_emb)`` and ``attn2(x, encoder_hidden_states, None, None)``
  and passes both through untouched, so the packed forward hands the processor a
  :class:`~lightning_dcp.diffusers.attention.PackedSelfAttention` as ``rotary_emb`` and a
  :class:`~lightning_dcp.diffusers.attention.PackedText` as ``encoder_hidden_states``;
* the first ``active_context().recompute`` blocks checkpointed (``model.dcp_recompute``);
* the output in diffusers' patch layout (``pt x ph x pw x C`` per token);
  :func:`~lightning_dcp.diffusers.samples.unpack_output` unpatchifies a whole batch.

Batch keys: :mod:`lightning_dcp.diffusers.forward`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from lightning_dcp.diffusers.attention import (PackedAttnProcessor, PackedSelfAttention, PackedText, packed_cross_attention,
                                               qkv_projections)
from lightning_dcp.diffusers.forward import (HIDDEN_STATES, TIMESTEP, PackedInputs, check_packed_inputs, concat_tokens,
                                             embed_patches, local_segments)
from lightning_dcp.diffusers.samples import GRID, IMAGE, TEXT, VIDEO_POS, per_sample_embeds, sample_labels
from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, active_context
from lightning_dcp.sp.contract import install_contract
from lightning_dcp.sp.recompute import LayerRecompute
from lightning_dcp.sp.ulysses import ulysses_attention

__all__ = ["DCPWanAttnProcessor", "adapt_wan", "apply_rotary", "is_wan_adapted", "packed_rotary", "wan_packed_forward",
           "wan_patch_size"]


def wan_patch_size(config: Any) -> tuple[int, int, int]:
    """``(pt, ph, pw)`` of a ``WanTransformer3DModel`` config."""
    pt, ph, pw = (int(v) for v in config.patch_size)
    return pt, ph, pw


# ---------------------------------------------------------------------------------------------- rotary

def packed_rotary(rope: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[1, tokens, 1, head_dim]``, for tokens at ``positions`` (int ``[tokens, 3]``).

    Args:
        rope: the model's ``WanRotaryPosEmbed`` (its ``freqs_cos``/``freqs_sin`` ``[max_seq_len, head_dim]``
            buffers, whose columns split ``t_dim``/``h_dim``/``w_dim`` into a frame, a row and a column part).
        positions: each token's (frame, row, column) on the patch grid; all below ``rope.max_seq_len``.
    """
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    pos = positions.to(device=rope.freqs_cos.device, dtype=torch.long)
    out = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        parts = table.split(split, dim=1)
        out.append(torch.cat([parts[axis][pos[:, axis]] for axis in range(3)], dim=-1)[None, :, None, :])
    return out[0], out[1]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., tokens, heads, head_dim]`` by interleaved pairs, exactly as diffusers' Wan processor does."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


# ---------------------------------------------------------------------------------------------- attention

def _added_projections(attn: Any, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if getattr(attn, "fused_projections", False):
        return attn.to_added_kv(image).chunk(2, dim=-1)
    return attn.add_k_proj(image), attn.add_v_proj(image)


def _heads(attn: Any, t: torch.Tensor) -> torch.Tensor:
    return t.unflatten(2, (attn.heads, -1))


def _out(attn: Any, hidden: torch.Tensor) -> torch.Tensor:
    return attn.to_out[1](attn.to_out[0](hidden))


def _self_attention(attn: Any, x: torch.Tensor, packed: PackedSelfAttention) -> torch.Tensor:
    query, key, value = qkv_projections(attn, x, x)
    query, key = attn.norm_q(query), attn.norm_k(key)
    query, key, value = _heads(attn, query), _heads(attn, key), _heads(attn, value)
    query, key = apply_rotary(query, packed.cos, packed.sin), apply_rotary(key, packed.cos, packed.sin)
    out = ulysses_attention(query[0], key[0], value[0], {CU_SEQLENS: packed.cu_seqlens, MAX_SEQLEN: packed.max_seqlen})
    return _out(attn, out.unsqueeze(0).flatten(2, 3).type_as(query))


def _cross_attention(attn: Any, x: torch.Tensor, packed: PackedText) -> torch.Tensor:
    query, key, value = qkv_projections(attn, x, packed.text)
    query, key = attn.norm_q(query), attn.norm_k(key)
    query, key, value = _heads(attn, query), _heads(attn, key), _heads(attn, value)
    image_out = None
    if attn.add_k_proj is not None:
        if packed.image is None:
            raise ValueError("this Wan model is image-conditioned (Wan 2.1 I2V: its cross-attention has add_k_proj) but "
                             "the batch has no image embeddings; give every sample encoder_hidden_states_image "
                             "(lightning_dcp.diffusers.video_sample(..., encoder_hidden_states_image=...))")
        key_img, value_img = _added_projections(attn, packed.image)
        key_img = _heads(attn, attn.norm_added_k(key_img))
        image_out = packed_cross_attention(query, key_img, _heads(attn, value_img), packed.segments, 4)
        image_out = image_out.flatten(2, 3).type_as(query)
    out = packed_cross_attention(query, key, value, packed.segments, 2).flatten(2, 3).type_as(query)
    if image_out is not None:
        out = out + image_out
    return _out(attn, out)


class DCPWanAttnProcessor(PackedAttnProcessor):
    """Attention processor for diffusers' ``WanAttention``: packed and sequence-parallel in
    :func:`wan_packed_forward`, the original processor elsewhere (:class:`PackedAttnProcessor`)."""

    family = "Wan"
    self_attention = staticmethod(_self_attention)
    cross_attention = staticmethod(_cross_attention)

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: Any = None, **kwargs: Any) -> torch.Tensor:
        return self.dispatch(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)


# ---------------------------------------------------------------------------------------------- adapt

def _check_supported(model: nn.Module) -> None:
    name = type(model).__name__
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as err:  # pragma: no cover - diffusers too old to have Wan
        raise ImportError(f"lightning_dcp.diffusers needs diffusers>=0.35 (WanTransformer3DModel): {err}; "
                          'pip install "lightning-dcp[diffusers]"') from err
    if not isinstance(model, WanTransformer3DModel):
        raise TypeError(f"adapt_wan takes a WanTransformer3DModel, got {name}; use lightning_dcp.diffusers.adapt")
    config = model.config
    if getattr(config, "pos_embed_seq_len", None):
        raise NotImplementedError(
            f"lightning_dcp.diffusers.adapt: {name} with pos_embed_seq_len={config.pos_embed_seq_len} (Wan 2.1 FLF2V, "
            "first-last-frame) pairs the image embeddings of two images per sample inside its image embedder, which "
            "the packed forward does not do yet; T2V, I2V and TI2V Wan models are supported.")
    heads, dim = int(config.num_attention_heads), int(config.attention_head_dim)
    if dim % 2 or heads < 1:
        raise ValueError(f"lightning_dcp.diffusers.adapt: {name} has {heads} heads of dim {dim}; rotary embeddings "
                         "need an even head dim")
    for i, block in enumerate(model.blocks):
        for attn in (block.attn1, block.attn2):
            processor = attn.processor
            if isinstance(processor, DCPWanAttnProcessor):
                continue
            if not callable(processor) or type(processor).__name__ != "WanAttnProcessor":
                raise ValueError(f"lightning_dcp.diffusers.adapt: block {i} of {name} uses the attention processor "
                                 f"{type(processor).__name__}, not diffusers' WanAttnProcessor; the packed processor "
                                 "replaces that one only (reset it with model.set_attn_processor(WanAttnProcessor()) "
                                 "before adapting)")


def adapt_wan(model: nn.Module, *, recompute_override: int | None = None) -> nn.Module:
    """Prepare a diffusers ``WanTransformer3DModel`` (Wan 2.1 / 2.2) for DCP, in place.

    * attention: every ``WanAttention`` gets a :class:`DCPWanAttnProcessor`: in :func:`wan_packed_forward` it
      runs Ulysses self-attention over the SP group of the micro-batch and per-sample cross-attention; any
      other call (the model's own ``forward``, a diffusers pipeline) goes to the processor it had, so
      inference is unchanged.
    * the contract (:func:`~lightning_dcp.sp.contract.install_contract`): ``model.dcp_recompute`` checkpoints
      block ``i`` in the packed forward iff ``i < active_context().recompute`` (or its ``recompute_override``),
      non-reentrant; ``model.dcp_num_heads`` (SP sizes must divide it); ``model.dcp_repeated_layers()`` (the
      blocks in call order); ``model.dcp_cost_per_sample = True``: every sample's cross-attention projects its
      text whatever the video's length, so the profile's time fit gets a per-sample term. No module is
      wrapped or moved, so ``state_dict`` keys are unchanged.

    Calling it again is a no-op apart from a new ``recompute_override``.

    Raises:
        NotImplementedError: Wan FLF2V -- the message says what is missing.
        TypeError: not a ``WanTransformer3DModel``.
        ValueError: a Wan model with a custom attention processor.
    """
    _check_supported(model)
    for block in model.blocks:
        for attn in (block.attn1, block.attn2):
            if not isinstance(attn.processor, DCPWanAttnProcessor):
                attn.set_processor(DCPWanAttnProcessor(attn.processor))
    install_contract(model, model.blocks, num_heads=model.config.num_attention_heads, per_sample_cost=True,
                     recompute_override=recompute_override)
    return model


def is_wan_adapted(model: nn.Module) -> bool:
    """Whether :func:`adapt_wan` has prepared ``model`` (its recompute switch and packed processors are in place)."""
    blocks = getattr(model, "blocks", None)
    return (isinstance(getattr(model, "dcp_recompute", None), LayerRecompute) and isinstance(blocks, nn.ModuleList)
            and all(isinstance(b.attn1.processor, DCPWanAttnProcessor) and isinstance(b.attn2.processor, DCPWanAttnProcessor)
                    for b in blocks))


# ---------------------------------------------------------------------------------------------- packed forward

def _inputs(model: nn.Module) -> PackedInputs:
    config = model.config
    patch = math.prod(wan_patch_size(config))
    return PackedInputs(
        family="Wan", width=int(config.in_channels) * patch,
        takes=f"[tokens, in_channels x patch] = [tokens, {config.in_channels} x {patch}]",
        builder="lightning_dcp.diffusers.video_sample",
        builder_hint=" for this model's patch size (I2V models take the noisy latents plus condition_latents channels)",
        text_dim=(int(config.text_dim), "text_dim"),
        image_model=getattr(model.blocks[0].attn2, "add_k_proj", None) is not None,
        no_image="has no image cross-attention (added_kv_proj_dim is None); drop them or use an I2V model",
        rope_limit=int(model.rope.max_seq_len))


def wan_packed_forward(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Velocity (or noise) prediction ``[local_tokens, out_channels*pt*ph*pw]`` of an adapted Wan model.

    Args:
        model: a ``WanTransformer3DModel`` prepared by :func:`~lightning_dcp.diffusers.adapt`.
        batch: a packed micro-batch (:mod:`lightning_dcp.diffusers.forward`), whole or this SP rank's shard.

    Returns:
        This shard's tokens' predictions in the output layout ``pt x ph x pw x C``; the shard's
        padding tokens get finite values that nothing else depends on.

    Raises:
        ValueError: a malformed batch (wrong feature count, a grid past the rotary table, a
            sample without text, ...), naming the sample.
    """
    if not is_wan_adapted(model):
        raise ValueError(f"packed_forward needs a model prepared by lightning_dcp.diffusers.adapt; {type(model).__name__} "
                         "is not (call adapt(model) once, before training)")
    x = batch[HIDDEN_STATES]
    ctx = active_context()
    grids = [tuple(int(v) for v in g) for g in batch[GRID]]
    labels = sample_labels(batch)
    check_packed_inputs(_inputs(model), batch, x, grids, labels, ctx.size)
    local = local_segments([math.prod(g) for g in grids], x.shape[0], ctx.size, ctx.rank)

    texts, images = batch[TEXT], batch.get(IMAGE)
    dtype = model.patch_embedding.weight.dtype  # inputs are cast to the model's dtype, as diffusers' pipelines do
    texts = [per_sample_embeds(t).to(dtype) for t in texts]
    text, text_bounds = concat_tokens([texts[j] for j, _, _ in local], texts[0])
    if images is None:
        image, image_bounds = None, [0] * (len(local) + 1)
    else:
        images = [per_sample_embeds(im).to(dtype) for im in images]
        image, image_bounds = concat_tokens([images[j] for j, _, _ in local], images[0])
    segments = tuple((a, b, text_bounds[i], text_bounds[i + 1], image_bounds[i], image_bounds[i + 1])
                     for i, (_, a, b) in enumerate(local))

    tokens = x.shape[0]
    temb, timestep_proj, text, image = model.condition_embedder(batch[TIMESTEP].reshape(-1), text, image,
                                                                timestep_seq_len=tokens)
    timestep_proj = timestep_proj.unflatten(2, (6, -1))  # [1, tokens, 6, dim]: the block's 4-D temb path

    hidden = embed_patches(model.patch_embedding, x.to(dtype)).unsqueeze(0)  # a peft wrapper's adapter too
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
