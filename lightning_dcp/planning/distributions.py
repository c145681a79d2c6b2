"""Named sequence-length distributions for the planner, the simulator and benchmarks (:data:`DISTRIBUTIONS`).

``short``, ``balanced``, ``long`` are the DCP paper's synthetic datasets (Appendix A), dominated by compute cost, not
count: all have many more short sequences than long ones and differ in where the training time goes. Each mixes
log-uniform bands (:data:`BANDS`, 1k..512k tokens) with the count weights of :data:`MIXTURES`, derived from the
Transformer-1D analytic cost on H100 (mean compute time per band 0.095, 0.48, 3.47, 38.7, 226 s) to give these
compute shares per band: short 0.45, 0.25, 0.15, 0.10, 0.05; balanced 0.2 each; long 0.01, 0.02, 0.07, 0.30, 0.60.
The longest (512k) need SP 8 on an 80 GB device even with full recomputation. ``video`` (Open-Sora 1.2 buckets),
``wan`` (Wan 2.1 shapes) and ``code`` (real data) are described by their classes. Pure Python + numpy.
"""

from __future__ import annotations

import abc
import bisect
import functools
import math
import os
import re
import sysconfig
from typing import Callable, Sequence

import numpy as np

class LengthDistribution(abc.ABC):
    """A named distribution of sequence lengths (tokens). ``sample`` is deterministic per seed."""

    name: str
    description: str

    def sample(self, n: int, seed: int) -> list[int]:
        """``n`` positive integer lengths, the same for the same ``(n, seed)``."""
        return [int(x) for x in self._sample(_count(n), np.random.default_rng(seed))]

    @abc.abstractmethod
    def _sample(self, n: int, rng: np.random.Generator) -> Sequence[int]:
        """Draw ``n`` lengths from ``rng``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _count(n: int) -> int:
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    return int(n)


BANDS: tuple[tuple[int, int], ...] = (
    (1024, 4096), (4096, 16384), (16384, 65536), (65536, 262144), (262144, 524288),
)
"""Length bands (tokens, ``[lo, hi)``) of the synthetic mixtures; log-uniform inside each."""

MIXTURES: dict[str, tuple[float, ...]] = {
    "short": (0.893, 0.0984, 0.00818, 4.89e-4, 4.19e-5),
    "balanced": (0.8135, 0.1618, 0.0223, 2.0e-3, 3.44e-4),
    "long": (0.592, 0.235, 0.114, 0.0437, 0.0150),
}
"""Count weights per band of :data:`BANDS` (normalized at use)."""


class MixtureDistribution(LengthDistribution):
    """Mixture of log-uniform components: band ``(lo, hi)`` (``1 <= lo < hi``) drawn with probability ``weights[i]``
    (normalized), a draw ``floor(exp(U(log lo, log hi)))``."""

    def __init__(self, name: str, bands: Sequence[tuple[int, int]], weights: Sequence[float], description: str = ""):
        if len(bands) != len(weights) or not bands:
            raise ValueError(f"distribution {name!r}: {len(bands)} bands but {len(weights)} weights; give one weight per band")
        for lo, hi in bands:
            if not 1 <= lo < hi:
                raise ValueError(f"distribution {name!r}: band ({lo}, {hi}) must satisfy 1 <= lo < hi")
        w = np.asarray(weights, dtype=float)
        if (w < 0).any() or not w.sum() > 0:
            raise ValueError(f"distribution {name!r}: weights {list(weights)} must be non-negative with a positive sum")
        self.name = name
        self.description = description
        self.bands = tuple((int(lo), int(hi)) for lo, hi in bands)
        self.weights = tuple(float(x) for x in w / w.sum())
        self._log_lo = np.log([lo for lo, _ in self.bands])
        self._log_hi = np.log([hi for _, hi in self.bands])

    def _sample(self, n: int, rng: np.random.Generator) -> Sequence[int]:
        comp = rng.choice(len(self.bands), size=n, p=self.weights)
        u = rng.random(n)
        x = np.exp(self._log_lo[comp] + u * (self._log_hi[comp] - self._log_lo[comp]))
        lo = np.array([b[0] for b in self.bands])[comp]
        hi = np.array([b[1] for b in self.bands])[comp]
        return np.clip(np.floor(x).astype(np.int64), lo, hi - 1).tolist()


# Open-Sora 1.2 style resolution names -> (pixel area at 16:9 landscape, sampling weight).
VIDEO_RESOLUTIONS: dict[str, tuple[int, float]] = {
    "144p": (144 * 256, 0.20),
    "240p": (240 * 426, 0.25),
    "360p": (360 * 640, 0.25),
    "480p": (480 * 854, 0.15),
    "720p": (720 * 1280, 0.15),
}
# Aspect ratios named width:height -> (height / width, sampling weight); landscape 16:9 is the
# most common in web video (weights are ours).
VIDEO_ASPECTS: dict[str, tuple[float, float]] = {
    "16:9": (9 / 16, 0.50),   # landscape
    "4:3": (3 / 4, 0.15),
    "1:1": (1.0, 0.10),
    "3:4": (4 / 3, 0.10),
    "9:16": (16 / 9, 0.15),   # portrait
}
# Frame counts (1 = image) as in Open-Sora 1.2's bucket config, with sampling weights.
VIDEO_FRAMES: dict[int, float] = {1: 0.25, 51: 0.35, 102: 0.25, 204: 0.15}
VAE_TEMPORAL = 4
VAE_SPATIAL = 8
PATCH = 2


def video_pixels(resolution: str, aspect: str) -> tuple[int, int]:
    """Pixel ``(height, width)`` of a bucket: the area of ``resolution`` at ``aspect`` (w:h name), multiples of 16."""
    area, _ = VIDEO_RESOLUTIONS[resolution]
    ratio, _ = VIDEO_ASPECTS[aspect]
    q = VAE_SPATIAL * PATCH
    h = max(q, int(round(math.sqrt(area * ratio) / q)) * q)
    w = max(q, int(round(math.sqrt(area / ratio) / q)) * q)
    return h, w


def video_tokens(frames: int, height: int, width: int) -> tuple[int, int, int]:
    """Latent token grid ``(1 + (frames - 1) // 4, height // 16, width // 16)`` of a video: a causal 4x temporal and
    8x spatial VAE, then 2x2 patchify; its tokens are the product."""
    if frames < 1 or height < 1 or width < 1:
        raise ValueError(f"video shape must be positive, got frames={frames}, height={height}, width={width}")
    q = VAE_SPATIAL * PATCH
    return 1 + (frames - 1) // VAE_TEMPORAL, max(1, height // q), max(1, width // q)


class VideoDistribution(LengthDistribution):
    """Any-size video in Open-Sora 1.2's buckets (:data:`VIDEO_RESOLUTIONS` x :data:`VIDEO_ASPECTS` x
    :data:`VIDEO_FRAMES`); lengths are latent tokens (:func:`video_tokens`)."""

    def __init__(self, name: str = "video"):
        self.name = name
        self.description = ("any-size video, Open-Sora-like buckets 144p..720p x 5 aspect ratios x {1,51,102,204} "
                            "frames; tokens = (1+(f-1)//4) * H/16 * W/16 (144 .. 183,600)")

    def _shapes(self, n: int, rng: np.random.Generator) -> list[tuple[int, int, int]]:
        res = _draw(rng, {k: w for k, (_, w) in VIDEO_RESOLUTIONS.items()}, n)
        asp = _draw(rng, {k: w for k, (_, w) in VIDEO_ASPECTS.items()}, n)
        frames = _draw(rng, VIDEO_FRAMES, n)
        return [video_tokens(f, *video_pixels(r, a)) for r, a, f in zip(res, asp, frames)]

    def sample_shapes(self, n: int, seed: int) -> list[tuple[int, int, int]]:
        """``n`` latent token grids (:func:`video_tokens`); the same draw as :meth:`sample`."""
        return self._shapes(_count(n), np.random.default_rng(seed))

    def _sample(self, n: int, rng: np.random.Generator) -> Sequence[int]:
        return [f * h * w for f, h, w in self._shapes(n, rng)]


# Wan 2.1's supported training/generation sizes (height, width) in pixels (Wan-Video/Wan2.1
# SUPPORTED_SIZES: 480*832, 832*480 for T2V-1.3B; also 720*1280, 1280*720 for T2V-14B), with
# sampling weights (ours: landscape more common, 480p more than 720p).
WAN_SIZES: dict[tuple[int, int], float] = {(480, 832): 0.40, (832, 480): 0.15, (720, 1280): 0.30, (1280, 720): 0.15}
# Frame counts 4k+1 up to Wan's 81 (1 = image, trained jointly), with sampling weights (ours).
WAN_FRAMES: dict[int, float] = {1: 0.20, 17: 0.10, 33: 0.15, 49: 0.15, 65: 0.15, 81: 0.25}


class WanVideoDistribution(VideoDistribution):
    """Wan 2.1 text-to-video shapes, :data:`WAN_SIZES` x :data:`WAN_FRAMES` (81 frames = 5 s at 16 fps); lengths are
    latent tokens (:func:`video_tokens`), 1,560 (a 480p image) .. 75,600 (81 frames of 720p)."""

    def __init__(self, name: str = "wan"):
        self.name = name
        self.description = ("Wan 2.1 video: 832x480 / 1280x720 (either orientation) x {1,17,33,49,65,81} frames; "
                            "tokens = (1+(f-1)//4) * H/16 * W/16 (1,560 .. 75,600)")

    def _shapes(self, n: int, rng: np.random.Generator) -> list[tuple[int, int, int]]:
        sizes, frames = _draw(rng, WAN_SIZES, n), _draw(rng, WAN_FRAMES, n)
        return [video_tokens(f, *hw) for hw, f in zip(sizes, frames)]


def _draw(rng: np.random.Generator, weights: dict, n: int) -> list:
    """``n`` keys of ``weights`` drawn with probability proportional to their values."""
    keys, w = list(weights), list(weights.values())
    total = float(sum(w))
    return [keys[i] for i in rng.choice(len(keys), size=n, p=[x / total for x in w]).tolist()]


_TOKEN_RE = re.compile(rb"\w+|[^\w\s]")


def count_tokens(source: bytes) -> int:
    """Approximate token count of source code: identifiers/numbers and single punctuation characters."""
    return len(_TOKEN_RE.findall(source))


@functools.lru_cache(maxsize=None)
def stdlib_token_counts(root: str | None = None) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``(paths, counts)`` of the ``.py`` files under ``root`` (default: this interpreter's stdlib), sorted by path;
    ``site-packages``/``dist-packages``/``__pycache__`` skipped, unreadable and empty files left out. Cached per root
    (the first call reads ~2k files, ~1 s)."""
    root = root or sysconfig.get_paths()["stdlib"]
    paths: list[str] = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__")]
        paths.extend(os.path.join(d, f) for f in files if f.endswith(".py"))
    paths.sort()
    kept_p, kept_c = [], []
    for p in paths:
        try:
            with open(p, "rb") as fh:
                c = count_tokens(fh.read())
        except OSError:
            continue
        if c > 0:
            kept_p.append(p)
            kept_c.append(c)
    return tuple(kept_p), tuple(kept_c)


