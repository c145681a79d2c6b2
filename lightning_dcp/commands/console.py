"""What a DCP training run prints on rank 0, as ``lightning-dcp train`` shows it: one plan line per
optimizer step (:class:`PlanPrinter`) and a closing summary with the imbalance (:func:`training_summary`).

Any script can use the same output::

    trainer = pl.Trainer(strategy=DCPStrategy(...), callbacks=[PlanPrinter()], ...)
    trainer.fit(module, loader)
    if trainer.is_global_zero:
        print(training_summary(trainer))

The fields of the step line are explained in ``lightning-dcp train --help``
(:data:`lightning_dcp.commands.train.STEP_LINE_HELP`). Imports Lightning: the CLI imports this module
only when ``train`` runs.
"""

from __future__ import annotations

from typing import Any, Sequence

import lightning.pytorch as pl

from lightning_dcp.runtime.metrics import format_plan

__all__ = ["LogDirPrinter", "PlanPrinter", "calibration_summary", "training_summary"]


class PlanPrinter(pl.Callback):
    """Prints, on rank 0, each optimizer step's plan under :class:`~lightning_dcp.DCPStrategy`::

        step   4: items=9 sp={1:7, 2:2} mb/rank=[7, 4] recompute=[0, 2, 3, 4] imbalance=0.029 time=0.81s loss=5.4206

    Args:
        quiet: print nothing (the callback stays, so a command can switch it off by a flag).
    """

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        m = getattr(trainer.strategy, "last_step_metrics", None)
        if self.quiet or m is None:
            return
        plan = batch.step.plan
        pl_module.print(f"step {trainer.global_step:3d}: {format_plan(plan, trainer.world_size)} "
                        f"imbalance={m.imbalance:.3f} time={m.step_s:.2f}s loss={m.loss:.4f}")


class LogDirPrinter(pl.Callback):
    """Prints, on rank 0 when training starts, where this run logs (the logger's version folder: metrics, validation
    videos) and, for a resumed run, that it continues from the checkpoint into a new version -- Lightning's
    convention: every fit logs into its own ``version_N`` (a CSV logger given an existing version would delete its
    ``metrics.csv``), while checkpoints continue in their own folder."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_dir = trainer.log_dir
        if log_dir is None or not trainer.loggers or not trainer.is_global_zero:
            return
        if trainer.ckpt_path:
            line = (f"resumed from {trainer.ckpt_path} at step {trainer.global_step}; this run logs into {log_dir}/ "
                    "(each fit logs into its own version, as Lightning does)")
        else:
            line = f"logs: {log_dir}/"
        bar = getattr(trainer.progress_bar_callback, "_train_progress_bar", None)
        if bar is not None:  # the bar is drawn already: print above it
            pl_module.print(line)
        else:  # a progress bar with no bar yet would swallow it (it prints through its active bar)
            print(line, flush=True)


def _policy(strategy: Any) -> str:
    """The planner policy the strategy runs (a user planner by its class name)."""
    settings = strategy.settings
    return settings.policy if settings.planner is None else type(settings.planner).__name__


def training_summary(trainer: pl.Trainer) -> str:
    """Two lines after a DCP fit: steps, processes, policy and SP sizes used; then the mean imbalance
    over the steps after the first (the first includes start-up), tokens/s and the last loss."""
    strategy = trainer.strategy
    hist = strategy.metrics_tracker.history
    warm = hist[1:] or hist
    sizes = sorted({s for m in hist for s in m.sp_sizes})
    mean_imb = sum(m.imbalance for m in warm) / max(1, len(warm))
    tps = sum(m.tokens_per_s for m in warm) / max(1, len(warm))
    kind = "GPU" if strategy.root_device.type == "cuda" else "CPU"
    head = (f"\nDCP training done: {trainer.global_step} steps on {trainer.world_size} {kind} processes, "
            f"policy={_policy(strategy)}, SP sizes used {sizes}")
    if not hist:
        return head + "\nno steps ran"
    return head + (f"\nimbalance ratio (mean over steps after the first): {mean_imb:.3f}   tokens/s: {tps:,.0f}   "
                   f"last loss: {hist[-1].loss:.4f}") + calibration_summary(strategy, warm)


def calibration_summary(strategy: Any, steps: Sequence[Any]) -> str:
    """A third line with calibration on: the mode and refits, the mean |predicted - measured| / measured step
    time (the last quarter of the steps), the uncalibrated model's, and the rank speeds."""
    cal = getattr(strategy, "calibration", None)
    rows = [m.calibration for m in steps if getattr(m, "calibration", None) is not None]
    if cal is None or not rows:
        return ""
    tail = rows[-max(1, len(rows) // 4):]
    err = sum(abs(c.error) for c in tail) / len(tail)
    base = sum(abs(c.measured_s - c.base_predicted_s) / c.measured_s for c in tail if c.measured_s > 0) / len(tail)
    speeds = cal.factors.rank_speeds
    shown = "all 1.00" if speeds is None else "[" + ", ".join(f"{s:.2f}" for s in speeds[:16]) + (
        ", ..." if len(speeds) > 16 else "") + "]"
    return (f"\ncalibration {cal.mode}: {cal.calibrator.refits} refits; predicted vs measured step time off by "
            f"{100 * err:.1f}% (uncalibrated {100 * base:.1f}%, last {len(tail)} steps); rank speeds {shown}")
