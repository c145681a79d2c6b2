"""The packed attention the cross-attention families (Wan, LTX-Video) share: what a packed forward hands its
attention processors, and per-sample cross-attention.

Diffusers' Wan and LTX blocks pass their attention modules' extra arguments through untouched, so a
family's packed forward (:mod:`lightning_dcp.diffusers.families`) runs the model's own blocks and hands
the processor what packing needs through them:

* self-attention gets a :class:`PackedSelfAttention` in place of the rotary embedding: per-token
  rotary angles of this rank's shard and the segment boundaries of the whole packed sequence. The
  family's processor projects, normalises and rotates q/k of its local tokens, then runs
  :func:`~lightning_dcp.sp.ulysses.ulysses_attention` -- the all-to-all over the SP group the
  strategy chose for this micro-batch (:func:`~lightning_dcp.sp.context.active_context`), and
  variable-length attention inside each sample;
* cross-attention gets a :class:`PackedText` in place of ``encoder_hidden_states``: the projected text
  (and Wan 2.1 I2V image) tokens of the samples this rank holds tokens of, replicated, with each
  sample's query and key ranges; :func:`packed_cross_attention` lets each local video token attend to
  its own sample's text only, with no communication (text is short and every SP rank holds the text of
  its own samples).

Any other call (diffusers' own ``model(...)`` forward, e.g. in a pipeline at inference) goes to the
processor the module had before, unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["PackedAttnProcessor", "PackedSelfAttention", "PackedText", "packed_cross_attention", "qkv_projections"]


class PackedSelfAttention(NamedTuple):
    """What a packed self-attention receives in place of its rotary embedding."""

    cos: torch.Tensor  #: rotary cosines of this shard's tokens (Wan ``[1, local_tokens, 1, head_dim]``)
    sin: torch.Tensor  #: same shape, sines
    cu_seqlens: torch.Tensor  #: int32 boundaries over the *whole* padded packed sequence
    max_seqlen: int  #: longest segment


class PackedText(NamedTuple):
    """What a packed cross-attention receives as ``encoder_hidden_states``.

    ``segments`` has one entry per sample with tokens in this shard, in order:
    ``(q_start, q_end, text_start, text_end, image_start, image_end)`` -- its local video tokens
    (contiguous, from 0; the shard's padding follows the last one) and its rows of ``text`` and
    ``image``.
    """

    text: torch.Tensor  #: ``[1, text_tokens, dim]``: the local samples' projected text, concatenated
    image: torch.Tensor | None  #: ``[1, image_tokens, dim]`` (Wan 2.1 I2V) or None
    segments: tuple[tuple[int, int, int, int, int, int], ...]


class PackedAttnProcessor:
    """Base of the families' attention processors: packed and sequence-parallel inside the family's packed
    forward (which hands a :class:`PackedSelfAttention` as the rotary embedding, or :class:`PackedText` as the
    encoder states), the module's original processor everywhere else.

    A family subclasses it with the ``__call__`` signature diffusers passes its processors (diffusers filters the
    keyword arguments by that signature), calls :meth:`dispatch`, and implements :meth:`self_attention` and
    :meth:`cross_attention`.

    Args:
        fallback: the processor the module had before (used for every unpacked call).
    """

    family = ""
    """The family's name, in errors."""

    def __init__(self, fallback: Any) -> None:
        self.fallback = fallback

    def dispatch(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any, attention_mask: Any,
                 rotary: Any, **kwargs: Any) -> torch.Tensor:
        """The packed path for packed inputs (checked), else the fallback with the arguments as given."""
        packed = isinstance(rotary, PackedSelfAttention) or isinstance(encoder_hidden_states, PackedText)
        if not packed:
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary, **kwargs)
        if attention_mask is not None or kwargs:
            raise ValueError(f"lightning_dcp's packed {self.family} attention takes no attention_mask or extra arguments "
                             f"(got mask={attention_mask is not None}, kwargs={sorted(kwargs)}): packed samples carry "
                             "their text unpadded and are described by cu_seqlens and PackedText.segments")
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
            raise ValueError(f"packed {self.family} attention expects hidden states [1, local_tokens, dim], got "
                             f"{tuple(hidden_states.shape)}")
        if isinstance(encoder_hidden_states, PackedText):
            return self.cross_attention(attn, hidden_states, encoder_hidden_states)
        return self.self_attention(attn, hidden_states, rotary)

    def self_attention(self, attn: Any, x: torch.Tensor, packed: PackedSelfAttention) -> torch.Tensor:
        raise NotImplementedError

    def cross_attention(self, attn: Any, x: torch.Tensor, packed: PackedText) -> torch.Tensor:
        raise NotImplementedError


def qkv_projections(attn: Any, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q from ``x``, k/v from ``context``, with the module's fused projections when it has them."""
    if getattr(attn, "fused_projections", False):
        if not attn.is_cross_attention:
            return attn.to_qkv(x).chunk(3, dim=-1)
        key, value = attn.to_kv(context).chunk(2, dim=-1)
        return attn.to_q(x), key, value
    return attn.to_q(x), attn.to_k(context), attn.to_v(context)


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
