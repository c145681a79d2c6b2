"""What the step executor needs from this rank, as one frozen value built once per fit.

The strategy builds a :class:`RankRuntime` when it builds the train loader and hands it to the
:class:`~lightning_dcp.runtime.executor.StepExecutor`; the executor never holds the strategy, so
calls go one way (strategy -> executor -> the callables given here, :class:`PrecisionBackward` and
:class:`BatchTransfer`, which call Lightning's precision plugin and the module's transfer hooks
directly) and the executor runs with a plain ``RankRuntime`` in tests, without a Trainer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import Tensor

from lightning_dcp.runtime.settings import DCPSettings
from lightning_dcp.runtime.sharding.protocol import Shards
from lightning_dcp.sp.contract import ModelContract
from lightning_dcp.sp.groups import SPGroups

__all__ = ["BatchTransfer", "PrecisionBackward", "RankRuntime"]


def _no_move(batch: Any) -> Any:
    return batch


@dataclass(frozen=True)
class PrecisionBackward:
    """Backward of one micro-batch's loss through Lightning's precision plugin: its ``pre_backward`` (loss scaling,
    the ``on_before_backward`` hooks) and ``backward`` (the module's ``backward``), as ``Strategy.backward`` runs
    them for automatic optimization. Its ``post_backward`` (the ``on_after_backward`` hooks) runs once per step,
    on the reduced gradients, as under DDP (the strategy's ``optimizer_step``, after the reduction)."""

    precision_plugin: Any
    module: Any
    optimizer: Any = None

    def __call__(self, loss: Tensor) -> None:
        loss = self.precision_plugin.pre_backward(loss, self.module)
        self.precision_plugin.backward(loss, self.module, self.optimizer)


@dataclass(frozen=True)
class BatchTransfer:
    """Moves a batch to ``device`` through the module's batch-transfer hooks, as ``Strategy.batch_to_device``."""

    module: Any
    device: torch.device
    dataloader_idx: int = 0

    def __call__(self, batch: Any) -> Any:
        return self.module._apply_batch_transfer_handler(batch, device=self.device, dataloader_idx=self.dataloader_idx)


@dataclass(frozen=True)
class RankRuntime:
    """This rank's view of the fit, fixed from the train loader's build on.

    Args:
        module: the LightningModule (or any module with ``training_step`` and ``parameters()``).
        settings: the strategy's :class:`~lightning_dcp.runtime.settings.DCPSettings`.
        backward: backward of one micro-batch's loss (the strategy gives a :class:`PrecisionBackward`).
        support: the module's support level (``"safe"``, ``"packed"`` or ``"sp"``).
        device: where the step's tensors live.
        world_size, rank: the world and this rank's global rank.
        sp_groups: the :class:`~lightning_dcp.sp.groups.SPGroups` (``None``: SP 1 only).
        num_heads: the model's attention heads (``None``: unknown, no SP-size check).
        shards: the sharding mode's runtime (:class:`~lightning_dcp.runtime.sharding.protocol.Shards`): the
            step start, the rounds, the gradient reduction.
        to_device: moves a batch to ``device`` (the strategy gives a :class:`BatchTransfer`).
        convert_input: the precision plugin's ``convert_input`` (e.g. ``"bf16-true"``: floating-point
            tensors to bf16), applied to the loaded micro-batches before they are prepared.
        train_step_context: the precision plugin's ``train_step_context``.
        checkpoint_io: writes an out-of-memory checkpoint (``None``: none is written).
        contract: the module's :class:`~lightning_dcp.sp.contract.ModelContract` (the strategy's
            ``model_contract``; ``None``: read from ``module`` when a step is prepared).
        sample_name: names a dataset index in errors (the train dataset's ``sample_name``, e.g. its clip file;
            :mod:`~lightning_dcp.planning.sample_names`).
    """

    module: Any
    settings: DCPSettings
    backward: Callable[[Tensor], None]
    shards: Shards
    support: str = "sp"
    device: torch.device = torch.device("cpu")
    world_size: int = 1
    rank: int = 0
    sp_groups: SPGroups | None = None
    num_heads: int | None = None
    to_device: Callable[[Any], Any] = _no_move
    convert_input: Callable[[Any], Any] = _no_move
    train_step_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    checkpoint_io: Any = None
    contract: ModelContract | None = None
    sample_name: Callable[[int], str] | None = None

    @property
    def trainer(self) -> Any:
        """The module's Trainer, or ``None`` (a module outside a fit)."""
        return getattr(self.module, "_trainer", None)
