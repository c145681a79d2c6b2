"""What ``lightning-dcp encode`` makes of each clip, said before it encodes: :func:`clip_rows`, :func:`report_lines`.

One line per sample: the clip's source size -> the frames kept -> the latent grid -> the tokens the model sees
(``(F/pt)(H/ph)(W/pw)``), computed from the probe and the settings exactly as the encode cuts it; then the spread of
tokens per sample, and a warning for every sample far larger than the rest (more than :data:`OUTLIER_RATIO` x the
median tokens): its steps run far longer (attention grows with the square of the tokens), and ``--max-area`` (or
``max_frames``) caps it. Pure Python.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from lightning_dcp.diffusers.preflight import EncodeItem
from lightning_dcp.diffusers.video_io import FrameGeometry

__all__ = ["OUTLIER_RATIO", "ClipRow", "clip_rows", "outliers", "report_lines"]

#: A sample with more than this many times the median tokens is named in a warning.
OUTLIER_RATIO = 4.0
#: Sample lines printed at most; the rest are counted (every sample is in ``index.jsonl``).
MAX_LINES = 40


@dataclass(frozen=True)
class ClipRow:
    """One sample as the encode will write it."""

    label: str
    source_size: tuple[int, int]          # width, height
    source_frames: int
    source_fps: float | None
    frames: int                           # frames kept
    fps: float | None                     # their rate (the settings' fps; else the clip's over the stride)
    size: tuple[int, int]                 # width, height after scaling and cropping
    latent: tuple[int, int, int]          # latent frames, height, width
    tokens: int

    @property
    def pixels(self) -> int:
        return self.size[0] * self.size[1]


def _label(item: EncodeItem, several_windows: bool, several_crops: bool) -> str:
    extra = ([f"segment {item.segment}"] if several_windows else []) + ([f"crop {item.crop}"] if several_crops else [])
    return item.source.name + (f" [{', '.join(extra)}]" if extra else "")


def clip_rows(items: Sequence[EncodeItem], geometry: FrameGeometry, fps: float | None = None) -> list[ClipRow]:
    """A :class:`ClipRow` per sample of ``items`` (:func:`~lightning_dcp.diffusers.preflight.plan_items`'), with the
    strides and patch of ``geometry`` and the output rate ``fps`` (``None``: each clip's own over the stride)."""
    pt, ph, pw = geometry.patch_size
    ss, ts = geometry.spatial_stride, geometry.temporal_stride
    windows = any(i.segment for i in items)
    crops = len({i.crop for i in items}) > 1
    rows = []
    for item in items:
        probe = item.probe
        width, height = (probe.width, probe.height) if probe is not None else (0, 0)
        _, _, ch, cw = geometry.size(height, width) if probe is not None else (0, 0, 0, 0)
        n = len(item.frames)
        lf = n if ts == 1 else (n - 1) // ts + 1
        lh, lw = ch // ss, cw // ss
        rate = fps if fps is not None else (probe.fps / geometry.frame_stride if probe is not None and probe.fps else None)
        rows.append(ClipRow(_label(item, windows, crops), (width, height), probe.frames if probe is not None else n,
                            probe.fps if probe is not None else None, n, rate, (cw, ch), (lf, lh, lw),
                            (lf // pt) * (lh // ph) * (lw // pw)))
    return rows


def outliers(rows: Sequence[ClipRow], ratio: float = OUTLIER_RATIO) -> list[ClipRow]:
    """The rows with more than ``ratio`` x the median tokens (none with fewer than 3 samples: no "rest" to compare)."""
    if len(rows) < 3:
        return []
    median = statistics.median(r.tokens for r in rows)
    return [r for r in rows if r.tokens > ratio * median]


def _rate(fps: float | None) -> str:
    return "" if fps is None else f" at {fps:g} fps"


def _line(row: ClipRow) -> str:
    (w, h), (cw, ch) = row.source_size, row.size
    lf, lh, lw = row.latent
    return (f"  {row.label}: {w}x{h}, {row.source_frames} frames{_rate(row.source_fps)} -> {row.frames} frames"
            f"{_rate(row.fps)}, {cw}x{ch} -> latent {lf}x{lh}x{lw} -> {row.tokens} tokens")


def _suggested_area(row: ClipRow, target_tokens: float) -> int:
    """The ``--max-area`` (pixels) that brings ``row`` to about ``target_tokens``: tokens scale with the area."""
    return max(1, int(row.pixels * target_tokens / max(1, row.tokens)))


def report_lines(rows: Sequence[ClipRow], max_lines: int = MAX_LINES) -> tuple[list[str], list[str]]:
    """``(lines, warnings)``: a line per sample (at most ``max_lines``, the rest counted) and the tokens' spread; a
    warning per sample above :data:`OUTLIER_RATIO` x the median tokens, naming ``--max-area`` with a value."""
    if not rows:
        return [], []
    lines = ["each sample: source size, frames -> frames kept, size -> latent grid (frames x height x width) -> tokens"]
    lines += [_line(r) for r in rows[:max_lines]]
    if len(rows) > max_lines:
        lines.append(f"  ... and {len(rows) - max_lines} more samples (every one is in index.jsonl once written)")
    tokens = sorted(r.tokens for r in rows)
    median = statistics.median(tokens)
    lines.append(f"tokens per sample: min {tokens[0]}, median {median:g}, max {tokens[-1]} ({len(rows)} samples)")
    warnings = []
    for r in outliers(rows):
        area = _suggested_area(r, OUTLIER_RATIO * median)
        warnings.append(f"warning: {r.label} makes {r.tokens}-token samples, {r.tokens / median:.0f}x the median "
                        f"{median:g}: a step that holds it runs far longer than the others (attention grows with the "
                        f"square of the tokens). Cap the pixels with --max-area (e.g. --max-area {area}: "
                        f"{r.size[0]}x{r.size[1]} -> about {area} pixels; smaller clips stay as they are) or the frames "
                        f"with --max-frames, or leave the clip out")
    return lines, warnings
