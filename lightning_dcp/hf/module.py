"""A ready LightningModule for Hugging Face causal LMs under DCP: :class:`CausalLMModule`.

Batch flow under :class:`~lightning_dcp.DCPStrategy` (the strategy calls the hooks)::

    samples {"input_ids", optional "labels"}  --pack_samples-->  packed micro-batch (host)
      --dcp_prepare_batch-->  + "shift_labels" (shifted inside each sample), LOSS_MASK recomputed
      --shard_batch-->  this SP rank's contiguous token chunk  --training_step-->  weighted loss

Labels are shifted on the whole packed micro-batch *before* sharding, so the last token of every
sample (and every padding token) gets ``-100`` and no token predicts across a sample or an SP
shard boundary. Under a plain Trainer the same ``training_step`` works on batches from
:meth:`CausalLMModule.collate` (packed) or on Hugging Face-style padded batches
(``input_ids``/``attention_mask``/``labels`` of shape ``[B, T]``), which it repacks itself.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dcp.sp.context import (
    CU_SEQLENS,
    LOSS_MASK,
    MAX_SEQLEN,
    NUM_TOKENS,
    POSITION_IDS,
    SAMPLE_INDICES,
    SEGMENT_IDS,
    TOKEN_WEIGHT,
    active_context,
)
from lightning_dcp.hf.adapt import TESTED_MODEL_TYPES, adapt, is_adapted, is_tested_family
from lightning_dcp.sp.packing import IGNORE_INDEX, pack_samples
from lightning_dcp.sp.tokens import weighted_loss
from lightning_dcp.step_loss import StepLossLogging

__all__ = ["IGNORE_INDEX", "SHIFT_LABELS", "CausalLMModule", "causal_lm_logits", "check_causal_lm_head",
           "collate_causal_lm", "pack_padded_batch", "prepare_causal_lm_batch"]

#: Key of the per-token next-token targets added by :func:`prepare_causal_lm_batch`.
SHIFT_LABELS = "shift_labels"

#: Keys :func:`~lightning_dcp.sp.packing.pack_samples` adds (not the user's sample keys).
_PACKED_KEYS = (CU_SEQLENS, MAX_SEQLEN, POSITION_IDS, LOSS_MASK, SEGMENT_IDS, NUM_TOKENS, SAMPLE_INDICES, TOKEN_WEIGHT,
                SHIFT_LABELS)


def _missing_input_ids(keys: Sequence[str]) -> KeyError:
    """The error for samples without ``input_ids``: names their keys and the rename that fixes it."""
    own = [k for k in keys if k not in _PACKED_KEYS and k != "labels" and not str(k).startswith("_")]
    guess = own[0] if own else "<your token key>"
    return KeyError(
        f"CausalLMModule reads each sample's token ids from 'input_ids' (and optional 'labels', -100 = no loss, "
        f"default input_ids), but the samples have the keys {sorted(own)}{' (and labels)' if 'labels' in keys else ''}. "
        f"Rename the key in your dataset: return {{'input_ids': sample[{guess!r}]}} from its __getitem__ (a Hugging "
        f"Face datasets.Dataset: dataset.rename_column({guess!r}, 'input_ids')).")


def prepare_causal_lm_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Shift labels inside each packed sample; recompute ``LOSS_MASK`` for the shifted targets.

    ``batch`` is a whole (unsharded) packed micro-batch from
    :func:`~lightning_dcp.sp.packing.pack_samples` with ``input_ids`` and optional ``labels``
    (default: ``input_ids``; ``-100`` = no loss). Returns a new dict with
    ``shift_labels[t] = labels[t + 1]`` inside a sample, ``-100`` on each sample's last token and
    on padding; ``labels`` is dropped and ``LOSS_MASK = real token & shift_labels != -100``
    (set, not AND-ed with the incoming mask: that one marks the *unshifted* labels, so a prompt
    mask would lose the token that predicts the first answer token). A batch that already has
    ``shift_labels`` is returned unchanged (idempotent). Vectorised, no per-sample loop.
    """
    if SHIFT_LABELS in batch:
        return dict(batch)
    if "input_ids" not in batch:
        raise _missing_input_ids(list(batch))
    if CU_SEQLENS not in batch:
        raise KeyError(f"prepare_causal_lm_batch needs a packed batch (with {CU_SEQLENS!r}); got keys {sorted(batch)}: "
                       "pack the samples first with lightning_dcp.sp.packing.pack_samples, or give the DataLoader "
                       "collate_fn=CausalLMModule.collate")
    labels = batch.get("labels", batch["input_ids"])
    total = labels.shape[0]
    cu = batch[CU_SEQLENS].to(device=labels.device, dtype=torch.long)
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:-1] = labels[1:]
    ends = cu[1:][cu[1:] > cu[:-1]] - 1  # last token of every non-empty segment
    shifted[ends] = IGNORE_INDEX
    real = _real_tokens(batch, total, labels.device)
    shifted = torch.where(real, shifted, torch.full_like(shifted, IGNORE_INDEX))
    out = {k: v for k, v in batch.items() if k != "labels"}
    out[SHIFT_LABELS] = shifted
    out[LOSS_MASK] = shifted != IGNORE_INDEX
    return out


