"""Encode your own videos into training latents: :func:`encode_videos` (and ``lightning-dcp encode``).

Each video of a folder or list file (:mod:`~lightning_dcp.diffusers.sources`) is decoded with PyAV,
cut and cropped so every latent size divides by the transformer's patch size
(:mod:`~lightning_dcp.diffusers.video_io`), encoded with the model's own VAE and its caption with
the model's text encoder (:mod:`~lightning_dcp.diffusers.encoder`), and written to safetensors
shards with an index (:mod:`~lightning_dcp.diffusers.shards`) that
:class:`~lightning_dcp.diffusers.EncodedVideoDataset` reads.

Resumable: shards are written atomically and indexed only when complete; rerunning the same
encode on the same folder continues at the first missing shard and gives the same shards as an
uninterrupted run (each sample depends only on its video, its caption and the models).

Example::

    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel
    from lightning_dcp.diffusers import EncodeSettings, encode_videos

    repo = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    encode_videos("clips/", "encoded/", vae=AutoencoderKLWan.from_pretrained(repo, subfolder="vae"),
                  text_encoder=UMT5EncoderModel.from_pretrained(repo, subfolder="text_encoder"),
                  tokenizer=AutoTokenizer.from_pretrained(repo, subfolder="tokenizer"),
                  settings=EncodeSettings(max_frames=81, max_area=480 * 832), device="cuda")
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from lightning_dcp.diffusers.encoder import VideoEncoder, config_hash
from lightning_dcp.diffusers.shards import (
    INDEX, SampleRecord, ShardRecord, append_index, atomic_write_bytes, read_index, read_meta, shard_name, write_meta,
)
from lightning_dcp.diffusers.sources import VideoSource, find_sources
from lightning_dcp.diffusers.video_io import FrameGeometry, VideoDecodeError, read_video

__all__ = ["FORMAT", "EncodeResult", "EncodeSettings", "encode_videos"]

#: ``meta.json``'s format tag.
FORMAT = "lightning-dcp/encoded-videos/v1"
_ON_ERROR = ("raise", "skip")
_STORE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EncodeSettings:
    """How videos are cut and stored.

    Attributes:
        patch_size: the transformer's ``config.patch_size``: heights and widths are cropped to multiples
            of the VAE stride x this, frame counts cut so the latent frames divide by its first entry.
        max_frames: keep at most this many frames per video (after ``frame_stride``); ``None``: all (Wan 2.1: 81).
        frame_stride: keep every n-th frame.
        max_area: scale frames down (aspect kept) to at most this many pixels, e.g. ``480 * 832``; ``None``: as is.
        text_len: captions are truncated to this many tokens (Wan: 512).
        samples_per_shard: videos per shard file (the unit of resumption).
        on_error: ``"raise"`` (default) stops at a video that cannot be decoded or is too small, naming it;
            ``"skip"`` records it in the index as skipped and goes on.
        store_dtype: dtype of the stored latents and embeddings.
        compute_dtype: dtype the VAE and text encoder run in.
    """

    patch_size: tuple[int, int, int] = (1, 2, 2)
    max_frames: int | None = None
    frame_stride: int = 1
    max_area: int | None = None
    text_len: int = 512
    samples_per_shard: int = 64
    on_error: str = "raise"
    store_dtype: str = "float32"
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(v) for v in self.patch_size))
        if self.on_error not in _ON_ERROR:
            raise ValueError(f"on_error must be one of {_ON_ERROR}, got {self.on_error!r}")
        if self.store_dtype not in _STORE_DTYPES:
            raise ValueError(f"store_dtype must be one of {_STORE_DTYPES}, got {self.store_dtype!r}")
        if self.samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {self.samples_per_shard}")
        if self.text_len < 1:
            raise ValueError(f"text_len must be >= 1, got {self.text_len}")
        self.geometry(1, 1)  # patch size, frame and area limits: refused before anything is written

    def geometry(self, spatial_stride: int, temporal_stride: int) -> FrameGeometry:
        return FrameGeometry(spatial_stride, temporal_stride, self.patch_size, self.max_frames, self.frame_stride,
                             self.max_area)


@dataclass(frozen=True)
class EncodeResult:
    """What :func:`encode_videos` did: the output folder, shard and sample counts, what was resumed or skipped."""

    out: Path
    shards: int
    samples: int
    resumed_shards: int
    skipped: tuple[tuple[str, str], ...] = field(default=())


def _meta(settings: EncodeSettings, encoder: VideoEncoder, sources: Sequence[VideoSource]) -> dict[str, Any]:
    info = encoder.info
    return {
        "format": FORMAT,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()},
        "vae": {"class": type(encoder.vae).__name__, "config_hash": config_hash(encoder.vae),
                "spatial_stride": info.spatial_stride, "temporal_stride": info.temporal_stride,
                "normalization": info.normalization},
        "text_encoder": {"class": type(encoder.text_encoder).__name__, "config_hash": config_hash(encoder.text_encoder),
                         "tokenizer": type(encoder.tokenizer).__name__},
        "sources": [[s.name, s.caption] for s in sources],
    }


def _start(out: Path, meta: dict[str, Any]) -> list[ShardRecord]:
    """Create ``out`` or check it holds the same encode; the completed shards so far."""
    out.mkdir(parents=True, exist_ok=True)
    old = read_meta(out)
    if old is None:
        if (out / INDEX).exists():
            raise ValueError(f"{out} has an {INDEX} but no meta.json: not an encode output folder; use an empty folder")
        write_meta(out, meta)
        return []
    if old != meta:
        differ = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
        raise ValueError(f"{out} holds another encode (different {', '.join(differ)}): resuming would mix them. Use a "
                         "new output folder, or rerun with the same videos, captions, models and settings")
    for stray in out.glob(".*.tmp"):  # temporary files of a killed run: never indexed, never read
        if re.fullmatch(r"\.(shard-\d+\.safetensors|index\.jsonl|meta\.json)\..*\.tmp", stray.name):
            stray.unlink()
    done = read_index(out, repair=True)
    for k, record in enumerate(done):
        if record.shard != k or not (out / record.file).is_file():
            raise ValueError(f"{out / INDEX} names shard {record.shard} ({record.file}) at position {k}, "
                             "but it is missing or out of order; delete the folder and encode again")
    return done


def _encode_one(encoder: VideoEncoder, source: VideoSource, j: int, settings: EncodeSettings,
                geometry: FrameGeometry) -> tuple[SampleRecord, dict[str, Any]]:
    import torch

    latent = encoder.encode_pixels(read_video(source.path, geometry))
    text = encoder.encode_text(source.caption)
    c, f, h, w = latent.shape
    pt, ph, pw = settings.patch_size
    if f % pt or h % ph or w % pw:  # the crop rules make this impossible for VAEs with the strides we read
        raise VideoDecodeError(f"{source.path}: latent {tuple(latent.shape)} does not divide by patch "
                               f"{settings.patch_size}; the VAE's strides are not what its config says")
    dtype = getattr(torch, settings.store_dtype)
    record = SampleRecord(j, source.name, source.caption, (c, f, h, w), int(text.shape[0]), int(text.shape[1]),
                          (f // pt) * (h // ph) * (w // pw))
    return record, {record.latent_key: latent.to(dtype), record.text_key: text.to(dtype)}


def _write_shard(out: Path, k: int, encoder: VideoEncoder, sources: Sequence[VideoSource], first: int,
                 settings: EncodeSettings, geometry: FrameGeometry, bar: Any) -> ShardRecord:
    from safetensors.torch import save

    samples, tensors, skipped = [], {}, []
    for j in range(first, min(first + settings.samples_per_shard, len(sources))):
        try:
            record, data = _encode_one(encoder, sources[j], j, settings, geometry)
        except VideoDecodeError as err:
            if settings.on_error == "raise":
                raise
            skipped.append((sources[j].name, str(err)))
        else:
            samples.append(record)
            tensors.update(data)
        bar.update(1)
    record = ShardRecord(k, shard_name(k), tuple(samples), tuple(skipped))
    atomic_write_bytes(out / record.file, save(tensors, metadata={"format": FORMAT}))
    append_index(out, record)
    return record


def encode_videos(videos: str | Path, out: str | Path, *, vae: Any, text_encoder: Any, tokenizer: Any,
                  captions: str | Path | Mapping[str, str] | None = None, settings: EncodeSettings | None = None,
                  device: str = "cpu", progress: bool = True) -> EncodeResult:
    """Encode the videos of a folder or list file into ``out`` (see the module docstring); resumes a killed run.

    Args:
        videos: a folder of videos (recursively) or a text file listing them.
        out: the output folder (created; an earlier run of the same encode there is resumed).
        vae, text_encoder, tokenizer: the model's own (``AutoencoderKLWan``, ``UMT5EncoderModel`` and its
            tokenizer for Wan).
        captions: a CSV/JSON/JSONL captions file or a ``{video: caption}`` mapping; else sidecar ``.txt`` files.
        settings: :class:`EncodeSettings`.
        device: where the VAE and the text encoder run.
        progress: show a progress bar.

    Raises:
        VideoDecodeError: a video that cannot be decoded or is too small (``on_error="raise"``), naming it.
        ValueError: a video without a caption, or ``out`` holding a different encode.
    """
    from tqdm.auto import tqdm

    settings = settings or EncodeSettings()
    out = Path(out)
    sources = find_sources(videos, captions)
    encoder = VideoEncoder(vae, text_encoder, tokenizer, text_len=settings.text_len, device=device,
                           dtype=settings.compute_dtype)
    done = _start(out, _meta(settings, encoder, sources))
    geometry = settings.geometry(encoder.info.spatial_stride, encoder.info.temporal_stride)
    per = settings.samples_per_shard
    total = math.ceil(len(sources) / per)
    records = list(done)
    with tqdm(total=len(sources), initial=min(len(done) * per, len(sources)), desc="encode", unit="video",
              disable=not progress) as bar:
        for k in range(len(done), total):
            records.append(_write_shard(out, k, encoder, sources, k * per, settings, geometry, bar))
    skipped = tuple(s for r in records for s in r.skipped)
    return EncodeResult(out, len(records), sum(len(r.samples) for r in records), len(done), skipped)
