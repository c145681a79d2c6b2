"""The training loss a user sees: ``train/loss``, the step's global mean, the same under any Trainer.

Under :class:`~lightning_dcp.DCPStrategy` a module's ``training_step`` runs once per *micro-batch*
and sees only this rank's shard, so a value logged there is one micro-batch's local number (and
a :func:`~lightning_dcp.sp.tokens.weighted_loss` is a *sum*, thousands of times the mean). What
the strategy hands back to Lightning after the step -- ``outputs["loss"]`` in
``on_train_batch_end`` -- is the exact loss of plain data-parallel training on the step's global
batch (the mean over its loss units, every rank the same value). Under a plain Trainer
``outputs["loss"]`` is what ``training_step`` returned: the batch's mean loss. So logging it there
means the same thing under both.

:class:`StepLossLogging` does exactly that for every module lightning-dcp ships; mix it into your
own module the same way (``class MyModule(StepLossLogging, pl.LightningModule)``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["TRAIN_LOSS", "StepLossLogging", "step_loss"]

#: The key under which :class:`StepLossLogging` logs the step's loss.
TRAIN_LOSS = "train/loss"


def step_loss(outputs: Any) -> torch.Tensor | None:
    """The step's loss from what ``on_train_batch_end`` receives (a tensor, or a dict with ``"loss"``)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return loss.detach() if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


class StepLossLogging:
    """LightningModule mixin: log the step's loss as ``train/loss`` (progress bar and logger).

    Logged from ``on_train_batch_end``, once per optimizer step, with no collective: under
    DCPStrategy the value is already the global mean on every rank; under a plain single-device
    Trainer it is the batch mean (under DDP, each rank's own batch mean, as DDP logs it). Step values
    only: an epoch mean would need a world collective (``sync_dist``) that the value does not need.
    Override :attr:`train_loss_key` to rename it, or set it to ``None`` to log nothing. Subclasses that override ``on_train_batch_end`` call
    ``super().on_train_batch_end(...)``.
    """

    train_loss_key: str | None = TRAIN_LOSS

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = step_loss(outputs)
        if self.train_loss_key and loss is not None:
            self.log(self.train_loss_key, loss, prog_bar=True, on_step=True, on_epoch=False,  # type: ignore[attr-defined]
                     batch_size=1, sync_dist=False)
        parent = getattr(super(), "on_train_batch_end", None)
        if callable(parent):
            parent(outputs, batch, batch_idx)
