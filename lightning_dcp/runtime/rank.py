"""What the step executor needs from this rank, as one frozen value built once per fit.

The strategy builds a :class:`RankRuntime` when it builds the train loader and hands it to the
:class:`~lightning_dcp.runtime.executor.StepExecutor`; the executor never holds the strategy, so
calls go one way (strategy -> executor -> the callables given here) and the executor runs with a
plain ``RankRuntime`` in tests, without a Trainer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import Tensor

from lightning_dcp.runtime.settings import DCPSettings

__all__ = ["RankRuntime"]


def _no_move(batch: Any) -> Any:
    return batch


@dataclass(frozen=True)
class RankRuntime:
    """This rank's view of the fit, fixed from the train loader's build on.

    Args:
        module: the LightningModule (or any module with ``training_step`` and ``parameters()``).
        settings: the strategy's :class:`~lightning_dcp.runtime.settings.DCPSettings`.
        backward: backward of one micro-batch's loss (the strategy: through the precision plugin).
        support: the module's support level (``"safe"``, ``"packed"`` or ``"sp"``).
        device: where the step's tensors live.
        world_size, rank: the world and this rank's global rank.
        sp_groups: the :class:`~lightning_dcp.sp.groups.SPGroups` (``None``: SP 1 only).
        num_heads: the model's attention heads (``None``: unknown, no SP-size check).
        shards: the ``fully_shard`` units (``sharding="zero2"`` / ``"fsdp"``), else ``None``.
        to_device: moves one micro-batch to ``device`` (the strategy's ``batch_to_device``).
        train_step_context: the precision plugin's ``train_step_context``.
        checkpoint_io: writes an out-of-memory checkpoint (``None``: none is written).
        unsaveable_reason: why one rank alone cannot write a full checkpoint (``None``: it can).
    """

    module: Any
    settings: DCPSettings
    backward: Callable[[Tensor], None]
    support: str = "sp"
    device: torch.device = torch.device("cpu")
    world_size: int = 1
    rank: int = 0
    sp_groups: Any = None
    num_heads: int | None = None
    shards: Any = None
    to_device: Callable[[Any], Any] = _no_move
    train_step_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    checkpoint_io: Any = None
    unsaveable_reason: str | None = None

    @property
    def trainer(self) -> Any:
        """The module's Trainer, or ``None`` (a module outside a fit)."""
        return getattr(self.module, "_trainer", None)
