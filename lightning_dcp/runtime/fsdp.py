"""Sharded weights (``DCPStrategy(sharding="zero2" | "fsdp")``): torch's ``fully_shard`` driven once per step.

Ranks run different numbers of micro-batches, in different SP groups, every step. FSDP's own
schedule issues a world all-gather before each unit's forward and a world reduce-scatter after its
backward, inside the micro-batch loop: that deadlocks here even with equal counts (rank A waits in
layer k's SP all-to-all with B while B waits in a world all-gather that A reaches only after that
all-to-all), and ranks with no micro-batch never reach it at all. So no world collective runs inside
the loop. The units (every repeated layer, then the whole LightningModule, sharded by
:func:`torch.distributed.fsdp.fully_shard` over a 1-D mesh of the world) are configured with gradient
sync off and no resharding after forward or backward; FSDP's hooks then only keep their bookkeeping,
and the runtime moves the weights itself, the same collectives in the same order on every rank:

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
5. ``"zero2"``: ``unshard()``, one all-gather per unit, so the weights are full again until the next
   step (``"fsdp"`` stays sharded until the next step's start).

Memory per rank (``W`` weights, ``B`` buffers, ``G`` gradients, ``O`` optimizer state of the full model,
``N`` ranks; the formulas live in :mod:`lightning_dcp.planning.state_sharding`): ``"zero2"`` holds
``W + W/N + B + G/N + O/N`` between steps (FSDP keeps the shard beside the full weights) and
``W + W/N + B + G + O/N`` in the loop; ``"fsdp"`` holds ``W/N + B + G/N + O/N`` between steps and the
same as ``"zero2"`` in the loop (the price of no collective inside it: full weights and full local
gradients during the step). So in the loop -- where the activations' room is decided -- ``"zero1"``
(``W + B + G + O/N``) holds the least; ``"zero2"`` / ``"fsdp"`` free memory between steps (evaluation,
co-resident models) and write sharded checkpoints without gathering anything on one rank.
:mod:`lightning_dcp.runtime.states` turns this into the planner's static memory.

A true ZeRO-3 peak (weights gathered per layer inside the loop) would need every rank to run the
same number of micro-batch *rounds*, each SP item in the same round on all its ranks and zero-weight
dummy micro-batches where a rank has none, plus a reduce-scatter per round: ``sharding="hsdp"``,
:mod:`lightning_dcp.runtime.hsdp`.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn

from lightning_dcp.runtime.buckets import ShardedGradBuckets

__all__ = ["FULLY_SHARDED_MODES", "ShardedParameters", "ShardedSpawnLauncher", "check_precision",
           "shard_units"]

#: The sharding modes this module runs (``"none"`` and ``"zero1"`` keep full replicas of the weights).
FULLY_SHARDED_MODES = ("zero2", "fsdp")

_NEAREST = "sharding='zero1' (full weights and gradients, optimizer state sharded)"


def shard_units(module: nn.Module, layers: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules to shard one by one, innermost first: every repeated layer with parameters (``layers``:
    the model contract's, :attr:`lightning_dcp.sp.contract.ModelContract.layers`); the caller shards
    ``module`` itself last. A unit is all-gathered as one piece, so per-layer units bound the all-gather's
    transient memory by a layer."""
    units: list[nn.Module] = []
    seen: set[int] = set()
    for layer in layers:
        if id(layer) not in seen and layer is not module and any(True for _ in layer.parameters()):
            seen.add(id(layer))
            units.append(layer)
    depth = {id(m): name.count(".") + (1 if name else 0) for name, m in module.named_modules()}
    return sorted(units, key=lambda m: -depth.get(id(m), 0))


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
            f"'16-mixed' with {_NEAREST}")


def _check_parameters(module: nn.Module, mode: str) -> None:
    for name, p in module.named_parameters():
        if p.dim() == 0:
            raise ValueError(f"sharding={mode!r}: parameter {name!r} is a scalar (0-d); fully_shard splits dim 0 and "
                             f"cannot shard it. Make it a 1-element tensor (shape [1]) or use {_NEAREST}")
        if not p.is_contiguous():
            raise ValueError(f"sharding={mode!r}: parameter {name!r} (shape {tuple(p.shape)}, stride {p.stride()}) is "
                             f"not contiguous; fully_shard needs contiguous parameters. Make it contiguous or use {_NEAREST}")


