"""Per-layer sharding inside the micro-batch loop: ``DCPStrategy(sharding="hsdp", shard_group_size=K)``.

Every repeated layer of the model contract and the LightningModule itself (the root: embeddings,
head) are :func:`torch.distributed.fsdp.fully_shard` units on a :class:`~torch.distributed.device_mesh.DeviceMesh`
that is 1-D over the world when ``K`` is the world (ZeRO-3) and 2-D ``(replicate, shard) = (N/K, K)``
otherwise (HSDP: the states sharded over a shard group of ``K`` consecutive ranks, replicated across
the ``N/K`` groups). FSDP's own schedule runs: a layer's weights are all-gathered just before its
forward and again before its backward (``reshard_after_forward=True``), its gradients reduce-scattered
inside the shard group right after its backward. Only two layers' weights are full at a time.

Those collectives run inside the micro-batch loop, so every rank of a shard group must run the same
number of micro-batches, in lockstep: the executor runs the plan's *rounds*
(:func:`lightning_dcp.planning.rounds.lockstep_rounds`), this rank's item of a round or, where it has
none, a **dummy** micro-batch (the step's first sample at SP 1, its loss times 0: zero gradients, but
every layer's collectives). Per round (:meth:`HsdpParameters.begin_round`):

- the reduce-scatter sums into the sharded gradients (``set_gradient_divide_factor(1.0)`` and
  ``set_force_sum_reduction_for_comms(True)``: a plain SUM, which gloo has; NCCL's PREMUL_SUM is not
  used), accumulated over the rounds by FSDP;
- the all-reduce across the replicas runs in the last round only (``set_requires_all_reduce``; FSDP keeps
  the earlier rounds' reduce-scatter outputs and adds them in), and ``set_is_last_backward`` says which
  round is the last.

Lightning's closure calls ``zero_grad`` after ``training_step`` (where every backward ran): the
accumulated sharded gradients are parked (:class:`HsdpGrads`) after the loop and put back, scaled by
``1 / global loss units`` (the step-end gather's divisor), right after the closure, before clipping
and the optimizer step. ``training_step``, ``validation_step``, ``test_step`` and ``predict_step`` are
FSDP forward methods (``register_fsdp_forward_method``), so the root unit gathers around them.

Memory per rank in the loop: ``(W + G + O)/K + B + 2R + 4L`` (``R`` the root unit's weights, ``L`` the
largest layer's), with ``offload`` (FSDP2's ``CPUOffloadPolicy``) ``B + 2R + 4L`` on the device; see
:func:`lightning_dcp.planning.state_sharding.state_bytes`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from lightning_dcp.planning.plan import StepPlan
from lightning_dcp.planning.rounds import lockstep_rounds
from lightning_dcp.runtime.fsdp import ShardedParameters, _check_parameters, shard_units

__all__ = ["FORWARD_METHODS", "HsdpGrads", "HsdpParameters", "rank_rounds", "shard_module", "unit_bytes"]

#: The LightningModule methods that run as the root unit's forward (its weights gathered around them).
FORWARD_METHODS = ("training_step", "validation_step", "test_step", "predict_step")

_NEAREST = "sharding='fsdp' (weights gathered once per step, full during the step)"


def rank_rounds(plan: StepPlan, world_size: int, shard_group_size: int, rank: int) -> list[int | None]:
    """Per lockstep round of ``rank``'s shard group: the position of this rank's item in its micro-batch
    loop (``Step.items`` order), or ``None`` where it runs a dummy. Every rank of a group gets a list of
    the same length (the group's round count), computed from the plan alone. A group without any item
    still runs one dummy round when there are replicas: every group takes part in the replicas' all-reduce."""
    k = int(shard_group_size)
    group = lockstep_rounds(plan, world_size, k)[int(rank) // k]
    mine = [i for i, item in enumerate(plan.items) if rank in item.ranks]
    position = {index: pos for pos, index in enumerate(mine)}
    out: list[int | None] = []
    for rnd in group.rounds:
        hit = [position[i] for i in rnd if i in position]
        out.append(hit[0] if hit else None)
    if not out and int(world_size) > k and plan.items:
        out.append(None)
    return out


def unit_bytes(module: nn.Module, layers: Sequence[nn.Module]) -> tuple[float, float]:
    """(largest layer's weight bytes ``L``, weight bytes outside the layers ``R``) of ``module``: what
    :func:`~lightning_dcp.planning.state_sharding.state_bytes` needs for ``"hsdp"``."""
    def size(params: Any) -> float:
        return float(sum(p.numel() * p.element_size() for p in params))

    units = shard_units(module, layers)
    in_layers = {id(p) for u in units for p in u.parameters()}
    largest = max((size(u.parameters()) for u in units), default=0.0)
    return largest, size(p for p in module.parameters() if id(p) not in in_layers)


class HsdpGrads:
    """The sharded gradients of one step, kept out of Lightning's ``zero_grad``: the executor's gradient
    buckets under ``"hsdp"`` (same calls as :class:`~lightning_dcp.runtime.buckets.GradBuckets`)."""

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


class HsdpParameters(ShardedParameters):
    """The ``fully_shard`` units of ``sharding="hsdp"`` and what the runtime does with them per round.

    Args:
        module: the LightningModule (after the rank-0 weights were broadcast).
        device: the root device (its type names the mesh).
        world_size: ranks in the world.
        shard_group_size: ``K``, a divisor of the world.
        layers: the model contract's repeated layers (each its own unit; the module is the root unit).
        offload: keep the sharded states on the host (``CPUOffloadPolicy``).
    """

    def __init__(self, module: nn.Module, device: torch.device, world_size: int, shard_group_size: int,
                 layers: Sequence[nn.Module] = (), offload: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method

        n, k = int(world_size), int(shard_group_size)
        if k < 1 or n % k:
            raise ValueError(f"shard_group_size={shard_group_size} must be a positive divisor of the world size ({n})")
        self.mode, self.world_size, self.shard_group_size, self.offload = "hsdp", n, k, bool(offload)
        _check_parameters(module, "hsdp")
        if offload and device.type != "cuda":
            raise ValueError(f"offload=True keeps the shards in host memory and copies them to the accelerator for each "
                             f"layer (FSDP2's CPUOffloadPolicy); this run is on {device.type!r}, where the shards are in "
                             "host memory already: drop offload=True")
        if k == n:
            self.mesh = init_device_mesh(device.type, (n,))
        else:
            self.mesh = init_device_mesh(device.type, (n // k, k), mesh_dim_names=("replicate", "shard"))
        policy = CPUOffloadPolicy() if offload else OffloadPolicy()
        units = shard_units(module, layers)
        try:
            for unit in units:
                fully_shard(unit, mesh=self.mesh, reshard_after_forward=True, offload_policy=policy)
            fully_shard(module, mesh=self.mesh, reshard_after_forward=True, offload_policy=policy)
        except (NotImplementedError, ValueError, RuntimeError, AssertionError) as err:
            raise ValueError(f"sharding='hsdp' cannot shard {type(module).__name__}: torch's fully_shard refused it "
                             f"({type(err).__name__}: {err}). Use {_NEAREST}") from err
        for name in FORWARD_METHODS:
            if callable(getattr(module, name, None)):
                register_fsdp_forward_method(module, name)
        self.units = [*units, module]
        module._get_fsdp_state()._lazy_init()  # the module is the root before any unit runs
        for unit in self.units:
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        self.module = module
        self.sharded = dict(module.named_parameters())
        self.full = {}

    def rounds(self, plan: StepPlan, rank: int) -> list[int | None]:
        """This rank's lockstep rounds of ``plan`` (:func:`rank_rounds`)."""
        return rank_rounds(plan, self.world_size, self.shard_group_size, rank)

    def begin_round(self, last: bool) -> None:
        """Before a round's forward: the replicas' all-reduce only in the step's last round."""
        for unit in self.units:
            unit.set_requires_all_reduce(last, recurse=False)
        self.module.set_is_last_backward(last)

    # ------------------------------------------------------------------ the runtime's per-step calls
    def unshard(self) -> None:
        """Nothing to gather up front: FSDP gathers each layer around its forward and backward."""

    def begin_step(self) -> None:
        for p in self.sharded.values():
            p.grad = None

    def after_reduce(self) -> None:
        """The gradients already are the sharded ones."""

    def after_step(self) -> None:
        """The weights stay sharded."""

    def at_rest(self) -> None:
        self.reshard()

    def grad_buckets(self, cap_bytes: int) -> HsdpGrads:
        return HsdpGrads(list(self.sharded.values()))


def shard_module(module: nn.Module, mode: str, device: torch.device, world_size: int, *, layers: Sequence[nn.Module],
                 k: int | None = None, offload: bool = False) -> ShardedParameters:
    """The sharded units of ``module`` under ``mode``: :class:`ShardedParameters` (``"zero2"`` / ``"fsdp"``), or
    :class:`HsdpParameters` over shard groups of ``k`` ranks (``"hsdp"``)."""
    if mode == "hsdp":
        return HsdpParameters(module, device, world_size, k if k is not None else world_size, layers=layers,
                              offload=offload)
    return ShardedParameters(module, mode, device, world_size, layers=layers)
