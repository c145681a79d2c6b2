"""Per-layer sharding inside the micro-batch loop: ``DCPStrategy(sharding="hsdp", shard_group_size=K)``.

Every repeated layer of the model contract and the LightningModule itself (the root: embeddings,
head) are ``fully_shard`` units (:class:`~lightning_dcp.runtime.sharding.units.FsdpUnits`) on a
:class:`~torch.distributed.device_mesh.DeviceMesh` that is 1-D over the world when ``K`` is the world
(ZeRO-3) and 2-D ``(replicate, shard) = (N/K, K)`` otherwise (HSDP: the states sharded over a shard
group of ``K`` consecutive ranks, replicated across the ``N/K`` groups). FSDP's own schedule runs: a
layer's weights are all-gathered just before its forward and again before its backward
(``reshard_after_forward=True``), its gradients reduce-scattered inside the shard group right after
its backward. Only two layers' weights are full at a time.

Those collectives run inside the micro-batch loop, so every rank of a shard group runs the plan's
lockstep rounds (:class:`~lightning_dcp.planning.rounds.Lockstep`): its item of a round or,
where it has none, a dummy round that runs only the collectives
(:class:`~lightning_dcp.runtime.sharding.dummy.CollectivesOnlyRound`). Per round
(:meth:`HsdpShards.begin_round`):

- every rank of a shard group reduce-scatters a gradient for every trainable parameter of a unit, zeros for the
  ones its input left unused (:mod:`~lightning_dcp.runtime.sharding.unused`: a Wan block's cross-attention on an
  SP rank holding only padding), so the ranks' reduce-scatters have one size;
- the reduce-scatter sums into the sharded gradients (``set_gradient_divide_factor(1.0)`` and
  ``set_force_sum_reduction_for_comms(True)``: a plain SUM, which gloo has; NCCL's PREMUL_SUM is not
  used), accumulated over the rounds by FSDP;
- the all-reduce across the replicas runs in the last round only (``set_requires_all_reduce``; FSDP keeps
  the earlier rounds' reduce-scatter outputs and adds them in), and ``set_is_last_backward`` says which
  round is the last.

An SP item may span shard groups: it runs in the same round of every group it touches (its ranks run their own
group's per-layer collectives and the item's all-to-all), and a step with such an item gives every group the same
round count, so the last round, whose backward all-reduces across the replicas layer by layer, is every group's
(:func:`~lightning_dcp.planning.rounds.lockstep_rounds`).

Lightning's closure calls ``zero_grad`` after ``training_step`` (where every backward ran): the
accumulated sharded gradients are parked (:class:`HsdpGrads`) after the loop and put back, scaled by
``1 / global loss units`` (the step-end gather's divisor), right after the closure, before clipping
and the optimizer step. ``training_step``, ``validation_step``, ``test_step`` and ``predict_step`` are
FSDP forward methods (``register_fsdp_forward_method``), so the root unit gathers around them:
evaluation needs no gather up front, and every rank runs the same number of evaluation batches
(Lightning's distributed sampler). Memory per rank: :mod:`lightning_dcp.planning.sharding.hsdp`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from lightning_dcp.planning.plan import StepPlan
from lightning_dcp.planning.sharding.base import ShardingMode
from lightning_dcp.runtime.sharding.dummy import CollectivesOnlyRound
from lightning_dcp.runtime.sharding.protocol import Round
from lightning_dcp.runtime.sharding.units import FsdpUnits
from lightning_dcp.runtime.sharding.unused import reduce_scatter_unused_params

__all__ = ["FORWARD_METHODS", "HsdpGrads", "HsdpShards"]

#: The LightningModule methods that run as the root unit's forward (its weights gathered around them).
FORWARD_METHODS = ("training_step", "validation_step", "test_step", "predict_step")

_NEAREST = "sharding='fsdp' (weights gathered once per step, full during the step)"


class HsdpGrads:
    """The sharded gradients of one step, kept out of Lightning's ``zero_grad``: the executor's gradient
    buckets under ``"hsdp"`` (the :class:`~lightning_dcp.runtime.sharding.protocol.GradReduction` calls)."""

    def __init__(self, sharded: Sequence[nn.Parameter]) -> None:
        self.params = [p for p in sharded if p.requires_grad]
        self._parked: list[Tensor | None] = [None] * len(self.params)

    def begin(self) -> None:
        """Step start: no gradient left from an earlier step (FSDP accumulates into ``.grad``)."""
        for p in self.params:
            p.grad = None
        self._parked = [None] * len(self.params)

    def park(self) -> None:
        """After the loop: the reduce-scattered (summed) sharded gradients leave ``.grad``."""
        self._parked = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    @property
    def parked(self) -> list[Tensor | None]:
        """The parked sharded gradients (between the loop and the reduction)."""
        return list(self._parked)

    @property
    def has_grad(self) -> Tensor:
        return torch.tensor([0.0 if g is None else 1.0 for g in self._parked], dtype=torch.float64)

    def reduce(self, world_has_grad: Tensor | None, group: Any = None, world: int = 1, scale: float = 1.0) -> None:
        """The parked gradients back on the sharded parameters, times ``scale`` (FSDP already reduced them)."""
        for p, g in zip(self.params, self._parked):
            if g is not None:
                g.mul_(scale)
            p.grad = g
        self._parked = [None] * len(self.params)


class HsdpShards(FsdpUnits):
    """The ``fully_shard`` units of ``sharding="hsdp"`` and what the runtime does with them per round.

    Args:
        module: the LightningModule (after the rank-0 weights were broadcast).
        mode: its :class:`~lightning_dcp.planning.sharding.hsdp.HsdpMode` (world, ``K``, offload).
        device: the root device (its type names the mesh).
        layers: the model contract's repeated layers in call order (each its own unit; the module is the root).
        coresident: modules kept out of the units.

    Raises:
        ValueError: ``offload=True`` on a device whose memory is the host's, or a module ``fully_shard``
            cannot shard (named, with the nearest mode).
    """

    def __init__(self, module: nn.Module, mode: ShardingMode, device: torch.device, *, layers: Sequence[nn.Module] = (),
                 coresident: Sequence[nn.Module] = ()) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, register_fsdp_forward_method

        n, k = mode.world_size, int(mode.shard_group_size)
        if mode.offload and device.type != "cuda":
            raise ValueError(f"offload=True keeps the shards in host memory and copies them to the accelerator for each "
                             f"layer (FSDP2's CPUOffloadPolicy); this run is on {device.type!r}, where the shards are in "
                             "host memory already: drop offload=True")
        def mesh() -> Any:
            if k == n:
                return init_device_mesh(device.type, (n,))
            return init_device_mesh(device.type, (n // k, k), mesh_dim_names=("replicate", "shard"))

        super().__init__(module, mode, mesh, layers=layers, coresident=coresident, reshard_after_forward=True,
                         offload_policy=CPUOffloadPolicy() if mode.offload else None, nearest=_NEAREST)
        self.shard_group_size, self.offload = k, mode.offload
        for name in FORWARD_METHODS:
            if callable(getattr(module, name, None)):
                register_fsdp_forward_method(module, name)
        for unit in self.units:
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            reduce_scatter_unused_params(unit)
        self.dummy = CollectivesOnlyRound(module, layers, self.units, self.coresident, device)

    # ------------------------------------------------------------------ a step
    def begin_step(self) -> None:
        self._drop_sharded_grads()

    def rounds(self, plan: StepPlan, rank: int) -> list[Round]:
        """This rank's lockstep rounds of ``plan``: the same count on every rank of its shard group."""
        positions = self.mode.rounds.rank_rounds(plan, self.mode.world_size, rank)
        return [Round(p, last=r == len(positions) - 1, lockstep=True) for r, p in enumerate(positions)]

    def begin_round(self, rnd: Round) -> None:
        """Before a round's forward: the replicas' all-reduce only in the step's last round."""
        for unit in self.units:
            unit.set_requires_all_reduce(rnd.last, recurse=False)
        self.module.set_is_last_backward(rnd.last)

    def run_dummy(self) -> None:
        """A round without an item: the collectives only (:class:`~lightning_dcp.runtime.sharding.dummy.CollectivesOnlyRound`)."""
        self.dummy.run()

    def grad_reduction(self, cap_bytes: int) -> HsdpGrads:
        return HsdpGrads(list(self.sharded.values()))

    def after_reduce(self) -> None:
        """The gradients already are the sharded ones."""

    def after_step(self) -> None:
        """The weights stay sharded."""

    # ------------------------------------------------------------------ resting state and evaluation
    def unshard(self) -> None:
        """Nothing to gather up front: FSDP gathers each layer around its forward (evaluation too)."""

    def at_rest(self) -> None:
        self.reshard()
