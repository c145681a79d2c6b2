"""The map-style dataset over an encode output folder: :class:`EncodedVideoDataset`.

Reads :mod:`~lightning_dcp.diffusers.shards`' index at construction (no latent opened) and checks
that every shard it names is there with its recorded size (a missing or cut-short shard is an
error naming the file and its clips, not a ``FileNotFoundError`` at the step that first reads it): ``lengths``
(video tokens per sample, what the DCP sampler plans with), ``video_shapes`` (checked against the
model at fit start) and ``shapes`` (latent patch grids). ``__getitem__`` opens the sample's shard
(safetensors, memory-mapped, only that sample's two tensors read) and returns the same
:func:`~lightning_dcp.diffusers.video_sample` dict a hand-written dataset would, so
:class:`~lightning_dcp.diffusers.VideoDiffusionModule` trains on it unchanged.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from torch.utils.data import Dataset

from lightning_dcp.diffusers.checks import VideoShape
from lightning_dcp.diffusers.samples import video_sample
from lightning_dcp.diffusers.shards import INDEX, SampleRecord, ShardRecord, read_index, read_meta

__all__ = ["EncodedSampleError", "EncodedVideoDataset"]


class EncodedSampleError(ValueError):
    """A sample of an encode output folder that cannot be read or built, naming its clip and shard."""


def _check_shards(root: Path, shards: Sequence[ShardRecord]) -> None:
    """Every shard the index names exists with its recorded size; else one error naming each bad shard and its clips."""
    bad = []
    for shard in shards:
        path = root / shard.file
        clips = ", ".join(dict.fromkeys(s.name for s in shard.samples)) or "no samples"
        if not path.is_file():
            bad.append(f"{path} is missing (shard {shard.shard}: {clips})")
        elif shard.size is not None and path.stat().st_size != shard.size:
            bad.append(f"{path} has {path.stat().st_size} bytes, the index says {shard.size} (shard {shard.shard}: "
                       f"{clips}; a copy cut short?)")
    if bad:
        raise FileNotFoundError(f"{root}: {len(bad)} of {len(shards)} shards in {INDEX} are not as encoded:\n  "
                                + "\n  ".join(bad) + "\nCopy them again from where they were encoded, or encode "
                                "into a new folder")


class EncodedVideoDataset(Dataset):
    """Samples of an encode output folder (``lightning-dcp encode`` / :func:`~lightning_dcp.diffusers.encode_videos`).

    Args:
        root: the encode output folder (its ``index.jsonl`` lists the completed shards; an encode
            still running or killed gives the samples of the shards done so far).
        patch_size: the transformer's ``config.patch_size``; default: the encode's.
        text_len: zero-pad text embeddings to this many tokens (Wan: 512); ``None`` keeps each one's length.
        sample_index: store each sample's index (``video_sample(..., index=i)``), which keys the flow-matching
            noise under a plain DataLoader. Set ``False`` when this dataset is wrapped in a ``Subset`` or
            ``ConcatDataset``: its own index is then not the DataLoader's (DCPStrategy refuses that), and
            DCPStrategy keys the noise on its sampler's index anyway.

    Sample ``i`` is the ``i``-th encoded video in index order; ``names[i]`` and ``captions[i]`` say which.
    """

    def __init__(self, root: str | Path, patch_size: Sequence[int] | None = None, text_len: int | None = 512,
                 sample_index: bool = True) -> None:
        self.root = Path(root)
        meta = read_meta(self.root)
        if meta is None:
            raise FileNotFoundError(f"{self.root} has no meta.json: not an encode output folder (lightning-dcp encode "
                                    "--out writes one)")
        self.patch_size = tuple(int(p) for p in (patch_size or meta["settings"]["patch_size"]))
        self.text_len, self.sample_index = text_len, bool(sample_index)
        self._files: list[str] = []
        self.records: list[SampleRecord] = []
        shards = read_index(self.root)
        _check_shards(self.root, shards)
        for shard in shards:
            for record in shard.samples:
                self._files.append(shard.file)
                self.records.append(record)
        pt, ph, pw = self.patch_size
        self.lengths: list[int] = [math.prod(n // p for n, p in zip(r.latent_shape[1:], (pt, ph, pw))) for r in self.records]

    @property
    def video_shapes(self) -> list[VideoShape]:
        """Each sample's latent and text shapes, from the index (no tensor read)."""
        return [VideoShape(r.latent_shape, (r.text_tokens, r.text_dim)) for r in self.records]

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """Each sample's latent ``(frames, height, width)``."""
        return [tuple(r.latent_shape[1:]) for r in self.records]  # type: ignore[misc]

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.records]

    @property
    def labels(self) -> list[str]:
        """Each sample's clip, with its window and crop when a clip gave several samples (what errors name)."""
        return [r.label for r in self.records]

    def sample_name(self, index: int) -> str:
        """Sample ``index``'s clip (:attr:`labels`): what the strategy's errors call it, e.g. a sample too long for the
        memory limit or an out-of-memory stop: ``sample 17 (clips/cat.mp4)``."""
        return self.records[index].label

    @property
    def captions(self) -> list[str]:
        return [r.caption for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def tensors(self, index: int) -> tuple[Any, Any]:
        """``(latent [C, F, H, W], text [text_tokens, text_dim])`` of sample ``index``, float32, as stored."""
        from safetensors import safe_open

        record, path = self.records[index], self.root / self._files[index]
        try:
            with safe_open(str(path), framework="pt") as fh:
                latent, text = fh.get_tensor(record.latent_key), fh.get_tensor(record.text_key)
        except Exception as err:  # noqa: BLE001 - safetensors raises OSError, SafetensorError, RuntimeError
            raise EncodedSampleError(f"sample {index} ({record.label}): cannot read it from {path}: "
                                     f"{type(err).__name__}: {err}") from err
        return latent.float(), text.float()

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} encoded videos in {self.root}")
        index = index % len(self)
        latent, text = self.tensors(index)
        try:
            return video_sample(latent, text, self.patch_size, text_len=self.text_len,
                                index=index if self.sample_index else None)
        except ValueError as err:
            raise EncodedSampleError(f"sample {index} ({self.records[index].label}, in {self.root / self._files[index]}):"
                                     f" {err}") from err