def _real_tokens(batch: Mapping[str, Any], total: int, device: torch.device) -> torch.Tensor:
    if SEGMENT_IDS in batch:
        return batch[SEGMENT_IDS].to(device) >= 0
    num = batch.get(NUM_TOKENS, total)
    return torch.arange(total, device=device) < int(num)


def collate_causal_lm(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``collate_fn`` for a plain DataLoader: :func:`pack_samples` then :func:`prepare_causal_lm_batch`."""
    if samples and isinstance(samples[0], Mapping) and "input_ids" not in samples[0]:
        raise _missing_input_ids(list(samples[0]))
    return prepare_causal_lm_batch(pack_samples(samples))


def pack_padded_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Repack a Hugging Face-style padded batch (``input_ids`` ``[B, T]``, optional ``attention_mask``
    and ``labels``) into one prepared packed micro-batch (the tokens where ``attention_mask`` is 1)."""
    if "input_ids" not in batch:
        raise _missing_input_ids(list(batch))
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    labels = batch.get("labels")
    samples = []
    for row in range(ids.shape[0]):
        keep = mask[row]
        sample = {"input_ids": ids[row][keep]}
        if labels is not None:
            sample["labels"] = labels[row][keep]
        if sample["input_ids"].numel():
            samples.append(sample)
    if not samples:
        raise ValueError("pack_padded_batch: every row of the batch is empty (attention_mask all 0)")
    return collate_causal_lm(samples)


def check_causal_lm_head(model: nn.Module) -> None:
    """Raise at once when :func:`causal_lm_logits` cannot reproduce ``model``'s own logits.

    Supported: a plain ``nn.Linear`` output embedding (tied or not), optionally followed by
    ``config.final_logit_softcapping`` (Gemma 2). Anything else (``config.logit_scale``, a custom
    head) raises a ``ValueError`` naming the field and the fix.
    """
    head = model.get_output_embeddings()
    config = model.config
    name = type(model).__name__
    if not isinstance(head, nn.Linear):
        raise ValueError(f"CausalLMModule computes logits as a linear head on the last hidden state; {name}'s output "
                         f"embedding is {type(head).__name__}, not nn.Linear: subclass CausalLMModule and override forward.")
    if getattr(config, "logit_scale", None) not in (None, 1.0):
        raise ValueError(f"CausalLMModule: {name} has config.logit_scale={config.logit_scale}, which it does not "
                         "apply: subclass CausalLMModule and override forward (logits = head(hidden) * logit_scale).")


def verify_packed_logits(model: nn.Module, lengths: Sequence[int] = (5, 3), rtol: float = 1e-3) -> None:
    """Raise at once unless a packed batch of ``lengths`` samples gets each sample's own logits from the
    model's own forward (for families outside :data:`~lightning_dcp.hf.TESTED_MODEL_TYPES`, whose heads
    may scale or transform logits in ways :func:`causal_lm_logits` does not know, e.g. Granite's
    ``config.logits_scaling``). One small forward on the model's device and dtype, no gradients."""
    param = next(model.parameters())
    vocab = int(model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, vocab, (n,), generator=gen)} for n in lengths]
    batch = {k: (v.to(param.device) if isinstance(v, torch.Tensor) else v)
             for k, v in prepare_causal_lm_batch(pack_samples(samples)).items()}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = causal_lm_logits(model, batch).float()
            own = torch.cat([model(input_ids=s["input_ids"].to(param.device)[None]).logits[0].float() for s in samples])
    finally:
        model.train(was_training)
    err = float((packed - own).abs().max() / own.abs().max().clamp_min(1e-6))
    if not err <= rtol:  # also catches NaN
        name, model_type = type(model).__name__, getattr(model.config, "model_type", "?")
        suspects = sorted(k for k, v in model.config.to_dict().items()
                          if any(w in k for w in ("scal", "multiplier", "softcap")) and v not in (None, 1, 1.0, False))
        hint = f" (config fields that may transform the logits: {', '.join(suspects)})" if suspects else ""
        raise ValueError(f"CausalLMModule: {name} (model_type {model_type!r}, not among the tested families) does not "
                         f"get its own logits from a packed batch: relative error {err:.2e}{hint}. Subclass CausalLMModule "
                         "and override forward to apply the head as the model's own forward does, or use a tested family")


