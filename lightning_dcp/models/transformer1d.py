"""Transformer-1D: a decoder-only language model that runs under DCP with a handful of changed lines.

Compared with a plain PyTorch decoder, the DCP-specific parts are:

1. attention calls :func:`lightning_dcp.sp.ulysses.ulysses_attention` with the batch (its
   ``cu_seqlens`` keep packed samples apart; the active SP group, if any, is used for the
   Ulysses all-to-all) instead of ``scaled_dot_product_attention``;
2. RoPE reads positions from ``batch[POSITION_IDS]`` (restarting at 0 for every packed sample,
   already the global positions of this rank's shard);
3. the repeated layers sit in ``RecomputeLayers(nn.ModuleList([...]))`` so the strategy can
   choose how many of them recompute, and each layer is called as ``layer(x, batch)``.

Everything else (RMSNorm, SwiGLU, embedding, LM head) is ordinary code working on the local
token shard ``[local_tokens, hidden]``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, POSITION_IDS, active_context
from lightning_dcp.planning.models import ModelSpec, get_model
from lightning_dcp.sp.recompute import RecomputeLayers
from lightning_dcp.sp.ulysses import ulysses_attention

__all__ = ["DecoderLayer", "SwiGLU", "Transformer1D", "apply_rope", "rope_tables"]


def rope_tables(positions: torch.Tensor, dim: int, base: float = 10000.0,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[tokens, 1, dim // 2]`` for rotary embeddings at integer ``positions``."""
    if dim % 2:
        raise ValueError(f"rotary embeddings need an even dimension, got {dim}; use an even head_dim")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, dim]`` (rotate-half convention) by the tables of :func:`rope_tables`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: RMSNorm -> RoPE attention (Ulysses) -> RMSNorm -> SwiGLU.

    ``forward(x, batch)``: ``x`` is ``[local_tokens, hidden]``; ``batch`` supplies
    ``POSITION_IDS`` (local shard), ``CU_SEQLENS`` and ``MAX_SEQLEN`` (whole packed sequence).
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h = spec.hidden_size
        self.num_heads, self.head_dim, self.causal = spec.num_heads, spec.head_dim, spec.causal
        self.attn_norm = nn.RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h)
        self.mlp = SwiGLU(h, spec.ffn_hidden_size)

    def forward(self, x: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        q, k, v = self.qkv(self.attn_norm(x)).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)
        cos, sin = rope_tables(batch[POSITION_IDS], self.head_dim, dtype=q.dtype)
        attn = ulysses_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, batch, causal=self.causal)
        x = x + self.proj(attn.flatten(1))
        return x + self.mlp(self.mlp_norm(x))


class Transformer1D(nn.Module):
    """Decoder-only LM from a ``"1d"`` :class:`~lightning_dcp.planning.models.ModelSpec` (or its name).

    ``forward(batch)`` takes a packed micro-batch dict with ``batch["input_ids"]`` (int64, local
    shard ``[local_tokens]``) and the packing keys of :mod:`lightning_dcp.sp.context`, and returns
    logits ``[local_tokens, vocab_size]``. Without ``CU_SEQLENS``/``POSITION_IDS`` (one plain
    sequence, SP size 1) it treats the input as a single sample.

    ``embed_inputs(batch) -> (x, layer_args)``, ``layers(x, *layer_args)`` and
    ``final(x, *layer_args)`` are the pieces of ``forward`` (profilers can run ``layers`` alone).

    Attributes: ``embed``, ``layers`` (a :class:`~lightning_dcp.sp.recompute.RecomputeLayers` of
    :class:`DecoderLayer`, each called ``layer(x, batch)``), ``norm``, ``head``.
    """

    def __init__(self, spec: ModelSpec | str):
        super().__init__()
        spec = get_model(spec) if isinstance(spec, str) else spec
        if spec.kind != "1d":
            raise ValueError(f"Transformer1D needs a '1d' spec, got {spec.name!r} of kind {spec.kind!r}; use Transformer2D")
        if spec.vocab_size <= 0:
            raise ValueError(f"Transformer1D needs vocab_size > 0, spec {spec.name!r} has {spec.vocab_size}")
        if spec.hidden_size % spec.num_heads or spec.head_dim % 2:
            raise ValueError(f"spec {spec.name!r}: hidden_size {spec.hidden_size} must split into {spec.num_heads} heads "
                             f"of an even head_dim (got {spec.hidden_size / spec.num_heads:g})")
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = RecomputeLayers(nn.ModuleList([DecoderLayer(spec) for _ in range(spec.num_layers)]))
        self.norm = nn.RMSNorm(spec.hidden_size)
        self.head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        ids = batch["input_ids"]
        batch = _single_sequence_defaults(batch, ids.shape[0], ids.device)
        x = self.layers(self.embed(ids), batch)
        return self.head(self.norm(x))

    def embed_inputs(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """``(x, layer_args)``: the first layer's input and the extra arguments of every layer."""
        ids = batch["input_ids"]
        return self.embed(ids), (_single_sequence_defaults(batch, ids.shape[0], ids.device),)

    def final(self, x: torch.Tensor, *layer_args: Any) -> torch.Tensor:
        """Logits from the last layer's output."""
        return self.head(self.norm(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def _single_sequence_defaults(batch: Mapping[str, Any], tokens: int, device: torch.device) -> Mapping[str, Any]:
    """Fill in the packing keys for a plain single sequence (SP size 1 only)."""
    if CU_SEQLENS in batch and POSITION_IDS in batch:
        return batch
    if active_context().size > 1:
        raise ValueError("a batch under sequence parallelism needs CU_SEQLENS and POSITION_IDS; pack it with "
                         "lightning_dcp.sp.packing.pack_samples (the DCP strategy's collate does)")
    out = dict(batch)
    if CU_SEQLENS not in out:
        out[CU_SEQLENS] = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        out[MAX_SEQLEN] = tokens
    if POSITION_IDS not in out:
        cu = out[CU_SEQLENS].to(device=device, dtype=torch.int64)
        out[POSITION_IDS] = torch.arange(tokens, device=device) - torch.repeat_interleave(cu[:-1], cu.diff())
    return out
