"""HunyuanVideo (``HunyuanVideoTransformer3DModel``) under DCP: adapt, samples, the packed forward.

HunyuanVideo refines each prompt's tokens (the token refiner, conditioned on the timestep and the
prompt's mean), then runs *dual-stream* blocks (text and video rows with their own weights, one
joint attention over ``[video; text]``) and *single-stream* blocks (one set of weights for all
rows), with 3-D rotary angles on the video rows only. Packed (see :mod:`lightning_dcp.diffusers.joint`):
rows ``[video; text]`` per sample, Ulysses attention within each joint segment, every row
modulated by its own sample's conditioning (timestep + guidance + pooled CLIP text); the text of
each sample is refined whole on every rank that holds some of its rows (a per-sample cost,
``dcp_cost_per_sample``).

A prompt's padding tokens do not enter the packed sequence: diffusers masks them out as keys
(``encoder_attention_mask``) and in the refiner, so the video's prediction is the same with the
padding dropped; :func:`hunyuan_sample` drops the rows its mask marks. Both block lists form the
repeated stack (``dcp_repeated_layers()``: dual-stream blocks, then single-stream blocks), so the
recompute count and the FSDP units cover both. Token-replace image conditioning (HunyuanVideo-I2V)
is not supported yet; ``latent_concat`` is (condition channels via ``condition_latents``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from diffusers.models.transformers.transformer_hunyuan_video import (
    HunyuanVideoSingleTransformerBlock,
    HunyuanVideoTransformerBlock,
)
from torch import nn

from lightning_dcp.diffusers.joint import (
    JointRows,
    check_row_width,
    by_role,
    check_texts,
    joint_attention,
    joint_rows,
    joint_sample,
    per_sample_timesteps,
    per_token,
    rotate,
    row_roles,
    swap_block_class,
    text_rows_input,
    video_rows,
)
from lightning_dcp.diffusers.forward import HIDDEN_STATES, TIMESTEP, embed_patches
from lightning_dcp.diffusers.samples import GRID, VIDEO_POS, _where, per_sample_embeds, sample_labels
from lightning_dcp.sp.context import SEGMENT_IDS
from lightning_dcp.sp.contract import install_contract
from lightning_dcp.sp.recompute import LayerRecompute

__all__ = ["GUIDANCE", "POOLED", "PackedHunyuanVideoBlock", "PackedHunyuanVideoSingleBlock", "adapt_hunyuan",
           "hunyuan_packed_forward", "hunyuan_patch_size", "hunyuan_sample", "is_hunyuan_adapted"]

#: Per-sample pooled text projection (CLIP), a 1-tuple ``(tensor [1, pooled_projection_dim],)``.
POOLED = "pooled_projections"
#: Per-sample guidance value (float, as the pipeline passes it: ``guidance_scale * 1000``), guidance-distilled models.
GUIDANCE = "guidance"


def hunyuan_patch_size(config: Any) -> tuple[int, int, int]:
    """``(patch_size_t, patch_size, patch_size)`` of a HunyuanVideo config."""
    return (int(config.patch_size_t), int(config.patch_size), int(config.patch_size))


def hunyuan_sample(latents: torch.Tensor, encoder_hidden_states: torch.Tensor, patch_size: Any, *,
                   pooled_projections: torch.Tensor | None = None, guidance: float | None = None,
                   encoder_attention_mask: torch.Tensor | None = None, index: int | None = None,
                   condition_latents: torch.Tensor | None = None, text_len: int | None = None) -> dict[str, Any]:
    """A HunyuanVideo training sample, rows ``[video; text]`` (:func:`~lightning_dcp.diffusers.joint.joint_sample`).

    Args:
        latents: ``[C, F, H, W]``.
        encoder_hidden_states: the LLM text encoder's output ``[tokens, text_embed_dim]``.
        patch_size: :func:`hunyuan_patch_size` of the model's config.
        pooled_projections: the CLIP pooled output ``[pooled_projection_dim]`` (required).
        guidance: the guidance embedding's input for guidance-distilled models (``guidance_embeds=True``),
            e.g. ``6.0 * 1000`` as the pipeline passes a guidance scale of 6.
        encoder_attention_mask: ``[tokens]`` (or ``[1, tokens]``); rows where it is 0 are dropped (diffusers
            masks them out).
    """
    where = _where(index)
    if pooled_projections is None or not isinstance(pooled_projections, torch.Tensor):
        raise ValueError(f"{where}: HunyuanVideo needs pooled_projections (the CLIP text encoder's pooled output "
                         "[pooled_projection_dim]) for every sample")
    text = encoder_hidden_states
    if encoder_attention_mask is not None and isinstance(text, torch.Tensor):
        keep = encoder_attention_mask.reshape(-1).bool()
        text = text.reshape(-1, text.shape[-1])[keep]
    extra: dict[str, Any] = {POOLED: (pooled_projections.reshape(1, -1),)}
    if guidance is not None:
        extra[GUIDANCE] = float(guidance)
    return joint_sample(latents, text, patch_size, text_first=False, index=index, condition_latents=condition_latents,
                        text_len=text_len, extra=extra)


def _heads(attn: Any, t: torch.Tensor) -> torch.Tensor:
    return t.unflatten(2, (attn.heads, -1))


def _norm(module: Any) -> Any:
    return module if module is not None else (lambda t: t)


def _dual_block(block: HunyuanVideoTransformerBlock, x: torch.Tensor, rows: JointRows) -> torch.Tensor:
    """One dual-stream block on the packed rows (diffusers' ``HunyuanVideoTransformerBlock.forward``, per role)."""
    n1, n1c = block.norm1, block.norm1_context
    video_mod = n1.linear(n1.silu(rows.temb)).chunk(6, dim=1)
    text_mod = n1c.linear(n1c.silu(rows.temb)).chunk(6, dim=1)
    shift, scale, gate, shift2, scale2, gate2 = (per_token(rows, a, b) for a, b in zip(video_mod, text_mod))
    h = by_role(rows, x, n1.norm, n1c.norm) * (1 + scale) + shift
    attn = block.attn
    q, k, v = (_heads(attn, by_role(rows, h, a, b)) for a, b in ((attn.to_q, attn.add_q_proj),
                                                                   (attn.to_k, attn.add_k_proj),
                                                                   (attn.to_v, attn.add_v_proj)))
    q = by_role(rows, q, _norm(attn.norm_q), _norm(attn.norm_added_q))
    k = by_role(rows, k, _norm(attn.norm_k), _norm(attn.norm_added_k))
    out = joint_attention(rotate(q, rows), rotate(k, rows), v, rows)
    out = by_role(rows, out, lambda o: attn.to_out[1](attn.to_out[0](o)), attn.to_add_out)
    x = x + out * gate
    h = by_role(rows, x, block.norm2, block.norm2_context) * (1 + scale2) + shift2
    return x + gate2 * by_role(rows, h, block.ff, block.ff_context)


def _single_block(block: HunyuanVideoSingleTransformerBlock, x: torch.Tensor, rows: JointRows) -> torch.Tensor:
    """One single-stream block on the packed rows (diffusers' ``HunyuanVideoSingleTransformerBlock.forward``)."""
    norm = block.norm
    shift, scale, gate = norm.linear(norm.silu(rows.temb)).chunk(3, dim=1)
    h = norm.norm(x) * (1 + per_token(rows, scale)) + per_token(rows, shift)
    mlp = block.act_mlp(block.proj_mlp(h))
    attn = block.attn
    q, k, v = _heads(attn, attn.to_q(h)), _heads(attn, attn.to_k(h)), _heads(attn, attn.to_v(h))
    q, k = _norm(attn.norm_q)(q), _norm(attn.norm_k)(k)
    out = joint_attention(rotate(q, rows), rotate(k, rows), v, rows)
    return x + per_token(rows, gate) * block.proj_out(torch.cat([out, mlp], dim=2))


class PackedHunyuanVideoBlock(HunyuanVideoTransformerBlock):
    """Dual-stream block: packed rows when called as ``block(x, rows)`` with :class:`JointRows`, diffusers otherwise."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(encoder_hidden_states, JointRows):
            return _dual_block(self, hidden_states, encoder_hidden_states)
        return super().forward(hidden_states, encoder_hidden_states, *args, **kwargs)


class PackedHunyuanVideoSingleBlock(HunyuanVideoSingleTransformerBlock):
    """Single-stream block: packed rows when called as ``block(x, rows)`` with :class:`JointRows`, diffusers otherwise."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(encoder_hidden_states, JointRows):
            return _single_block(self, hidden_states, encoder_hidden_states)
        return super().forward(hidden_states, encoder_hidden_states, *args, **kwargs)


def _check(model: nn.Module) -> None:
    name = type(model).__name__
    if getattr(model.config, "image_condition_type", None) == "token_replace":
        raise NotImplementedError(f"lightning_dcp.diffusers.adapt: {name} with image_condition_type='token_replace' "
                                  "(HunyuanVideo-I2V) modulates first-frame tokens separately, which the packed forward "
                                  "does not do yet; T2V and latent_concat models are supported")
    for kind, blocks, cls in (("dual-stream", model.transformer_blocks, HunyuanVideoTransformerBlock),
                              ("single-stream", model.single_transformer_blocks, HunyuanVideoSingleTransformerBlock)):
        for i, block in enumerate(blocks):
            processor = type(block.attn.processor).__name__
            if not isinstance(block, cls) or processor != "HunyuanVideoAttnProcessor2_0":
                raise ValueError(f"lightning_dcp.diffusers.adapt: {kind} block {i} of {name} is a {type(block).__name__} "
                                 f"with the attention processor {processor}; the packed forward implements "
                                 f"{cls.__name__} with HunyuanVideoAttnProcessor2_0 (reset custom processors first)")


def adapt_hunyuan(model: nn.Module, *, recompute_override: int | None = None) -> nn.Module:
    """Prepare a ``HunyuanVideoTransformer3DModel`` in place (see :func:`lightning_dcp.diffusers.adapt`)."""
    _check(model)
    for block in model.transformer_blocks:
        swap_block_class(block, PackedHunyuanVideoBlock)
    for block in model.single_transformer_blocks:
        swap_block_class(block, PackedHunyuanVideoSingleBlock)
    # per_sample_cost: each sample's whole text goes through the token refiner
    install_contract(model, model.transformer_blocks, model.single_transformer_blocks,
                     num_heads=model.config.num_attention_heads, per_sample_cost=True,
                     recompute_override=recompute_override)
    return model


def is_hunyuan_adapted(model: nn.Module) -> bool:
    return (isinstance(getattr(model, "dcp_recompute", None), LayerRecompute)
            and all(isinstance(b, PackedHunyuanVideoBlock) for b in model.transformer_blocks)
            and all(isinstance(b, PackedHunyuanVideoSingleBlock) for b in model.single_transformer_blocks))


def _rotary(model: nn.Module, batch: Mapping[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[rows, head_dim]``: the video rows' angles from their grid positions, as diffusers'
    ``HunyuanVideoRotaryPosEmbed`` computes them; identity on text and padding rows."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    rope = model.rope
    real = torch.nonzero(video_rows(batch)).flatten().to(device)
    pos = batch[VIDEO_POS].to(device)[real].float()
    freqs = [get_1d_rotary_pos_embed(int(rope.rope_dim[i]), pos[:, i], rope.theta, use_real=True) for i in range(3)]
    rows = batch[SEGMENT_IDS].shape[0]
    dim = int(model.config.attention_head_dim)
    cos = torch.ones(rows, dim, dtype=freqs[0][0].dtype, device=device)
    sin = torch.zeros(rows, dim, dtype=freqs[0][1].dtype, device=device)
    cos[real], sin[real] = torch.cat([f[0] for f in freqs], dim=1), torch.cat([f[1] for f in freqs], dim=1)
    return cos, sin


def _conditioning(model: nn.Module, batch: Mapping[str, Any], t: torch.Tensor, labels: list[str],
                  dtype: torch.dtype) -> torch.Tensor:
    """``[samples, dim]``: timestep + pooled text (+ guidance) embedding per sample (``time_text_embed``)."""
    pooled = batch.get(POOLED)
    if pooled is None or any(p is None for p in pooled):
        raise ValueError(f"{', '.join(labels)}: no pooled text projection ({POOLED!r}); build samples with "
                         "lightning_dcp.diffusers.hunyuan_sample(..., pooled_projections=...)")
    pooled = torch.stack([per_sample_embeds(p).reshape(-1) for p in pooled]).to(t.device, dtype)
    guidance = None
    if model.time_text_embed.guidance_embedder is not None:
        values = batch.get(GUIDANCE)
        if values is None:
            raise ValueError(f"{type(model).__name__} is guidance-distilled (guidance_embeds=True) but "
                             f"{', '.join(labels)} carry no guidance; pass hunyuan_sample(..., guidance=...) (e.g. "
                             "6.0 * 1000, as the pipeline passes guidance_scale=6)")
        guidance = torch.tensor([float(g) for g in values], device=t.device, dtype=dtype)
    return model.time_text_embed(t.to(dtype), pooled, guidance)[0]


def hunyuan_packed_forward(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Velocity prediction ``[local rows, C*pt*ph*pw]`` (channel-major) of an adapted HunyuanVideo; text and
    padding rows get zeros. Batch keys as for CogVideoX, plus :data:`POOLED` (and :data:`GUIDANCE`) per sample."""
    x = batch[HIDDEN_STATES]
    labels = sample_labels(batch)
    config = model.config
    check_row_width(x, config.in_channels, hunyuan_patch_size(config), 'HunyuanVideo', 'hunyuan_sample')
    texts = check_texts(batch, labels)
    num = len(batch[GRID])
    roles = row_roles(batch, num)
    dtype = model.proj_out.weight.dtype
    t = per_sample_timesteps(batch, batch[TIMESTEP], num).to(x.device)
    temb = _conditioning(model, batch, t, labels, dtype)
    needed = set(roles["sample"][roles["text"]].tolist())
    refined = [model.context_embedder(texts[j][None].to(x.device, dtype), t[j:j + 1].to(dtype), None)[0]
               if j in needed else texts[j].new_zeros(texts[j].shape[0], temb.shape[-1]).to(x.device, dtype)
               for j in range(num)]
    video = embed_patches(model.x_embedder.proj, x.index_select(0, roles["video"].to(x.device)).to(dtype))
    h = torch.cat([video, text_rows_input(batch, roles, refined)])[roles["inverse"].to(x.device)][None]
    rows = joint_rows(batch, roles, temb, _rotary(model, batch, h.device), h.device)
    switch = model.dcp_recompute
    for i, block in enumerate(model.dcp_repeated_layers()):
        h = switch.call(i, block, h, rows)
    norm = model.norm_out  # AdaLayerNormContinuous: scale, shift
    scale, shift = norm.linear(norm.silu(temb).to(h.dtype)).chunk(2, dim=1)
    h = norm.norm(h) * (1 + per_token(rows, scale)) + per_token(rows, shift)
    out = model.proj_out(h)[0]
    return out * video_rows(batch).to(out.device, out.dtype)[:, None]
