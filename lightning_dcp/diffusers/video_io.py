"""Read a video file into VAE-ready pixels with PyAV: :func:`probe_video` and :func:`read_video`.

:func:`probe_video` reads what a pre-flight needs without decoding the clip: its size, frame
timestamps (from the demuxed packets) and rate, and decodes its first frame only, so a file PyAV
cannot open or decode is found before any model loads.

The frames are decoded with PyAV (``pip install av``, the ``encode`` extra), every
``frame_stride``-th one kept, at most ``max_frames``; the count is cut to what the VAE's temporal
compression and the model's temporal patch take (Wan: ``4k + 1`` frames, ``k + 1`` latent frames).
Each frame is scaled down (aspect kept) to at most ``max_area`` pixels, then center-cropped to
height and width multiples of the VAE's spatial stride x the model's patch size, so every latent
size divides by the patch size (``crop``: the center, or the start or end of the cropped axis).
Pixels are returned as float ``[3, F, H, W]`` in ``[-1, 1]``. Given ``frames`` (indices in
presentation order, :class:`~lightning_dcp.diffusers.frames.FrameSampling`), exactly those frames
are returned, in that order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

__all__ = ["CROPS", "FrameGeometry", "VideoDecodeError", "VideoProbe", "probe_video", "read_video"]

#: Where a frame is cropped along the axis that is cut: its center, its start (top / left) or its end (bottom / right).
CROPS = ("center", "start", "end")


class VideoDecodeError(ValueError):
    """A video that cannot be decoded, has no frames, or is too small for the VAE and the patch size."""


@dataclass(frozen=True)
class FrameGeometry:
    """What sizes the encoder takes, from the VAE and the transformer's patch size.

    Attributes:
        spatial_stride: the VAE's spatial compression (8 for Wan 2.1's VAE, 16 for Wan 2.2 TI2V-5B's).
        temporal_stride: the VAE's temporal compression (4 for Wan: ``4k + 1`` frames make ``k + 1``
            latent frames; 1 for an image VAE applied frame by frame).
        patch_size: the transformer's ``(pt, ph, pw)``.
        max_frames: keep at most this many (strided) frames; ``None``: all.
        frame_stride: keep every ``frame_stride``-th decoded frame.
        max_area: scale frames down (aspect kept) to at most this many pixels; ``None``: keep the size.
    """

    spatial_stride: int
    temporal_stride: int
    patch_size: tuple[int, int, int] = (1, 2, 2)
    max_frames: int | None = None
    frame_stride: int = 1
    max_area: int | None = None

    def __post_init__(self) -> None:
        for name in ("spatial_stride", "temporal_stride", "frame_stride"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"patch_size must be (t, h, w) of positive ints, got {self.patch_size}")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max_frames must be >= 1 or None, got {self.max_frames}")
        if self.max_area is not None and self.max_area < 1:
            raise ValueError(f"max_area must be >= 1 pixel or None, got {self.max_area}")

    @property
    def multiples(self) -> tuple[int, int]:
        """Pixel height and width must be multiples of these: spatial stride x patch."""
        return self.spatial_stride * self.patch_size[1], self.spatial_stride * self.patch_size[2]

    def frames_to_keep(self, available: int) -> int:
        """The most frames ``<= available`` whose latent frame count divides by the temporal patch (0: none fit)."""
        ts, pt = self.temporal_stride, self.patch_size[0]
        if ts == 1:
            return available // pt * pt
        latent = (available - 1) // ts + 1 if available >= 1 else 0
        latent = latent // pt * pt
        return (latent - 1) * ts + 1 if latent >= 1 else 0

    def size(self, height: int, width: int) -> tuple[int, int, int, int]:
        """``(scaled height, scaled width, cropped height, cropped width)`` of a ``height x width`` video, or ``0``
        crops when it is too small."""
        scale = 1.0 if self.max_area is None else min(1.0, math.sqrt(self.max_area / (height * width)))
        h, w = (height, width) if scale >= 1.0 else (max(1, round(height * scale)), max(1, round(width * scale)))
        mh, mw = self.multiples
        return h, w, h // mh * mh, w // mw * mw

    def size_problem(self, width: int, height: int) -> str | None:
        """Why a ``width x height`` video is too small for one patch, or ``None``."""
        h, w, ch, cw = self.size(height, width)
        if ch >= 1 and cw >= 1:
            return None
        mh, mw = self.multiples
        scaled = f" (scaled to {w}x{h})" if (h, w) != (height, width) else ""
        return (f"{width}x{height} pixels{scaled} is smaller than one patch: height must be >= {mh} and width >= {mw} "
                f"(VAE stride {self.spatial_stride} x patch {self.patch_size[1:]}); upscale the video, raise max_area, "
                "or drop it")

    def frames_problem(self, frames: int, how: str) -> str:
        """Why ``frames`` frames (picked ``how``) make no latent patch."""
        return (f"{frames} frames ({how}) are fewer than the {self.min_frames()} one latent patch needs (VAE temporal "
                f"stride {self.temporal_stride}, patch {self.patch_size}); use a longer clip or drop it")

    def min_frames(self) -> int:
        """The fewest frames that make one temporal patch of latents."""
        pt = self.patch_size[0]
        return pt if self.temporal_stride == 1 else (pt - 1) * self.temporal_stride + 1


@dataclass(frozen=True)
class VideoProbe:
    """What :func:`probe_video` found: frame size, each frame's timestamp (seconds, presentation order), the rate."""

    width: int
    height: int
    times: tuple[float, ...]
    fps: float | None

    @property
    def frames(self) -> int:
        return len(self.times)


