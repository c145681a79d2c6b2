"""``Trainer(accumulate_grad_batches=N)`` under DCPStrategy: a global batch N times larger, exact against DDP.

DDPStrategy with ``accumulate_grad_batches=2`` and per-rank batch ``b`` steps the optimizer once per 2 loader
batches, on ``2 x world x b`` samples; DCPStrategy with ``accumulate_grad_batches=2`` trains global batches of
``2 x world x b`` samples, one optimizer step per DCP step. On the same data order (no shuffling: DDP gets a
``DistributedSampler(shuffle=False)``, which deals consecutive samples to the ranks) the weights, ``global_step``
and the LR schedule after ``k`` optimizer steps are the same (see :mod:`lightning_dcp.runtime.accumulation`).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _dist import run_distributed
from _dcp_helpers import make_trainer, max_rel_err, regression_loader
from lightning_dcp import DCPStrategy
from lightning_dcp.runtime.accumulation import Accumulation, accumulation_message
from lightning_dcp.runtime.checks import check_fit
from lightning_dcp.runtime.preflight import check_train_data
from lightning_dcp.runtime.settings import DCPSettings
from lightning_dcp.runtime.train_loader import global_batch

PER_RANK, WORLD, N, STEPS = 3, 2, 2, 3


class AccumRegressor(pl.LightningModule):
    """An ordinary module (safe mode under DCP): MLP, mean MSE, SGD with momentum, a per-step LR schedule."""

    def __init__(self, ordered_ddp: bool = False) -> None:
        super().__init__()
        self.ordered_ddp = ordered_ddp
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return regression_loader(self.trainer, PER_RANK, self.ordered_ddp)


class Final(pl.Callback):
    """Per rank at the fit's end: the weights, global_step, the LR, loader batches seen and the DCP step plans."""

    def __init__(self, out_dir: str, tag: str) -> None:
        self.out_dir, self.tag, self.batches, self.plans = out_dir, tag, 0, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        plan = getattr(trainer.strategy, "last_step_plan", None)
        if plan is not None:
            self.plans.append(sorted(s for it in plan["items"] for s in it["samples"]))

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save({"weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                    "global_step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"],
                    "batches": self.batches, "plans": self.plans,
                    "accumulate_in_fit": trainer.accumulate_grad_batches},
                   os.path.join(self.out_dir, f"{self.tag}{trainer.global_rank}.pt"))


def _fit(strategy, out_dir: str, tag: str, ddp: bool = False) -> pl.Trainer:
    trainer = make_trainer(WORLD, strategy, [Final(out_dir, tag)], max_steps=STEPS, accumulate_grad_batches=N,
                           use_distributed_sampler=not ddp)
    trainer.fit(AccumRegressor(ordered_ddp=ddp))
    return trainer


def _ddp_then_dcp(rank, world, out_dir):
    """The DDP fit, then the DCP fit, on the same processes (one spawn for both)."""
    from lightning.pytorch.strategies import DDPStrategy

    _fit(DDPStrategy(process_group_backend="gloo"), out_dir, "ddp", ddp=True)
    trainer = _fit(DCPStrategy(shuffle=False, seed=0), out_dir, "dcp")
    assert trainer.accumulate_grad_batches == N  # the Trainer's own value again after the fit


