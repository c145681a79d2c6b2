"""Synthetic datasets with known lengths (reference data for tests, the demo and benchmarks).

Two map-style datasets for tests, the demo and the profiler:

- :class:`SyntheticTokenDataset`: token sequences (``input_ids``, ``labels``) for 1d models.
- :class:`SyntheticVideoDataset`: latent videos of any size (``latents``, ``targets``,
  ``shapes``, ``timesteps``) for 2d models.

Both expose ``.lengths`` (list of ints, tokens per sample) without generating any sample, which
is all the DCP sampler/planner needs.

Packing lives in :mod:`lightning_dcp.sp.packing` (``pack_samples`` and friends are re-exported here).
"""

from __future__ import annotations

import math
import random
from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

from lightning_dcp.planning.lengths import check_lengths
from lightning_dcp.sp.packing import DEFAULT_PAD_VALUES, pack_samples, plain_collate, sample_length  # re-exported

__all__ = [
    "DEFAULT_PAD_VALUES", "SyntheticTokenDataset", "SyntheticVideoDataset", "pack_samples", "plain_collate",
    "sample_length", "tiny_lengths", "tiny_video_shapes",
]


# ---------------------------------------------------------------------------------------------
# length distributions
# ---------------------------------------------------------------------------------------------

def tiny_lengths(num_samples: int, seed: int = 0, min_len: int = 8, max_len: int = 512) -> list[int]:
    """CPU-scale "any size" lengths: skewed log-uniform in ``[min_len, max_len]`` with a long tail.

    ``l = min_len * (max_len / min_len) ** (u ** 1.5)`` with ``u ~ U(0, 1)``: most samples are
    short, a few reach ``max_len`` (the shape of real document / video length distributions).
    Deterministic for a given ``seed``.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    rng = random.Random(seed)
    ratio = max_len / min_len
    return [min(max_len, max(min_len, int(round(min_len * ratio ** (rng.random() ** 1.5))))) for _ in range(num_samples)]


def _named_lengths(distribution: str, num_samples: int, seed: int) -> list[int]:
    if distribution == "tiny":
        return tiny_lengths(num_samples, seed)
    from lightning_dcp.planning.distributions import get_distribution  # the paper's datasets, "video", "code"

    return [int(n) for n in get_distribution(distribution).sample(num_samples, seed)]


def _named_shapes(distribution: str, num_samples: int, seed: int, max_frames: int,
                  resolutions: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    if distribution == "tiny":
        return tiny_video_shapes(num_samples, seed, max_frames, resolutions)
    from lightning_dcp.planning.distributions import get_distribution

    dist = get_distribution(distribution)
    if not hasattr(dist, "sample_shapes"):
        raise ValueError(f"distribution {distribution!r} has lengths but no video shapes; use 'tiny', 'video', "
                         "or pass shapes=[(frames, h, w), ...]")
    return [tuple(int(d) for d in s) for s in dist.sample_shapes(num_samples, seed)]


def tiny_video_shapes(num_samples: int, seed: int = 0, max_frames: int = 16,
                      resolutions: Sequence[tuple[int, int]] = ((4, 4), (4, 6), (6, 4), (6, 6), (8, 8)),
                      ) -> list[tuple[int, int, int]]:
    """CPU-scale any-size video latent shapes ``(frames, h, w)``: skewed log-uniform frames in
    ``[1, max_frames]`` (many short clips and images, few long ones), ``(h, w)`` drawn from
    ``resolutions``. Deterministic for a given ``seed``."""
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    if not resolutions:
        raise ValueError("resolutions must name at least one (h, w)")
    rng = random.Random(seed)
    out = []
    for _ in range(num_samples):
        frames = min(max_frames, max(1, int(round(max_frames ** (rng.random() ** 1.5)))))
        h, w = resolutions[rng.randrange(len(resolutions))]
        out.append((frames, int(h), int(w)))
    return out


def _generator(seed: int, index: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + index * 7919 + 17) % (2**63 - 1))
    return g


# ---------------------------------------------------------------------------------------------
# datasets
# ---------------------------------------------------------------------------------------------

class SyntheticTokenDataset(Dataset):
    """Token sequences of known lengths following a noisy arithmetic pattern a model can learn.

    Sample ``i`` is a sequence ``x_{j+1} = (x_j + stride) mod vocab_size`` with a per-sample
    random start and ``stride`` in ``{1, 2, 3}``; 5% of the *inputs* are replaced by random tokens
    (noise), the labels are the clean pattern's next token at every position (so the number of
    loss tokens equals the length; nothing is shifted away). Deterministic per ``(seed, i)``.

    Args:
        lengths: tokens per sample; when ``None``, ``num_samples`` lengths are drawn from
            ``distribution``.
        num_samples: how many samples when ``lengths`` is None.
        distribution: ``"tiny"`` (:func:`tiny_lengths`) or a name known to
            :func:`lightning_dcp.planning.distributions.get_distribution` (``short``,
            ``balanced``, ``long``, ``video``, ``code``; those are GPU-scale lengths).
        vocab_size: token ids are in ``[0, vocab_size)``.
        seed: fixes lengths (when drawn) and content.

    Items: ``{"input_ids": LongTensor[l], "labels": LongTensor[l]}``.
    """

    def __init__(self, lengths: Sequence[int] | None = None, *, num_samples: int = 256, distribution: str = "tiny",
                 vocab_size: int = 256, seed: int = 0):
        if vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
        if lengths is None:
            lengths = _named_lengths(distribution, num_samples, seed)
        self.lengths: list[int] = check_lengths(lengths, f"{type(self).__name__} lengths", allow_empty=True)
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        index = index % len(self)
        n, v = self.lengths[index], self.vocab_size
        g = _generator(self.seed, index)
        start = int(torch.randint(v, (), generator=g))
        stride = int(torch.randint(1, 4, (), generator=g))
        pos = torch.arange(n + 1, dtype=torch.int64)
        clean = (start + stride * pos) % v
        inputs = clean[:n].clone()
        noise = torch.rand(n, generator=g) < 0.05
        inputs[noise] = torch.randint(v, (int(noise.sum()),), generator=g)
        return {"input_ids": inputs, "labels": clean[1:].clone()}


class SyntheticVideoDataset(Dataset):
    """Latent videos of any size, as a flow-matching denoising task.

    Sample ``i`` has shape ``(frames, h, w)`` (latent tokens after patchify), flattened frame-major
    (``t, y, x``) into ``frames*h*w`` tokens of ``in_channels`` channels. The clean latent ``x0``
    is a smooth random field (sums of sinusoids over t, y, x with per-sample phases); with noise
    ``e`` and timestep ``s ~ U(0, 1)``: ``latents = (1 - s) * x0 + s * e`` and
    ``targets = e - x0`` (the flow-matching velocity). Deterministic per ``(seed, i)``.

    Args:
        shapes: ``(frames, h, w)`` per sample; when ``None``, ``num_samples`` shapes drawn from
            ``distribution``.
        num_samples: how many samples when ``shapes`` is None.
        distribution: ``"tiny"`` (:func:`tiny_video_shapes` with ``max_frames`` and
            ``resolutions``) or ``"video"`` (Open-Sora-like latent grids, GPU scale).
        in_channels: channels per latent token.
        seed: fixes shapes (when drawn) and content.
        max_frames: longest clip when shapes are drawn.
        resolutions: ``(h, w)`` choices when shapes are drawn.

    Items: ``{"latents": FloatTensor[l, C], "targets": FloatTensor[l, C], "shapes": (frames, h, w),
    "timesteps": float}`` with ``l = frames*h*w``. ``shapes`` and ``timesteps`` are per-sample
    metadata (lists after :func:`pack_samples`).
    """

    def __init__(self, shapes: Sequence[Sequence[int]] | None = None, *, num_samples: int = 128, in_channels: int = 16,
                 seed: int = 0, distribution: str = "tiny", max_frames: int = 16,
                 resolutions: Sequence[tuple[int, int]] = ((4, 4), (4, 6), (6, 4), (6, 6), (8, 8))):
        if shapes is None:
            shapes = _named_shapes(distribution, num_samples, seed, max_frames, resolutions)
        self.shapes: list[tuple[int, int, int]] = []
        for s in shapes:
            if len(s) != 3 or min(int(d) for d in s) < 1:
                raise ValueError(f"each shape is (frames, h, w) of positive ints, got {tuple(s)!r}")
            self.shapes.append((int(s[0]), int(s[1]), int(s[2])))
        if in_channels < 1:
            raise ValueError(f"in_channels must be >= 1, got {in_channels}")
        self.lengths: list[int] = [f * h * w for f, h, w in self.shapes]
        self.in_channels = in_channels
        self.seed = seed

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        index = index % len(self)
        f, h, w = self.shapes[index]
        c = self.in_channels
        g = _generator(self.seed + 1_000, index)
        t, y, x = torch.meshgrid(torch.arange(f, dtype=torch.float32), torch.arange(h, dtype=torch.float32),
                                 torch.arange(w, dtype=torch.float32), indexing="ij")
        coords = torch.stack([t.reshape(-1) / 4.0, y.reshape(-1) / 2.0, x.reshape(-1) / 2.0], dim=-1)  # [l, 3]
        freq = torch.rand(3, c, generator=g) * 2.0
        phase = torch.rand(c, generator=g) * (2 * math.pi)
        x0 = torch.sin(coords @ freq + phase)  # [l, C]
        noise = torch.randn(f * h * w, c, generator=g)
        s = float(torch.rand((), generator=g)) * 0.98 + 0.01
        return {"latents": (1 - s) * x0 + s * noise, "targets": noise - x0, "shapes": (f, h, w), "timesteps": s}