def _cannot_decode(path: Path, err: Exception) -> VideoDecodeError:
    return VideoDecodeError(f"{path}: cannot decode the video ({type(err).__name__}: {err}); check the file "
                            "(e.g. `ffprobe` it), re-encode it, or remove it from the inputs")


def _no_video_stream(path: Path, container) -> VideoDecodeError:
    return VideoDecodeError(f"{path}: no video stream (streams: {[s.type for s in container.streams] or 'none'}); "
                            "remove it from the inputs")


def probe_video(path: str | Path) -> VideoProbe:
    """Size, frame timestamps and rate of ``path`` from its packets, after decoding its first frame.

    Raises:
        VideoDecodeError: PyAV cannot open the file, it has no video stream, or its first frame does not decode.
    """
    import av
    from av.error import FFmpegError

    path = Path(path)
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise _no_video_stream(path, container)
            stream = container.streams.video[0]
            base = float(stream.time_base) if stream.time_base else None
            pts = [p.pts for p in container.demux(stream) if p.size and (p.pts is not None or p.dts is not None)]
            rate = float(stream.average_rate or stream.guessed_rate or 0) or None
        with av.open(str(path)) as container:
            first = next(container.decode(video=0), None)
    except VideoDecodeError:
        raise
    except (FFmpegError, OSError, ValueError, StopIteration) as err:
        raise _cannot_decode(path, err) from err
    if first is None:
        raise VideoDecodeError(f"{path}: no frames could be decoded; check the file or remove it from the inputs")
    if base is not None and all(p is not None for p in pts):
        times = tuple(sorted(p * base for p in pts))
    else:
        times = tuple(i / (rate or 25.0) for i in range(len(pts)))
    return VideoProbe(int(first.width), int(first.height), times, rate)


def _decode(path: Path, geometry: FrameGeometry, wanted: Sequence[int] | None) -> list:
    import av
    from av.error import FFmpegError

    cap, frames = geometry.max_frames, []
    keep = None if wanted is None else set(wanted)
    last = None if wanted is None else max(wanted, default=-1)
    found: dict[int, object] = {}
    decoded = 0
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise _no_video_stream(path, container)
            for n, frame in enumerate(container.decode(video=0)):
                decoded = n + 1
                if keep is not None:
                    if n in keep:
                        found[n] = frame
                    if n >= last:
                        break
                elif n % geometry.frame_stride == 0:
                    frames.append(frame)
                    if cap is not None and len(frames) >= cap:
                        break
    except VideoDecodeError:
        raise
    except (FFmpegError, OSError, ValueError) as err:
        raise _cannot_decode(path, err) from err
    if wanted is None:
        return frames
    if len(found) < len(keep):
        raise VideoDecodeError(f"{path}: {decoded} frames decoded, but the probe found frame {last}; "
                               "the file is damaged or truncated: re-encode it or remove it from the inputs")
    return [found[i] for i in wanted]


def _crop_start(excess: int, crop: str) -> int:
    return {"center": excess // 2, "start": 0, "end": excess}[crop]


def read_video(path: str | Path, geometry: FrameGeometry, frames: Sequence[int] | None = None,
               crop: str = "center") -> torch.Tensor:
    """Float pixels ``[3, F, H, W]`` in ``[-1, 1]`` of ``path``, cut and cropped as ``geometry`` says.

    ``frames``: the decoded frames to take (indices in presentation order, already cut to what the VAE takes);
    ``None``: every ``geometry.frame_stride``-th up to ``geometry.max_frames``, cut here. ``crop``: one of
    :data:`CROPS`.

    Raises:
        VideoDecodeError: the file cannot be decoded, has no frames, has fewer frames than one latent
            patch needs, or is smaller than one spatial patch -- naming the file and the sizes.
    """
    path = Path(path)
    if crop not in CROPS:
        raise ValueError(f"crop must be one of {CROPS}, got {crop!r}")
    wanted = frames
    frames = _decode(path, geometry, wanted)
    if not frames:
        raise VideoDecodeError(f"{path}: no frames could be decoded; check the file or remove it from the inputs")
    keep = geometry.frames_to_keep(len(frames)) if wanted is None else len(frames)
    if keep < 1:
        raise VideoDecodeError(f"{path}: {geometry.frames_problem(len(frames), f'frame_stride {geometry.frame_stride}')}")
    height, width = frames[0].height, frames[0].width
    h, w, ch, cw = geometry.size(height, width)
    problem = geometry.size_problem(width, height)
    if problem:
        raise VideoDecodeError(f"{path}: {problem}")
    top, left = (_crop_start(h - ch, crop), _crop_start(w - cw, crop))
    arrays = []
    for frame in frames[:keep]:
        if (frame.height, frame.width) != (height, width):
            raise VideoDecodeError(f"{path}: frame size changes mid-stream ({width}x{height} -> "
                                   f"{frame.width}x{frame.height}); re-encode it at one size")
        rgb = frame.to_ndarray(format="rgb24", width=w, height=h, interpolation="AREA") if (h, w) != (height, width) \
            else frame.to_ndarray(format="rgb24")
        arrays.append(rgb[top:top + ch, left:left + cw])
    pixels = torch.from_numpy(np.stack(arrays)).permute(3, 0, 1, 2).float()  # [3, F, H, W]
    return pixels / 127.5 - 1.0
