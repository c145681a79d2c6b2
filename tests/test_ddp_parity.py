"""What Lightning's hooks and ``self.log`` see under DCPStrategy, against DDPStrategy on the same global batch.

One 2-process gloo fit of each strategy on the same data order (DDP: ``DistributedSampler(shuffle=False)``, 4
samples per rank; DCP: ``shuffle=False``, the same 8 samples per step), DCP with a handcrafted plan whose ranks run
different numbers of micro-batches of different sizes (rank 0: 4 micro-batches, 5 samples; rank 1: 1 micro-batch, 3
samples). From that one run of each:

- ``on_after_backward`` (the module's and a callback's) runs once per optimizer step, as under DDP, and sees DDP's
  gradients (the reduced ones: the total norm within 1e-5), on every rank;
- ``on_before_optimizer_step`` sees the same gradients as under DDP (as before);
- ``self.log(..., sync_dist=True)`` inside ``training_step`` writes DDP's step values to the CSV logger: a mean
  loss (``reduce_fx="mean"``), a max (``"max"``) and a count (``"sum"``).

``python tests/test_ddp_parity.py`` prints the figures (grad norm in ``on_after_backward`` and the CSV train loss at
step 1, both strategies).
"""

from __future__ import annotations

import csv
import glob
import os
import sys
import tempfile
from typing import Any, Sequence

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from _dcp_helpers import regression_loader  # noqa: E402
from _dist import run_distributed  # noqa: E402
from lightning_dcp import DCPStrategy  # noqa: E402
from lightning_dcp.planning.plan import StepPlan, WorkItem  # noqa: E402

PER_RANK, WORLD, STEPS = 4, 2, 3
#: DCP's plan per step (positions in the step's 8 samples): rank 0 runs 4 micro-batches, rank 1 one.
PLAN = (((0,), (0,)), ((0,), (1, 2)), ((1,), (3, 4, 5)), ((0,), (6,)), ((0,), (7,)))


class UnevenPlanner:
    """Every step: rank 0 runs micro-batches of 1, 2, 1 and 1 samples, rank 1 one of 3 (:data:`PLAN`)."""

    one_step_per_batch = True

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        items = tuple(WorkItem(ranks, tuple(samples[i] for i in pos), tuple(lengths[i] for i in pos))
                      for ranks, pos in PLAN)
        return [StepPlan(items)]


def grad_norm(module: nn.Module) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in module.parameters()
                                                       if p.grad is not None])))


