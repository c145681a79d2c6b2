"""Full replicas of the weights (``sharding="none"``; ``"zero1"`` builds on it): the step's gradients reduced once.

Ranks run different numbers of micro-batches, so nothing is reduced inside the loop: each rank runs
its items in plan order (one round per item, no dummy), accumulating into flat buckets, and once per
step the buckets are SUM all-reduced over the world and scaled by ``1 / global loss units``
(:class:`~lightning_dcp.runtime.buckets.GradBuckets`). Checkpoints are Lightning's own file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_dcp.planning.plan import StepPlan
from lightning_dcp.planning.sharding.base import ShardingMode
from lightning_dcp.runtime.buckets import GradBuckets
from lightning_dcp.runtime.sharding.protocol import Round
from lightning_dcp.runtime.sharding.states import ModelStates, measure_model_states

__all__ = ["ReplicatedShards"]


class ReplicatedShards:
    """``sharding="none"``: every rank holds the full model; one bucketed all-reduce per step.

    Args:
        module: the LightningModule.
        mode: the mode's pure counterpart.
        device: the root device (unused: nothing is sharded).
        layers: the model contract's repeated layers (their sizes, for the bytes measured).
        coresident: co-resident modules (held in full like everything here).
    """

    sharded_checkpoint = False

    def __init__(self, module: nn.Module, mode: ShardingMode, device: torch.device | None = None, *,
                 layers: Sequence[nn.Module] = (), coresident: Sequence[nn.Module] = ()) -> None:
        self.module, self.mode = module, mode
        self.layers, self.coresident = tuple(layers), tuple(coresident)

    # ------------------------------------------------------------------ setup
    def setup_optimizers(self, optimizers: list[Any], lr_scheduler_configs: Sequence[Any]) -> list[Any]:
        return optimizers

    def optimized_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.module.named_parameters())

    def states(self, optimizers: Sequence[Any]) -> ModelStates:
        from lightning_dcp.runtime.sharding.units import shard_units

        return measure_model_states(self.module, optimizers, self.mode, units=shard_units(self.module, self.layers),
                                    coresident=self.coresident)

    @property
    def unsaveable_reason(self) -> str | None:
        return None

    # ------------------------------------------------------------------ a step
    def begin_step(self) -> None:
        """Nothing to gather."""

    def rounds(self, plan: StepPlan, rank: int) -> list[Round]:
        """One round per item of this rank, in plan order."""
        return [Round(i) for i in self.mode.rounds.rank_rounds(plan, self.mode.world_size, rank)]

    def begin_round(self, rnd: Round) -> None:
        """Nothing: no collective inside the loop but the SP groups'."""

    def run_dummy(self) -> None:
        raise RuntimeError(f"sharding={self.mode.name!r} runs no dummy rounds (no collective inside the loop)")

    def grad_reduction(self, cap_bytes: int) -> GradBuckets:
        """All-reduce buckets over the trainable parameters."""
        return GradBuckets([p for p in self.module.parameters() if p.requires_grad], cap_bytes)

    def after_reduce(self) -> None:
        """The gradients are the reduced ones."""

    def after_step(self) -> None:
        """The replicas were stepped alike."""

    # ------------------------------------------------------------------ resting state and evaluation
    def unshard(self) -> None:
        """The weights are full."""

    def at_rest(self) -> None:
        """The weights are full."""

    def reshard(self) -> None:
        """Nothing is sharded."""

    # ------------------------------------------------------------------ checkpoints: Lightning's own file
    def model_state(self) -> dict[str, Any]:
        raise NotImplementedError(f"sharding={self.mode.name!r} saves Lightning's own checkpoint file")

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        raise NotImplementedError(f"sharding={self.mode.name!r} saves Lightning's own checkpoint file")

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Path, *, rank: int, barrier: Callable[[], None]) -> None:
        raise NotImplementedError(f"sharding={self.mode.name!r} saves Lightning's own checkpoint file")

    def load_checkpoint(self, path: Path, optimizers: list[Any], *, strict: bool = True) -> dict[str, Any]:
        raise NotImplementedError(f"sharding={self.mode.name!r} loads Lightning's own checkpoint file")
