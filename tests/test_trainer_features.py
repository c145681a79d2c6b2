"""Lightning features keep working under DCPStrategy on 2 CPU processes (the default run's tests on one spawn: the
processes are started by ``run_distributed`` and every Trainer call runs inside them).

- fit with ``gradient_clip_val`` (clipping runs on the already-reduced gradients: the norm seen
  after clipping is <= the clip value on every rank, and it was above it before), a CSVLogger
  (the ``dcp/*`` step metrics land in ``metrics.csv``), a tqdm progress bar (``rich`` is not
  installed here) and a val dataloader; then ``validate``, ``test`` and ``predict``.
- ZeRO-1 (``DCPStrategy(zero1=True)``, AdamW): weights after 3 steps equal ``zero1=False``.
- Against ``DDPStrategy`` on the same data order, in one spawn (issue #35; the rows of docs/strategy.md's
  "Lightning features" table name these tests): a LightningDataModule, ``limit_*_batches``, an epoch LR
  scheduler with LearningRateMonitor, EarlyStopping, a best-``val_loss`` ModelCheckpoint, CSV and TensorBoard
  loggers, a callback reading ``x, y = batch``, the gradients ``on_before_optimizer_step`` and
  ``on_after_backward`` see; then a second fit of each under ``precision="bf16-mixed"``.
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
from torch.utils.data import DataLoader, DistributedSampler

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
def test_fit_clip_csv_progress_bar_validate_test_predict(tmp_path, request, bar):
    if bar == "tqdm":  # its run: _features on two_process_runs' spawn
        _assert_done(request.getfixturevalue("two_process_runs"), "features-tqdm")
        return
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


def test_zero1_equals_plain_adamw(two_process_runs):
    """ZeRO-1 (sharded AdamW state) after 3 steps gives the same weights as unsharded AdamW."""
    _assert_done(two_process_runs, "zero1")  # its run: _zero1 on two_process_runs' spawn


# ---------------------------------------------------------------- the features the issue checked against DDP (#35)
PER = 3  # DDP's batch per rank: global batches of 6 on 2 ranks; 48 samples, 8 steps per epoch, 4 of them run


class FeatureData(pl.LightningDataModule):
    """A DataModule; for DDP the train loader deals the samples in order (``DistributedSampler(shuffle=False)``:
    rank r gets r, r + 2, ...), the data order of DCPStrategy(shuffle=False)'s global batches."""

    def __init__(self, ordered_ddp: bool) -> None:
        super().__init__()
        self.ordered_ddp = ordered_ddp
        g = torch.Generator().manual_seed(4)
        x = torch.randn(64, 6, generator=g)
        self.train_set = torch.utils.data.TensorDataset(x[:48], x[:48].sum(1) * 0.3 + x[:48, 0] ** 2)
        self.val_set = torch.utils.data.TensorDataset(x[48:], x[48:].sum(1) * 0.3 + x[48:, 0] ** 2)

    def train_dataloader(self) -> DataLoader:
        if self.ordered_ddp:
            sampler = DistributedSampler(self.train_set, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
            return DataLoader(self.train_set, batch_size=PER, sampler=sampler)
        return DataLoader(self.train_set, batch_size=PER)

    def val_dataloader(self) -> DataLoader:  # the same ranks' halves under both strategies
        sampler = DistributedSampler(self.val_set, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(self.val_set, batch_size=4, sampler=sampler)


class FeatureRegressor(pl.LightningModule):
    """An ordinary module (safe mode under DCP): MLP, mean MSE, SGD with momentum, an epoch StepLR."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.autocast: list[bool] = []

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x).squeeze(-1)
        self.autocast.append(out.dtype == torch.bfloat16)
        return F.mse_loss(out.float(), y)

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x).squeeze(-1).float(), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.6)}


def _grad_norm(module: pl.LightningModule) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()])))


class HookRecord(pl.Callback):
    """Per step on this rank: the labels of the batch a callback reads (``x, y = batch``), the calls of
    ``on_after_backward`` and the last grad norm it saw, the grad norm ``on_before_optimizer_step`` sees."""

    def __init__(self) -> None:
        self.labels: list[list[float]] = []
        self.after_backward: list[tuple[int, float]] = []
        self.before_step: list[float] = []
        self._calls, self._last = 0, 0.0

    def on_after_backward(self, trainer, pl_module) -> None:
        self._calls, self._last = self._calls + 1, _grad_norm(pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before_step.append(_grad_norm(pl_module))
        self.after_backward.append((self._calls, self._last))
        self._calls = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        x, y = batch  # what a sample logger does
        assert x.shape == (len(y), 6)
        self.labels.append(y.tolist())


def _feature_fit(strategy, out_dir: str, tag: str, ddp: bool, epochs: int = 12, **kw) -> tuple[pl.Trainer, FeatureRegressor, dict]:
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    stop = EarlyStopping(monitor="val_loss", min_delta=0.02, patience=1)
    best = ModelCheckpoint(dirpath=os.path.join(out_dir, tag, "ckpt"), monitor="val_loss", save_top_k=1)
    loggers = [CSVLogger(out_dir, name=tag, version=0), TensorBoardLogger(out_dir, name=f"{tag}_tb", version=0)]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, limit_train_batches=4,
                         limit_val_batches=2, log_every_n_steps=1, logger=loggers, use_distributed_sampler=not ddp,
                         callbacks=[stop, best, LearningRateMonitor(logging_interval="step"), HookRecord()],
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)
    module = FeatureRegressor()
    trainer.fit(module, datamodule=FeatureData(ordered_ddp=ddp))
    hooks = next(c for c in trainer.callbacks if isinstance(c, HookRecord))
    ranks = [None] * trainer.world_size
    dist.all_gather_object(ranks, (hooks.labels, hooks.after_backward, hooks.before_step))
    labels = [sorted(sum((r[0][k] for r in ranks), [])) for k in range(len(hooks.labels))]  # the step's union
    seen = {"labels": labels, "after_backward": [r[1] for r in ranks], "before_step": [r[2] for r in ranks]}
    seen |= {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "stopped_epoch": stop.stopped_epoch,
            "best": os.path.basename(best.best_model_path), "best_score": float(best.best_model_score)}
    return trainer, module, seen


def _scalars(out_dir: str, tag: str) -> dict:
    """``{name: [(step, value), ...]}`` from the CSV and the TensorBoard logs of run ``tag`` (rank 0 writes them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open(os.path.join(out_dir, tag, "version_0", "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    csv_series = {k: [(int(r["step"]), float(r[k])) for r in rows if r.get(k)] for k in ("lr-SGD", "val_loss")}
    events = EventAccumulator(os.path.join(out_dir, f"{tag}_tb", "version_0"))
    events.Reload()
    tb_series = {k: [(e.step, e.value) for e in events.Scalars(k)] for k in ("lr-SGD", "val_loss")}
    return {"csv": csv_series, "tb": tb_series}


def _close(a: dict, b: dict, tol: float) -> None:
    for name in b:
        assert max_rel_err(a[name], b[name]) < tol, name


def _against_ddp(rank: int, world: int, out_dir: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    ddp = lambda: DDPStrategy(process_group_backend="gloo")  # noqa: E731
    dcp = lambda: DCPStrategy(shuffle=False, seed=0)  # noqa: E731
    _, m_ddp, s_ddp = _feature_fit(ddp(), out_dir, "ddp", ddp=True)
    trainer, m_dcp, s_dcp = _feature_fit(dcp(), out_dir, "dcp", ddp=False)
    assert s_dcp["best_score"] == pytest.approx(s_ddp.pop("best_score"), rel=1e-5)
    for r in range(world):  # grad norms a callback logs: DDP's in on_before_optimizer_step
        assert s_dcp["before_step"][r] == pytest.approx(s_ddp["before_step"][r], rel=1e-5)
    # on_after_backward (#35 item 4): under both, once per step on the reduced gradients (those that
    # on_before_optimizer_step sees): DDP's numbers (docs/strategy.md, Lightning features)
    for s in (s_ddp, s_dcp):
        assert [n for n, _ in s["after_backward"][0]] != [] and all(n == 1 for r in s["after_backward"] for n, _ in r)
        assert all(b == pytest.approx(a) for r in range(world) for (_, a), b in zip(s["after_backward"][r], s["before_step"][r]))
    for r in range(world):
        assert [a for _, a in s_dcp["after_backward"][r]] == pytest.approx([a for _, a in s_ddp["after_backward"][r]], rel=1e-5)
    for key in ("before_step", "after_backward"):
        s_ddp.pop(key), s_dcp.pop(key)
    assert s_dcp == dict(s_ddp, best_score=s_dcp["best_score"])  # each step's samples, the stop, the best checkpoint
    assert s_dcp["stopped_epoch"] < 11 and s_dcp["global_step"] == 4 * (s_dcp["epoch"]), s_dcp  # stopped early
    assert s_dcp["labels"][0] == sorted(FeatureData(True).train_set.tensors[1][:6].tolist())
    _close(m_dcp.state_dict(), m_ddp.state_dict(), 1e-5)
    if rank == 0:
        logs_ddp, logs_dcp = _scalars(out_dir, "ddp"), _scalars(out_dir, "dcp")
        lrs = [v for _, v in logs_dcp["csv"]["lr-SGD"]]
        assert len(lrs) == s_dcp["global_step"] and lrs[0] == pytest.approx(0.05) and lrs[-1] < lrs[0], lrs
        for kind in ("csv", "tb"):
            for name, series in logs_ddp[kind].items():
                got = logs_dcp[kind][name]
                assert [s for s, _ in got] == [s for s, _ in series], (kind, name)
                assert [v for _, v in got] == pytest.approx([v for _, v in series], rel=1e-5), (kind, name)
    # a second fit in the same processes, under bf16-mixed: the autocast runs on every micro-batch, as DDP's
    _, b_ddp, _ = _feature_fit(ddp(), out_dir, "ddp16", ddp=True, precision="bf16-mixed", epochs=1)
    _, b_dcp, _ = _feature_fit(dcp(), out_dir, "dcp16", ddp=False, precision="bf16-mixed", epochs=1)
    assert all(b_ddp.autocast) and all(b_dcp.autocast) and b_dcp.autocast and not any(m_dcp.autocast)
    _close(b_dcp.state_dict(), b_ddp.state_dict(), 2e-2)


def test_datamodule_schedulers_early_stopping_checkpoint_loggers_and_bf16_match_ddp(two_process_runs):
    """One 2-process spawn, DDPStrategy and DCPStrategy on the same data order: a LightningDataModule,
    ``limit_train_batches``/``limit_val_batches``, an epoch StepLR with LearningRateMonitor, EarlyStopping and a
    best-``val_loss`` ModelCheckpoint, CSV and TensorBoard loggers give the same weights (1e-5), the same stop,
    the same best checkpoint and the same logged series; then a second fit of each in the same processes under
    ``precision="bf16-mixed"``."""
    _assert_done(two_process_runs, "against-ddp")  # its run: _against_ddp on two_process_runs' spawn


def _two_process_parts(rank: int, world: int, out: str) -> None:
    """The default run's 2-process tests of this file one after the other on one spawn (each spawn costs more than
    these fits): each part runs in its own folder and leaves ``<part>.rank<r>.done`` once its checks passed."""
    runs = {"features-tqdm": lambda d: _features(rank, world, d, "tqdm"), "zero1": lambda d: _zero1(rank, world),
            "against-ddp": lambda d: _against_ddp(rank, world, d)}
    for part, run in runs.items():
        folder = os.path.join(out, part)
        os.makedirs(folder, exist_ok=True)
        dist.barrier()  # every rank's folder exists
        run(folder)
        with open(os.path.join(out, f"{part}.rank{rank}.done"), "w") as f:
            f.write("ok")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """The folder of the done-markers of _two_process_parts' runs, all on one spawn of 2 processes."""
    out = str(tmp_path_factory.mktemp("features2"))
    run_distributed(_two_process_parts, 2, out, timeout=600)
    return out


def _assert_done(out: str, part: str, world: int = 2) -> None:
    missing = [r for r in range(world) if not os.path.exists(os.path.join(out, f"{part}.rank{r}.done"))]
    assert not missing, f"{part}: ranks {missing} did not finish its checks"
