"""What the strategy refuses at fit start, and why (the world collectives it refuses inside the micro-batch
loop are :mod:`~lightning_dcp.runtime.collective_guard`'s).

Each check raises with the values it saw and the fix; the strategy's hooks call them and decide
nothing else (see :mod:`~lightning_dcp.runtime.strategy`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_dcp.planning.sharding.registry import DEFAULT_MODE, MODES

__all__ = ["check_fit", "check_precision", "check_sharding", "check_sharding_agreement"]


def check_fit(trainer: Any, module: Any, sharding: str = DEFAULT_MODE) -> None:
    """The Trainer's gradient accumulation is fixed for the fit (a fixed ``accumulate_grad_batches`` becomes a larger
    global batch: :mod:`~lightning_dcp.runtime.accumulation`); manual optimization runs with a ``sharding`` mode that
    keeps full weights (:mod:`~lightning_dcp.runtime.manual`)."""
    if not module.automatic_optimization and MODES[sharding].shards_weights:
        raise ValueError(
            f"DCPStrategy(sharding={sharding!r}) with manual optimization "
            f"({type(module).__name__}.automatic_optimization is False): the mode shards the weights, and its weight "
            "gathers and gradient reduce-scatter belong to the strategy's own optimizer step, which manual "
            "optimization replaces. Use a mode that keeps full weights "
            f"with manual optimization ({', '.join(repr(m) for m, c in MODES.items() if not c.shards_weights)}: the "
            f"optimizer state can still be sharded), or automatic optimization with sharding={sharding!r}")
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    scheduler = next((c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)), None)
    if scheduler is not None:
        raise ValueError(
            f"GradientAccumulationScheduler(scheduling={scheduler.scheduling}) with DCPStrategy: the accumulation "
            "factor may not change during a fit (the strategy turns it into the global batch at fit start). Remove "
            "the callback and use a fixed Trainer(accumulate_grad_batches=N) (global batch x N), or set the global "
            "batch directly with DCPStrategy(global_batch_size=...)")


def check_precision(precision_plugin: Any, mode: str) -> None:
    """Refuse precision plugins that cannot work with sharded gradients, naming the nearest mode that works.

    Raises:
        ValueError: ``"16-mixed"`` (a ``GradScaler``): its inf/NaN check sees only this rank's gradient
            shard, so ranks would skip different steps and their shards drift apart.
    """
    if getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(
            f"sharding={mode!r} with precision={getattr(precision_plugin, 'precision', '16-mixed')!r}: the GradScaler's "
            "inf/NaN check would see only this rank's gradient shard, so ranks could skip different steps and their "
            f"weight shards drift apart. Use precision='bf16-mixed' (no loss scaling) with sharding={mode!r}, or keep "
            "'16-mixed' with sharding='zero1' (full weights and gradients, optimizer state sharded)")


def check_sharding(mode: str, world_size: int, precision_plugin: Any) -> None:
    """A sharding mode on one process is warned about (nothing to shard over); the modes that shard the
    weights refuse a GradScaler precision."""
    if mode != DEFAULT_MODE and world_size == 1:
        rank_zero_warn(f"DCPStrategy(sharding={mode!r}) on a single process: nothing to shard over, running "
                       "with full replicas")
    if MODES[mode].shards_weights and world_size > 1:
        check_precision(precision_plugin, mode)


def check_sharding_agreement(mode: str, shard_group_size: int | None, gather: Callable[[Tensor], Tensor]) -> None:
    """Every rank must run the same sharding mode and shard group (else their first collectives differ and
    hang): one world all-gather (``gather``) of both at setup, the same error on every rank."""
    names = list(MODES)
    row = torch.tensor([float(names.index(mode)), float(shard_group_size or 0)], dtype=torch.float64)
    table = gather(row).tolist()
    if len({tuple(r) for r in table}) > 1:
        per_rank = ", ".join(f"rank {r}: {names[int(m)]!r}" + (f" shard_group_size={int(k)}" if k else "")
                             for r, (m, k) in enumerate(table))
        raise ValueError(f"DCPStrategy(sharding=...) differs across ranks ({per_rank}); every rank must pass the "
                         "same sharding and shard_group_size and see the same train data (an automatic shard group "
                         "is picked from the data)")
