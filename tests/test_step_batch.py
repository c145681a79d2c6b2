"""The batch Lightning hooks see in safe mode (``lightning_dcp.runtime.step_batch``): a step unpacks like this
rank's samples batched in one ``collate_fn`` call; what does not join says so (the multi-process check against
DDP is ``tests/test_ddp_parity.py``)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils.data import default_collate

from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.runtime.step import MicroBatch, PreparedStep, Step
from lightning_dcp.runtime.step_batch import StepBatchError, join_batches

Pair = namedtuple("Pair", "x y")


def _samples(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [{"image": torch.randn(3, 4, 4, generator=g), "label": i, "name": f"s{i}", "pair": Pair(torch.ones(2) * i, i)}
            for i in range(n)]


def _prepared(groups: list[list[int]], collate, collated: bool = True, rank: int = 0) -> PreparedStep:
    plan = StepPlan(tuple(WorkItem((0,), tuple(g), tuple([4] * len(g))) for g in groups) + (WorkItem((1,), (99,), (4,)),))
    step = Step.build(plan, epoch=0, index=2, rank=rank, world_size=2)
    samples = _samples(100)
    mbs = tuple(MicroBatch(it, collate([samples[i] for i in it.samples]), len(it.samples), len(it.samples),
                           len(it.samples), 4) for it in step.items)
    return PreparedStep(step, mbs, collated=collated)


def test_a_safe_mode_step_unpacks_like_one_collate_call_of_its_samples():
    groups = [[5, 1], [7], [3, 2, 8]]
    whole = default_collate([_samples(100)[i] for g in groups for i in g])
    batch = _prepared(groups, default_collate)
    assert set(batch.keys()) == set(whole) and len(batch) == len(whole) and "image" in batch
    assert torch.equal(batch["image"], whole["image"]) and batch["image"].shape == (6, 3, 4, 4)
    assert torch.equal(batch["label"], whole["label"]) and batch["name"] == whole["name"] == ["s5", "s1", "s7", "s3", "s2", "s8"]
    assert isinstance(batch["pair"], Pair) and torch.equal(batch["pair"].x, whole["pair"].x)
    assert dict(batch).keys() == whole.keys() and bool(batch)
    tuples = _prepared(groups, lambda s: default_collate([(x["image"], x["label"]) for x in s]))
    x, y = tuples  # what a Lightning sample logger writes
    assert torch.equal(x, whole["image"]) and y.tolist() == [5, 1, 7, 3, 2, 8]
    one = _prepared([[4, 6]], default_collate)
    assert one.data is one.micro_batches[0].data  # one micro-batch: the batch itself, no copy


def test_what_does_not_join_names_the_field_and_the_fix():
    def pad_collate(samples):  # pads each batch to its own longest sample
        t = 2 + len(samples)
        return {"ids": torch.zeros(len(samples), t)}

    with pytest.raises(StepBatchError, match=r"batch\['ids'\]: this rank's micro-batches have shapes \(2, 4\), \(1, 3\)"
                                             r".*pad to a fixed length in collate_fn, or read .*micro_batches\[i\].data"):
        _prepared([[1, 2], [3]], pad_collate)["ids"]
    with pytest.raises(StepBatchError, match="packed shards .*batch.micro_batches"):
        iter(_prepared([[1]], default_collate, collated=False))
    with pytest.raises(StepBatchError, match="gives rank 0 no sample this step"):
        len(_prepared([], default_collate))
    with pytest.raises(StepBatchError, match="different keys"):
        join_batches([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    assert join_batches([torch.tensor(1.0), torch.tensor(2.0)]).tolist() == [1.0, 2.0]
