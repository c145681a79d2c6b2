"""Hugging Face transformers support: train a causal LM under DCP without changing its code.

* :func:`adapt` prepares a transformers causal LM in place: Ulysses attention through
  transformers' own ``AttentionInterface``, packed variable-length micro-batches, GQA/MQA,
  attention logit soft-capping, the per-layer recompute switch, ``dcp_num_heads`` and
  ``dcp_repeated_layers()``. Tested families: :data:`TESTED_MODEL_TYPES` (Llama, Qwen2, Qwen3,
  Mistral, Gemma, Gemma 2, Phi-3, GPT-NeoX, OLMo, OLMo 2).
* :class:`CausalLMModule` is a ready LightningModule for it (``dcp_support = "sp"``); it logs
  ``train/loss`` once per step and says its support level at fit start.

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

from lightning_dcp.hf.adapt import TESTED_MODEL_TYPES, adapt, find_decoder_layers, is_adapted, is_tested_family
from lightning_dcp.hf.attention import (
    ATTN_IMPLEMENTATION,
    dcp_attention,
    kv_repeat_before_all_to_all,
    packed_gqa_attention,
    register_attention,
)
from lightning_dcp.hf.module import (
    IGNORE_INDEX,
    SHIFT_LABELS,
    CausalLMModule,
    causal_lm_logits,
    check_causal_lm_head,
    collate_causal_lm,
    pack_padded_batch,
    prepare_causal_lm_batch,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "IGNORE_INDEX",
    "SHIFT_LABELS",
    "TESTED_MODEL_TYPES",
    "CausalLMModule",
    "adapt",
    "causal_lm_logits",
    "check_causal_lm_head",
    "collate_causal_lm",
    "dcp_attention",
    "find_decoder_layers",
    "is_adapted",
    "is_tested_family",
    "kv_repeat_before_all_to_all",
    "pack_padded_batch",
    "packed_gqa_attention",
    "prepare_causal_lm_batch",
    "register_attention",
]
