"""Weights gathered once per step (``sharding="zero2"`` / ``"fsdp"``): torch's ``fully_shard`` driven by the runtime.

Ranks run different numbers of micro-batches, in different SP groups, every step. FSDP's own
schedule issues a world all-gather before each unit's forward and a world reduce-scatter after its
backward, inside the micro-batch loop: that deadlocks here even with equal counts (rank A waits in
layer k's SP all-to-all with B while B waits in a world all-gather that A reaches only after that
all-to-all), and ranks with no micro-batch never reach it at all. So no world collective runs inside
the loop. The units (:class:`~lightning_dcp.runtime.sharding.units.FsdpUnits` over a 1-D mesh of the
world) are configured with gradient sync off and no resharding after forward or backward; FSDP's hooks
then only keep their bookkeeping, and the runtime moves the weights itself, the same collectives in the
same order on every rank:

1. **step start**, before the first micro-batch (ranks with no micro-batch too): ``unshard()`` every
   unit in a fixed order (``"fsdp"``: one all-gather per unit; ``"zero2"``: already full, no-op);
2. **micro-batch loop**: no collective but the SP groups'; autograd accumulates this rank's full local
   gradient on the unsharded parameters;
3. **step end** (inside ``optimizer_step``'s closure): one bucketed SUM reduce-scatter of those
   gradients into the sharded DTensor gradients, scaled once by ``1 / global loss units``
   (:class:`~lightning_dcp.runtime.buckets.ShardedGradBuckets`); then ``reshard()`` frees the full
   weights, so the module's parameters are the sharded ones with their gradients;
4. clipping (DTensor norms are global), ``on_before_optimizer_step`` and the optimizer step, on each
   rank's shard only;
5. the mode's resting state (:meth:`GatheredShards.after_step`): ``"zero2"`` all-gathers the weights
   again, ``"fsdp"`` stays sharded until the next step's start.

Memory per rank: :mod:`lightning_dcp.planning.sharding.zero2` and :mod:`~lightning_dcp.planning.sharding.fsdp`.
A ZeRO-3 peak (weights gathered per layer inside the loop) is ``sharding="hsdp"``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from lightning_dcp.planning.plan import StepPlan
from lightning_dcp.planning.sharding.base import ShardingMode
from lightning_dcp.runtime.buckets import ShardedGradBuckets
from lightning_dcp.runtime.sharding.protocol import Round
from lightning_dcp.runtime.sharding.units import FsdpUnits

__all__ = ["NEAREST", "GatheredShards"]

#: The mode named when ``fully_shard`` cannot shard a module.
NEAREST = "sharding='zero1' (full weights and gradients, optimizer state sharded)"


class GatheredShards(FsdpUnits):
    """The ``fully_shard`` units of ``"zero2"`` / ``"fsdp"`` and what the runtime does with them per step.

    Args:
        module: the LightningModule (after the rank-0 weights were broadcast).
        mode: the mode's pure counterpart.
        device: the root device (its type names the mesh: ``"cpu"`` with gloo, ``"cuda"`` with NCCL).
        layers: the repeated layers (the model contract's), each its own unit; the module is the last unit.
        coresident: modules kept out of the units.
    """

    def __init__(self, module: nn.Module, mode: ShardingMode, device: torch.device, *, layers: Sequence[nn.Module] = (),
                 coresident: Sequence[nn.Module] = ()) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(module, mode, lambda: init_device_mesh(device.type, (mode.world_size,)), layers=layers, coresident=coresident, reshard_after_forward=False,
                         nearest=NEAREST)
        for unit in self.units:
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)

    # ------------------------------------------------------------------ per step
    def unshard(self) -> None:
        """All-gather every sharded unit (a world collective per unit, in a fixed order)."""
        self._unshard_units()

    def begin_step(self) -> None:
        """Step start, on every rank before its first micro-batch: full weights for the step; the last step's
        sharded gradients are dropped now (Lightning's ``zero_grad`` comes only after ``training_step``)."""
        self._drop_sharded_grads()
        self.unshard()

    def rounds(self, plan: StepPlan, rank: int) -> list[Round]:
        return [Round(i) for i in self.mode.rounds.rank_rounds(plan, self.mode.world_size, rank)]

    def begin_round(self, rnd: Round) -> None:
        """Nothing: no collective inside the loop."""

    def run_dummy(self) -> None:
        raise RuntimeError(f"sharding={self.mode.name!r} runs no dummy rounds (no collective inside the loop)")

    def grad_reduction(self, cap_bytes: int) -> ShardedGradBuckets:
        """Reduce-scatter buckets over the trainable parameters, in the module's parameter order."""
        if not self.full:
            raise RuntimeError("grad_reduction before the first unshard()")
        names = [n for n, p in self.full.items() if p.requires_grad]
        return ShardedGradBuckets([self.full[n] for n in names], [self.sharded[n] for n in names], cap_bytes)

    def after_reduce(self) -> None:
        """The gradients are sharded now: free the full weights, so clipping, ``on_before_optimizer_step``
        and the optimizer step see the module's sharded parameters and their gradients."""
        self.reshard()

    def after_step(self) -> None:
        """After the optimizer step: the mode's resting state."""
        self.at_rest()

    def at_rest(self) -> None:  # pragma: no cover - zero2 and fsdp define it
        raise NotImplementedError
