"""``self.log(..., sync_dist=True)`` values of a step, reduced once at its end (:mod:`lightning_dcp.runtime.step_logs`).

In process, on Lightning's own result collection (what ``self.log`` writes to): each "rank" is a
:class:`StepLogs` over its own collection, and the step-end collectives are played by hand (``gather`` stacks the
ranks' tables, ``gather_objects`` lists their objects). The 2-process fit against DDP is tests/test_ddp_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from lightning_dcp.planning.plan import WorkItem
from lightning_dcp.runtime.step import MicroBatch, RankItem
from lightning_dcp.runtime.step_logs import StepLogs


class Rank:
    """One rank's result collection and :class:`StepLogs`; :meth:`log` is ``self.log`` inside the loop."""

    def __init__(self) -> None:
        self.results = _ResultCollection(training=True)
        self.logs = StepLogs(lambda: self.results)

    def log(self, name: str, value: float, weight: float, on_epoch: bool = False, **kw) -> None:
        self.logs.weight = weight
        self.results.log("training_step", name, torch.tensor(value), on_step=True, on_epoch=on_epoch, sync_dist=True,
                         sync_dist_fn=self.logs.defer, batch_size=int(weight) or 1, **kw)

    def step_value(self, name: str) -> float:
        return float(self.results.metrics(on_step=True)["log"][name])


def _finish(ranks: list[Rank], allow_collective: bool = True) -> list[dict]:
    """Every rank's :meth:`StepLogs.finish`, with the step-end gather's columns and the collectives played by hand."""
    signatures = [r.logs.signature() for r in ranks]
    counts, hashes = [float(c) for c, _ in signatures], [h for _, h in signatures]
    locals_ = [r.logs.local() for r in ranks]
    tables = torch.stack([t for _, _, t in locals_]) if len({t.shape for _, _, t in locals_}) == 1 else None
    objects = [{k: (op, row.tolist()) for k, op, row in zip(keys, ops, t)} for keys, ops, t in locals_]
    calls = []

    def gather(t):
        calls.append("tensor")
        assert allow_collective
        return tables

    def gather_objects(obj):
        calls.append("objects")
        assert allow_collective
        return objects

    out = [r.logs.finish(counts, hashes, gather, gather_objects) for r in ranks]
    return out, calls


def test_a_step_value_is_the_sample_weighted_mean_over_every_micro_batch_of_every_rank():
    """Rank 0 runs 3 micro-batches (1, 2, 1 samples), rank 1 one of 4: per-sample losses 1..8."""
    losses = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    a, b = Rank(), Rank()
    for rank, chunk in ((a, losses[0:1]), (a, losses[1:3]), (a, losses[3:4]), (b, losses[4:8])):
        n = len(chunk)
        rank.log("train_loss", sum(chunk) / n, n)
        rank.log("max_err", max(chunk), n, reduce_fx="max")
        rank.log("low", min(chunk), n, reduce_fx="min")
        rank.log("samples", float(n), n, reduce_fx="sum")
    assert a.step_value("train_loss") == 4.0  # Lightning's value before the step end: the last micro-batch's
    out, calls = _finish([a, b])
    assert calls == ["tensor", "tensor"]  # the same names on every rank: one tensor all-gather
    for rank in (a, b):
        assert rank.step_value("train_loss") == pytest.approx(sum(losses) / 8)  # DDP's: mean over ranks of 4-sample means
        assert rank.step_value("max_err") == 8.0 and rank.step_value("low") == 1.0 and rank.step_value("samples") == 8.0
    assert out[0] == out[1] and out[0]["training_step.train_loss"] == pytest.approx(4.5)


def test_names_that_differ_across_ranks_are_reduced_by_name_and_a_rank_without_any_takes_part():
    a, b, idle = Rank(), Rank(), Rank()
    a.log("train_loss", 2.0, 1)
    a.log("only_a", 7.0, 1)
    b.log("train_loss", 4.0, 3)
    out, calls = _finish([a, b, idle])
    assert calls == ["objects"] * 3
    assert out[0] == out[1] == out[2]
    assert out[0]["training_step.train_loss"] == pytest.approx((2.0 + 3 * 4.0) / 4)
    assert out[0]["training_step.only_a"] == 7.0
    assert b.step_value("train_loss") == pytest.approx(3.5) and "only_a" not in b.results.metrics(on_step=True)["log"]


