"""Encode your own videos into training latents: :func:`encode_videos` (and ``lightning-dcp encode``).

Each video of a folder or list file (:mod:`~lightning_dcp.diffusers.sources`) is decoded with PyAV,
cut and cropped so every latent size divides by the transformer's patch size
(:mod:`~lightning_dcp.diffusers.video_io`), encoded with the model's own VAE and its caption with
the model's text encoder (:mod:`~lightning_dcp.diffusers.encoder`), and written to safetensors
shards with an index (:mod:`~lightning_dcp.diffusers.shards`) that
:class:`~lightning_dcp.diffusers.EncodedVideoDataset` reads.

First a pre-flight (:mod:`~lightning_dcp.diffusers.preflight`) probes every file and finds every
caption, and, with the VAE's strides, plans every sample (its frames: ``fps``, ``frame_stride``,
``frame_offset``, ``max_frames``, ``segments``; its ``crops``); every problem is listed at once,
before anything is encoded (``on_error="skip"``: recorded in ``meta.json`` and left out).

Resumable: shards are written atomically and indexed only when complete; rerunning the same
encode on the same folder continues at the first missing shard and gives the same shards as an
uninterrupted run (each sample depends only on its video, its caption and the models). A rerun
that would write something else is refused naming what differs (a setting, a model, the videos or
their captions); ``on_error`` changes nothing written and may differ.

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

import logging
import math
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from lightning_dcp.diffusers.encoder import VideoEncoder, config_hash
from lightning_dcp.diffusers.frames import FrameSampling
from lightning_dcp.diffusers.preflight import EncodeItem, EncodeProblem, Preflight, PreflightError, plan_items, probe_sources
from lightning_dcp.diffusers.shards import (
    INDEX, SampleRecord, ShardRecord, append_index, atomic_write_bytes, read_index, read_meta, shard_name, write_meta,
)
from lightning_dcp.diffusers.video_io import CROPS, FrameGeometry, VideoDecodeError, read_video

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "EncodeResult", "EncodeSettings", "encode_videos", "meta_differences", "stop_for_problems"]

#: ``meta.json``'s format tag (v1: before the pre-flight; readable, not resumable).
FORMAT = "lightning-dcp/encoded-videos/v2"
_ON_ERROR = ("raise", "skip")
_STORE_DTYPES = ("float32", "bfloat16", "float16")
#: Settings that change nothing written: not stored, free to differ on resume.
NEUTRAL_SETTINGS = ("on_error",)


@dataclass(frozen=True)
class EncodeSettings:
    """How videos are cut and stored.

    Attributes:
        patch_size: the transformer's ``config.patch_size``: heights and widths are cropped to multiples
            of the VAE stride x this, frame counts cut so the latent frames divide by its first entry.
        max_frames: frames per sample (after ``fps`` / ``frame_stride``); ``None``: all (Wan 2.1: 81).
        frame_stride: keep every n-th frame (without ``fps``).
        max_area: scale frames down (aspect kept) to at most this many pixels, e.g. ``480 * 832``; ``None``: as is.
        text_len: captions are truncated to this many tokens (Wan: 512).
        samples_per_shard: samples per shard file (the unit of resumption).
        on_error: ``"raise"`` (default) lists every video that cannot be encoded (no caption, cannot be decoded,
            too small or too short) and stops before encoding; ``"skip"`` records them and encodes the rest.
        store_dtype: dtype of the stored latents and embeddings.
        compute_dtype: dtype the VAE and text encoder run in.
        fps: resample every clip to this frame rate by timestamp (``None``: the clip's own frames).
        frame_offset: skip this many frames (at the output rate) at the start of each clip.
        segments: up to this many samples per clip, windows of ``max_frames`` one after another.
        crops: one sample per crop of each window: ``"center"``, ``"start"`` (top / left), ``"end"`` (bottom /
            right) of the axis that is cut; crops that cut the same pixels give one sample.
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
    fps: float | None = None
    frame_offset: int = 0
    segments: int = 1
    crops: tuple[str, ...] = ("center",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(v) for v in self.patch_size))
        object.__setattr__(self, "crops", tuple(self.crops))
        if self.on_error not in _ON_ERROR:
            raise ValueError(f"on_error must be one of {_ON_ERROR}, got {self.on_error!r}")
        if self.store_dtype not in _STORE_DTYPES:
            raise ValueError(f"store_dtype must be one of {_STORE_DTYPES}, got {self.store_dtype!r}")
        if self.samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {self.samples_per_shard}")
        if self.text_len < 1:
            raise ValueError(f"text_len must be >= 1, got {self.text_len}")
        if not self.crops or any(c not in CROPS for c in self.crops) or len(set(self.crops)) != len(self.crops):
            raise ValueError(f"crops must be distinct values of {CROPS}, got {list(self.crops)}")
        self.geometry(1, 1)  # patch size, frame and area limits: refused before anything is written
        self.sampling  # noqa: B018 - fps, stride, offset and segments likewise

    def geometry(self, spatial_stride: int, temporal_stride: int) -> FrameGeometry:
        return FrameGeometry(spatial_stride, temporal_stride, self.patch_size, self.max_frames, self.frame_stride,
                             self.max_area)

    @property
    def sampling(self) -> FrameSampling:
        return FrameSampling(self.fps, self.frame_stride, self.frame_offset, self.max_frames, self.segments)

    def stored(self) -> dict[str, Any]:
        """The settings as ``meta.json`` keeps them: those that change what is written."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k not in NEUTRAL_SETTINGS}


@dataclass(frozen=True)
class EncodeResult:
    """What :func:`encode_videos` did: the output folder, shard and sample counts, what was resumed or skipped."""

    out: Path
    shards: int
    samples: int
    resumed_shards: int
    skipped: tuple[tuple[str, str], ...] = field(default=())


def _meta(settings: EncodeSettings, encoder: VideoEncoder, pre: Preflight,
          problems: Sequence[EncodeProblem]) -> dict[str, Any]:
    info = encoder.info
    return {
        "format": FORMAT,
        "settings": settings.stored(),
        "vae": {"class": type(encoder.vae).__name__, "config_hash": config_hash(encoder.vae),
                "spatial_stride": info.spatial_stride, "temporal_stride": info.temporal_stride,
                "normalization": info.normalization},
        "text_encoder": {"class": type(encoder.text_encoder).__name__, "config_hash": config_hash(encoder.text_encoder),
                         "tokenizer": type(encoder.tokenizer).__name__},
        "sources": [[p.source.name, p.source.caption, p.probe.width, p.probe.height, p.probe.frames] for p in pre.probed],
        "skipped": [[p.name, p.reason] for p in problems],
    }


def _few(names: Sequence[str], k: int = 3) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def meta_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What differs between two encodes' ``meta.json``, in words: each setting with its two values, each model, the
    videos added, removed or changed, captions changed, videos skipped."""
    out = []
    if old.get("format") != new.get("format"):
        return [f"format {old.get('format')} (an earlier version of lightning-dcp) -> {new.get('format')}"]
    a, b = dict(old.get("settings", {})), dict(new.get("settings", {}))
    for key in sorted(set(a) | set(b)):
        if key not in NEUTRAL_SETTINGS and a.get(key) != b.get(key):
            out.append(f"setting {key}: {a.get(key)!r} -> {b.get(key)!r}")
    for part, what in (("vae", "VAE"), ("text_encoder", "text encoder")):
        if old.get(part) != new.get(part):
            x, y = old.get(part, {}), new.get(part, {})
            out.append(f"the {what}: {x.get('class')} config {x.get('config_hash')} -> {y.get('class')} config "
                       f"{y.get('config_hash')}")
    olds = {s[0]: s for s in old.get("sources", [])}
    news = {s[0]: s for s in new.get("sources", [])}
    for label, names in (("videos added", [n for n in news if n not in olds]),
                         ("videos gone", [n for n in olds if n not in news]),
                         ("captions changed", [n for n in news if n in olds and olds[n][1] != news[n][1]]),
                         ("videos changed (size or frame count)",
                          [n for n in news if n in olds and olds[n][2:] != news[n][2:]])):
        if names:
            out.append(f"{label}: {_few(names)}")
    if old.get("skipped") != new.get("skipped") and not out:
        olds_k = {n for n, _ in old.get("skipped", [])}
        news_k = {n for n, _ in new.get("skipped", [])}
        out.append(f"videos skipped: {_few(sorted(olds_k)) or 'none'} -> {_few(sorted(news_k)) or 'none'}")
    return out


