"""Write generated frames to an mp4 file with PyAV: :func:`write_mp4`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["write_mp4"]


def _uint8(frames: Any) -> np.ndarray:
    """``[F, H, W, 3]`` uint8 from a pipeline's ``output_type="np"`` frames (float in [0, 1]) or uint8, or a
    ``[F, H, W, 3]`` / ``[F, 3, H, W]`` torch tensor."""
    if hasattr(frames, "detach"):
        frames = frames.detach().float().cpu().numpy()
    frames = np.asarray(frames)
    if frames.ndim != 4:
        raise ValueError(f"write_mp4 takes frames [F, H, W, 3], got shape {frames.shape}")
    if frames.shape[-1] != 3 and frames.shape[1] == 3:
        frames = frames.transpose(0, 2, 3, 1)
    if frames.shape[-1] != 3:
        raise ValueError(f"write_mp4 takes RGB frames [F, H, W, 3], got shape {frames.shape}")
    if frames.dtype != np.uint8:
        frames = (np.clip(frames, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    return frames


def write_mp4(frames: Any, path: str | Path, fps: float = 16.0, codec: str = "libx264") -> Path:
    """Write ``frames`` (``[F, H, W, 3]``, float in [0, 1] or uint8) to ``path`` as H.264 in yuv420p (odd sizes
    are padded by one pixel, which yuv420p needs); ``mpeg4`` when the PyAV build lacks ``libx264``.

    Raises:
        ImportError: PyAV is not installed (naming the extra).
    """
    try:
        import av
    except ImportError as err:
        raise ImportError('writing mp4 files needs PyAV: pip install "lightning-dcp[encode]" (or pip install av)') from err
    from fractions import Fraction

    frames = _uint8(frames)
    _, h, w, _ = frames.shape
    pad_h, pad_w = h % 2, w % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    if codec not in av.codecs_available:
        codec = "mpeg4"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = w + pad_w, h + pad_h, "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
