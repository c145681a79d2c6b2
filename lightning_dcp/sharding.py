"""Token-dimension sharding of a packed micro-batch, token weights, and :func:`weighted_loss`.

A packed micro-batch (from :func:`lightning_dcp.packing.pack_samples`) has a *token dimension*
of length ``T`` (padded to a multiple of the SP size): ``LOSS_MASK`` spans it, and so does
every sequence tensor. For an SP group of size ``P``, rank ``i`` of the group keeps tokens
``[i*T/P, (i+1)*T/P)`` of every tensor whose first dimension is ``T``; ``CU_SEQLENS`` and
``MAX_SEQLEN`` stay whole (they describe the whole packed sequence, as Ulysses attention needs),
lists and scalars are kept as they are.

Loss reductions (``DCPStrategy(loss_reduction=...)``); ``N`` samples of ``L = sum(len_i)``
real tokens in the step's *global* batch:

- ``"token"`` (default): global loss ``= (1/L) * sum over all real tokens of token_loss``.
  A ``training_step`` returning the mean loss over its *local* real tokens (``LOSS_MASK``; the
  usual ``cross_entropy(..., ignore_index=-100)`` on this rank's shard) is multiplied by the
  strategy by ``local_real_tokens / L``.
- ``"sample"``: global loss ``= (1/N) * sum_i mean_{t in sample i} token_loss``. The per-token
  weight is ``1 / (len_i * N)``; the strategy puts it in ``batch[TOKEN_WEIGHT]`` and the
  ``training_step`` returns ``weighted_loss(token_loss, batch)`` (a plain mean is accepted only
  for single-sample micro-batches, where the strategy can rescale it exactly).

:func:`weighted_loss` works for both reductions (``TOKEN_WEIGHT`` is ``1/L`` in token mode);
its result is marked so the strategy applies no further factor.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from lightning_dcp.context import CU_SEQLENS, LOSS_MASK, MAX_SEQLEN, SEGMENT_IDS, TOKEN_WEIGHT

__all__ = ["LOSS_REDUCTIONS", "add_token_weights", "is_weighted", "shard_batch", "token_dim", "weighted_loss"]

LOSS_REDUCTIONS = ("token", "sample")

#: Attribute set on the tensor :func:`weighted_loss` returns.
_WEIGHTED_ATTR = "_dcp_weighted"

#: Keys never chunked even if their first dimension happens to equal the token count.
_WHOLE_KEYS = (CU_SEQLENS, MAX_SEQLEN)


def token_dim(batch: Mapping[str, Any]) -> int:
    """Length ``T`` of the packed (padded) token dimension of ``batch``."""
    if LOSS_MASK in batch:
        return int(batch[LOSS_MASK].shape[0])
    if CU_SEQLENS in batch:
        return int(batch[CU_SEQLENS][-1])
    raise KeyError(f"a packed micro-batch needs {LOSS_MASK!r} or {CU_SEQLENS!r} to know its token dimension; "
                   f"got keys {sorted(batch)} (pack samples with lightning_dcp.packing.pack_samples)")


def shard_batch(batch: Mapping[str, Any], sp_rank: int, sp_size: int) -> dict[str, Any]:
    """This SP rank's shard of a packed micro-batch (see the module docstring for the rule).

    Raises:
        ValueError: the token dimension is not a multiple of ``sp_size``.
    """
    if sp_size == 1:
        return dict(batch)
    total = token_dim(batch)
    if total % sp_size:
        raise ValueError(f"the packed micro-batch has {total} tokens, not a multiple of the SP size {sp_size}; "
                         f"pack it with pack_samples(..., pad_to_multiple={sp_size})")
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} is outside an SP group of size {sp_size}")
    local = total // sp_size
    lo, hi = sp_rank * local, (sp_rank + 1) * local
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key not in _WHOLE_KEYS and isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == total:
            out[key] = value[lo:hi]
        else:
            out[key] = value
    return out


def add_token_weights(batch: dict[str, Any], lengths: Sequence[int], reduction: str, global_tokens: int,
                      global_samples: int) -> dict[str, Any]:
    """Add ``TOKEN_WEIGHT`` (float32, same token dimension as ``LOSS_MASK``) to an *unsharded* packed batch.

    ``lengths`` are the item's sample lengths in packing order (``SEGMENT_IDS`` indexes them).
    """
    mask = batch[LOSS_MASK]
    if reduction == "token":
        weight = mask.to(torch.float32) / float(global_tokens)
    elif reduction == "sample":
        seg = batch[SEGMENT_IDS]
        per_sample = torch.tensor([1.0 / (n * global_samples) for n in lengths] + [0.0], dtype=torch.float32)
        weight = per_sample[torch.where(seg >= 0, seg, torch.full_like(seg, len(lengths)))]
        weight = weight * mask.to(torch.float32)
    else:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {reduction!r}")
    batch[TOKEN_WEIGHT] = weight.to(mask.device)
    return batch


def weighted_loss(token_loss: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """``(token_loss * batch[TOKEN_WEIGHT]).sum()``, marked so the strategy applies no factor.

    Args:
        token_loss: per-token loss of this rank's shard, shape ``[local_tokens]`` (e.g.
            ``F.cross_entropy(logits, labels, reduction="none", ignore_index=-100)``); padding
            tokens have weight 0, so their value does not matter.
        batch: the micro-batch the strategy passed to ``training_step``.

    Outside a DCP training step (no ``TOKEN_WEIGHT`` in the batch: validation, plain
    DataLoader) it returns the mean over ``LOSS_MASK`` tokens (or over all tokens), unmarked.
    """
    if TOKEN_WEIGHT not in batch:
        if LOSS_MASK in batch:
            mask = batch[LOSS_MASK].to(token_loss.dtype)
            return (token_loss * mask).sum() / mask.sum().clamp_min(1)
        return token_loss.mean()
    weight = batch[TOKEN_WEIGHT]
    if token_loss.shape != weight.shape:
        raise ValueError(f"weighted_loss: token_loss has shape {tuple(token_loss.shape)} but batch[{TOKEN_WEIGHT!r}] "
                         f"has {tuple(weight.shape)}; pass the per-token loss of this rank's shard (reduction='none')")
    out = (token_loss * weight.to(token_loss.dtype)).sum()
    setattr(out, _WEIGHTED_ATTR, True)
    return out


def is_weighted(loss: Any) -> bool:
    """Whether ``loss`` came from :func:`weighted_loss` (in a DCP step)."""
    return bool(getattr(loss, _WEIGHTED_ATTR, False))
