"""Hugging Face transformers support: train a causal LM under DCP without changing its code.

* :func:`adapt` prepares a transformers causal LM (Llama, Qwen2, Qwen3, Mistral, ...) in place:
  Ulysses attention through transformers' own ``AttentionInterface``, packed variable-length
  micro-batches, GQA/MQA, the per-layer recompute switch, ``dcp_num_heads`` and
  ``dcp_repeated_layers()``.
* :class:`CausalLMModule` is a ready LightningModule for it (``dcp_support = "sp"``).

Needs ``transformers`` (``pip install lightning-dcp[hf]``); importing this package without it
raises an ImportError saying so. ``import lightning_dcp`` never imports it.
"""

from __future__ import annotations

try:
    import transformers as _transformers  # noqa: F401
except ImportError as _err:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "lightning_dcp.hf needs Hugging Face transformers, which is not installed; install it with "
        "`pip install lightning-dcp[hf]` (or `pip install transformers`)."
    ) from _err

from lightning_dcp.hf.adapt import adapt, find_decoder_layers, is_adapted
from lightning_dcp.hf.attention import ATTN_IMPLEMENTATION, dcp_attention, packed_gqa_attention, register_attention
from lightning_dcp.hf.module import (
    IGNORE_INDEX,
    SHIFT_LABELS,
    CausalLMModule,
    collate_causal_lm,
    pack_padded_batch,
    prepare_causal_lm_batch,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "IGNORE_INDEX",
    "SHIFT_LABELS",
    "CausalLMModule",
    "adapt",
    "collate_causal_lm",
    "dcp_attention",
    "find_decoder_layers",
    "is_adapted",
    "pack_padded_batch",
    "packed_gqa_attention",
    "prepare_causal_lm_batch",
    "register_attention",
]
