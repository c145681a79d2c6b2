"""Sample lengths, read from the dataset without loading a sample, and checked one by one.

DCP plans from every sample's length (tokens; for video, frames x height x width after
patchify) before any sample is loaded: a ``lengths`` attribute of the dataset (a sequence of ints,
or a callable returning one), or ``DCPStrategy(lengths=...)``. A bad entry is refused by index and
source (``MyDataset.lengths[17] is 152.7 ...``), never rounded or skipped silently: the one check of
:func:`lightning_dcp.planning.lengths.check_lengths` (numpy scalars and one-element tensors accepted).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from lightning_dcp.planning.lengths import check_lengths

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
    out = check_lengths(lengths, source, allow_empty=True)
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
