"""What every sharding mode does at run time: the :class:`Shards` protocol.

One class per mode of ``DCPStrategy(sharding=...)`` implements it (named by the mode's pure counterpart,
:attr:`ShardingMode.runtime <lightning_dcp.planning.sharding.base.ShardingMode.runtime>`), ``"none"`` and
``"zero1"`` included, so the strategy and the executor hold one typed object and never a mode string:

- **setup**: the optimizer hook (``zero1`` wraps the optimizers, the ``fully_shard`` modes check they
  hold the sharded parameters) and the bytes it measured (:meth:`Shards.states`);
- **a step**: :meth:`Shards.begin_step`; the rounds (:meth:`Shards.rounds`: one per item in the
  replicated modes, lockstep rounds of the shard group under ``"hsdp"``, each begun with
  :meth:`Shards.begin_round`, a rank without an item running :meth:`Shards.run_dummy`); the gradient
  reduction (:meth:`Shards.grad_reduction`, then :meth:`Shards.after_reduce`); :meth:`Shards.after_step`;
- **resting state and evaluation**: :meth:`Shards.unshard` before evaluation, :meth:`Shards.at_rest`
  between steps and after it, :meth:`Shards.reshard` before a later fit builds its optimizers;
- **checkpoints**: :attr:`Shards.sharded_checkpoint` modes write and read every rank's shards
  (:meth:`Shards.save_checkpoint`, :meth:`Shards.load_checkpoint`); the others leave them to Lightning.

Co-resident and frozen models, and trainable subsets, in every mode:

- **A trainable subset** (LoRA: only the adapters require grad): only parameters with
  ``requires_grad`` are reduced, accumulated and stepped; frozen ones get no gradient in any mode.
  ``none``/``zero1`` replicate the frozen weights; ``zero2``/``fsdp``/``hsdp`` shard them with the
  trainable ones inside the same units (a frozen base layer is gathered like any other and its
  reduce-scatter carries only the adapters' gradients); the optimizer must be built over the
  trainable parameters the strategy hands ``configure_optimizers`` (after sharding).
- **A co-resident frozen model** held by the LightningModule (a teacher, an EMA copy as a child
  module): every direct child module of the LightningModule whose parameters are all frozen and that
  holds none of the repeated layers (or what ``dcp_coresident`` names,
  :attr:`~lightning_dcp.sp.contract.ModelContract.coresident`) is kept out of the ``fully_shard``
  units: a plain replica on every rank (rank 0's weights, broadcast at setup), never gathered, no
  collective, so it can run inside the micro-batch loop and the rounds; its bytes count as held in
  full in every phase. A co-resident module must stay frozen.
- **An EMA kept by a callback** outside the module: after the optimizer step the module's parameters
  are full tensors under ``none``/``zero1``/``zero2`` and this rank's DTensor shards under
  ``fsdp``/``hsdp``; an EMA of ``p.detach().clone()`` updates shard by shard there with no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

from torch import Tensor, nn

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.plan import StepPlan
    from lightning_dcp.planning.sharding.base import ShardingMode
    from lightning_dcp.runtime.sharding.states import ModelStates

__all__ = ["GradReduction", "Round", "Shards"]


@dataclass(frozen=True)
class Round:
    """One round of this rank's micro-batch loop.

    Args:
        position: the position of this rank's item in its loop (``Step.items`` order); ``None``: a dummy
            round (the shard group's collectives, no compute).
        last: the step's last round of this rank's group.
        lockstep: whether the round runs in lockstep with the shard group (collectives inside it).
    """

    position: int | None
    last: bool = False
    lockstep: bool = False


@runtime_checkable
class GradReduction(Protocol):
    """The step's gradients between the loop and the optimizer step (the executor's buckets)."""

    params: list[nn.Parameter]

    def begin(self) -> None:
        """Before the first micro-batch: no gradient left from an earlier step."""

    def park(self) -> None:
        """After the loop: the accumulated gradients leave ``.grad`` (Lightning's ``zero_grad`` comes next)."""

    @property
    def has_grad(self) -> Tensor:
        """Per parameter: 1.0 where this rank produced a gradient (for the step-end gather)."""

    def reduce(self, world_has_grad: Tensor | None, group: Any = None, world: int = 1, scale: float = 1.0) -> None:
        """The parked gradients reduced (if the mode still needs it), times ``scale``, back on ``.grad``."""


@runtime_checkable
class Shards(Protocol):
    """A sharding mode at run time (see the module docstring)."""

    mode: "ShardingMode"
    module: nn.Module
    sharded_checkpoint: bool
    """Checkpoints are directories of every rank's shards (else Lightning's own file)."""

    # ------------------------------------------------------------------ setup
    def setup_optimizers(self, optimizers: list[Any], lr_scheduler_configs: Sequence[Any]) -> list[Any]:
        """The optimizers to train with (``zero1``: wrapped; sharded modes: checked, raising by name)."""

    def optimized_parameters(self) -> dict[str, nn.Parameter]:
        """Name -> the parameters the optimizer steps: the module's own in the replicated modes, this rank's
        DTensor shards where the mode shards the weights (what an EMA of the weights averages)."""

    def states(self, optimizers: Sequence[Any]) -> "ModelStates":
        """The model-state bytes this rank holds, as measured on the module (what the planner budgets)."""

    @property
    def unsaveable_reason(self) -> str | None:
        """Why one rank alone cannot write a full checkpoint (``None``: it can)."""

    # ------------------------------------------------------------------ a step
    def begin_step(self) -> None:
        """Step start, on every rank before its first micro-batch (ranks without items too)."""

    def rounds(self, plan: "StepPlan", rank: int) -> list[Round]:
        """This rank's rounds of ``plan`` (every rank of a shard group gets as many)."""

    def begin_round(self, rnd: Round) -> None:
        """Before a round's forward."""

    def run_dummy(self) -> None:
        """A dummy round: the round's collectives with no compute and no gradient."""

    def grad_reduction(self, cap_bytes: int) -> GradReduction:
        """The gradient buckets of the step end (built once per fit)."""

    def after_reduce(self) -> None:
        """The gradients are reduced: what clipping and the optimizer step must see."""

    def after_step(self) -> None:
        """After the optimizer step."""

    # ------------------------------------------------------------------ resting state and evaluation
    def unshard(self) -> None:
        """Full weights for evaluation (or the fit's first step), where the mode shards them."""

    def at_rest(self) -> None:
        """The mode's resting state: between steps and after evaluation."""

    def reshard(self) -> None:
        """The module's parameters are the sharded ones (what ``configure_optimizers`` must see in a later fit)."""

    # ------------------------------------------------------------------ checkpoints (sharded_checkpoint only)
    def model_state(self) -> dict[str, Any]:
        """The module's state dict as this rank saves it."""

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """An optimizer's state dict as this rank saves it."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Path, *, rank: int, barrier: Callable[[], None]) -> None:
        """Write Lightning's ``checkpoint`` at ``path`` (every rank calls this)."""

    def load_checkpoint(self, path: Path, optimizers: list[Any], *, strict: bool = True) -> dict[str, Any]:
        """Read a checkpoint into the module and ``optimizers``; return the rest of Lightning's checkpoint."""
