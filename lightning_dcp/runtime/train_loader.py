"""Building the train loader of a fit: the dataset check, the sample lengths and names, the global batch, the
:class:`~lightning_dcp.runtime.sampler.DCPBatchSampler` and the
:class:`~lightning_dcp.runtime.loader.DCPDataLoader` around the user's DataLoader.

The strategy's ``process_dataloader`` calls these in order (with the planner and the setup
agreement check between them); each takes its inputs as arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader

from lightning_dcp.runtime.lengths import resolve_lengths
from lightning_dcp.runtime.loader import DCPDataLoader
from lightning_dcp.runtime.sampler import DCPBatchSampler
from lightning_dcp.runtime.settings import DCPSettings
from lightning_dcp.runtime.support import uniform_lengths

__all__ = ["DatasetNames", "build_loader", "build_sampler", "check_not_empty", "global_batch", "global_batch_source",
           "map_style_dataset", "sample_namer", "train_lengths"]


def map_style_dataset(dataloader: DataLoader) -> Any:
    """``dataloader``'s dataset, which must allow random access by index."""
    dataset = dataloader.dataset
    if not hasattr(dataset, "__getitem__") or isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError(f"DCPStrategy needs a map-style train dataset (random access by index); got "
                         f"{type(dataset).__name__}")
    return dataset


class DatasetNames:
    """The dataset's ``sample_name(index)`` as a picklable function of the index it is given, through ``Subset``s
    (:mod:`~lightning_dcp.planning.sample_names`: what errors call a sample)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, index: int) -> str:
        dataset = self.dataset
        while isinstance(dataset, torch.utils.data.Subset):
            dataset, index = dataset.dataset, dataset.indices[index]
        return dataset.sample_name(index)


def sample_namer(dataset: Any) -> DatasetNames | None:
    """A function naming ``dataset``'s samples in errors when it (or the dataset under its ``Subset``s) has a
    ``sample_name(index)`` method (:class:`~lightning_dcp.diffusers.EncodedVideoDataset`: the clip file); else None."""
    inner = dataset
    while isinstance(inner, torch.utils.data.Subset):
        inner = inner.dataset
    return DatasetNames(dataset) if callable(getattr(inner, "sample_name", None)) else None


def train_lengths(dataset: Any, settings: DCPSettings, support: str | None) -> list[int]:
    """Every train sample's length, without loading samples (safe mode: equal lengths when none are given)."""
    if support != "safe" or settings.lengths is not None or getattr(dataset, "lengths", None) is not None:
        return resolve_lengths(dataset, settings.lengths)
    rank_zero_info(f"DCPStrategy (safe mode): {type(dataset).__name__} gives no sample lengths; treating samples as "
                   "equally long (ranks balanced by sample count). Give the dataset a `lengths` attribute or pass "
                   "DCPStrategy(lengths=...) to balance by length")
    return uniform_lengths(dataset)


def global_batch(settings: DCPSettings, per_rank: int, world_size: int,
                 accumulate: int = 1) -> tuple[int | None, int | None]:
    """(samples, tokens) per optimizer step: the settings', else the DataLoader's ``batch_size`` times the world;
    times ``accumulate`` (``Trainer(accumulate_grad_batches=...)``, :mod:`~lightning_dcp.runtime.accumulation`)."""
    gbs, gbt = settings.global_batch_size, settings.global_batch_tokens
    if gbs is None and gbt is None:
        gbs = per_rank * world_size
    return (gbs * accumulate if gbs is not None else None), (gbt * accumulate if gbt is not None else None)


def global_batch_source(settings: DCPSettings, per_rank: int, world_size: int) -> str:
    """Where :func:`global_batch` came from (before any ``x accumulate_grad_batches``), for messages."""
    if settings.global_batch_size is not None:
        return f"DCPStrategy(global_batch_size={settings.global_batch_size})"
    if settings.global_batch_tokens is not None:
        return f"DCPStrategy(global_batch_tokens={settings.global_batch_tokens})"
    return f"the DataLoader's batch_size {per_rank} x {world_size} ranks (DCPStrategy's default global batch)"


def build_sampler(lengths: list[int], planner: Any, settings: DCPSettings, *, global_batch_size: int | None,
                  global_batch_tokens: int | None, world_size: int, rank: int) -> DCPBatchSampler:
    """The fit's batch sampler: one step per item, planned by ``planner``. Says once (rank 0) how many samples an
    epoch leaves out when the last global batch is incomplete and ``drop_last`` drops it."""
    s = settings
    sampler = DCPBatchSampler(lengths, planner=planner, global_batch_size=global_batch_size,
                              global_batch_tokens=global_batch_tokens, num_replicas=world_size, rank=rank, seed=s.data_seed,
                              shuffle=s.shuffle, drop_last=s.drop_last, plan_ahead=s.plan_ahead)
    left = sampler.left_out(0)
    if left:
        which = "other samples each epoch: the order is shuffled" if s.shuffle else "the last ones"
        what = (f"global batches of {global_batch_size} samples leave {left} of {len(lengths)} samples out of every "
                f"epoch" if global_batch_size is not None else
                f"global batches of up to {global_batch_tokens} tokens leave each epoch's last, incomplete batch out "
                f"({left} of {len(lengths)} samples in epoch 0)")
        rank_zero_info(f"DCPStrategy: {what} (drop_last=True; {which}); DCPStrategy(drop_last=False) trains them as a "
                       "smaller last step")
    return sampler


def check_not_empty(sampler: DCPBatchSampler, num_samples: int, global_batch_size: int | None,
                    global_batch_tokens: int | None) -> None:
    """At least one full global batch per epoch."""
    if len(sampler) == 0:
        size = global_batch_size if global_batch_size is not None else f"{global_batch_tokens} tokens"
        raise ValueError(f"the train dataset ({num_samples} samples) gives no full global batch of {size}; lower the "
                         "global batch or set drop_last=False")


def build_loader(dataloader: DataLoader, sampler: DCPBatchSampler, support: str | None) -> DCPDataLoader:
    """The DCP train loader over ``dataloader``'s dataset, keeping its worker settings (and, in safe
    mode, its ``collate_fn``); a sample that does not load is named as the dataset names it (:func:`sample_namer`)."""
    kwargs: dict[str, Any] = {}
    if dataloader.num_workers > 0:
        kwargs.update(prefetch_factor=dataloader.prefetch_factor, persistent_workers=dataloader.persistent_workers,
                      multiprocessing_context=dataloader.multiprocessing_context)
    collate_fn = None
    if support == "safe":
        from torch.utils.data import default_collate

        collate_fn = dataloader.collate_fn or default_collate
    return DCPDataLoader(dataloader.dataset, sampler, collate_fn=collate_fn, sample_name=sample_namer(dataloader.dataset),
                         num_workers=dataloader.num_workers,
                         pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
                         worker_init_fn=dataloader.worker_init_fn, **kwargs)
