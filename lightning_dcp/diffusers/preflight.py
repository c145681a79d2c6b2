"""The encode pre-flight: every clip probed and captioned before any model loads, every problem listed at once.

:func:`probe_sources` finds the videos and their captions (:func:`~lightning_dcp.diffusers.sources.scan_sources`)
and probes each file with PyAV (:func:`~lightning_dcp.diffusers.video_io.probe_video`: opens it, reads its
packets' timestamps, decodes its first frame). :func:`plan_items` then turns the clips into samples once the
VAE's strides are known -- the frames of each (:class:`~lightning_dcp.diffusers.frames.FrameSampling`) and its
crop -- and adds the clips too small or too short for one latent patch to the problems. Nothing is decoded
beyond first frames, so a folder of long clips is checked in seconds, and a corrupt file, a missing caption and
a clip too small are all reported before the first one is encoded (:class:`PreflightError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from lightning_dcp.diffusers.frames import FrameSampling
from lightning_dcp.diffusers.sources import VideoSource, scan_sources
from lightning_dcp.diffusers.video_io import CROPS, FrameGeometry, VideoDecodeError, VideoProbe, probe_video

__all__ = ["EncodeItem", "EncodeProblem", "Preflight", "PreflightError", "ProbedSource", "plan_items", "probe_sources"]


@dataclass(frozen=True)
class EncodeProblem:
    """Why one video cannot be encoded: its name (relative path, as the index records it), file and the reason."""

    name: str
    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True)
class ProbedSource:
    """A captioned video PyAV can decode, and what its probe found."""

    source: VideoSource
    probe: VideoProbe


@dataclass(frozen=True)
class EncodeItem:
    """One sample to encode: a clip, which of its windows (``segment``) and ``crop``, and its decoded frames."""

    source: VideoSource
    segment: int
    crop: str
    frames: tuple[int, ...]
    probe: VideoProbe | None = None  # the clip's probe (its size, frames and rate), for the encode's report


@dataclass(frozen=True)
class Preflight:
    """The clips that probed cleanly, the problems of the others, and every video's name (in the videos' order)."""

    probed: tuple[ProbedSource, ...]
    problems: tuple[EncodeProblem, ...]
    names: tuple[str, ...]


class PreflightError(VideoDecodeError):
    """Videos that cannot be encoded, every one named, found before anything is encoded or written."""

    def __init__(self, problems: Sequence[EncodeProblem], total: int) -> None:
        self.problems = tuple(problems)
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} of {total} videos cannot be encoded (nothing was encoded; "
                         f"--on-error skip / on_error='skip' records them in the index and encodes the rest):\n{lines}")


def probe_sources(videos: str | Path, captions: str | Path | Mapping[str, str] | None = None, *,
                  progress: bool = False) -> Preflight:
    """Find every video and its caption and probe every file (see the module docstring); no model is needed.

    Raises:
        ValueError: no videos, or a video named twice.
    """
    from tqdm.auto import tqdm

    probed, problems = [], []
    sources = scan_sources(videos, captions)
    for source in tqdm(sources, desc="probe", unit="video", disable=not progress):
        reasons = [source.missing] if source.caption is None else []
        try:
            probe = probe_video(source.path)
        except VideoDecodeError as err:
            reasons.append(str(err).removeprefix(f"{source.path}: "))
        if reasons:
            problems.append(EncodeProblem(source.name, source.path, "; ".join(reasons)))
        else:
            probed.append(ProbedSource(source, probe))
    return Preflight(tuple(probed), tuple(problems), tuple(s.name for s in sources))


def _distinct_crops(probe: VideoProbe, geometry: FrameGeometry, crops: Sequence[str]) -> list[str]:
    """``crops`` without the ones that cut the same pixels as an earlier one (a clip that fits needs one)."""
    h, w, ch, cw = geometry.size(probe.height, probe.width)
    seen, out = set(), []
    for crop in crops:
        offsets = tuple({"center": e // 2, "start": 0, "end": e}[crop] for e in (h - ch, w - cw))
        if offsets not in seen:
            seen.add(offsets)
            out.append(crop)
    return out


def plan_items(preflight: Preflight, geometry: FrameGeometry, sampling: FrameSampling,
               crops: Sequence[str] = ("center",)) -> tuple[list[EncodeItem], list[EncodeProblem]]:
    """The samples to encode, clip by clip, window by window, crop by crop; and every problem: the pre-flight's
    plus the clips too small or too short for one latent patch."""
    bad = [c for c in crops if c not in CROPS]
    if bad or not crops:
        raise ValueError(f"crops must be one or more of {CROPS}, got {list(crops)}")
    items, problems = [], list(preflight.problems)
    for entry in preflight.probed:
        source, probe = entry.source, entry.probe
        small = geometry.size_problem(probe.width, probe.height)
        windows = sampling.windows(probe.times, geometry.frames_to_keep)
        if small or not windows:
            how = f"at {sampling.fps:g} fps" if sampling.fps else f"frame_stride {sampling.frame_stride}"
            picked = len(sampling.output_frames(probe.times)[sampling.frame_offset:][:sampling.max_frames])
            offset = f", frame_offset {sampling.frame_offset}" if sampling.frame_offset else ""
            problems.append(EncodeProblem(source.name, source.path, small or geometry.frames_problem(
                picked, f"{how}{offset}, of {probe.frames} in the file")))
            continue
        for segment, frames in enumerate(windows):
            for crop in _distinct_crops(probe, geometry, crops):
                items.append(EncodeItem(source, segment, crop, tuple(frames), probe))
    order = {name: k for k, name in enumerate(preflight.names)}
    problems.sort(key=lambda p: order[p.name])
    return items, problems
