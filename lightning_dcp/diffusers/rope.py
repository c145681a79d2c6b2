"""Wan's 3-D rotary embedding for packed tokens: angles per token, from the model's own tables.

Diffusers' ``WanRotaryPosEmbed`` holds ``freqs_cos`` / ``freqs_sin`` ``[max_seq_len, head_dim]``
whose columns split into a frame, a row and a column part; a token at patch-grid position
``(f, h, w)`` rotates by ``cat(t_part[f], h_part[h], w_part[w])``. Diffusers builds that for one
grid shape per batch; here every token looks up its own position (:data:`~lightning_dcp.diffusers.samples.VIDEO_POS`),
so samples of different shapes pack together and any SP shard gets exactly its tokens' angles.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["apply_rotary", "packed_rotary"]


def packed_rotary(rope: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[1, tokens, 1, head_dim]``, for tokens at ``positions`` (int ``[tokens, 3]``).

    Args:
        rope: the model's ``WanRotaryPosEmbed`` (its ``freqs_cos``/``freqs_sin`` buffers and
            ``t_dim``/``h_dim``/``w_dim`` split).
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
