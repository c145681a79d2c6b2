"""CogVideoX (``CogVideoXTransformer3DModel``, 1.0 and 1.5) under DCP: adapt, samples, the packed forward.

CogVideoX attends over ``[text; video]`` of each sample in every block, with *expert* adaptive
norms (one modulation for the text rows, one for the video rows) and one set of projections for
both. Packed (see :mod:`lightning_dcp.diffusers.joint`): the rows of all samples in one sequence,
each block modulating every row with its own sample's and role's shift/scale/gate, attention
within each sample's joint segment (Ulysses over the SP group), rotary angles per video row from
its own grid, computed as diffusers' CogVideoX pipeline computes them for that video size
(:func:`cogvideox_rotary`), or the 3-D sin-cos positions of the patch embedding (CogVideoX-2b).
Its output per token is channel-major (``C x pt x ph x pw``), the flow target's ``"input"`` layout.

Not supported (``adapt`` says so): learned positional embeddings (CogVideoX-5b-I2V) and the ``ofs``
embedding (CogVideoX1.5-5B-I2V).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock
from torch import nn

from lightning_dcp.diffusers.attention import qkv_projections
from lightning_dcp.diffusers.joint import (
    JointRows,
    check_row_width,
    check_texts,
    joint_attention,
    joint_rows,
    joint_sample,
    per_sample_timesteps,
    per_token,
    position_rows,
    rotary_rows,
    rotate,
    row_roles,
    swap_block_class,
    text_rows_input,
    video_rows,
)
from lightning_dcp.diffusers.forward import HIDDEN_STATES, TIMESTEP, embed_patches
from lightning_dcp.diffusers.samples import GRID, sample_labels
from lightning_dcp.sp.contract import install_contract
from lightning_dcp.sp.recompute import LayerRecompute

__all__ = ["PackedCogVideoXBlock", "adapt_cogvideox", "cogvideox_packed_forward", "cogvideox_patch_size",
           "cogvideox_rotary", "cogvideox_sample", "is_cogvideox_adapted"]


def cogvideox_patch_size(config: Any) -> tuple[int, int, int]:
    """``(pt, ph, pw)`` of a CogVideoX config: ``(1, p, p)`` for 1.0, ``(patch_size_t, p, p)`` for 1.5."""
    p = int(config.patch_size)
    return (int(config.patch_size_t or 1), p, p)


def cogvideox_sample(latents: torch.Tensor, encoder_hidden_states: torch.Tensor, patch_size: Any, *,
                     index: int | None = None, text_len: int | None = None,
                     condition_latents: torch.Tensor | None = None) -> dict[str, Any]:
    """A CogVideoX training sample, rows ``[text; video]`` (:func:`~lightning_dcp.diffusers.joint.joint_sample`).

    ``latents`` are ``[C, F, H, W]`` (channels first, as the VAE encodes; the transformer's own forward
    takes ``[B, F, C, H, W]``); ``encoder_hidden_states`` the T5 output the model attends to (CogVideoX's
    pipeline pads prompts to 226 tokens and attends over all of them; sin-cos models need exactly
    ``max_text_seq_length`` tokens). ``patch_size``: :func:`cogvideox_patch_size` of the model's config.
    """
    return joint_sample(latents, encoder_hidden_states, patch_size, text_first=True, index=index, text_len=text_len,
                        condition_latents=condition_latents)


def cogvideox_rotary(model: nn.Module, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[F*H*W, head_dim]`` of one video's patch grid, as diffusers' CogVideoX pipeline
    computes them (``_prepare_rotary_positional_embeddings``: crop region of the base grid for 1.0,
    ``grid_type="slice"`` for 1.5)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    config = model.config
    p = int(config.patch_size)
    frames, height, width = grid
    base_w, base_h = int(config.sample_width) // p, int(config.sample_height) // p
    if config.patch_size_t is None:
        crops = get_resize_crop_region_for_grid((height, width), base_w, base_h)
        return get_3d_rotary_pos_embed(embed_dim=int(config.attention_head_dim), crops_coords=crops,
                                       grid_size=(height, width), temporal_size=frames)
    return get_3d_rotary_pos_embed(embed_dim=int(config.attention_head_dim), crops_coords=None, grid_size=(height, width),
                                   temporal_size=frames, grid_type="slice", max_size=(base_h, base_w))


def _sincos_table(model: nn.Module, grid: tuple[int, int, int]) -> torch.Tensor:
    """``[F*H*W, dim]`` video rows of the patch embedding's 3-D sin-cos positions for one grid (CogVideoX-2b)."""
    pe = model.patch_embed
    p = int(model.config.patch_size)
    frames = (grid[0] - 1) * int(pe.temporal_compression_ratio) + 1
    table = pe._get_positional_embeddings(grid[1] * p, grid[2] * p, frames)
    return table[0, int(pe.max_text_seq_length):]