def _start(out: Path, meta: dict[str, Any]) -> list[ShardRecord]:
    """Create ``out`` or check it holds the same encode; the completed shards so far."""
    out.mkdir(parents=True, exist_ok=True)
    old = read_meta(out)
    if old is None:
        if (out / INDEX).exists():
            raise ValueError(f"{out} has an {INDEX} but no meta.json: not an encode output folder; use an empty folder")
        write_meta(out, meta)
        return []
    differ = meta_differences(old, meta)
    if differ:
        raise ValueError(f"{out} holds another encode, so resuming would mix two encodes; it differs in:\n  "
                         + "\n  ".join(differ) + "\nUse a new output folder, or rerun with the same videos, captions, "
                         "models and settings")
    for stray in out.glob(".*.tmp"):  # temporary files of a killed run: never indexed, never read
        if re.fullmatch(r"\.(shard-\d+\.safetensors|index\.jsonl|meta\.json)\..*\.tmp", stray.name):
            stray.unlink()
    done = read_index(out, repair=True)
    for k, record in enumerate(done):
        if record.shard != k or not (out / record.file).is_file():
            raise ValueError(f"{out / INDEX} names shard {record.shard} ({record.file}) at position {k}, "
                             "but it is missing or out of order; delete the folder and encode again")
    return done