def test_no_sync_dist_value_means_no_collective():
    out, calls = _finish([Rank(), Rank()], allow_collective=False)
    assert out == [{}, {}] and calls == []


def test_a_shard_without_loss_tokens_does_not_count_in_a_mean():
    a, b = Rank(), Rank()
    a.log("train_loss", float("nan"), 0.0)  # weight 0: an SP shard without loss tokens (its mean is NaN)
    a.log("train_loss", 3.0, 2.0)
    b.log("train_loss", 6.0, 1.0)
    b.log("train_loss", 6.0, 0.0)
    (out, _), _ = _finish([a, b])
    assert out["training_step.train_loss"] == pytest.approx(4.0)
    c = Rank()
    c.log("train_loss", 5.0, 0.0)  # nothing but weight 0: the plain mean
    (out,), _ = _finish([c])
    assert out["training_step.train_loss"] == 5.0


def test_epoch_values_stay_lightnings_accumulation():
    a = Rank()
    a.log("train_loss", 1.0, 1, on_epoch=True)
    a.log("train_loss", 4.0, 2, on_epoch=True)
    _finish([a])
    metric = a.results["training_step.train_loss"]
    assert a.results.metrics(on_step=True)["log"]["train_loss_step"] == pytest.approx(3.0)
    assert float(metric.value) == 9.0 and int(metric.cumulated_batch_size) == 3  # epoch: sum of value x batch size


def test_an_earlier_attempt_is_forgotten():
    a = Rank()
    a.log("train_loss", 100.0, 4)
    a.logs.begin()  # the step is re-run (an out-of-memory re-plan)
    a.log("train_loss", 2.0, 4)
    (out,), _ = _finish([a])
    assert out["training_step.train_loss"] == 2.0


def test_values_that_cannot_be_matched_stay_local_and_are_warned_by_name():
    group = object()  # a process group of the user's
    a = Rank()
    a.log("train_loss", 2.0, 1)
    with pytest.warns(UserWarning, match=r"self.log\('grouped', \.\.\., sync_dist=True, sync_dist_group=\.\.\.\).*Drop "
                                         r"sync_dist_group"):
        a.log("grouped", 5.0, 1, sync_dist_group=group)
        a.log("grouped", 6.0, 1, sync_dist_group=group)
        a.logs.signature()
    t = torch.tensor(3.0)
    assert a.logs.defer(t) is t  # a direct trainer.strategy.reduce(t): no self.log key takes it
    with pytest.warns(UserWarning, match=r"trainer.strategy.reduce\(\.\.\.\) inside training_step .*returned this "
                                         r"rank's own value.*on_train_batch_end"):
        (out,), _ = _finish([a])
    assert out == {"training_step.train_loss": 2.0}
    assert a.step_value("grouped") == 6.0


def test_a_micro_batch_weighs_its_samples_split_over_its_shards_by_loss_tokens():
    def mb(ranks, samples, local, item):
        it = RankItem.of(WorkItem(ranks, samples, (4,) * len(samples)), index=0, micro_batch=0, rank=ranks[0])
        return MicroBatch(it, None, loss_units=local, local_loss_tokens=local, item_loss_tokens=item, real_tokens=local)

    assert mb((0,), (1, 2, 3), 12, 12).log_weight == 3.0
    shards = [mb((0, 1), (4, 5), 6, 8), mb((0, 1), (4, 5), 2, 8)]
    assert [s.log_weight for s in shards] == [1.5, 0.5] and math.fsum(s.log_weight for s in shards) == 2.0
    assert mb((0, 1), (4,), 0, 0).log_weight == 0.5  # an item without loss tokens: evenly