def _modulated(norm: nn.Module, x: torch.Tensor, rows: JointRows) -> tuple[torch.Tensor, torch.Tensor]:
    """``CogVideoXLayerNormZero`` per row: ``(normed and modulated x, gate)``, text rows with the text half."""
    shift, scale, gate, enc_shift, enc_scale, enc_gate = norm.linear(norm.silu(rows.temb)).chunk(6, dim=1)
    out = norm.norm(x) * (1 + per_token(rows, scale, enc_scale)) + per_token(rows, shift, enc_shift)
    return out, per_token(rows, gate, enc_gate)


def _attention(attn: Any, x: torch.Tensor, rows: JointRows) -> torch.Tensor:
    query, key, value = qkv_projections(attn, x, x)
    query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    out = joint_attention(rotate(query, rows), rotate(key, rows), value, rows)
    return attn.to_out[1](attn.to_out[0](out))


def _packed_block(block: CogVideoXBlock, x: torch.Tensor, rows: JointRows) -> torch.Tensor:
    """One CogVideoX block on the packed rows ``[1, rows, dim]`` (diffusers' ``CogVideoXBlock.forward``, per row)."""
    h, gate = _modulated(block.norm1, x, rows)
    x = x + gate * _attention(block.attn1, h, rows)
    h, gate = _modulated(block.norm2, x, rows)
    return x + gate * block.ff(h)


