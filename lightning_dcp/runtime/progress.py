"""The epoch in Lightning's Rich progress bar of a step-bounded run: ``Epoch 2``, not ``Epoch 2/-2``.

A Trainer bounded by ``max_steps`` (no ``max_epochs``) runs with ``max_epochs=-1``; Lightning's
``RichProgressBar`` (2.6) then writes ``Epoch {n}/{max_epochs - 1}``, i.e. ``Epoch 2/-2``
(Lightning-AI/pytorch-lightning#21925). DCP runs are usually step-bounded, so the strategy mends
the bars of the user's own Trainer at setup (:func:`mend_progress_bars`); a bar whose class
overrides the description itself is left alone, and so is every other progress bar.
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["mend_progress_bars"]

_MENDED = "_dcp_mended_description"


def _step_bounded_description(bar: Any, current_epoch: int) -> str:
    description = type(bar)._get_train_description(bar, current_epoch)
    max_epochs = bar.trainer.max_epochs
    if max_epochs is not None and max_epochs < 0:
        description = description.replace(f"/{max_epochs - 1}", "")
    return description


def mend_progress_bars(trainer: Any) -> int:
    """Mend the Rich progress bars among ``trainer.callbacks`` (see the module docstring); return how many."""
    try:
        from lightning.pytorch.callbacks import RichProgressBar
    except ImportError:  # pragma: no cover - Lightning without the Rich bar
        return 0
    mended = 0
    for bar in getattr(trainer, "callbacks", []):
        if not isinstance(bar, RichProgressBar) or getattr(bar, _MENDED, False):
            continue
        if type(bar)._get_train_description is not RichProgressBar._get_train_description:
            continue  # the user's own description: theirs to format
        bar._get_train_description = types.MethodType(_step_bounded_description, bar)
        setattr(bar, _MENDED, True)
        mended += 1
    return mended
