""":class:`StepProgressBar`: Lightning's own tqdm progress bar, counting the run's optimizer steps.

Lightning's :class:`~lightning.pytorch.callbacks.TQDMProgressBar` counts one epoch's batches and starts again each
epoch. A fine-tune on a few clips has an epoch of one or two steps, so its bar reads ``Epoch 17: 1/1`` and never
says how long the run has left. This bar is the same class with one bar for the whole run: the optimizer steps
done of ``max_steps``, elapsed and time left, and the progress-bar metrics (``train/loss``, ``dcp/imbalance``)::

    train (epoch 3):  60%|██████    | 12/20 [00:31<00:20,  0.39it/s, train/loss=1.42, dcp/imbalance=0.118]

Without ``max_steps`` it counts the epochs' batches as Lightning's does (``max_epochs`` x batches per epoch).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

__all__ = ["StepProgressBar"]


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar over the whole run's optimizer steps (see the module docstring); the arguments are
    :class:`~lightning.pytorch.callbacks.TQDMProgressBar`'s."""

    @property
    @override
    def train_description(self) -> str:
        return "train"

    def _total(self, trainer: pl.Trainer) -> float:
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return float(trainer.max_steps)
        epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else 1
        return float(trainer.num_training_batches) * epochs

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        bar = self._train_progress_bar
        total = self._total(trainer)
        bar.reset(total=None if total == float("inf") else int(total))
        bar.initial = bar.n = trainer.global_step  # a resumed run: its rate and time left from here
        bar.set_description("train")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if self._train_progress_bar is not None:
            self.train_progress_bar.set_description(f"train (epoch {trainer.current_epoch})")

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # the metrics of the step just done: a module that logs its loss in its own on_train_batch_end (as
        # lightning_dcp's StepLossLogging does) logs it after the callbacks' on_train_batch_end has run
        bar = self._train_progress_bar
        if bar is not None and not bar.disable and trainer.global_step > bar.initial:
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        bar = self._train_progress_bar
        if bar is not None and not bar.disable:
            bar.n = trainer.global_step
            bar.refresh()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        bar = self._train_progress_bar
        if bar is not None and not bar.disable:
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        bar = self._train_progress_bar
        if bar is not None and not bar.disable:
            bar.set_postfix(self.get_metrics(trainer, pl_module))
        super().on_train_end(trainer, pl_module)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the run folder's version: printed once by the command, not every step
        return items
