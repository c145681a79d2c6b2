"""The attention processor :func:`~lightning_dcp.diffusers.adapt` installs on every Wan attention module.

Diffusers' Wan block calls ``attn1(x, None, None, rotary_emb)`` (self-attention) and
``attn2(x, encoder_hidden_states, None, None)`` (cross-attention) and passes both arguments
through untouched, so the packed forward (:func:`~lightning_dcp.diffusers.dispatch.packed_forward`)
runs the model's own blocks and hands the processor what packing needs through them:

* self-attention gets a :class:`PackedSelfAttention` as ``rotary_emb``: per-token rotary angles
  of this rank's shard and the segment boundaries of the whole packed sequence. The processor
  projects, normalises and rotates q/k of its local tokens, then runs
  :func:`~lightning_dcp.sp.ulysses.ulysses_attention` -- the all-to-all over the SP group the
  strategy chose for this micro-batch (:func:`~lightning_dcp.sp.context.active_context`), and
  variable-length attention inside each sample;
* cross-attention gets a :class:`PackedText` as ``encoder_hidden_states``: the projected text (and
  Wan 2.1 I2V image) tokens of the samples this rank holds tokens of, replicated, with each
  sample's query and key ranges. Each local video token attends to its own sample's text only;
  no communication (text is short and every SP rank holds the text of its own samples).

Any other call (diffusers' own ``model(...)`` forward, e.g. in a pipeline at inference) goes to the
processor the module had before, unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from lightning_dcp.diffusers.rope import apply_rotary
from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN
from lightning_dcp.sp.ulysses import ulysses_attention

__all__ = ["DCPWanAttnProcessor", "PackedSelfAttention", "PackedText", "packed_cross_attention"]


class PackedSelfAttention(NamedTuple):
    """What a Wan self-attention receives as ``rotary_emb`` in a packed forward."""

    cos: torch.Tensor  #: ``[1, local_tokens, 1, head_dim]`` rotary cosines of this shard's tokens
    sin: torch.Tensor  #: same shape, sines
    cu_seqlens: torch.Tensor  #: int32 boundaries over the *whole* padded packed sequence
    max_seqlen: int  #: longest segment


class PackedText(NamedTuple):
    """What a Wan cross-attention receives as ``encoder_hidden_states`` in a packed forward.

    ``segments`` has one entry per sample with tokens in this shard, in order:
    ``(q_start, q_end, text_start, text_end, image_start, image_end)`` -- its local video tokens
    (contiguous, from 0; the shard's padding follows the last one) and its rows of ``text`` and
    ``image``.
    """

    text: torch.Tensor  #: ``[1, text_tokens, dim]``: the local samples' projected text, concatenated
    image: torch.Tensor | None  #: ``[1, image_tokens, dim]`` (Wan 2.1 I2V) or None
    segments: tuple[tuple[int, int, int, int, int, int], ...]


def _projections(attn: Any, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q from ``x``, k/v from ``context``, with the module's fused projections when it has them."""
    if getattr(attn, "fused_projections", False):
        if not attn.is_cross_attention:
            return attn.to_qkv(x).chunk(3, dim=-1)
        key, value = attn.to_kv(context).chunk(2, dim=-1)
        return attn.to_q(x), key, value
    return attn.to_q(x), attn.to_k(context), attn.to_v(context)


def _added_projections(attn: Any, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if getattr(attn, "fused_projections", False):
        return attn.to_added_kv(image).chunk(2, dim=-1)
    return attn.add_k_proj(image), attn.add_v_proj(image)


def _heads(attn: Any, t: torch.Tensor) -> torch.Tensor:
    return t.unflatten(2, (attn.heads, -1))


def _out(attn: Any, hidden: torch.Tensor) -> torch.Tensor:
    return attn.to_out[1](attn.to_out[0](hidden))


def _self_attention(attn: Any, x: torch.Tensor, packed: PackedSelfAttention) -> torch.Tensor:
    query, key, value = _projections(attn, x, x)
    query, key = attn.norm_q(query), attn.norm_k(key)
    query, key, value = _heads(attn, query), _heads(attn, key), _heads(attn, value)
    query, key = apply_rotary(query, packed.cos, packed.sin), apply_rotary(key, packed.cos, packed.sin)
    out = ulysses_attention(query[0], key[0], value[0], {CU_SEQLENS: packed.cu_seqlens, MAX_SEQLEN: packed.max_seqlen})
    return _out(attn, out.unsqueeze(0).flatten(2, 3).type_as(query))


def packed_cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           segments: Any, kv_slot: int) -> torch.Tensor:
    """Each local sample's queries attend to its own keys only.

    Args:
        q: ``[1, local_tokens, heads, head_dim]``; k, v: ``[1, kv_tokens, heads, head_dim]``.
        segments: :attr:`PackedText.segments`.
        kv_slot: which key range of a segment to use: 2 (text) or 4 (image).

    Returns:
        ``[1, local_tokens, heads, head_dim]``; the shard's padding tokens (after the last segment) get zeros.

    One SDPA call per local sample (no mask: every key of the sample is attended, as diffusers
    does per batch row), so any device and dtype works and no ``[q, k]`` mask is built.
    """
    pieces, end = [], 0
    for seg in segments:
        qa, qb, ka, kb = seg[0], seg[1], seg[kv_slot], seg[kv_slot + 1]
        if qa != end:
            raise ValueError(f"packed cross-attention: local query segments must be contiguous from 0, got {segments}")
        out = F.scaled_dot_product_attention(q[:, qa:qb].transpose(1, 2), k[:, ka:kb].transpose(1, 2),
                                             v[:, ka:kb].transpose(1, 2))
        pieces.append(out.transpose(1, 2))
        end = qb
    if end < q.shape[1]:
        pieces.append(q.new_zeros(1, q.shape[1] - end, q.shape[2], v.shape[3]))
    return torch.cat(pieces, dim=1)


def _cross_attention(attn: Any, x: torch.Tensor, packed: PackedText) -> torch.Tensor:
    query, key, value = _projections(attn, x, packed.text)
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


class DCPWanAttnProcessor:
    """Attention processor for diffusers' ``WanAttention``: packed and sequence-parallel in
    :func:`~lightning_dcp.diffusers.dispatch.packed_forward`, the original processor elsewhere.

    Args:
        fallback: the processor the module had before (used for every unpacked call).
    """

    def __init__(self, fallback: Any) -> None:
        self.fallback = fallback

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: Any = None, **kwargs: Any) -> torch.Tensor:
        packed = isinstance(rotary_emb, PackedSelfAttention) or isinstance(encoder_hidden_states, PackedText)
        if not packed:
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if attention_mask is not None or kwargs:
            raise ValueError(f"lightning_dcp's packed Wan attention takes no attention_mask or extra arguments "
                             f"(got mask={attention_mask is not None}, kwargs={sorted(kwargs)}): packed samples are "
                             "described by cu_seqlens and PackedText.segments")
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
            raise ValueError(f"packed Wan attention expects hidden states [1, local_tokens, dim], got "
                             f"{tuple(hidden_states.shape)}")
        if isinstance(encoder_hidden_states, PackedText):
            return _cross_attention(attn, hidden_states, encoder_hidden_states)
        return _self_attention(attn, hidden_states, rotary_emb)