def causal_lm_logits(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """fp32 logits ``[local_tokens, vocab]`` of an adapted causal LM on a prepared packed batch.

    Runs ``model.base_model`` on the (possibly SP-sharded) packed ``input_ids`` with this shard's
    ``position_ids`` and the whole micro-batch's ``cu_seqlens``/``max_seqlen``, then the output
    embedding in fp32, and ``config.final_logit_softcapping`` when set (Gemma 2: ``cap *
    tanh(logits / cap)``), as the model's own ``forward`` does.
    """
    ids = batch["input_ids"]
    hidden = model.base_model(
        input_ids=ids.unsqueeze(0), position_ids=batch[POSITION_IDS].unsqueeze(0), use_cache=False,
        cu_seq_lens_q=batch[CU_SEQLENS], cu_seq_lens_k=batch[CU_SEQLENS],
        max_length_q=int(batch[MAX_SEQLEN]), max_length_k=int(batch[MAX_SEQLEN]),
    ).last_hidden_state[0]
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        bias = None if head.bias is None else head.bias.float()
        logits = F.linear(hidden.float(), head.weight.float(), bias)
        return torch.tanh(logits / cap) * cap if cap else logits


class CausalLMModule(StepLossLogging, pl.LightningModule):
    """Trains a Hugging Face causal LM under :class:`~lightning_dcp.DCPStrategy` or a plain Trainer.

    Samples are dicts with ``input_ids`` (int64 ``[len]``) and optional ``labels`` (``-100`` =
    no loss; default ``input_ids``). The loss is next-token cross-entropy within each sample,
    averaged over every valid target token of the *global* batch (``loss_reduction="token"``);
    logits and cross-entropy are computed in fp32. ``train/loss`` is logged once per optimizer
    step (:class:`~lightning_dcp.step_loss.StepLossLogging`): the global batch's loss under
    DCPStrategy, the batch's under a plain Trainer -- never one micro-batch's shard.

    Args:
        model: a transformers causal LM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...);
            :func:`~lightning_dcp.hf.adapt` is applied to it unless already done.
        lr, weight_decay, betas: AdamW settings of the default :meth:`configure_optimizers`
            (override it for anything else).

    Plain DataLoaders: ``collate_fn=CausalLMModule.collate`` (packs and shifts), or Hugging
    Face-style padded ``[B, T]`` batches, which ``training_step`` repacks.
    """

    #: Tells DCPStrategy that this module takes packed, SP-sharded micro-batches.
    dcp_support = "sp"
    dcp_ring_layout = "zigzag"  # ring items: causal work balanced over the ring (lightning_dcp.sp.tokens)
    #: ``collate_fn`` for plain DataLoaders.
    collate = staticmethod(collate_causal_lm)

    def __init__(self, model: nn.Module, lr: float = 1e-4, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95)) -> None:
        super().__init__()
        self.model = model if is_adapted(model) else adapt(model)
        check_causal_lm_head(self.model)
        if not is_tested_family(self.model):
            verify_packed_logits(self.model)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)

    def dcp_support_message(self, support: str) -> str | None:
        """The one line DCPStrategy prints at fit start: what this module runs with at ``support``.

        ``support`` is the level the strategy resolved (``"sp"`` unless ``DCPStrategy(support=...)``
        says otherwise); ``None`` for ``"safe"``, whose line the strategy prints itself.
        """
        if support == "safe":
            return None
        model, config = self.model, self.model.config
        model_type = getattr(config, "model_type", "?")
        family = (f"model_type {model_type!r}, a tested family" if is_tested_family(model) else
                  f"model_type {model_type!r}, NOT among the tested families ({', '.join(TESTED_MODEL_TYPES)}): check "
                  "that a packed batch gives each sample's own logits, as tests/test_hf.py does")
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        layers = len(model.dcp_repeated_layers())
        extras = [f"attention logit soft-capping {config.attn_logit_softcapping}"] if getattr(
            config, "attn_logit_softcapping", None) else []
        if getattr(config, "final_logit_softcapping", None):
            extras.append(f"final logit soft-capping {config.final_logit_softcapping}")
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) is not False:
            extras.append(f"samples longer than its sliding window ({window} tokens) are refused")
        sp = (f"Ulysses SP groups of sizes dividing its {heads} attention heads ({kv_heads} key/value heads)"
              if support == "sp" else "SP size 1 (support='packed')")
        return (f"DCPStrategy: {type(self).__name__} trains {type(model).__name__} ({family}) at support level "
                f"{support!r}: packed micro-batches (attention within each sample only, positions restart per sample), {sp}, "
                f"per-layer recompute of its {layers} decoder layers"
                + (f"; {', '.join(extras)}" if extras else "") + ".")

    def dcp_prepare_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """DCPStrategy hook, called on the whole packed micro-batch before sharding: shift labels per sample."""
        return prepare_causal_lm_batch(batch)

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """fp32 logits ``[local_tokens, vocab]`` of a prepared (possibly SP-sharded) packed batch
        (:func:`causal_lm_logits`)."""
        return causal_lm_logits(self.model, batch)

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        """Per-token CE against ``shift_labels``, reduced by :func:`~lightning_dcp.weighted_loss`."""
        batch = self._as_prepared(batch)
        logits = self(batch)
        token_loss = F.cross_entropy(logits, batch[SHIFT_LABELS], reduction="none", ignore_index=IGNORE_INDEX)
        return weighted_loss(token_loss, batch)

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        """Mean next-token CE over the batch's valid targets, logged as ``val_loss``."""
        batch = self._as_prepared(batch)
        token_loss = F.cross_entropy(self(batch), batch[SHIFT_LABELS], reduction="none", ignore_index=IGNORE_INDEX)
        mask = batch[LOSS_MASK]
        loss = (token_loss * mask).sum() / mask.sum().clamp_min(1)
        self.log("val_loss", loss, batch_size=int(mask.sum()))
        return loss

    def _as_prepared(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        if SHIFT_LABELS in batch:
            return batch
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and CU_SEQLENS not in batch:
            return pack_padded_batch(batch)
        sharded = CU_SEQLENS in batch and isinstance(ids, torch.Tensor) and ids.shape[0] != int(batch[CU_SEQLENS][-1])
        if sharded or TOKEN_WEIGHT in batch or active_context().size > 1:
            raise RuntimeError(
                f"{type(self).__name__}.training_step got a DCP micro-batch without {SHIFT_LABELS!r}: labels must be "
                "shifted on the whole packed micro-batch before SP sharding and before the strategy computes token "
                "weights, which DCPStrategy does by calling the module's dcp_prepare_batch(batch) hook; this strategy "
                "version did not call it. Use a lightning-dcp version whose DCPStrategy supports dcp_prepare_batch.")
        return self.dcp_prepare_batch(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over all parameters with ``lr``, ``weight_decay`` and ``betas``."""
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, betas=self.betas)