class ParityModule(pl.LightningModule):
    """An ordinary module (safe mode under DCP): MLP, mean MSE, SGD; logs three sync_dist values per step and
    records the gradients' norm in ``on_after_backward`` and ``on_before_optimizer_step``."""

    def __init__(self, ordered_ddp: bool = False) -> None:
        super().__init__()
        self.ordered_ddp = ordered_ddp
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.after_backward: list[tuple[int, float]] = []
        self.before_step: list[tuple[int, float]] = []

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self.net(x).squeeze(-1)
        loss = F.mse_loss(pred, y)
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_max_err", (pred - y).abs().max(), sync_dist=True, reduce_fx="max")
        self.log("train_samples", torch.tensor(float(len(y))), sync_dist=True, reduce_fx="sum")
        return loss

    def on_after_backward(self) -> None:
        self.after_backward.append((self.trainer.global_step, grad_norm(self)))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.before_step.append((self.trainer.global_step, grad_norm(self)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return regression_loader(self.trainer, PER_RANK, self.ordered_ddp)


class Record(pl.Callback):
    """A callback's ``on_after_backward`` (global step, grad norm), and per rank at the end what the module saw."""

    def __init__(self, out_dir: str, tag: str) -> None:
        self.out_dir, self.tag, self.after_backward = out_dir, tag, []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after_backward.append((trainer.global_step, grad_norm(pl_module)))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save({"module": pl_module.after_backward, "callback": self.after_backward,
                    "before_step": pl_module.before_step},
                   os.path.join(self.out_dir, f"{self.tag}{trainer.global_rank}.pt"))


def fit(strategy: Any, out_dir: str, tag: str, ddp: bool = False) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS,
                         callbacks=[Record(out_dir, tag)], logger=CSVLogger(out_dir, name=tag),
                         log_every_n_steps=1, use_distributed_sampler=not ddp, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(ParityModule(ordered_ddp=ddp))


def csv_rows(out_dir: str, tag: str) -> dict[int, dict[str, float]]:
    """The CSV logger's rows by step: {step: {metric: value}}."""
    (path,) = glob.glob(os.path.join(out_dir, tag, "version_*", "metrics.csv"))
    rows: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    return rows


def _ddp_then_dcp(rank: int, world: int, out_dir: str) -> None:
    """The DDP fit, then the DCP fit, on the same processes (one spawn for both)."""
    from lightning.pytorch.strategies import DDPStrategy

    fit(DDPStrategy(process_group_backend="gloo"), out_dir, "ddp", ddp=True)
    fit(DCPStrategy(planner=UnevenPlanner(), shuffle=False, seed=0, log_metrics=False), out_dir, "dcp")


def run_both(out_dir: str) -> dict[str, Any]:
    """DDP and DCP on the same global batches; what each rank's hooks saw and the CSV rows of each."""
    run_distributed(_ddp_then_dcp, WORLD, out_dir, timeout=600)
    hooks = {tag: [torch.load(os.path.join(out_dir, f"{tag}{r}.pt")) for r in range(WORLD)] for tag in ("ddp", "dcp")}
    return {"hooks": hooks, "csv": {tag: csv_rows(out_dir, tag) for tag in ("ddp", "dcp")}}


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> dict[str, Any]:
    return run_both(str(tmp_path_factory.mktemp("parity")))


def _per_step(calls: list[tuple[int, float]]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for step, norm in calls:
        out.setdefault(step, []).append(norm)
    return out


def test_on_after_backward_once_per_step_on_the_reduced_gradients(both):
    for r in range(WORLD):
        ddp, dcp = both["hooks"]["ddp"][r], both["hooks"]["dcp"][r]
        for who in ("module", "callback"):
            ddp_steps, dcp_steps = _per_step(ddp[who]), _per_step(dcp[who])
            assert sorted(ddp_steps) == sorted(dcp_steps) == list(range(STEPS)), (who, r)
            for step in range(STEPS):
                assert len(dcp_steps[step]) == len(ddp_steps[step]) == 1, (who, r, step, dcp_steps[step])
                assert dcp_steps[step][0] == pytest.approx(ddp_steps[step][0], rel=1e-5, abs=1e-7), (who, r, step)


def test_on_before_optimizer_step_sees_ddp_gradients(both):
    for r in range(WORLD):
        ddp, dcp = both["hooks"]["ddp"][r]["before_step"], both["hooks"]["dcp"][r]["before_step"]
        assert [s for s, _ in dcp] == [s for s, _ in ddp] == list(range(STEPS))
        for (_, a), (_, b) in zip(dcp, ddp):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
        # the reduced gradients are the ones on_after_backward saw (nothing changes them in between)
        assert [n for _, n in both["hooks"]["dcp"][r]["module"]] == [n for _, n in dcp]


@pytest.mark.parametrize("name", ["train_loss", "train_max_err", "train_samples"])
def test_sync_dist_step_values_equal_ddp(both, name):
    ddp, dcp = both["csv"]["ddp"], both["csv"]["dcp"]
    assert sorted(s for s in ddp if name in ddp[s]) == sorted(s for s in dcp if name in dcp[s]) == list(range(STEPS))
    for step in range(STEPS):
        assert dcp[step][name] == pytest.approx(ddp[step][name], rel=1e-5), (name, step)
    if name == "train_samples":
        assert [dcp[s][name] for s in range(STEPS)] == [WORLD * PER_RANK] * STEPS


if __name__ == "__main__":  # the figures: python tests/test_ddp_parity.py
    with tempfile.TemporaryDirectory() as d:
        res = run_both(d)
    for tag in ("ddp", "dcp"):
        h = res["hooks"][tag][0]
        print(f"{tag}: rank-0 on_after_backward grad norms at step 1 (global_step 0): "
              f"{[round(n, 4) for s, n in h['module'] if s == 0]}; on_before_optimizer_step: "
              f"{[round(n, 4) for s, n in h['before_step'] if s == 0]}")
        print(f"{tag}: CSV step 0: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(res["csv"][tag][0].items())))
