"""Benchmark datasets: the planner's five named length distributions at CPU scale, as LightningDataModules.

The named distributions of :mod:`lightning_dcp.planning.distributions` are GPU-scale (``short`` /
``balanced`` / ``long``: 1k..512k tokens; ``video``: latent grids up to 52 x 80 x 45; ``code``:
real Python files, up to ~100k tokens). A CPU run of a tiny model needs tiny samples, so
:func:`scaled_lengths` / :func:`scaled_shapes` keep each distribution's *shape* and shrink it:

==============================  ==================================================================
distribution                    CPU scaling (defaults)
==============================  ==================================================================
``short``/``balanced``/``long``  ``l' = clamp(round(l / 64), 8, 2048)`` -- the bands 1k-4k, 4k-16k,
                                 16k-64k, 64k-256k, 256k-512k become 16-64, 64-256, 256-1024,
                                 1024-2048 (the last two bands are clamped together at 2048)
``code``                         ``l' = clamp(round(l / 8), 8, 2048)`` (the stdlib's files have a
                                 median of a few thousand tokens; /8 keeps most below 2048)
``video``                        latent frames ``f' = ceil(f / 4)`` ({1, 13, 26, 52} -> {1, 4, 7, 13}),
                                 ``h' = clamp(round(h / 8), 2, 10)``, same for ``w``; then frames are
                                 cut until ``f' h' w' <= 2048``
``tiny``                         the package's own CPU distribution (:func:`lightning_dcp.data.tiny_lengths`)
==============================  ==================================================================

``scale=`` / ``min_len=`` / ``max_len=`` override the defaults (``scale=1, min_len=1,
max_len=None`` gives the GPU-scale lengths unchanged, for GPU runs).

For a **2d (video) model** a 1-D distribution's length ``l'`` becomes a shape ``(frames, h, w)``:
``(h, w)`` is drawn (seeded) among the CPU resolutions ``(4, 4), (4, 6), (6, 4), (6, 6), (8, 8)``
whose ``h*w <= l'`` (the smallest when none is), and ``frames = clamp(round(l' / (h*w)), 1, 64)`` --
so the sample's token count ``frames*h*w`` is within one frame of ``l'``. For a **1d model**
``video`` gives the flattened token counts ``f'*h'*w'``.

Note the scaled data keeps the *count* shape of each distribution, not its *compute* shape: the
paper's mixtures were weighted so that each band takes a given share of Transformer-1D compute on
an H100 (attention quadratic beyond ~32k tokens); a tiny model on a CPU is nearly linear in
tokens plus a per-micro-batch constant, so on CPU the long bands take a smaller share.
"""

from __future__ import annotations

import math
import random
from typing import Any, Sequence

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_dcp.data import SyntheticTokenDataset, SyntheticVideoDataset, plain_collate, tiny_lengths

__all__ = [
    "BenchDataModule", "CPU_RESOLUTIONS", "DISTRIBUTIONS", "SCALES", "lengths_to_shapes", "make_dataset",
    "scaled_lengths", "scaled_shapes",
]

DISTRIBUTIONS = ("short", "balanced", "long", "video", "code", "tiny")
#: Default divisor of each distribution's lengths for CPU runs (``video`` scales its shape instead).
SCALES: dict[str, float] = {"short": 64.0, "balanced": 64.0, "long": 64.0, "code": 8.0, "video": 1.0, "tiny": 1.0}
MIN_LEN, MAX_LEN = 8, 2048
#: ``(h, w)`` latent resolutions a 1-D length is mapped onto for 2d models (tokens per frame 16..64).
CPU_RESOLUTIONS: tuple[tuple[int, int], ...] = ((4, 4), (4, 6), (6, 4), (6, 6), (8, 8))
MAX_FRAMES = 64


def _clamp(x: int, lo: int, hi: int | None) -> int:
    return max(lo, x if hi is None else min(hi, x))