class PackedCogVideoXBlock(CogVideoXBlock):
    """``CogVideoXBlock`` whose forward runs the packed rows when its second argument is a
    :class:`~lightning_dcp.diffusers.joint.JointRows` (``block(x, rows) -> x``), diffusers' forward otherwise."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: Any = None, *args: Any,
                **kwargs: Any) -> Any:
        if isinstance(encoder_hidden_states, JointRows):
            return _packed_block(self, hidden_states, encoder_hidden_states)
        return super().forward(hidden_states, encoder_hidden_states, *args, **kwargs)


def _check(model: nn.Module) -> None:
    config, name = model.config, type(model).__name__
    if getattr(config, "use_learned_positional_embeddings", False):
        raise NotImplementedError(f"lightning_dcp.diffusers.adapt: {name} with use_learned_positional_embeddings=True "
                                  "(CogVideoX-5b-I2V) learns positions for one video size only; any-size packing "
                                  "supports rotary (CogVideoX-5b, 1.5) and sin-cos (CogVideoX-2b) positions")
    if getattr(model, "ofs_embedding", None) is not None:
        raise NotImplementedError(f"lightning_dcp.diffusers.adapt: {name} with ofs_embed_dim set (CogVideoX1.5-5B-I2V) "
                                  "is not supported yet: the packed forward has no per-sample ofs input")
    if not config.use_rotary_positional_embeddings and config.patch_size_t is not None:
        raise NotImplementedError(f"lightning_dcp.diffusers.adapt: {name} with sin-cos positions and patch_size_t="
                                  f"{config.patch_size_t}: diffusers has no such checkpoint; use rotary positions")
    for i, block in enumerate(model.transformer_blocks):
        kind = type(block.attn1.processor).__name__
        if kind not in ("CogVideoXAttnProcessor2_0", "FusedCogVideoXAttnProcessor2_0"):
            raise ValueError(f"lightning_dcp.diffusers.adapt: block {i} of {name} uses the attention processor {kind}, "
                             "not diffusers' CogVideoXAttnProcessor2_0; the packed forward implements that one (reset it "
                             "with model.set_attn_processor(CogVideoXAttnProcessor2_0()) before adapting)")


def adapt_cogvideox(model: nn.Module, *, recompute_override: int | None = None) -> nn.Module:
    """Prepare a ``CogVideoXTransformer3DModel`` in place (see :func:`lightning_dcp.diffusers.adapt`)."""
    _check(model)
    for block in model.transformer_blocks:
        swap_block_class(block, PackedCogVideoXBlock)
    # per_sample_cost False: text rows are tokens of the sequence (lengths count them)
    install_contract(model, model.transformer_blocks, num_heads=model.config.num_attention_heads, per_sample_cost=False,
                     recompute_override=recompute_override)
    return model


def is_cogvideox_adapted(model: nn.Module) -> bool:
    blocks = getattr(model, "transformer_blocks", None)
    return (isinstance(getattr(model, "dcp_recompute", None), LayerRecompute) and isinstance(blocks, nn.ModuleList)
            and all(isinstance(b, PackedCogVideoXBlock) for b in blocks))


def _embed(model: nn.Module, batch: Mapping[str, Any], roles: Mapping[str, torch.Tensor], texts: list[torch.Tensor],
           x: torch.Tensor) -> torch.Tensor:
    """``[1, rows, dim]``: video rows through the patch projection (+ sin-cos positions), text rows through ``text_proj``."""
    pe = model.patch_embed
    dtype = pe.text_proj.weight.dtype
    video = embed_patches(pe.proj, x.index_select(0, roles["video"].to(x.device)).to(dtype))  # a peft wrapper's too
    text = pe.text_proj(text_rows_input(batch, roles, [t.to(dtype) for t in texts]))
    h = torch.cat([video, text])[roles["inverse"].to(x.device)][None]
    if not model.config.use_rotary_positional_embeddings:
        grids = [tuple(int(v) for v in g) for g in batch[GRID]]
        pos = position_rows(batch, roles, [_sincos_table(model, g) for g in grids], h.shape[-1], h.device)
        h = h + pos.to(h.dtype)[None]
    return model.embedding_dropout(h)


def cogvideox_packed_forward(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Velocity prediction ``[local rows, C*pt*ph*pw]`` (channel-major) of an adapted CogVideoX; text and padding
    rows get zeros. Batch keys as for :func:`~lightning_dcp.diffusers.dispatch.packed_forward`, over joint rows."""
    x = batch[HIDDEN_STATES]
    grids = [tuple(int(v) for v in g) for g in batch[GRID]]
    labels = sample_labels(batch)
    config = model.config
    check_row_width(x, config.in_channels, cogvideox_patch_size(config), 'CogVideoX', 'cogvideox_sample')
    texts = check_texts(batch, labels)
    num = len(grids)
    roles = row_roles(batch, num)
    dtype = model.proj_out.weight.dtype
    t = per_sample_timesteps(batch, batch[TIMESTEP], num)
    emb = model.time_embedding(model.time_proj(t.to(x.device)).to(dtype), None)
    h = _embed(model, batch, roles, texts, x)
    rotary = None
    if config.use_rotary_positional_embeddings:
        rotary = rotary_rows(batch, roles, [cogvideox_rotary(model, g) for g in grids], int(config.attention_head_dim),
                             h.device)
    rows = joint_rows(batch, roles, emb, rotary, h.device)
    switch = model.dcp_recompute
    for i, block in enumerate(model.transformer_blocks):
        h = switch.call(i, block, h, rows)
    h = model.norm_final(h)
    norm = model.norm_out  # AdaLayerNorm(chunk_dim=1): shift, scale
    shift, scale = norm.linear(norm.silu(emb)).chunk(2, dim=1)
    h = norm.norm(h) * (1 + per_token(rows, scale)) + per_token(rows, shift)
    out = model.proj_out(h)[0]
    return out * video_rows(batch).to(out.device, out.dtype)[:, None]