class ShardedParameters:
    """The ``fully_shard`` units of one LightningModule and what the runtime does with them per step.

    Args:
        module: the LightningModule (after the rank-0 weights were broadcast).
        mode: ``"zero2"`` or ``"fsdp"``.
        device: the root device (its type names the mesh: ``"cpu"`` with gloo, ``"cuda"`` with NCCL).
        world_size: ranks in the world (the mesh).
        layers: the repeated layers (the model contract's), each its own unit; the module is the last unit.

    Raises:
        ValueError: a parameter ``fully_shard`` cannot shard (scalar, non-contiguous, shared across
            units...), naming the parameter and the nearest mode that works.
    """

    def __init__(self, module: nn.Module, mode: str, device: torch.device, world_size: int,
                 layers: Sequence[nn.Module] = ()) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if mode not in FULLY_SHARDED_MODES:
            raise ValueError(f"ShardedParameters runs {FULLY_SHARDED_MODES}, got {mode!r}")
        self.mode = mode
        self.world_size = world_size
        _check_parameters(module, mode)
        self.mesh = init_device_mesh(device.type, (world_size,))
        units = shard_units(module, layers)
        try:
            for unit in units:
                fully_shard(unit, mesh=self.mesh, reshard_after_forward=False)
            fully_shard(module, mesh=self.mesh, reshard_after_forward=False)
        except (NotImplementedError, ValueError, RuntimeError, AssertionError) as err:
            raise ValueError(f"sharding={mode!r} cannot shard {type(module).__name__}: torch's fully_shard refused it "
                             f"({type(err).__name__}: {err}). Use {_NEAREST}") from err
        self.units = [*units, module]
        # the root must know it is the root before any unit runs forward (the module's own forward never
        # runs: training_step calls submodules), else the first unit called would claim the root role
        module._get_fsdp_state()._lazy_init()
        for unit in self.units:
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
        self.module = module
        self.sharded = dict(module.named_parameters())
        """Name -> the sharded DTensor parameter (what the optimizer steps; the module holds these until
        the first :meth:`unshard`, so ``configure_optimizers`` sees them)."""
        self.full: dict[str, nn.Parameter] = {}
        """Name -> the unsharded parameter (what forward and backward use; the same objects every step)."""

    def check_optimizers(self, optimizers: Iterable[Any]) -> None:
        """Every optimized parameter must be a sharded one (an optimizer built over the full weights would
        step a copy FSDP overwrites at the next all-gather).

        Raises:
            ValueError: an optimizer holds a parameter that is not a sharded one.
        """
        sharded = {id(p) for p in self.sharded.values()}
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in sharded:
                        raise ValueError(
                            f"sharding={self.mode!r}: {type(opt).__name__} holds a parameter of shape {tuple(p.shape)} "
                            "that is not one of the module's sharded parameters; build the optimizer in "
                            "configure_optimizers from self.parameters() (the strategy shards the module before it "
                            "calls configure_optimizers)")

    # ------------------------------------------------------------------ per step
    def unshard(self) -> None:
        """All-gather every unit that is sharded (a world collective per such unit, in a fixed order)."""
        for unit in self.units:
            unit.unshard()
        if not self.full:
            self.full = dict(self.module.named_parameters())
            if set(self.full) != set(self.sharded):
                raise RuntimeError(f"fully_shard renamed parameters: {sorted(set(self.full) ^ set(self.sharded))}")

    def reshard(self) -> None:
        """Free every unit's full weights (local, no collective)."""
        for unit in self.units:
            unit.reshard()

    def begin_step(self) -> None:
        """Step start, on every rank before its first micro-batch: full weights for the step; the last step's
        sharded gradients are dropped now (Lightning's ``zero_grad`` comes only after ``training_step``)."""
        for p in self.sharded.values():
            p.grad = None
        self.unshard()

    def after_reduce(self) -> None:
        """The gradients are sharded now: free the full weights, so clipping, ``on_before_optimizer_step``
        and the optimizer step see the module's sharded parameters and their gradients."""
        self.reshard()

    def after_step(self) -> None:
        """After the optimizer step: ``"zero2"`` all-gathers the updated shards into full weights."""
        if self.mode == "zero2":
            self.unshard()

    def at_rest(self) -> None:
        """Between steps and after evaluation: the mode's resting state (``"fsdp"`` sharded, ``"zero2"`` full)."""
        if self.mode == "fsdp":
            self.reshard()
        else:
            self.unshard()

    def grad_buckets(self, cap_bytes: int) -> ShardedGradBuckets:
        """Reduce-scatter buckets over the trainable parameters, in the module's parameter order."""
        if not self.full:
            raise RuntimeError("grad_buckets before the first unshard()")
        names = [n for n, p in self.full.items() if p.requires_grad]
        return ShardedGradBuckets([self.full[n] for n in names], [self.sharded[n] for n in names], cap_bytes)


class ShardedSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher for sharded weights: after the fit, rank 0 hands the main process the
    *full* weights, gathered from every rank's shards (all ranks take part), instead of its own DTensor
    shards, which the main process -- outside the process group -- could not load."""

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        module = trainer.lightning_module
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        module.state_dict = lambda *args, **kwargs: full  # what the base class saves for the main process
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
