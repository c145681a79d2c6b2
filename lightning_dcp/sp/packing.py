"""Packing: the one function that turns samples into a variable-length micro-batch.

The DCP runtime (the sampler's loader, the profiler) calls :func:`pack_samples` for every
micro-batch; it lives here, apart from the reference datasets, so no runtime room imports them.

Packing rule:

    A sample is a ``dict``. Its *length* is ``len(sample["input_ids"])`` if present, else
    ``len(sample["latents"])``, else the first dimension of its first tensor with at least one
    dimension. A value is a **sequence tensor** iff it is a ``torch.Tensor`` whose first dimension
    equals the sample's length; sequence tensors are concatenated along dim 0 (and padded at the
    end). Every other value (tuples like ``shapes``, floats like ``timesteps``, 0-d tensors,
    strings) is **per-sample metadata**: the packed batch holds it as a ``list`` with one entry
    per real sample, in sample order (no entry for padding).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from lightning_dcp.sp.context import CU_SEQLENS, LOSS_MASK, MAX_SEQLEN, NUM_TOKENS, POSITION_IDS, SAMPLE_INDICES, SEGMENT_IDS

__all__ = ["DEFAULT_PAD_VALUES", "IGNORE_INDEX", "pack_samples", "plain_collate", "sample_length"]

#: Label value that carries no loss (PyTorch's and Hugging Face's ``ignore_index``).
IGNORE_INDEX = -100

#: Pad value per key used by :func:`pack_samples` (and the 2d frame sharding); any other key pads with 0.
DEFAULT_PAD_VALUES: dict[str, Any] = {"labels": -100, LOSS_MASK: False, SEGMENT_IDS: -1, POSITION_IDS: 0}

def sample_length(sample: Mapping[str, Any]) -> int:
    """Tokens in ``sample`` (see the module docstring for the rule)."""
    for key in ("input_ids", "latents"):
        value = sample.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return int(value.shape[0])
    for value in sample.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return int(value.shape[0])
    raise ValueError(f"cannot tell the length of a sample with keys {sorted(sample)}: it has no tensor with a "
                     "first dimension; give it an 'input_ids' or 'latents' tensor")


def pack_samples(samples: Sequence[Mapping[str, Any]], pad_to_multiple: int = 1,
                 pad_values: Mapping[str, Any] | None = None, sample_indices: Sequence[int] | None = None) -> dict[str, Any]:
    """Pack ``samples`` into one variable-length micro-batch (no SP sharding).

    Sequence tensors are concatenated along dim 0; when the total is not a multiple of
    ``pad_to_multiple``, a padding segment is appended at the end (its own segment in
    ``cu_seqlens``). Per-sample metadata become lists (see the module docstring).

    Args:
        samples: non-empty list of sample dicts with the same keys.
        pad_to_multiple: pad the packed length up to a multiple of this (e.g. the SP size).
        pad_values: pad value per key, overriding :data:`DEFAULT_PAD_VALUES` (0 for other keys;
            ``-100`` for ``"labels"``).
        sample_indices: dataset indices of the samples; stored under ``SAMPLE_INDICES`` if given.

    Returns:
        The samples' keys plus ``CU_SEQLENS`` (int32 ``[segments+1]``), ``MAX_SEQLEN`` (int),
        ``POSITION_IDS`` (int64, position inside the sample, 0 on padding), ``LOSS_MASK`` (bool:
        the tokens that carry a loss -- False on padding and, when the samples have integer
        ``labels``, where ``labels == IGNORE_INDEX`` (-100), e.g. masked prompts),
        ``SEGMENT_IDS`` (int64, sample number, -1 on padding) and ``NUM_TOKENS`` (int, real tokens).
    """
    if not samples:
        raise ValueError("pack_samples got no samples; a micro-batch needs at least one")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    pads = dict(DEFAULT_PAD_VALUES)
    if pad_values:
        pads.update(pad_values)
    keys = list(samples[0].keys())
    reserved = [k for k in keys if k in (CU_SEQLENS, MAX_SEQLEN, POSITION_IDS, LOSS_MASK, SEGMENT_IDS, NUM_TOKENS)]
    if reserved:
        raise ValueError(f"samples must not carry the reserved key(s) {reserved}: pack_samples adds them")
    lengths = [sample_length(s) for s in samples]
    for i, s in enumerate(samples):
        if set(s.keys()) != set(keys):
            raise ValueError(f"sample {i} has keys {sorted(s)} but sample 0 has {sorted(keys)}; all samples of a "
                             "micro-batch need the same keys")
    total = sum(lengths)
    padded = -(-total // pad_to_multiple) * pad_to_multiple
    pad = padded - total

    out = _concatenated(samples, keys, lengths, pad, pads)
    seg_lens = lengths + ([pad] if pad else [])
    cu = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg_lens, dtype=torch.int64), 0).to(torch.int32)
    out[CU_SEQLENS] = cu
    out[MAX_SEQLEN] = int(max(seg_lens))
    out[POSITION_IDS] = torch.cat([torch.arange(n, dtype=torch.int64) for n in seg_lens[: len(lengths)]]
                                  + ([torch.zeros(pad, dtype=torch.int64)] if pad else []))
    mask = torch.zeros(padded, dtype=torch.bool)
    mask[:total] = True
    labels = out.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() >= 1 and labels.shape[0] == padded and not labels.is_floating_point():
        mask &= (labels != IGNORE_INDEX) if labels.dim() == 1 else (labels != IGNORE_INDEX).flatten(1).any(1)
    out[LOSS_MASK] = mask
    out[SEGMENT_IDS] = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lengths)]
                                 + ([torch.full((pad,), -1, dtype=torch.int64)] if pad else []))
    out[NUM_TOKENS] = int(total)
    if sample_indices is not None:
        if len(sample_indices) != len(samples):
            raise ValueError(f"got {len(sample_indices)} sample_indices for {len(samples)} samples")
        out[SAMPLE_INDICES] = [int(i) for i in sample_indices]
    return out


def _concatenated(samples: Sequence[Mapping[str, Any]], keys: list[str], lengths: list[int], pad: int,
                  pads: Mapping[str, Any]) -> dict[str, Any]:
    """Each key's sequence tensors concatenated along dim 0 (plus ``pad`` rows of its pad value), or its
    per-sample metadata as a list."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [s[key] for s in samples]
        is_seq = [isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n for v, n in zip(values, lengths)]
        if all(is_seq):
            parts = list(values)
            if pad:
                ref = values[0]
                parts.append(torch.full((pad, *ref.shape[1:]), pads.get(key, 0), dtype=ref.dtype, device=ref.device))
            try:
                out[key] = torch.cat(parts, dim=0)
            except RuntimeError as err:
                raise ValueError(f"cannot concatenate {key!r} across samples (shapes "
                                 f"{[tuple(v.shape) for v in values]}): {err}") from None
        elif any(is_seq):
            raise ValueError(f"{key!r} is a sequence tensor in some samples and metadata in others (lengths {lengths}, "
                             f"first dims {[getattr(v, 'shape', (None,))[:1] for v in values]}); make it one or the other")
        else:
            out[key] = values
    return out


def plain_collate(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``collate_fn`` for an ordinary DataLoader: :func:`pack_samples` with no padding.

    ``DataLoader(dataset, batch_size=4, collate_fn=plain_collate)`` feeds
    :class:`~lightning_dcp.models.DCPTransformerModule` without the DCP strategy.
    """
    return pack_samples(samples)
