"""The on-disk layout of encoded videos: shards, their index, and crash-safe writes.

An encode output folder holds:

* ``meta.json`` -- the encode settings and the list of source videos (written once, atomically);
  a rerun with other settings or other videos is refused, so a resumed encode is the same encode;
* ``shard-000000.safetensors``, ... -- shard ``k`` holds samples
  ``[k * samples_per_shard, (k + 1) * samples_per_shard)`` of the encode's plan (each clip's
  windows and crops, clip by clip): for sample ``j``, the tensors ``"{j}.latents"``
  ``[C, F, H, W]`` and ``"{j}.text"`` ``[text_tokens, text_dim]``;
* ``index.jsonl`` -- one line per *completed* shard: its file, its size in bytes, and each
  sample's video, caption, window and crop, latent shape, text length and video tokens
  (:class:`ShardRecord`).

A shard is written to a temporary name, fsynced, renamed into place (atomic), and the folder
fsynced, before its index line is appended (and fsynced). So the index never names a half-written
shard, and an encode killed at any point resumes at the first shard the index does not name (a
torn last index line is dropped and rewritten). Pure Python apart from the tensor writer.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["INDEX", "META", "SampleRecord", "ShardRecord", "append_index", "atomic_write_bytes", "read_index",
           "read_meta", "shard_name", "write_meta"]

INDEX = "index.jsonl"
META = "meta.json"


@dataclass(frozen=True)
class SampleRecord:
    """One encoded video as the index records it (no tensor needed to read it)."""

    source: int  # the sample's position in the encode's plan (its tensors' key; with one sample per clip, the clip's)
    name: str  # the video's path relative to the input root
    caption: str
    latent_shape: tuple[int, int, int, int]  # [C, F, H, W]
    text_tokens: int
    text_dim: int
    tokens: int  # video tokens at the encode's patch size
    segment: int = 0  # which window of the clip (EncodeSettings.segments)
    crop: str = "center"  # which crop (EncodeSettings.crops)

    @property
    def label(self) -> str:
        """The video's name, with its window and crop when they are not the first / center."""
        extra = [f"segment {self.segment}"] * (self.segment != 0) + [f"crop {self.crop}"] * (self.crop != "center")
        return f"{self.name} ({', '.join(extra)})" if extra else self.name

    @property
    def latent_key(self) -> str:
        return f"{self.source}.latents"

    @property
    def text_key(self) -> str:
        return f"{self.source}.text"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SampleRecord:
        return cls(int(d["source"]), str(d["name"]), str(d["caption"]), tuple(int(v) for v in d["latent_shape"]),
                   int(d["text_tokens"]), int(d["text_dim"]), int(d["tokens"]), int(d.get("segment", 0)),
                   str(d.get("crop", "center")))


@dataclass(frozen=True)
class ShardRecord:
    """A completed shard: its file name, its samples, the videos that failed to decode part way (``on_error="skip"``),
    and its size in bytes (``None`` in indexes written before sizes were recorded)."""

    shard: int
    file: str
    samples: tuple[SampleRecord, ...]
    skipped: tuple[tuple[str, str], ...] = field(default=())  # (name, error)
    size: int | None = None

    def to_json(self) -> str:
        d = {"shard": self.shard, "file": self.file, "samples": [asdict(s) for s in self.samples],
             "skipped": [list(s) for s in self.skipped]}
        if self.size is not None:
            d["size"] = self.size
        return json.dumps(d, sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardRecord:
        return cls(int(d["shard"]), str(d["file"]), tuple(SampleRecord.from_dict(s) for s in d["samples"]),
                   tuple((str(a), str(b)) for a, b in d.get("skipped", ())),
                   None if d.get("size") is None else int(d["size"]))


def shard_name(k: int) -> str:
    return f"shard-{k:06d}.safetensors"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``: temporary file in the same folder, fsync, rename, fsync the folder."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def write_meta(out: Path, meta: Mapping[str, Any]) -> None:
    atomic_write_bytes(Path(out) / META, (json.dumps(meta, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode())


def read_meta(out: Path) -> dict[str, Any] | None:
    path = Path(out) / META
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def read_index(out: Path, *, repair: bool = False) -> list[ShardRecord]:
    """The completed shards of ``out`` in order. A torn last line (a crash while appending) is ignored, and
    with ``repair=True`` removed from the file; a bad line before the last one raises, naming the line."""
    path = Path(out) / INDEX
    if not path.is_file():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    records, good_bytes = [], 0
    for n, line in enumerate(lines):
        if not line.strip():
            good_bytes += len(line) + 1
            continue
        last = all(not rest.strip() for rest in lines[n + 1:])
        try:
            record = ShardRecord.from_dict(json.loads(line))
        except (ValueError, KeyError, TypeError) as err:
            if last and not raw.endswith(b"\n"):
                break  # torn by a crash mid-append: the shard is redone
            raise ValueError(f"{path}, line {n + 1}: not an index record ({err}); the index is damaged: delete "
                             f"{Path(out)} and encode again") from err
        records.append(record)
        good_bytes += len(line) + 1
    if repair and good_bytes < len(raw):
        atomic_write_bytes(path, raw[:good_bytes])
    return records


def append_index(out: Path, record: ShardRecord) -> None:
    """Append ``record``'s line to the index and fsync it (after its shard is in place)."""
    path = Path(out) / INDEX
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(record.to_json() + "\n")
        fh.flush()
        os.fsync(fh.fileno())
