"""Read a video file into VAE-ready pixels with PyAV: :func:`read_video`.

The frames are decoded with PyAV (``pip install av``, the ``encode`` extra), every
``frame_stride``-th one kept, at most ``max_frames``; the count is cut to what the VAE's temporal
compression and the model's temporal patch take (Wan: ``4k + 1`` frames, ``k + 1`` latent frames).
Each frame is scaled down (aspect kept) to at most ``max_area`` pixels, then center-cropped to
height and width multiples of the VAE's spatial stride x the model's patch size, so every latent
size divides by the patch size. Pixels are returned as float ``[3, F, H, W]`` in ``[-1, 1]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["FrameGeometry", "VideoDecodeError", "read_video"]


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

    def min_frames(self) -> int:
        """The fewest frames that make one temporal patch of latents."""
        pt = self.patch_size[0]
        return pt if self.temporal_stride == 1 else (pt - 1) * self.temporal_stride + 1


def _decode(path: Path, geometry: FrameGeometry) -> list:
    import av
    from av.error import FFmpegError

    cap, frames = geometry.max_frames, []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoDecodeError(f"{path}: no video stream (streams: "
                                       f"{[s.type for s in container.streams] or 'none'}); remove it from the inputs")
            for n, frame in enumerate(container.decode(video=0)):
                if n % geometry.frame_stride == 0:
                    frames.append(frame)
                    if cap is not None and len(frames) >= cap:
                        break
    except VideoDecodeError:
        raise
    except (FFmpegError, OSError, ValueError) as err:
        raise VideoDecodeError(f"{path}: cannot decode the video ({type(err).__name__}: {err}); check the file "
                               "(e.g. `ffprobe` it), re-encode it, or remove it from the inputs") from err
    return frames


def read_video(path: str | Path, geometry: FrameGeometry) -> torch.Tensor:
    """Float pixels ``[3, F, H, W]`` in ``[-1, 1]`` of ``path``, cut and cropped as ``geometry`` says.

    Raises:
        VideoDecodeError: the file cannot be decoded, has no frames, has fewer frames than one latent
            patch needs, or is smaller than one spatial patch -- naming the file and the sizes.
    """
    path = Path(path)
    frames = _decode(path, geometry)
    if not frames:
        raise VideoDecodeError(f"{path}: no frames could be decoded; check the file or remove it from the inputs")
    keep = geometry.frames_to_keep(len(frames))
    if keep < 1:
        raise VideoDecodeError(f"{path}: {len(frames)} frames (frame_stride {geometry.frame_stride}) are fewer than "
                               f"the {geometry.min_frames()} one latent patch needs (VAE temporal stride "
                               f"{geometry.temporal_stride}, patch {geometry.patch_size}); use a longer clip or drop it")
    height, width = frames[0].height, frames[0].width
    h, w, ch, cw = geometry.size(height, width)
    if ch < 1 or cw < 1:
        mh, mw = geometry.multiples
        raise VideoDecodeError(f"{path}: {width}x{height} pixels{f' (scaled to {w}x{h})' if (h, w) != (height, width) else ''}"
                               f" is smaller than one patch: height must be >= {mh} and width >= {mw} (VAE stride "
                               f"{geometry.spatial_stride} x patch {geometry.patch_size[1:]}); upscale the video, raise "
                               "max_area, or drop it")
    top, left = (h - ch) // 2, (w - cw) // 2
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
