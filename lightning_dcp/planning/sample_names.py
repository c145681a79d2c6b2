"""How errors name a sample: its dataset index, and what the dataset calls it where it says.

A dataset may name its samples with ``sample_name(index) -> str``
(:class:`~lightning_dcp.diffusers.EncodedVideoDataset`: the clip's path), so an error says
``sample 17 (clips/cat.mp4)``; the runtime hands that method, as a plain function, to whatever builds such messages
(:func:`lightning_dcp.runtime.train_loader.sample_namer`). A name function that fails or returns nothing leaves the
index alone: an error message must never fail.
"""

from __future__ import annotations

from typing import Callable, Iterable

__all__ = ["SampleNamer", "name_sample", "name_samples"]

#: dataset index -> the sample's name (``Dataset.sample_name``).
SampleNamer = Callable[[int], str]


def _name(index: int, namer: SampleNamer | None) -> str | None:
    if namer is None:
        return None
    try:
        name = namer(int(index))
    except Exception:  # noqa: BLE001 - a message must be built whatever the dataset does
        return None
    return str(name) if name not in (None, "") else None


def name_sample(index: int, namer: SampleNamer | None = None) -> str:
    """``sample 17``, or ``sample 17 (clips/cat.mp4)`` where ``namer`` names it."""
    name = _name(index, namer)
    return f"sample {index}" if name is None else f"sample {index} ({name})"


def name_samples(indices: Iterable[int], namer: SampleNamer | None = None) -> str:
    """``[4, 9]``, or ``[4 (clips/a.mp4), 9 (clips/b.mp4)]`` where ``namer`` names them."""
    parts = []
    for i in indices:
        name = _name(i, namer)
        parts.append(str(i) if name is None else f"{i} ({name})")
    return "[" + ", ".join(parts) + "]"
