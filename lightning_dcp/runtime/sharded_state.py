"""The strategy's hooks that ask its :class:`~lightning_dcp.runtime.sharding.protocol.Shards`: setup, checkpoints, evaluation.

A mixin of :class:`~lightning_dcp.DCPStrategy` before Lightning's ``DDPStrategy``. After Lightning's setup
every run holds its mode's runtime (:meth:`ShardedStateHooks._shards_after_setup`: one rank and
evaluation without a fit hold full replicas), with its optimizer hook applied. Where the mode writes
sharded checkpoints (``ShardingMode.shards_weights``: every rank's shards in a directory,
:mod:`~lightning_dcp.runtime.checkpoint`) the module's and optimizers' states come from the shards and
load after setup, into the sharded module; otherwise Lightning's own file. Evaluation starts with the
mode's full weights (:meth:`Shards.unshard`) and ends in its resting state (:meth:`Shards.at_rest`).
"""

from __future__ import annotations

from typing import Any, Mapping

from typing_extensions import override

from lightning_dcp.planning.sharding.registry import DEFAULT_MODE, get_mode
from lightning_dcp.runtime.run_sharding import contract_units
from lightning_dcp.runtime.sharding import build_shards
from lightning_dcp.runtime.sharding.protocol import Shards
from lightning_dcp.runtime.sharding.states import ModelStates, measure_model_states

__all__ = ["ShardedStateHooks"]


class ShardedStateHooks:
    """Checkpoint and evaluation hooks that ask the strategy's ``shards`` (see the module docstring)."""

    shards: Shards | None = None
    _sharding: Any = None  # the strategy's RunSharding

    @property
    def _weights_sharded(self) -> bool:
        """Whether the run's mode shards the weights (known before setup: from the settings and the world)."""
        return self._sharding.shards_weights(self.world_size)

    @property
    def _sharded_checkpoint(self) -> bool:
        return self.shards is not None and self.shards.sharded_checkpoint

    def _shards_after_setup(self, fitting: bool) -> None:
        """Every run holds its mode's runtime after setup (``configure_ddp`` built it on several ranks); a fit
        applies its optimizer hook and starts with the weights of a step (the profiler measures them)."""
        if self.shards is None or self.shards.module is not self.model:  # one rank, or evaluation without a fit
            mode = self.mode if fitting else get_mode(DEFAULT_MODE, self.world_size)
            self.shards = build_shards(mode, self.model, self.root_device, **contract_units(self._model_contract))
        if fitting:
            self.optimizers = self.shards.setup_optimizers(self.optimizers, self.lr_scheduler_configs)
            self.shards.unshard()

    def _evaluation_after_sharded_fit(self, trainer: Any) -> bool:
        """Validate / test / predict after a fit that sharded the weights: DDPStrategy's setup without its weight
        broadcast (the weights are DTensor shards, equal across ranks by construction; c10d cannot broadcast
        DTensors). ``False``: nothing sharded, Lightning's setup runs."""
        if not (self._sharded_checkpoint and self.shards.module is self.model):
            return False
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_precision_plugin()
        return True

    def model_states(self) -> ModelStates:
        """Bytes of the full model's weights, buffers, gradients and optimizer state, and the sharding mode:
        what the planner's static memory is built from (:mod:`~lightning_dcp.runtime.sharding.states`)."""
        if self.shards is not None:
            return self.shards.states(self.optimizers)
        return measure_model_states(self.lightning_module, self.optimizers, self.mode,
                                    coresident=contract_units(self._model_contract)["coresident"])

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Sharded states load into the sharded module and optimizer, so after setup."""
        return self._weights_sharded

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return not self._weights_sharded

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state; sharded (each rank's DTensor shards) where the mode shards the weights."""
        return self.shards.model_state() if self._sharded_checkpoint else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.shards.optimizer_state(optimizer) if self._sharded_checkpoint else super().optimizer_state(optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._sharded_checkpoint:  # sharded: load_checkpoint already loaded every rank's shards
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._sharded_checkpoint:
            super().load_optimizer_state_dict(checkpoint)

    # ------------------------------------------------------------------ evaluation with sharded weights
    def _full_weights(self) -> None:
        """Evaluation starts: the mode's full weights (``"fsdp"``: gathered once, every rank)."""
        if self.shards is not None:
            self.shards.unshard()

    def _weights_at_rest(self) -> None:
        """Evaluation ends: the mode's resting state (``"fsdp"``, ``"hsdp"``: sharded again)."""
        if self.shards is not None:
            self.shards.at_rest()

    on_validation_start = on_test_start = on_predict_start = _full_weights
    on_validation_end = on_test_end = on_predict_end = _weights_at_rest
