"""Which decoded frames of a clip make its samples: :class:`FrameSampling`.

From a clip's frame timestamps (presentation order, seconds) the frames are first put at the
output rate:

* ``fps=F``: resampled by timestamp -- output frame ``k`` is the frame on screen at
  ``t_0 + k / F`` (the last frame whose timestamp is at or before it), for every ``k`` whose time
  falls inside the clip. A 30 fps clip at ``F = 10`` keeps every third frame, an 8 fps clip at
  ``F = 16`` shows each frame twice, and clips of any rate give samples of the same speed;
* else every ``frame_stride``-th decoded frame.

Then ``frame_offset`` output frames are skipped and the rest cut into ``segments`` windows of
``max_frames`` frames, one after another (``max_frames=None``: one window of everything). The
first window may be shorter (a short clip is one short sample); a later one is taken only when
full. Each window is cut to what the VAE takes (:meth:`FrameGeometry.frames_to_keep
<lightning_dcp.diffusers.video_io.FrameGeometry.frames_to_keep>`; Wan: ``4k + 1`` frames), and a
window too short for one latent patch is dropped, so a clip gives between 0 and ``segments``
samples. Pure Python.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["FrameSampling"]


@dataclass(frozen=True)
class FrameSampling:
    """How a clip's frames are chosen (see the module docstring).

    Attributes:
        fps: resample to this frame rate by timestamp; ``None`` keeps the clip's frames (with ``frame_stride``).
        frame_stride: keep every n-th decoded frame (only without ``fps``).
        frame_offset: skip this many output frames first.
        max_frames: frames per window (before the VAE cut); ``None``: all.
        segments: windows per clip, one after another, each its own sample (needs ``max_frames``).
    """

    fps: float | None = None
    frame_stride: int = 1
    frame_offset: int = 0
    max_frames: int | None = None
    segments: int = 1

    def __post_init__(self) -> None:
        if self.fps is not None and not (math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"fps must be a positive frame rate or None, got {self.fps}")
        if self.frame_stride < 1:
            raise ValueError(f"frame_stride must be >= 1, got {self.frame_stride}")
        if self.fps is not None and self.frame_stride != 1:
            raise ValueError(f"give fps ({self.fps}) or frame_stride ({self.frame_stride}), not both: fps already "
                             "picks the frames by timestamp")
        if self.frame_offset < 0:
            raise ValueError(f"frame_offset must be >= 0, got {self.frame_offset}")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max_frames must be >= 1 or None, got {self.max_frames}")
        if self.segments < 1:
            raise ValueError(f"segments must be >= 1, got {self.segments}")
        if self.segments > 1 and self.max_frames is None:
            raise ValueError(f"segments={self.segments} cuts each clip into windows of max_frames frames: set max_frames")

    def output_frames(self, times: Sequence[float]) -> list[int]:
        """Indices into ``times`` (a clip's frame timestamps, ascending) of the frames at the output rate."""
        n = len(times)
        if n == 0:
            return []
        if self.fps is None:
            return list(range(0, n, self.frame_stride))
        start = times[0]
        steps = [b - a for a, b in zip(times, times[1:]) if b > a]
        last = sorted(steps)[len(steps) // 2] if steps else 1.0 / self.fps  # the last frame shows this long
        end = times[-1] + last
        out, k = [], 0
        while True:
            t = start + k / self.fps
            if t >= end - 1e-9:
                return out
            out.append(max(0, bisect.bisect_right(times, t + 1e-9) - 1))
            k += 1

    def windows(self, times: Sequence[float], keep) -> list[list[int]]:
        """Each sample's frame indices into ``times``: up to ``segments`` windows (after the first, only full ones),
        each cut by ``keep(n)`` (the most frames of ``n`` the VAE takes, 0: none); windows the VAE takes nothing of
        are dropped."""
        frames = self.output_frames(times)[self.frame_offset:]
        size = self.max_frames or max(1, len(frames))
        out = []
        for s in range(self.segments):
            window = frames[s * size:(s + 1) * size]
            if s and len(window) < size:
                break
            n = keep(len(window))
            if n >= 1:
                out.append(window[:n])
        return out
