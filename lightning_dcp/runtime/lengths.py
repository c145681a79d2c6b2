"""Sample lengths, read from the dataset without loading a sample, and checked one by one.

DCP plans from every sample's length (tokens; for video, frames x height x width after
patchify) before any sample is loaded: a ``lengths`` attribute of the dataset (a sequence of ints,
or a callable returning one), or ``DCPStrategy(lengths=...)``. A bad entry is refused by index and
source (``MyDataset.lengths[17] is 152.7 ...``), never rounded or skipped silently.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Sequence

import torch

__all__ = ["LENGTHS_HELP", "check_lengths", "resolve_lengths"]


LENGTHS_HELP = (
    "give the dataset a `lengths` attribute (a list of ints, one per sample: its sequence length in tokens, "
    "e.g. frames*height*width after patchify for video) or a `lengths()` method returning it, or pass "
    "`lengths=` (a list, or a callable taking the dataset) to DCPStrategy / DCPBatchSampler"
)


def resolve_lengths(dataset: Any, lengths: Sequence[int] | Callable[[Any], Sequence[int]] | None = None) -> list[int]:
    """Sample lengths of ``dataset`` without loading samples.

    Order of lookup: ``lengths`` (a sequence, or a callable called with the dataset), then
    ``dataset.lengths`` (a sequence or a callable with no arguments).

    Raises:
        ValueError: none is available, the dataset is empty, the count differs from
            ``len(dataset)``, or a length is not an integer >= 1 (named by index and source).
    """
    source = "lengths"
    if lengths is None:
        lengths = getattr(dataset, "lengths", None)
        source = f"{type(dataset).__name__}.lengths"
        if lengths is not None and callable(lengths):
            lengths = lengths()
    elif callable(lengths):
        lengths = lengths(dataset)
    if lengths is None:
        raise ValueError(f"DCP needs every sample's length before loading it, and {type(dataset).__name__} has no "
                         f"`lengths`: {LENGTHS_HELP}")
    out = check_lengths(lengths, source)
    try:
        size = len(dataset)
    except TypeError:
        size = None
    if size is not None and size != len(out):
        raise ValueError(f"{source} has {len(out)} entries but the dataset has {size} samples; give one length per sample")
    if not out:
        raise ValueError(f"the train dataset {type(dataset).__name__} is empty ({source} has no entries): DCP needs at "
                         "least one sample per global batch; check the data path and any filtering")
    return out


def _as_length(value: Any, where: str) -> int:
    """``value`` as a positive int token count, or a ValueError naming ``where`` (e.g. ``ds.lengths[17]``)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    elif hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:  # numpy scalars
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where} is {value!r} ({type(value).__name__}), not an integer; lengths are token counts "
                         "(ints >= 1)")
    if not isinstance(value, numbers.Integral):
        if not math.isfinite(value) or not float(value).is_integer():
            raise ValueError(f"{where} is {value!r}, not an integer; lengths are token counts: round them where the "
                             "dataset computes them (e.g. frames*height*width after patchify is an int)")
    if value < 1:
        raise ValueError(f"{where} is {value!r}; every sample needs >= 1 token (drop empty samples from the dataset)")
    return int(value)


def check_lengths(lengths: Any, source: str = "lengths") -> list[int]:
    """``lengths`` as a list of positive ints; a ValueError names the first bad entry as ``source[i]``.

    Accepts Python and numpy integers, integer-valued floats (``152.0``) and one-element
    tensors; refuses ``152.7``, ``True``, strings, NaN and values below 1.
    """
    try:
        seq = list(lengths)
    except TypeError:
        raise ValueError(f"{source} must be a sequence of ints (one token count per sample), got "
                         f"{type(lengths).__name__}") from None
    if all(type(n) is int and n > 0 for n in seq):  # the common case, fast
        return seq
    return [_as_length(n, f"{source}[{i}]") for i, n in enumerate(seq)]
