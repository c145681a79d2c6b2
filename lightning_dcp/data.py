"""Synthetic datasets with known lengths, and the one function that packs samples into a micro-batch.

Two map-style datasets for tests, the demo and the profiler:

- :class:`SyntheticTokenDataset`: token sequences (``input_ids``, ``labels``) for 1d models.
- :class:`SyntheticVideoDataset`: latent videos of any size (``latents``, ``targets``,
  ``shapes``, ``timesteps``) for 2d models.

Both expose ``.lengths`` (list of ints, tokens per sample) without generating any sample, which
is all the DCP sampler/planner needs.

Packing rule (shared with the DCP strategy's collate, which calls :func:`pack_samples`):

    A sample is a ``dict``. Its *length* is ``len(sample["input_ids"])`` if present, else
    ``len(sample["latents"])``, else the first dimension of its first tensor with at least one
    dimension. A value is a **sequence tensor** iff it is a ``torch.Tensor`` whose first dimension
    equals the sample's length; sequence tensors are concatenated along dim 0 (and padded at the
    end). Every other value (tuples like ``shapes``, floats like ``timesteps``, 0-d tensors,
    strings) is **per-sample metadata**: the packed batch holds it as a ``list`` with one entry
    per real sample, in sample order (no entry for padding).
"""

from __future__ import annotations

import math
import random
from typing import Any, Mapping, Sequence

import torch
from torch.utils.data import Dataset

from lightning_dcp.context import CU_SEQLENS, LOSS_MASK, MAX_SEQLEN, NUM_TOKENS, POSITION_IDS, SAMPLE_INDICES, SEGMENT_IDS

__all__ = [
    "DEFAULT_PAD_VALUES", "SyntheticTokenDataset", "SyntheticVideoDataset", "pack_samples", "plain_collate",
    "sample_length", "tiny_lengths", "tiny_video_shapes",
]

#: Pad value per key used by :func:`pack_samples` (and the 2d frame sharding); any other key pads with 0.
DEFAULT_PAD_VALUES: dict[str, Any] = {"labels": -100, LOSS_MASK: False, SEGMENT_IDS: -1, POSITION_IDS: 0}


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
        self.lengths: list[int] = [int(n) for n in lengths]
        bad = [n for n in self.lengths if n < 1]
        if bad:
            raise ValueError(f"every length must be >= 1, got {bad[:5]}")
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


# ---------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------

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
        ``POSITION_IDS`` (int64, position inside the sample, 0 on padding), ``LOSS_MASK`` (bool,
        False on padding), ``SEGMENT_IDS`` (int64, sample number, -1 on padding) and
        ``NUM_TOKENS`` (int, real tokens).
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

    seg_lens = lengths + ([pad] if pad else [])
    cu = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg_lens, dtype=torch.int64), 0).to(torch.int32)
    out[CU_SEQLENS] = cu
    out[MAX_SEQLEN] = int(max(seg_lens))
    out[POSITION_IDS] = torch.cat([torch.arange(n, dtype=torch.int64) for n in seg_lens[: len(lengths)]]
                                  + ([torch.zeros(pad, dtype=torch.int64)] if pad else []))
    mask = torch.zeros(padded, dtype=torch.bool)
    mask[:total] = True
    out[LOSS_MASK] = mask
    out[SEGMENT_IDS] = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lengths)]
                                 + ([torch.full((pad,), -1, dtype=torch.int64)] if pad else []))
    out[NUM_TOKENS] = int(total)
    if sample_indices is not None:
        if len(sample_indices) != len(samples):
            raise ValueError(f"got {len(sample_indices)} sample_indices for {len(samples)} samples")
        out[SAMPLE_INDICES] = [int(i) for i in sample_indices]
    return out


def plain_collate(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``collate_fn`` for an ordinary DataLoader: :func:`pack_samples` with no padding.

    ``DataLoader(dataset, batch_size=4, collate_fn=plain_collate)`` feeds
    :class:`~lightning_dcp.models.DCPTransformerModule` without the DCP strategy.
    """
    return pack_samples(samples)