def _encode_one(encoder: VideoEncoder, item: EncodeItem, j: int, settings: EncodeSettings,
                geometry: FrameGeometry, texts: dict[str, Any]) -> tuple[SampleRecord, dict[str, Any]]:
    import torch

    source = item.source
    latent = encoder.encode_pixels(read_video(source.path, geometry, frames=item.frames, crop=item.crop))
    if source.caption not in texts:
        texts.clear()  # a clip's samples are consecutive: keep one caption's embeddings
        texts[source.caption] = encoder.encode_text(source.caption)
    text = texts[source.caption]
    c, f, h, w = latent.shape
    pt, ph, pw = settings.patch_size
    if f % pt or h % ph or w % pw:  # the crop rules make this impossible for VAEs with the strides we read
        raise VideoDecodeError(f"{source.path}: latent {tuple(latent.shape)} does not divide by patch "
                               f"{settings.patch_size}; the VAE's strides are not what its config says")
    dtype = getattr(torch, settings.store_dtype)
    record = SampleRecord(j, source.name, source.caption, (c, f, h, w), int(text.shape[0]), int(text.shape[1]),
                          (f // pt) * (h // ph) * (w // pw), segment=item.segment, crop=item.crop)
    return record, {record.latent_key: latent.to(dtype), record.text_key: text.to(dtype).clone()}  # own memory per key


def _write_shard(out: Path, k: int, encoder: VideoEncoder, items: Sequence[EncodeItem], settings: EncodeSettings,
                 geometry: FrameGeometry, bar: Any) -> ShardRecord:
    from safetensors.torch import save

    samples, tensors, skipped, texts = [], {}, [], {}
    first = k * settings.samples_per_shard
    for j in range(first, min(first + settings.samples_per_shard, len(items))):
        try:
            record, data = _encode_one(encoder, items[j], j, settings, geometry, texts)
        except VideoDecodeError as err:
            if settings.on_error == "raise":
                raise
            skipped.append((items[j].source.name, str(err)))
        else:
            samples.append(record)
            tensors.update(data)
        bar.update(1)
    payload = save(tensors, metadata={"format": FORMAT})
    record = ShardRecord(k, shard_name(k), tuple(samples), tuple(skipped), size=len(payload))
    atomic_write_bytes(out / record.file, payload)
    append_index(out, record)
    return record


def stop_for_problems(problems: Sequence[EncodeProblem], total: int, settings: EncodeSettings, out: str | Path,
                      *, complete: bool = True) -> None:
    """Raise :class:`PreflightError` for ``problems`` under ``on_error="raise"``, unless ``out`` holds this encode
    already and it skipped exactly these videos (a resume, whatever ``on_error`` was: nothing new to stop for).
    ``complete=False``: ``problems`` are the pre-flight's before the model's strides are known, a subset of what the
    encode will have skipped."""
    if not problems or settings.on_error != "raise":
        return
    old = read_meta(Path(out))
    recorded = [list(s) for s in (old or {}).get("skipped", [])]
    mine = [[p.name, p.reason] for p in problems]
    if old is not None and (recorded == mine if complete else all(p in recorded for p in mine)):
        return
    raise PreflightError(problems, total)


def _report(items: Sequence[EncodeItem], geometry: FrameGeometry, settings: EncodeSettings,
            report: Callable[[str], None] | None) -> None:
    from lightning_dcp.diffusers.clip_report import clip_rows, report_lines

    lines, warned = report_lines(clip_rows(items, geometry, settings.fps))
    if report is not None:
        for line in lines + warned:
            report(line)
        return
    for line in lines:
        log.info(line)
    for line in warned:
        warnings.warn(line.removeprefix("warning: "), stacklevel=3)


def encode_videos(videos: str | Path, out: str | Path, *, vae: Any, text_encoder: Any, tokenizer: Any,
                  captions: str | Path | Mapping[str, str] | None = None, settings: EncodeSettings | None = None,
                  device: str = "cpu", progress: bool = True, preflight: Preflight | None = None,
                  report: Callable[[str], None] | None = None) -> EncodeResult:
    """Encode the videos of a folder or list file into ``out`` (see the module docstring); resumes a killed run.

    Args:
        videos: a folder of videos (recursively) or a text file listing them.
        out: the output folder (created; an earlier run of the same encode there is resumed).
        vae, text_encoder, tokenizer: the model's own (``AutoencoderKLWan``, ``UMT5EncoderModel`` and its
            tokenizer for Wan).
        captions: a CSV/JSON/JSONL captions file or a ``{video: caption}`` mapping; else sidecar ``.txt`` files.
        settings: :class:`EncodeSettings`.
        device: where the VAE and the text encoder run.
        progress: show progress bars.
        preflight: the :func:`~lightning_dcp.diffusers.preflight.probe_sources` of ``videos`` and ``captions``, when
            already done (``lightning-dcp encode`` probes before it loads the models).
        report: called with each line of what the encode makes of each clip, before it encodes
            (:mod:`~lightning_dcp.diffusers.clip_report`: source size -> frames -> latent grid -> tokens, then a
            warning per sample far larger than the rest); default: the lines are logged and the warnings warned.

    Raises:
        PreflightError: videos without a caption, that cannot be decoded, or too small or short
            (``on_error="raise"``), every one named, before anything is encoded.
        VideoDecodeError: a video that stops decoding part way (``on_error="raise"``), naming it.
        ValueError: ``out`` holding a different encode, naming what differs.
    """
    from tqdm.auto import tqdm

    settings = settings or EncodeSettings()
    out = Path(out)
    pre = preflight or probe_sources(videos, captions, progress=progress)
    encoder = VideoEncoder(vae, text_encoder, tokenizer, text_len=settings.text_len, device=device,
                           dtype=settings.compute_dtype)
    geometry = settings.geometry(encoder.info.spatial_stride, encoder.info.temporal_stride)
    items, problems = plan_items(pre, geometry, settings.sampling, settings.crops)
    stop_for_problems(problems, len(pre.names), settings, out)
    _report(items, geometry, settings, report)
    done = _start(out, _meta(settings, encoder, pre, problems))
    per = settings.samples_per_shard
    total = math.ceil(len(items) / per)
    records = list(done)
    with tqdm(total=len(items), initial=min(len(done) * per, len(items)), desc="encode", unit="sample",
              disable=not progress) as bar:
        for k in range(len(done), total):
            records.append(_write_shard(out, k, encoder, items, settings, geometry, bar))
    skipped = tuple((p.name, str(p)) for p in problems) + tuple(s for r in records for s in r.skipped)
    return EncodeResult(out, len(records), sum(len(r.samples) for r in records), len(done), skipped)
