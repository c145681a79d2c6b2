"""The loss a user sees: ``train/loss`` logged under DCPStrategy equals plain training's, step by step."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger

from _dcp_helpers import SPEC, RandomPlanner, make_dataset
from _dist import run_distributed
from lightning_dcp import DCPStrategy
from lightning_dcp.models import DCPTransformerModule
from lightning_dcp.sp.packing import plain_collate
from lightning_dcp.step_loss import TRAIN_LOSS, StepLossLogging, step_loss


class MemoryLogger(Logger):
    """Keeps what Lightning logs, per rank; writes it to ``out_dir/logged_rank{r}.pt`` at the end."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((int(step or 0), {k: float(v) for k, v in metrics.items()}))

    def finalize(self, status: str) -> None:
        rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.save(self.rows, os.path.join(self.out_dir, f"logged_rank{rank}.pt"))


class RecordPlans(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.plans = out_dir, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.plans.append(batch.step.plan.to_dict())

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(self.plans, os.path.join(self.out_dir, f"plans_rank{trainer.global_rank}.pt"))


class LossModule(DCPTransformerModule):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(SPEC, lr=0.01)

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)


def _trainer(out: str, devices: int, strategy, callbacks, steps: int) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, callbacks=callbacks,
                      logger=MemoryLogger(out), log_every_n_steps=1, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def _logged(out: str, rank: int) -> list[float]:
    return [m[TRAIN_LOSS] for _, m in torch.load(os.path.join(out, f"logged_rank{rank}.pt")) if TRAIN_LOSS in m]


def _dcp_fit(rank: int, world: int, out: str, steps: int) -> None:
    """The DCPStrategy fit, on the fresh processes of a ``run_distributed`` call."""
    strategy = DCPStrategy(planner=RandomPlanner(world, seed=2, force_mix=True), global_batch_size=8)
    _trainer(out, world, strategy, [RecordPlans(out)], steps).fit(
        LossModule(), torch.utils.data.DataLoader(make_dataset(), batch_size=4))


def test_logged_train_loss_under_dcp_equals_plain_training(tmp_path):
    """2 processes, SP 1 and SP 2 items, every rank a different micro-batch count: each step's logged
    ``train/loss`` is the global mean loss -- the number a plain single-device Trainer logs for the same
    global batch (its whole batch at once), not one micro-batch's or one shard's."""
    steps = 4
    dcp_dir, plain_dir = tmp_path / "dcp", tmp_path / "plain"
    dcp_dir.mkdir(), plain_dir.mkdir()
    dataset = make_dataset()
    run_distributed(_dcp_fit, 2, str(dcp_dir), steps, timeout=600)
    plans = torch.load(dcp_dir / "plans_rank0.pt")
    assert any(len(it["ranks"]) == 2 for p in plans for it in p["items"])  # sharded items were in the run
    batches = [[s for it in p["items"] for s in it["samples"]] for p in plans]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=plain_collate)
    _trainer(str(plain_dir), 1, "auto", [], steps).fit(LossModule(), loader)
    plain = _logged(str(plain_dir), 0)
    assert len(plain) == steps
    worst = 0.0
    for rank in (0, 1):
        got = _logged(str(dcp_dir), rank)
        assert len(got) == steps
        worst = max(worst, max(abs(a - b) / abs(b) for a, b in zip(got, plain)))
    print(f"logged train/loss, DCP (2 ranks) vs plain Trainer: max rel err {worst:.2e}", flush=True)
    assert worst < 1e-5, (got, plain)


def test_step_loss_reads_what_lightning_passes():
    assert float(step_loss({"loss": torch.tensor(2.5, requires_grad=True)})) == 2.5
    assert float(step_loss(torch.tensor(1.0))) == 1.0
    assert step_loss(None) is None and step_loss({"loss": torch.ones(2)}) is None

    class Quiet(StepLossLogging, pl.LightningModule):
        train_loss_key = None

    Quiet().on_train_batch_end({"loss": torch.tensor(1.0)}, None, 0)  # logs nothing, needs no Trainer
