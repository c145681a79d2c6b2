"""The ``"lightning_dcp"`` attention function for Hugging Face transformers' ``AttentionInterface``.

A model adapted by :func:`lightning_dcp.hf.adapt` runs every attention layer through
:func:`dcp_attention`: Ulysses sequence parallelism over the active SP group
(:func:`lightning_dcp.sp.context.active_context`), variable-length causal attention inside each
packed sample, grouped-query attention without repeating key/value heads more than the SP size
needs -- all of it :func:`lightning_dcp.sp.ulysses.ulysses_attention`; this module only translates
transformers' calling convention.

Packed boundaries reach it as forward keyword arguments, the names transformers itself uses for
packed (flash-attention) batches, which every ``AttentionInterface`` model forwards unchanged
to its attention function:

* ``cu_seq_lens_q`` -- int32 ``[segments + 1]`` boundaries over the *whole* packed (padded)
  sequence, not just this SP rank's shard (``batch["cu_seqlens"]``);

An SP size the heads do not divide runs as ring x Ulysses (a ring item, :mod:`lightning_dcp.sp.ring`) through
the same call; :class:`~lightning_dcp.hf.CausalLMModule` shards ring items zigzag (``dcp_ring_layout``).
* ``max_length_q`` -- the longest segment (``batch["max_seqlen"]``).

:class:`~lightning_dcp.hf.CausalLMModule` passes them. Without them (a direct
``model(input_ids, position_ids=...)`` call) the boundaries are derived from ``position_ids``
(a new sample starts wherever the position is 0), all-gathered over the SP group when it has
more than one rank -- correct, one small collective and a host sync more per layer.

The function is registered when this module is imported (and again by ``adapt``): transformers'
registry is per process, and a model adapted in one process and unpickled in a spawned one
(Lightning's spawn launchers) imports this package through the adapted model's attributes, so
the name resolves there too.

No dense ``[S, S]`` mask is built: the name is not registered in ``AttentionMaskInterface``,
so transformers' mask creation returns ``None`` for it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, active_context
from lightning_dcp.sp.tokens import shard_spans
from lightning_dcp.sp.ulysses import kv_repeat_before_all_to_all, ulysses_attention

__all__ = ["ATTN_IMPLEMENTATION", "dcp_attention", "kv_repeat_before_all_to_all", "packed_gqa_attention",
           "register_attention"]

#: The name under which :func:`dcp_attention` is registered (``config._attn_implementation``).
ATTN_IMPLEMENTATION = "lightning_dcp"

_UNSUPPORTED_KWARGS = ("s_aux", "sinks")


def register_attention() -> None:
    """Register :func:`dcp_attention` as ``"lightning_dcp"`` in transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, dcp_attention)


def packed_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, *, causal: bool = True, scale: float | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """:func:`~lightning_dcp.sp.ulysses.ulysses_attention` with the boundaries as arguments.

    ``q`` ``[local_tokens, heads, head_dim]``, ``k``/``v`` ``[local_tokens, kv_heads, head_dim]``
    (GQA/MQA: ``kv_heads`` dividing ``heads``), ``cu_seqlens``/``max_seqlen`` over the whole padded
    packed sequence; returns this rank's ``[local_tokens, heads, head_dim]``.
    """
    return ulysses_attention(q, k, v, {CU_SEQLENS: cu_seqlens, MAX_SEQLEN: max_seqlen}, causal=causal, scale=scale,
                             softcap=softcap)


def _boundaries_from_positions(position_ids: torch.Tensor, group: Any) -> tuple[torch.Tensor, int]:
    """``cu_seqlens``/``max_seqlen`` of the whole packed sequence from (this shard's) restarting positions."""
    pos = position_ids.reshape(-1)
    if group is not None and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(pos) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, pos.contiguous(), group=group)
        pos = torch.cat(parts)
        grid = active_context().ring
        if grid is not None and grid.layout != "contiguous":  # the shards are not in token order: put them back
            size, total = len(parts), pos.numel()
            order = torch.cat([torch.arange(a, b) for r in range(size)
                               for a, b in shard_spans(total, r, size, grid.degree, grid.layout)]).to(pos.device)
            pos = torch.empty_like(pos).index_copy_(0, order, pos)
    starts = torch.nonzero(pos == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _packed_boundaries(query: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.Tensor, int]:
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        max_len = kwargs.get("max_length_q")
        if max_len is None:
            max_len = int((cu[1:] - cu[:-1]).max())
        return cu, int(max_len)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # one sequence: the whole (global) shard sequence
        size = active_context().size
        total = query.shape[2] * size
        return torch.tensor([0, total], dtype=torch.int32, device=query.device), total
    return _boundaries_from_positions(position_ids, active_context().group)


def _check_call(module: nn.Module, query: torch.Tensor, attention_mask: Any, dropout: float,
                kwargs: dict[str, Any], max_len: int) -> None:
    name = type(module).__name__
    if query.shape[0] != 1:
        raise ValueError(f"lightning_dcp attention in {name}: batch size {query.shape[0]}; a packed micro-batch is one "
                         "row [1, tokens]: concatenate the samples (lightning_dcp.sp.packing.pack_samples) and pass "
                         "cu_seq_lens_q/max_length_q (CausalLMModule does).")
    if attention_mask is not None:
        raise ValueError(f"lightning_dcp attention in {name} got an attention mask of shape "
                         f"{tuple(attention_mask.shape)}; packed batches are described by cu_seq_lens_q, not a mask: "
                         "drop attention_mask from the model call.")
    if dropout:
        raise ValueError(f"lightning_dcp attention in {name}: attention dropout {dropout} is not supported by the "
                         "varlen kernels; set config.attention_dropout = 0.0.")
    for key in _UNSUPPORTED_KWARGS:
        if kwargs.get(key) is not None:
            raise ValueError(f"lightning_dcp attention in {name}: {key!r} is not supported (model family not handled).")
    window = kwargs.get("sliding_window")
    if window is not None and max_len > int(window):
        raise ValueError(f"lightning_dcp attention in {name}: sliding_window={window} is shorter than the longest "
                         f"packed sample ({max_len} tokens) and sliding-window attention is not implemented; cap "
                         f"sample lengths at {window} or disable the window (config.sliding_window = None / "
                         "use_sliding_window = False).")


def dcp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention function for transformers' ``AttentionInterface`` (registered as ``"lightning_dcp"``).

    Args:
        module: the calling attention module (its ``is_causal`` is honoured, default True).
        query: ``[1, heads, local_tokens, head_dim]``; key, value: ``[1, kv_heads, local_tokens, head_dim]``
            -- this SP rank's contiguous shard of the packed sequence.
        attention_mask: must be ``None`` (packing is described by ``cu_seq_lens_q``).
        scaling: softmax scale (default ``head_dim ** -0.5``); dropout: must be 0.
        **kwargs: ``cu_seq_lens_q``/``max_length_q`` (see the module docstring), else ``position_ids``;
            ``sliding_window`` is accepted when no packed sample is longer than it; ``softcap``
            (Gemma 2's ``attn_logit_softcapping``) is applied to the scores.

    Returns:
        ``([1, local_tokens, heads, head_dim], None)``, as transformers' attention functions return.
    """
    cu, max_len = _packed_boundaries(query, kwargs)
    _check_call(module, query, attention_mask, dropout, kwargs, max_len)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    batch = {CU_SEQLENS: cu.to(query.device), MAX_SEQLEN: max_len}
    out = ulysses_attention(q, k, v, batch, causal=causal, scale=scale, softcap=kwargs.get("softcap"))
    return out.unsqueeze(0), None


register_attention()  # per process: see the module docstring
