"""The train DataLoader the strategy builds: it loads and packs each step's micro-batches.

:class:`DCPDataLoader` iterates a :class:`~lightning_dcp.runtime.sampler.DCPBatchSampler`, which
yields one :class:`~lightning_dcp.runtime.step.Step` per optimizer step; :class:`StepDataset` turns
a step into this rank's micro-batches -- samples loaded with ``dataset[i]`` (in worker processes
when ``num_workers > 0``) and packed with :func:`~lightning_dcp.sp.packing.pack_samples` (or, in
safe mode, collated by the user's own ``collate_fn``). A training batch is a
:class:`~lightning_dcp.runtime.step.LoadedStep`; the strategy shards and runs it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from torch.utils.data import DataLoader, Dataset

from lightning_dcp.planning.sample_names import SampleNamer, name_sample
from lightning_dcp.runtime.sampler import DCPBatchSampler
from lightning_dcp.runtime.step import LoadedStep, RankItem, Step
from lightning_dcp.sp.packing import pack_samples, sample_length
from lightning_dcp.sp.tokens import pad_multiple

__all__ = ["DCPDataLoader", "StepDataset", "collate_step"]


class StepDataset(Dataset):
    """Wraps the user's map-style dataset: ``ds[step]`` loads and builds a step's micro-batches.

    Each item's samples are loaded with ``dataset[i]`` and packed with
    :func:`lightning_dcp.sp.packing.pack_samples` (``pad_to_multiple`` = the item's SP size, twice it for a ring item); with
    ``collate_fn`` (safe mode, see :mod:`lightning_dcp.runtime.support`) they are collated by it instead,
    exactly as the user's own DataLoader would batch them.
    """

    def __init__(self, dataset: Any, pad_values: Mapping[str, Any] | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None, sample_name: SampleNamer | None = None) -> None:
        self.dataset = dataset
        self.pad_values = pad_values
        self.collate_fn = collate_fn
        self.sample_name = sample_name
        """Names a dataset index in errors (the dataset's ``sample_name``; ``None``: the index alone)."""

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, step: Step) -> LoadedStep:
        return LoadedStep(step, tuple(self.load_item(item) for item in step.items))

    def load_item(self, item: RankItem) -> Any:
        """One work item's samples, loaded and packed (or collated by ``collate_fn``)."""
        samples = [self.dataset[i] for i in item.samples]
        if self.collate_fn is not None:
            return self.collate_fn(samples)
        for i, s, n in zip(item.samples, samples, item.lengths):
            if not isinstance(s, Mapping):
                raise TypeError(f"{name_sample(i, self.sample_name)} is a {type(s).__name__}, but packing needs dict "
                                "samples (tensors with the token dimension first); return a dict from __getitem__, or let the "
                                "strategy run the module in safe mode (DCPStrategy(support='safe')), which "
                                "batches samples with your DataLoader's collate_fn")
            got = sample_length(s)
            if got != n:
                raise ValueError(f"{name_sample(i, self.sample_name)} has {got} tokens but its length is given as {n}; "
                                 "the dataset's `lengths` must match what __getitem__ returns")
        return pack_samples(samples, pad_to_multiple=pad_multiple(item.sp_size, item.ring), pad_values=self.pad_values,
                            sample_indices=list(item.samples))


def collate_step(batch: Sequence[LoadedStep]) -> LoadedStep:
    """The batch sampler yields one step at a time, so a batch is that one loaded step."""
    if len(batch) != 1:
        raise ValueError(f"a DCP batch holds exactly one step, got {len(batch)}")
    return batch[0]


class DCPDataLoader(DataLoader):
    """A DataLoader over a :class:`DCPBatchSampler`, stateful for Lightning's mid-epoch resume.

    Lightning saves a train dataloader's state only if the dataloader itself has
    ``state_dict``/``load_state_dict`` (``_Stateful``); this one forwards to the batch sampler.
    """

    def __init__(self, dataset: Any, batch_sampler: DCPBatchSampler, *, pad_values: Mapping[str, Any] | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0, pin_memory: bool = False,
                 sample_name: SampleNamer | None = None, **kwargs: Any) -> None:
        self.dcp_sampler = batch_sampler
        self.source_dataset = dataset
        if num_workers == 0:
            kwargs.pop("prefetch_factor", None)
            kwargs.pop("persistent_workers", None)
        super().__init__(StepDataset(dataset, pad_values, collate_fn, sample_name), batch_sampler=batch_sampler,
                         collate_fn=collate_step, num_workers=num_workers, pin_memory=pin_memory, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.dcp_sampler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.dcp_sampler.load_state_dict(state_dict)
