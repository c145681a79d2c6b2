"""The profiling grid: which ``(seq_len, micro_batch, sp)`` points to measure, and the samples
that fill them.

Pure Python (no torch): the grid is built on rank 0 and broadcast, so every rank measures the
same points in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from lightning_dcp.planning.sp_sizes import ulysses_sizes

__all__ = ["DENSITIES", "GridPoint", "ProfileGrid", "Samples", "build_grid", "default_sp_sizes", "select_lengths"]

#: Lengths per SP size and micro-batch sizes per density (``lengths`` / ``micro_batch_sizes`` override).
DENSITIES = {"coarse": (4, (1, 2)), "fine": (8, (1, 2, 4))}


@dataclass(frozen=True)
class GridPoint:
    """One measurement: ``micro_batch`` samples of ``seq_len`` tokens on an SP group of ``sp`` ranks.

    ``required`` points (each SP size's cheapest: its shortest length at its smallest micro-batch size) run even
    past the time budget, so every SP size the strategy has groups for gets a fit; every other point is measured
    only when it is forecast to end within the budget (:mod:`lightning_dcp.profiling.deadline`).
    """

    seq_len: int
    micro_batch: int
    sp: int
    required: bool = False


@dataclass
class ProfileGrid:
    """The ordered grid (required points first, then the cheapest first) plus what was asked for, for logs and
    ``meta``."""

    points: list[GridPoint]
    lengths: list[int]
    micro_batch_sizes: list[int]
    sp_sizes: list[int]


def select_lengths(lengths: Sequence[int], count: int) -> list[int]:
    """``count`` lengths of the data at evenly spaced quantiles, min and max included; sorted, unique.

    Every returned value is a length some sample has (quantile by rank, no interpolation).
    """
    if not lengths:
        raise ValueError("cannot pick profile lengths from an empty dataset; give the profiler lengths=[...]")
    ordered = sorted(int(n) for n in lengths)
    count = max(1, int(count))
    if count == 1:
        return [ordered[len(ordered) // 2]]
    picks = {ordered[round(i * (len(ordered) - 1) / (count - 1))] for i in range(count)}
    return sorted(picks)


def default_sp_sizes(world_size: int, num_heads: int | None) -> list[int]:
    """Every Ulysses SP size up to ``world_size``: the divisors of ``num_heads`` (any size, not only powers of two,
    as :mod:`lightning_dcp.planning.sp_sizes` rules), or the powers of two when the head count is unknown."""
    if num_heads is None:
        return [1 << k for k in range(max(1, world_size).bit_length())]
    return list(ulysses_sizes(num_heads, world_size))


def check_sp_sizes(sp_sizes: Sequence[int], world_size: int, num_heads: int | None) -> list[int]:
    """``sp_sizes`` as a list; raises naming the unusable ones (above the world size, or not dividing the head
    count: each is measured as Ulysses on an aligned block of that many ranks)."""
    sps = list(sp_sizes)
    bad = [p for p in sps if p < 1 or p > world_size or (num_heads is not None and num_heads % p)]
    if bad:
        raise ValueError(f"sp_sizes {bad} are not usable on {world_size} rank(s) with {num_heads} heads: an SP size is "
                         f"at most the world size and divides the head count; drop them")
    return sps


def build_grid(lengths: Sequence[int], micro_batch_sizes: Sequence[int], sp_sizes: Sequence[int]) -> ProfileGrid:
    """Order the grid: the required point of every SP size first (its shortest length at its smallest micro-batch
    size), then the rest shortest length first (then micro-batch size, then SP size), so that a profile stopped by
    its time budget has measured the cheap points and skipped the long ones.

    Points whose per-rank token count would be below 1 (``l * b < p``) are left out.
    """
    lengths = sorted({int(n) for n in lengths})
    mbs = sorted({int(b) for b in micro_batch_sizes})
    sps = sorted({int(p) for p in sp_sizes})
    if not lengths or not mbs or not sps:
        raise ValueError(f"empty profile grid: lengths={lengths}, micro_batch_sizes={mbs}, sp_sizes={sps}")
    if min(lengths) < 1 or min(mbs) < 1 or min(sps) < 1:
        raise ValueError(f"grid values must be positive: lengths={lengths}, micro_batch_sizes={mbs}, sp_sizes={sps}")
    points = [(n, b, p) for n in lengths for b in mbs for p in sps if n * b >= p]
    first = {}
    for n, b, p in points:  # in order: each SP size's first point is its cheapest
        first.setdefault(p, (n, b, p))
    required = [GridPoint(*first[p], True) for p in sps if p in first]
    optional = [GridPoint(n, b, p) for n, b, p in points if first.get(p) != (n, b, p)]
    return ProfileGrid(required + optional, lengths, mbs, sps)


class Samples:
    """Lengths plus random access to samples, from a dataset with ``.lengths`` or a list of samples."""

    def __init__(self, data: Any):
        from lightning_dcp.sp.packing import sample_length

        self.data = data
        lengths = getattr(data, "lengths", None)
        if lengths is None:
            if not isinstance(data, Sequence):
                raise TypeError(
                    f"the profiler needs the dataset's sample lengths: {type(data).__name__} has no `.lengths`; give the "
                    "dataset a `lengths` list (tokens per sample) or pass DCPProfiler(dataset=...) one that has it"
                )
            lengths = [sample_length(s) for s in data]
        self.lengths = [int(n) for n in lengths]
        if not self.lengths:
            raise ValueError("the profiler got an empty dataset; it needs samples to build micro-batches from")

    def pick(self, seq_len: int, count: int) -> tuple[int, list[int]]:
        """(length actually used, ``count`` sample indices of that length; repeated if too few)."""
        exact = [i for i, n in enumerate(self.lengths) if n == seq_len]
        if not exact:
            nearest = min(self.lengths, key=lambda n: (abs(n - seq_len), n))
            seq_len = nearest
            exact = [i for i, n in enumerate(self.lengths) if n == seq_len]
        return seq_len, [exact[i % len(exact)] for i in range(count)]

    def __getitem__(self, index: int) -> Any:
        return self.data[index]
