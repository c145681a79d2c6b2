"""``Trainer(accumulate_grad_batches=N)`` under :class:`~lightning_dcp.DCPStrategy`: a global batch N times larger.

What Lightning's fit loop does with N (2.6): ``_TrainingEpochLoop._should_accumulate`` skips the optimizer step
on N - 1 of every N loader batches (the automatic loop then runs the closure -- ``training_step`` and
``backward`` -- under ``strategy.block_backward_sync``), ``ClosureResult`` divides the loss by N, and the LR
schedulers, ``global_step`` and ``max_steps`` count the optimizer steps. Under DCPStrategy one loader item is
already a whole optimizer step: the strategy's ``training_step`` runs this rank's planned micro-batches of the
step (:meth:`~lightning_dcp.runtime.executor.StepExecutor.run_items`) and parks their gradients, reduced once in
``optimizer_step``. Left to Lightning, N would accumulate twice (and a skipped step's parked gradients would be
dropped by the next step's loop).

So :class:`Accumulation` takes N over at fit start: the strategy's global batch becomes N times larger
(``global_batch_size x N``, or ``global_batch_tokens x N``; :func:`~lightning_dcp.runtime.train_loader.global_batch`),
said once (:func:`accumulation_message`), and ``trainer.accumulate_grad_batches`` reads 1 for the fit, so the
loop steps the optimizer after every loader item and does not divide the loss. The optimizer then steps once per
N times larger global batch: the same updates, ``global_step``, LR schedule and ``max_steps`` as ``DDPStrategy``
with ``accumulate_grad_batches=N`` on the same data (one optimizer step per N loader batches there). The
trainer's value is restored at teardown.

A ``GradientAccumulationScheduler`` (an N that changes per epoch) is refused at fit start
(:func:`~lightning_dcp.runtime.checks.check_fit`); an ``accumulate_grad_batches`` changed during the fit (by a
callback) stops the next step (:meth:`Accumulation.check_unchanged`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Accumulation", "accumulation_message"]


class Accumulation:
    """The fit's ``accumulate_grad_batches``, taken over from the Trainer (see the module docstring)."""

    def __init__(self) -> None:
        self.factor = 1
        self._trainer: Any = None
        self._said = False

    def take_over(self, trainer: Any) -> int:
        """Read the Trainer's ``accumulate_grad_batches`` (``N``), make it 1 for the fit; return ``N``."""
        self.restore()
        n = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        self.factor, self._said = n, False
        if n != 1:
            self._trainer = trainer
            trainer.accumulate_grad_batches = 1
        return n

    def restore(self) -> None:
        """Give the Trainer its ``accumulate_grad_batches`` back (teardown; idempotent)."""
        if self._trainer is not None:
            self._trainer.accumulate_grad_batches = self.factor
            self._trainer = None

    def say_once(self) -> bool:
        """True the first time in a fit (the loader may be built again: the message is said once)."""
        if self.factor == 1 or self._said:
            return False
        self._said = True
        return True

    def check_unchanged(self, trainer: Any) -> None:
        """The loop would accumulate across DCP steps if something set ``accumulate_grad_batches`` again."""
        if self._trainer is not None and getattr(trainer, "accumulate_grad_batches", 1) != 1:
            raise RuntimeError(
                f"trainer.accumulate_grad_batches changed to {trainer.accumulate_grad_batches} during the fit (a "
                f"callback?); DCPStrategy took Trainer(accumulate_grad_batches={self.factor}) over at fit start as a "
                f"global batch {self.factor} times larger, and Lightning would now accumulate across whole DCP steps. "
                "Leave accumulate_grad_batches fixed for the fit (no GradientAccumulationScheduler or callback that "
                "sets it), or make the global batch larger with DCPStrategy(global_batch_size=...)")


def accumulation_message(n: int, *, global_batch_size: int | None, global_batch_tokens: int | None,
                         source: str) -> str:
    """What the fit trains per optimizer step under ``Trainer(accumulate_grad_batches=n)`` (``source``: where the
    global batch before ``x n`` came from)."""
    size = (f"{global_batch_size} samples" if global_batch_size is not None else
            f"up to {global_batch_tokens} tokens")
    return (f"DCPStrategy: Trainer(accumulate_grad_batches={n}) trains global batches of {size} per optimizer step "
            f"({source} x {n}): one optimizer step per DCP step, as DDPStrategy steps once per {n} loader batches "
            "(global_step, LR schedulers and max_steps count optimizer steps); the strategy's plan does the "
            "accumulation, and trainer.accumulate_grad_batches reads 1 during the fit")