class CodeDistribution(LengthDistribution):
    """Real lengths: token counts of the Python standard library's source files, drawn with replacement."""

    def __init__(self, name: str = "code", root: str | None = None):
        self.name = name
        self.root = root
        self.description = ("real data: token counts of this interpreter's stdlib .py files (regex tokens), "
                            "files drawn with replacement")

    @property
    def counts(self) -> tuple[int, ...]:
        return stdlib_token_counts(self.root)[1]

    def _sample(self, n: int, rng: np.random.Generator) -> Sequence[int]:
        counts = self.counts
        if not counts:
            raise ValueError(f"no readable non-empty .py files under {self.root or sysconfig.get_paths()['stdlib']!r}; "
                             "pass root= pointing at a source tree")
        idx = rng.integers(0, len(counts), size=n)
        return [counts[i] for i in idx.tolist()]


DISTRIBUTIONS: dict[str, LengthDistribution] = {
    "short": MixtureDistribution("short", BANDS, MIXTURES["short"],
                                 "short-dominated (by compute): 1k-16k sequences take ~70% of the time; rare tail to 512k"),
    "balanced": MixtureDistribution("balanced", BANDS, MIXTURES["balanced"],
                                    "compute spread evenly: each band 1k-4k .. 256k-512k takes ~20% of the time"),
    "long": MixtureDistribution("long", BANDS, MIXTURES["long"],
                                "long-dominated (by compute): the ~6% of sequences over 64k take ~90% of the time"),
    "video": VideoDistribution("video"),
    "wan": WanVideoDistribution("wan"),
    "code": CodeDistribution("code"),
}


