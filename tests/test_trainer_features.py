"""Lightning features keep working under DCPStrategy on 2 CPU processes (one spawn per test: the
processes are started by ``run_distributed`` and every Trainer call runs inside them).

- fit with ``gradient_clip_val`` (clipping runs on the already-reduced gradients: the norm seen
  after clipping is <= the clip value on every rank, and it was above it before), a CSVLogger
  (the ``dcp/*`` step metrics land in ``metrics.csv``), a tqdm progress bar (``rich`` is not
  installed here) and a val dataloader; then ``validate``, ``test`` and ``predict``.
- ZeRO-1 (``DCPStrategy(zero1=True)``, AdamW): weights after 3 steps equal ``zero1=False``.
"""

from __future__ import annotations

import csv
import os

import pytest

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader

from _dcp_helpers import RandomPlanner, TinyLM, make_dataset, max_rel_err
from _dist import run_distributed
from lightning_dcp.data import plain_collate
from lightning_dcp import DCPStrategy

CLIP = 1e-3  # far below the tiny model's gradient norm, so clipping always acts


class FeatureLM(TinyLM):
    """TinyLM with eval steps and a clipping hook that checks (and records) the clipped norm."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(lr=0.01)
        self.out_dir = out_dir

    def _loss(self, batch: dict) -> torch.Tensor:
        return F.cross_entropy(self.model(batch).float(), batch["labels"], ignore_index=-100)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True, batch_size=1)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True, batch_size=1)

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(batch).argmax(-1)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        before = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        after = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        assert before > CLIP and after <= CLIP * (1 + 1e-4), (before, after)
        path = os.path.join(self.out_dir, f"clip_rank{self.global_rank}.txt")
        with open(path, "a") as f:
            f.write(f"{before} {after}\n")

    def _loader(self) -> DataLoader:
        return DataLoader(make_dataset(n=8), batch_size=2, collate_fn=plain_collate)

    val_dataloader = test_dataloader = predict_dataloader = _loader


def _trainer(strategy: DCPStrategy, max_steps: int, **kw) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, enable_checkpointing=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kw)


def _features(rank: int, world: int, out_dir: str, bar: str) -> None:
    strategy = DCPStrategy(planner=RandomPlanner(2, seed=5), global_batch_size=8, seed=2)
    trainer = _trainer(strategy, 2, gradient_clip_val=CLIP, logger=CSVLogger(out_dir, name="csv", version=0),
                       log_every_n_steps=1, callbacks=[TQDMProgressBar(refresh_rate=1) if bar == "tqdm" else RichProgressBar(refresh_rate=1)], limit_val_batches=2,
                       val_check_interval=2)
    module = FeatureLM(out_dir)
    trainer.fit(module)
    if bar == "rich":  # the user's own Rich bar in a step-bounded run: no "Epoch 0/-2"
        assert trainer.progress_bar_callback._get_train_description(0).strip() == "Epoch 0"
    lines = open(os.path.join(out_dir, f"clip_rank{rank}.txt")).read().split()
    assert len(lines) == 4, lines  # clipped at both steps
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "csv", "version_0", "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
        for key in ("dcp/imbalance", "dcp/tokens_per_s", "dcp/busy_s_max", "dcp/sp_size_max", "val_loss"):
            assert key in rows[0], (key, sorted(rows[0]))
        assert sum(1 for r in rows if r["dcp/imbalance"]) == 2
    assert "val_loss" in trainer.validate(module, verbose=False)[0]
    assert "test_loss" in trainer.test(module, verbose=False)[0]
    preds = trainer.predict(module)
    assert len(preds) == 2 and all(p.dim() == 1 for p in preds), preds  # this rank's 2 of 4 batches


@pytest.mark.parametrize("bar", ["tqdm", "rich"])
def test_fit_clip_csv_progress_bar_validate_test_predict(tmp_path, bar):
    if bar == "rich":
        pytest.importorskip("rich")
    run_distributed(_features, 2, str(tmp_path), bar)


def _zero1(rank: int, world: int) -> None:
    weights = []
    for zero1 in (False, True):
        strategy = DCPStrategy(planner=RandomPlanner(2, seed=7), global_batch_size=8, seed=3, zero1=zero1)
        module = TinyLM(lr=0.01, optimizer="adamw")
        trainer = _trainer(strategy, 3, logger=False, enable_progress_bar=False)
        trainer.fit(module)
        assert isinstance(trainer.optimizers[0], ZeroRedundancyOptimizer) == zero1, trainer.optimizers
        weights.append({k: v.detach().clone() for k, v in module.state_dict().items()})
    init = TinyLM().state_dict()
    for name, w in weights[0].items():
        assert max_rel_err(weights[1][name], w) < 1e-6, name
        if name.endswith("weight"):
            assert max_rel_err(w, init[name]) > 1e-4, name  # training moved it


def test_zero1_equals_plain_adamw():
    """ZeRO-1 (sharded AdamW state) after 3 steps gives the same weights as unsharded AdamW."""
    run_distributed(_zero1, 2)
