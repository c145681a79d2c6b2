"""``lightning-dcp train``'s console: the step line explained in --help, the progress bar's epoch
label in a step-bounded run, library warnings dropped on ranks other than 0."""

from __future__ import annotations

import types
import warnings

import pytest

from lightning_dcp.commands import train


def test_help_explains_every_field_of_the_step_line(capsys):
    from lightning_dcp import cli

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    for field in ("items", "sp={p:n}", "mb/rank", "recompute", "imbalance", "time", "loss"):
        assert f"\n  {field} " in out, field
    assert "[0, 3, 4] means" in out


@pytest.mark.parametrize("max_epochs,label", [(-1, "Epoch 0"), (3, "Epoch 0/2")])
def test_progress_bar_shows_no_negative_epoch_total(max_epochs, label):
    """DCPStrategy mends the Rich bars of any Trainer at setup (the CLI's too): no ``Epoch 0/-2``."""
    pytest.importorskip("rich")
    from lightning.pytorch.callbacks import RichProgressBar

    from lightning_dcp.runtime.progress import mend_progress_bars

    class OwnDescription(RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            return "mine"

    bar, own = train._progress_bar(), OwnDescription()
    trainer = types.SimpleNamespace(max_epochs=max_epochs, callbacks=[bar, own])
    assert mend_progress_bars(trainer) == 1 and mend_progress_bars(trainer) == 0  # once; the user's own bar is left alone
    bar._trainer = own._trainer = trainer
    assert bar._get_train_description(0).strip() == label and own._get_train_description(0) == "mine"


def test_deprecation_warnings_dropped_on_nonzero_ranks_only(monkeypatch):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("NODE_RANK", raising=False)
        monkeypatch.setenv("LOCAL_RANK", "0")
        train._quiet_nonzero_rank()
        warnings.warn("rank 0 keeps it", FutureWarning)
        monkeypatch.setenv("LOCAL_RANK", "1")
        train._quiet_nonzero_rank()
        warnings.warn("rank 1 drops it", FutureWarning)
        warnings.warn("rank 1 drops it too", DeprecationWarning)
        warnings.warn("a user warning stays", UserWarning)
    assert [str(w.message) for w in seen] == ["rank 0 keeps it", "a user warning stays"]


def test_train_command_runs_two_processes_end_to_end(tmp_path):
    """``lightning-dcp train`` as a user types it (no profile, 2 steps): exit 0 and the closing summary."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "lightning_dcp.cli", "train", "--devices", "2", "--steps", "2",
                           "--num-samples", "64", "--global-batch-size", "8", "--no-profile", "--no-progress-bar",
                           "--quiet-plans", "--default-root-dir", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "DCP training done: 2 steps on 2 CPU processes, policy=dcp, SP sizes used" in proc.stdout


def test_step_progress_bar_counts_the_runs_steps_across_short_epochs_with_loss_and_time_left():
    """train-video's bar: Lightning's tqdm bar, one bar for the run (max_steps), not one per 2-step epoch."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch.utils.data import DataLoader

    from lightning_dcp.callbacks import StepProgressBar

    class Logged(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("train/loss", out["loss"], prog_bar=True)
            return out

    seen = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, *_):
            bar = next(c for c in trainer.callbacks if isinstance(c, StepProgressBar)).train_progress_bar
            seen.append((bar.n, bar.total, bar.desc))

    bar = StepProgressBar()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, callbacks=[bar, Watch()])
    torch.manual_seed(0)
    trainer.fit(Logged(), DataLoader(RandomDataset(32, 2), batch_size=1))  # an epoch of 2 steps
    assert [n for n, _, _ in seen] == [1, 2, 3, 4, 5] and {t for _, t, _ in seen} == {5}
    assert [d for _, _, d in seen][-1].startswith("train (epoch 2)")
    shown = str(bar.train_progress_bar)
    assert "5/5" in shown and "train/loss=" in shown and "<" in shown  # steps done of max_steps, loss, elapsed<left
    assert "v_num" not in shown