def get_distribution(name: str) -> LengthDistribution:
    """The :class:`LengthDistribution` registered as ``name``; the error lists the known names."""
    try:
        return DISTRIBUTIONS[name]
    except KeyError:
        raise ValueError(f"unknown distribution {name!r}; known distributions: {', '.join(sorted(DISTRIBUTIONS))}") from None


ATTENTION_SCALE_1D = 32768.0
"""Length at which attention time equals the rest of a Transformer-1D layer (H100, analytic model):
``default_cost(l) = l + l^2 / ATTENTION_SCALE_1D`` tracks its compute time within ~15% over 1k..512k."""


def default_cost(length: int) -> float:
    """Relative compute cost of one sequence: linear GEMM part plus quadratic attention part."""
    return length + length * length / ATTENTION_SCALE_1D


def compute_share(lengths: Sequence[int], cost: Callable[[int], float] = default_cost,
                  edges: Sequence[int] | None = None) -> list[float]:
    """Share of the total ``cost`` of ``lengths`` in each band ``[edges[i], edges[i+1])`` (default: :data:`BANDS`);
    lengths outside count in the first or last band."""
    if edges is None:
        edges = [b[0] for b in BANDS] + [BANDS[-1][1]]
    if len(edges) < 2:
        raise ValueError(f"edges must have at least two values, got {list(edges)}")
    nb = len(edges) - 1
    per = [0.0] * nb
    for n in lengths:
        i = min(max(bisect.bisect_right(edges, n) - 1, 0), nb - 1)
        per[i] += cost(n)
    total = sum(per)
    return [0.0] * nb if total <= 0 else [p / total for p in per]


def count_share(lengths: Sequence[int], edges: Sequence[int] | None = None) -> list[float]:
    """Share of the *number* of sequences in each band (same banding as :func:`compute_share`)."""
    return compute_share(lengths, cost=lambda n: 1.0, edges=edges)