def scaled_lengths(distribution: str, num_samples: int, seed: int = 0, *, scale: float | None = None,
                   min_len: int = MIN_LEN, max_len: int | None = MAX_LEN) -> list[int]:
    """``num_samples`` token lengths of ``distribution`` at CPU scale (see the module docstring)."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {distribution!r}; known: {', '.join(DISTRIBUTIONS)}")
    if distribution == "tiny":
        return tiny_lengths(num_samples, seed, min_len=min_len, max_len=max_len or 512)
    if distribution == "video":
        return [f * h * w for f, h, w in scaled_shapes("video", num_samples, seed, scale=scale, max_len=max_len)]
    from lightning_dcp.planning.distributions import get_distribution

    s = SCALES[distribution] if scale is None else float(scale)
    if s <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    raw = get_distribution(distribution).sample(num_samples, seed)
    return [_clamp(int(round(n / s)), min_len, max_len) for n in raw]


def lengths_to_shapes(lengths: Sequence[int], seed: int = 0,
                      resolutions: Sequence[tuple[int, int]] = CPU_RESOLUTIONS,
                      max_frames: int = MAX_FRAMES, max_len: int | None = MAX_LEN) -> list[tuple[int, int, int]]:
    """Video shapes ``(frames, h, w)`` with ``frames*h*w`` close to each length (see the module docstring)."""
    rng = random.Random(seed + 7)
    smallest = min(resolutions, key=lambda r: r[0] * r[1])
    out = []
    for n in lengths:
        fitting = [r for r in resolutions if r[0] * r[1] <= n] or [smallest]
        h, w = fitting[rng.randrange(len(fitting))]
        cap = max_frames if max_len is None else max(1, min(max_frames, max_len // (h * w)))
        frames = _clamp(int(round(n / (h * w))), 1, cap)
        out.append((frames, h, w))
    return out


def scaled_shapes(distribution: str, num_samples: int, seed: int = 0, *, scale: float | None = None,
                  min_len: int = MIN_LEN, max_len: int | None = MAX_LEN) -> list[tuple[int, int, int]]:
    """``num_samples`` video shapes ``(frames, h, w)`` for ``distribution`` at CPU scale."""
    if distribution == "video":
        from lightning_dcp.planning.distributions import get_distribution

        if scale is not None and scale == 1 and max_len is None:
            return [tuple(int(d) for d in s) for s in get_distribution("video").sample_shapes(num_samples, seed)]
        out = []
        for f, h, w in get_distribution("video").sample_shapes(num_samples, seed):
            f2, h2, w2 = math.ceil(f / 4), _clamp(int(round(h / 8)), 2, 10), _clamp(int(round(w / 8)), 2, 10)
            while max_len is not None and f2 > 1 and f2 * h2 * w2 > max_len:
                f2 -= 1
            out.append((f2, h2, w2))
        return out
    if distribution == "tiny":
        from lightning_dcp.data import tiny_video_shapes

        return tiny_video_shapes(num_samples, seed)
    return lengths_to_shapes(scaled_lengths(distribution, num_samples, seed, scale=scale, min_len=min_len,
                                            max_len=max_len), seed, max_len=max_len)


def make_dataset(kind: str, distribution: str, num_samples: int, seed: int = 0, *, scale: float | None = None,
                 min_len: int = MIN_LEN, max_len: int | None = MAX_LEN, vocab_size: int = 256,
                 in_channels: int = 16) -> Any:
    """A map-style dataset with ``.lengths`` (and ``.shapes`` for ``kind="2d"``)."""
    if kind == "1d":
        lengths = scaled_lengths(distribution, num_samples, seed, scale=scale, min_len=min_len, max_len=max_len)
        return SyntheticTokenDataset(lengths, vocab_size=vocab_size, seed=seed)
    if kind == "2d":
        shapes = scaled_shapes(distribution, num_samples, seed, scale=scale, min_len=min_len, max_len=max_len)
        return SyntheticVideoDataset(shapes, in_channels=in_channels, seed=seed)
    raise ValueError(f"kind must be '1d' or '2d', got {kind!r}")


class BenchDataModule(pl.LightningDataModule):
    """Synthetic benchmark data of one named distribution, for a 1d (token) or 2d (latent video) model.

    Args:
        kind: ``"1d"`` or ``"2d"`` (take it from the model's spec: ``spec.kind``).
        distribution: one of :data:`DISTRIBUTIONS`.
        num_samples: dataset size (every policy of a benchmark sees all of them).
        seed: fixes lengths / shapes and content.
        scale, min_len, max_len: CPU scaling (module docstring); defaults per distribution.
        batch_size: per-rank batch size of the plain DataLoader (the DCP strategy replaces the
            loader; it only sets the default global batch ``batch_size * world_size``).
        vocab_size, in_channels: from the model spec.

    The dataset is built in ``__init__`` (cheap: no sample is generated until indexed), so
    ``dm.lengths`` / ``dm.shapes`` are available before the Trainer starts.
    """

    def __init__(self, kind: str = "2d", distribution: str = "balanced", num_samples: int = 256, seed: int = 0, *,
                 scale: float | None = None, min_len: int = MIN_LEN, max_len: int | None = MAX_LEN,
                 batch_size: int = 8, vocab_size: int = 256, in_channels: int = 16) -> None:
        super().__init__()
        self.kind, self.distribution, self.batch_size = kind, distribution, batch_size
        self.dataset = make_dataset(kind, distribution, num_samples, seed, scale=scale, min_len=min_len,
                                    max_len=max_len, vocab_size=vocab_size, in_channels=in_channels)

    @property
    def lengths(self) -> list[int]:
        return list(self.dataset.lengths)

    @property
    def shapes(self) -> list[tuple[int, int, int]] | None:
        return list(self.dataset.shapes) if hasattr(self.dataset, "shapes") else None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, collate_fn=plain_collate)

    def describe(self) -> dict[str, Any]:
        """Summary for reports: samples, tokens, min / median / max length."""
        ls = sorted(self.lengths)
        return {"distribution": self.distribution, "kind": self.kind, "samples": len(ls), "tokens": sum(ls),
                "min": ls[0], "median": ls[len(ls) // 2], "max": ls[-1], "mean": sum(ls) / len(ls)}
