"""Token-dimension sharding of a packed micro-batch, token weights, and :func:`weighted_loss`.

A packed micro-batch (from :func:`lightning_dcp.sp.packing.pack_samples`) has a *token dimension*
of length ``T`` (padded to a multiple of :func:`pad_multiple`: the SP size, any size -- 3, 5, 6, 7 as
well as powers of two -- and twice it for a ring item): ``LOSS_MASK`` spans it, and so does every
sequence tensor. For an SP group of size ``P``, rank ``i`` of the group keeps tokens
``[i*T/P, (i+1)*T/P)`` of every tensor whose first dimension is ``T``; ``CU_SEQLENS`` and
``MAX_SEQLEN`` stay whole (they describe the whole packed sequence, as Ulysses attention needs),
lists and scalars are kept as they are.

A ring item (``WorkItem.ring = r > 1``, ``u = P / r``) whose module asks for the ``"zigzag"`` layout
(:attr:`~lightning_dcp.sp.contract.ModelContract.ring_layout`, for causal attention) deals the tokens
so every ring position gets as much causal work: ``T`` is cut into ``2r`` chunks, ring position ``j``
takes chunks ``j`` and ``2r - 1 - j`` (one early, one late), and SP rank ``j*u + i`` the ``i``-th of
``u`` equal pieces of those two chunks laid end to end (:func:`shard_spans`). The ``"contiguous"``
layout (the default) is the rule above for ring items too. Either way the shard is chosen by token
index, so the token weights below are sharded with the tokens and the loss stays exact.

Loss reductions (``DCPStrategy(loss_reduction=...)``). A *loss token* is one whose
``LOSS_MASK`` is True: not padding and, for integer ``labels``, ``labels != -100`` (prompt
masking in fine-tuning). With ``n_i`` loss tokens in sample ``i`` of the step's *global* batch:

- ``"token"`` (default): global loss ``= sum over all loss tokens of token_loss / sum_i n_i``.
- ``"sample"``: global loss ``= mean over the samples with n_i > 0 of (their token_loss sum / n_i)``.

The global divisor (``sum_i n_i``, or the number of samples with a loss) is only known once every
rank has counted its own micro-batches, so the strategy works with *sums*: each micro-batch
contributes ``sum(token_loss * TOKEN_WEIGHT)`` (``TOKEN_WEIGHT`` is 1 per loss token in token
mode and ``1/n_i`` in sample mode), every rank counts its *loss units* on the host before the
batch moves to the device (:func:`prepare_item`), the counts ride on the step-end all-gather that
already exists, and the summed gradient is divided by the global count once, before the optimizer
step. No device-to-host sync per micro-batch.

A ``training_step`` can return either :func:`weighted_loss` of its per-token losses (exact for
both reductions, any packing) or, as usual, the mean over its local loss tokens
(``cross_entropy(..., ignore_index=-100)``); the strategy multiplies a plain mean by the local
loss-token count (token mode; sample mode only for single-sample micro-batches).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from lightning_dcp.sp.context import CU_SEQLENS, LOSS_MASK, MAX_SEQLEN, RING_LAYOUTS, SEGMENT_IDS, TOKEN_WEIGHT

__all__ = ["LOSS_REDUCTIONS", "add_token_weights", "count_weighted_calls", "is_weighted", "local_loss_tokens", "pad_multiple",
           "ring_spans", "shard_batch", "shard_spans", "token_dim", "weighted_loss"]

LOSS_REDUCTIONS = ("token", "sample")

#: Attribute set on the tensor :func:`weighted_loss` returns.
_WEIGHTED_ATTR = "_dcp_weighted"

#: How many times :func:`weighted_loss` weighted a DCP micro-batch since :func:`count_weighted_calls` last
#: reset it. The marker attribute does not survive arithmetic (``weighted_loss(a) + weighted_loss(b)``
#: is a new tensor), so the runtime also counts the calls made while a micro-batch runs.
_WEIGHTED_CALLS = [0]

#: Keys never chunked even if their first dimension happens to equal the token count.
_WHOLE_KEYS = (CU_SEQLENS, MAX_SEQLEN)


def token_dim(batch: Mapping[str, Any]) -> int:
    """Length ``T`` of the packed (padded) token dimension of ``batch``."""
    if LOSS_MASK in batch:
        return int(batch[LOSS_MASK].shape[0])
    if CU_SEQLENS in batch:
        return int(batch[CU_SEQLENS][-1])
    raise KeyError(f"a packed micro-batch needs {LOSS_MASK!r} or {CU_SEQLENS!r} to know its token dimension; "
                   f"got keys {sorted(batch)} (pack samples with lightning_dcp.sp.packing.pack_samples)")


def pad_multiple(sp_size: int, ring: int = 1) -> int:
    """What the packed token dimension of an item of ``sp_size`` ranks is padded to a multiple of: the SP size,
    twice it for a ring item (``ring > 1``: the zigzag layout deals ``2 * ring`` equal chunks)."""
    return int(sp_size) * (2 if ring > 1 else 1)


Spans = tuple[tuple[int, int], ...]


def _check_layout(total: int, sp_size: int, ring: int, layout: str) -> None:
    if layout not in RING_LAYOUTS:
        raise ValueError(f"unknown token layout {layout!r}; use one of {RING_LAYOUTS}")
    if ring < 1 or sp_size % ring:
        raise ValueError(f"ring degree {ring} must be >= 1 and divide the SP size {sp_size}")
    multiple = pad_multiple(sp_size, ring) if layout == "zigzag" and ring > 1 else sp_size
    if total % multiple:
        what = f"the SP size {sp_size}" if multiple == sp_size else f"{multiple} (SP size {sp_size}, ring {ring}, {layout} layout)"
        raise ValueError(f"the packed micro-batch has {total} tokens, not a multiple of {what}; pack it with "
                         f"pack_samples(..., pad_to_multiple={multiple}) (lightning_dcp.sp.tokens.pad_multiple)")


def ring_spans(total: int, position: int, ring: int, layout: str = "contiguous") -> Spans:
    """The token ranges ``[start, end)`` ring position ``position`` of ``ring`` holds (its Ulysses subgroup's shards
    laid end to end, the order its all-to-all gathers them in)."""
    if layout == "zigzag" and ring > 1:
        c = total // (2 * ring)
        return ((position * c, (position + 1) * c), ((2 * ring - 1 - position) * c, (2 * ring - position) * c))
    c = total // ring
    return ((position * c, (position + 1) * c),)


def shard_spans(total: int, sp_rank: int, sp_size: int, ring: int = 1, layout: str = "contiguous") -> Spans:
    """The token ranges ``[start, end)`` SP rank ``sp_rank`` holds, in order (see the module docstring).

    Raises:
        ValueError: ``total`` is not a multiple of what the layout needs, or a bad rank, ring or layout.
    """
    _check_layout(total, sp_size, ring, layout)
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} is outside an SP group of size {sp_size}")
    local = total // sp_size
    if ring == 1 or layout == "contiguous":
        return ((sp_rank * local, (sp_rank + 1) * local),)
    u = sp_size // ring
    lo, hi = (sp_rank % u) * local, (sp_rank % u + 1) * local  # a piece of the two chunks laid end to end
    out, offset = [], 0
    for a, b in ring_spans(total, sp_rank // u, ring, layout):
        s, e = max(a, a + lo - offset), min(b, a + hi - offset)
        if s < e:
            out.append((s, e))
        offset += b - a
    return tuple(out)


def shard_batch(batch: Mapping[str, Any], sp_rank: int, sp_size: int, ring: int = 1,
                layout: str = "contiguous") -> dict[str, Any]:
    """This SP rank's shard of a packed micro-batch (see the module docstring for the rule).

    Args:
        ring, layout: the item's ring degree and the module's ring token layout (``"contiguous"`` or
            ``"zigzag"``; only read when ``ring > 1``).

    Raises:
        ValueError: the token dimension is not a multiple of what the layout needs (:func:`pad_multiple`).
    """
    if sp_size == 1:
        return dict(batch)
    total = token_dim(batch)
    spans = shard_spans(total, sp_rank, sp_size, ring, layout)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key not in _WHOLE_KEYS and isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == total:
            out[key] = value[spans[0][0]:spans[0][1]] if len(spans) == 1 else torch.cat([value[a:b] for a, b in spans])
        else:
            out[key] = value
    return out


def add_token_weights(batch: dict[str, Any], reduction: str) -> int:
    """Add ``TOKEN_WEIGHT`` to an *unsharded* packed batch; return the item's loss units.

    ``TOKEN_WEIGHT`` (float32, the token dimension of ``LOSS_MASK``) is 1 on loss tokens in token
    mode and ``1/n_i`` on the loss tokens of sample ``i`` in sample mode; 0 elsewhere. The loss
    units are the item's loss tokens (token mode) or its samples with at least one loss token
    (sample mode): summed over the step's items they are the global divisor.
    """
    mask = batch[LOSS_MASK]
    if reduction == "token":
        batch[TOKEN_WEIGHT] = mask.to(torch.float32)
        return int(mask.sum())
    if reduction != "sample":
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {reduction!r}")
    seg = batch[SEGMENT_IDS]
    num = int(seg.max()) + 1 if seg.numel() else 0
    ids = torch.where(mask & (seg >= 0), seg, torch.full_like(seg, num))
    counts = torch.bincount(ids, minlength=num + 1)[:num].to(torch.float64)
    per_sample = torch.cat([torch.where(counts > 0, 1.0 / counts.clamp_min(1), torch.zeros_like(counts)),
                            torch.zeros(1, dtype=torch.float64)])
    batch[TOKEN_WEIGHT] = per_sample[ids].to(torch.float32)
    return int((counts > 0).sum())


def local_loss_tokens(local: Mapping[str, Any]) -> int:
    """Loss tokens in a (sharded) packed batch, counted on the host."""
    return int(local[LOSS_MASK].sum()) if LOSS_MASK in local else 0


def weighted_loss(token_loss: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """``(token_loss * batch[TOKEN_WEIGHT]).sum()``, marked so the strategy applies no factor but the global divisor.

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
    _WEIGHTED_CALLS[0] += 1
    return out


def is_weighted(loss: Any) -> bool:
    """Whether ``loss`` came from :func:`weighted_loss` (in a DCP step)."""
    return bool(getattr(loss, _WEIGHTED_ATTR, False))


def count_weighted_calls(reset: bool = False) -> int:
    """How many DCP micro-batch losses :func:`weighted_loss` made since the last reset (then reset if asked).

    The runtime resets it before each ``training_step`` and reads it after: a loss built from weighted
    losses -- ``weighted_loss(a, batch) + weighted_loss(b, batch)``, which loses the marker -- is then
    still taken as the sum it is, never re-scaled as if it were a plain mean."""
    calls = _WEIGHTED_CALLS[0]
    if reset:
        _WEIGHTED_CALLS[0] = 0
    return calls
