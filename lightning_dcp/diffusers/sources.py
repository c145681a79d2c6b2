"""Which videos to encode and their captions: :func:`find_sources`.

Videos come from a folder (every file with a video extension, recursively, sorted by relative
path) or from a list file (one path per line, relative to the list file's folder; ``#`` starts a
comment). Each video's caption is, in this order:

* its entry in a captions file (``--captions``): CSV with a ``video``/``file``/``path`` column and a
  ``caption``/``text``/``prompt`` column; JSON either ``{"clip.mp4": "a cat", ...}`` or a list of
  ``{"video": ..., "caption": ...}`` objects; JSONL one such object per line. Keys are paths relative to
  the videos' folder (or list file's folder), or bare file names when those are unique;
* a sidecar text file next to it with the same stem (``clip.mp4`` -> ``clip.txt``).

A video without a caption is an error naming it and where captions are looked for (an empty
caption is a caption: write an empty sidecar file for unconditional samples); :func:`scan_sources`
returns it with ``caption=None`` instead, for a pre-flight that lists every problem at once. Pure
Python: no torch.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

__all__ = ["VIDEO_EXTENSIONS", "VideoSource", "find_sources", "read_captions", "scan_sources"]

#: File extensions treated as videos when a folder is listed (case-insensitive).
VIDEO_EXTENSIONS = (".mp4", ".mkv", ".avi", ".mov", ".webm", ".m4v", ".mpg", ".mpeg", ".gif")

_PATH_COLUMNS = ("video", "file", "path", "filename", "file_name")
_CAPTION_COLUMNS = ("caption", "text", "prompt")


@dataclass(frozen=True)
class VideoSource:
    """One video to encode: its file, its caption and its name (the path relative to the root, as recorded in the index).

    ``caption`` is ``None`` for a video :func:`scan_sources` found no caption for (``missing`` says where it looked).
    """

    path: Path
    caption: str | None
    name: str
    missing: str = ""


def _pick(row: Mapping[str, object], names: tuple[str, ...], where: str, what: str) -> str:
    lowered = {str(k).strip().lower(): v for k, v in row.items()}
    for name in names:
        if name in lowered and lowered[name] is not None:
            return str(lowered[name])
    raise ValueError(f"{where}: no {what} column/key (one of {', '.join(names)}); got {sorted(lowered)}")


def read_captions(path: str | Path) -> dict[str, str]:
    """``{video key: caption}`` from a CSV, JSON or JSONL captions file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"captions file {path} does not exist")
    suffix = path.suffix.lower()
    rows: list[Mapping[str, object]]
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    elif suffix == ".jsonl":
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    elif suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            return {str(k): str(v) for k, v in data.items()}
        rows = data
    else:
        raise ValueError(f"captions file {path}: use .csv, .json or .jsonl, got {suffix!r}")
    out = {}
    for n, row in enumerate(rows):
        where = f"captions file {path}, row {n + 1}"
        if not isinstance(row, Mapping):
            raise ValueError(f"{where}: expected an object with a video and a caption, got {type(row).__name__}")
        key = _pick(row, _PATH_COLUMNS, where, "video path")
        out[key] = _pick(row, _CAPTION_COLUMNS, where, "caption")
    return out


def _list_videos(videos: Path) -> tuple[Path, list[Path]]:
    """``(root, video files)`` of a folder or a list file."""
    if videos.is_dir():
        files = sorted((p for p in videos.rglob("*") if p.is_file() and p.suffix.lower() in VIDEO_EXTENSIONS),
                       key=lambda p: p.relative_to(videos).as_posix())
        if not files:
            raise ValueError(f"no video files ({', '.join(VIDEO_EXTENSIONS)}) under {videos}")
        return videos, files
    if not videos.is_file():
        raise FileNotFoundError(f"{videos} is neither a folder of videos nor a list file")
    root = videos.parent
    files = []
    for line in videos.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            p = Path(line)
            files.append(p if p.is_absolute() else root / p)
    if not files:
        raise ValueError(f"list file {videos} names no videos")
    return root, files


def _name(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


def scan_sources(videos: str | Path, captions: str | Path | Mapping[str, str] | None = None) -> list[VideoSource]:
    """The videos of a folder or list file with their captions, in a fixed order (see the module docstring); a
    video without a caption has ``caption=None`` and ``missing`` says how to give it one.

    Raises:
        ValueError: no videos, or a video named twice.
    """
    root, files = _list_videos(Path(videos))
    table = dict(captions) if isinstance(captions, Mapping) else (read_captions(captions) if captions else {})
    by_file: dict[str, list[str]] = {}
    for key in table:
        by_file.setdefault(Path(key).name, []).append(key)
    out, seen = [], set()
    for path in files:
        name = _name(path, root)
        if name in seen:
            raise ValueError(f"{path} is listed twice; each video is one sample")
        seen.add(name)
        keys = [k for k in (name, path.as_posix(), str(path)) if k in table]
        if not keys and len(by_file.get(path.name, [])) == 1:
            keys = by_file[path.name]
        sidecar = path.with_suffix(".txt")
        if keys:
            out.append(VideoSource(path, table[keys[0]], name))
        elif sidecar.is_file():
            out.append(VideoSource(path, sidecar.read_text(encoding="utf-8").strip(), name))
        else:
            where = "the captions file, or " if captions else ""
            out.append(VideoSource(path, None, name, missing=(
                f"no caption: add it to {where}a sidecar file {sidecar} (an empty file for an unconditional sample), "
                "or pass a captions CSV/JSON naming it")))
    return out


def find_sources(videos: str | Path, captions: str | Path | Mapping[str, str] | None = None) -> list[VideoSource]:
    """:func:`scan_sources`, every video with a caption.

    Raises:
        ValueError: no videos, a video named twice, or videos without a caption (naming each and where captions
            are looked for).
    """
    sources = scan_sources(videos, captions)
    missing = [s for s in sources if s.caption is None]
    if missing:
        raise ValueError("\n".join(f"{s.path}: {s.missing}" for s in missing))
    return sources