def test_accumulate_grad_batches_equals_ddp(tmp_path):
    run_distributed(_ddp_then_dcp, WORLD, str(tmp_path), timeout=600)
    worst = 0.0
    for r in range(WORLD):
        ddp = torch.load(os.path.join(tmp_path, f"ddp{r}.pt"))
        dcp = torch.load(os.path.join(tmp_path, f"dcp{r}.pt"))
        assert dcp["global_step"] == ddp["global_step"] == STEPS
        assert dcp["lr"] == pytest.approx(ddp["lr"]) and ddp["lr"] == pytest.approx(0.1 * 0.7 ** STEPS)
        assert ddp["batches"] == N * STEPS and dcp["batches"] == STEPS  # one DCP step per optimizer step
        assert dcp["accumulate_in_fit"] == 1  # Lightning's loop does not accumulate a second time
        gbs = N * WORLD * PER_RANK  # DDP's optimizer step k saw samples [gbs k, gbs (k + 1)) too
        assert dcp["plans"] == [list(range(gbs * k, gbs * (k + 1))) for k in range(STEPS)]
        for name, w in dcp["weights"].items():
            err = max_rel_err(w, ddp["weights"][name])
            assert err < 1e-5, f"rank {r}, {name}: relative error {err:.2e}"
            worst = max(worst, err)
    print(f"accumulate_grad_batches={N} vs DDP: max rel weight err {worst:.2e}", flush=True)


def test_the_global_batch_grows_and_is_said():
    settings = DCPSettings()
    assert global_batch(settings, 3, 2, 4) == (24, None)
    assert global_batch(DCPSettings(global_batch_size=10), 3, 2, 4) == (40, None)
    assert global_batch(DCPSettings(global_batch_tokens=1000), 3, 2, 3) == (None, 3000)
    message = accumulation_message(4, global_batch_size=24, global_batch_tokens=None,
                                   source="the DataLoader's batch_size 3 x 2 ranks")
    assert message.startswith("DCPStrategy: Trainer(accumulate_grad_batches=4) trains global batches of 24 samples "
                              "per optimizer step (the DataLoader's batch_size 3 x 2 ranks x 4)")
    assert "up to 3000 tokens" in accumulation_message(3, global_batch_size=None, global_batch_tokens=3000, source="")


def test_the_trainer_value_is_taken_over_and_restored():
    trainer = SimpleNamespace(accumulate_grad_batches=3)
    acc = Accumulation()
    assert acc.take_over(trainer) == 3 and trainer.accumulate_grad_batches == 1
    assert acc.say_once() and not acc.say_once()
    acc.check_unchanged(trainer)
    trainer.accumulate_grad_batches = 2  # e.g. a callback that sets it during the fit
    with pytest.raises(RuntimeError, match=r"changed to 2 during the fit.*accumulate_grad_batches=3\) over at fit "
                                           r"start as a global batch 3 times larger"):
        acc.check_unchanged(trainer)
    acc.restore()
    assert trainer.accumulate_grad_batches == 3
    acc.restore()  # idempotent
    assert trainer.accumulate_grad_batches == 3
    plain = SimpleNamespace(accumulate_grad_batches=1)
    assert acc.take_over(plain) == 1 and not acc.say_once()


def test_the_dataset_is_checked_against_the_larger_global_batch():
    data = DataLoader(TensorDataset(torch.zeros(10, 2)), batch_size=3)
    check_train_data(data, DCPSettings(), world_size=2, accumulate=1)  # 6 <= 10
    with pytest.raises(ValueError, match=r"gives no full global batch of 12 samples \(the DataLoader's batch_size 3 x "
                                         r"2 ranks \(DCPStrategy's default global batch\) x "
                                         r"Trainer\(accumulate_grad_batches=2\)\).*DCPStrategy\(global_batch_size=5\) "
                                         r"with accumulate_grad_batches=2"):
        check_train_data(data, DCPSettings(), world_size=2, accumulate=2)


def test_a_changing_accumulation_is_refused():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    module = SimpleNamespace(automatic_optimization=True)
    check_fit(SimpleNamespace(callbacks=[], accumulate_grad_batches=4), module)  # a fixed N is taken over
    trainer = SimpleNamespace(callbacks=[GradientAccumulationScheduler({0: 1, 2: 4})], accumulate_grad_batches=1)
    with pytest.raises(ValueError, match=r"GradientAccumulationScheduler\(scheduling=\{0: 1, 2: 4\}\) with DCPStrategy"
                                         r".*Remove the callback and use a fixed Trainer\(accumulate_grad_batches=N\)"):
        check_fit(trainer, module)
