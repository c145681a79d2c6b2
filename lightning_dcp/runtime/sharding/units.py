"""The ``fully_shard`` units of one LightningModule, shared by every mode that shards the weights.

:class:`FsdpUnits` makes every repeated layer of the model contract with parameters a
:func:`torch.distributed.fsdp.fully_shard` unit, then the LightningModule itself (the root: embeddings,
head), on a mesh the mode gives (``zero2`` / ``fsdp``: 1-D over the world,
:mod:`~lightning_dcp.runtime.sharding.gathered`; ``hsdp``: over shard groups,
:mod:`~lightning_dcp.runtime.sharding.hsdp`). Co-resident frozen modules
(:attr:`~lightning_dcp.sp.contract.ModelContract.coresident`) are the root's ``ignored_params``: plain
replicas, never gathered. It also holds what those modes share: the optimizer check, the resting
state's unshard / reshard, sharded checkpoints (:mod:`~lightning_dcp.runtime.checkpoint`) and the bytes
measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn

from lightning_dcp.planning.sharding.base import ShardingMode
from lightning_dcp.runtime.sharding.states import ModelStates, measure_model_states

__all__ = ["FsdpUnits", "check_parameters", "shard_units"]


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


def check_parameters(module: nn.Module, mode: str, nearest: str, skip: set[int] = frozenset()) -> None:
    """Every parameter ``fully_shard`` must shard is one it can (``skip``: ids of co-resident parameters).

    Raises:
        ValueError: a scalar or non-contiguous parameter, naming it and ``nearest`` (the mode that works).
    """
    for name, p in module.named_parameters():
        if id(p) in skip:
            continue
        if p.dim() == 0:
            raise ValueError(f"sharding={mode!r}: parameter {name!r} is a scalar (0-d); fully_shard splits dim 0 and "
                             f"cannot shard it. Make it a 1-element tensor (shape [1]) or use {nearest}")
        if not p.is_contiguous():
            raise ValueError(f"sharding={mode!r}: parameter {name!r} (shape {tuple(p.shape)}, stride {p.stride()}) is "
                             f"not contiguous; fully_shard needs contiguous parameters. Make it contiguous or use {nearest}")


class FsdpUnits:
    """The ``fully_shard`` units of one LightningModule (see the module docstring).

    Args:
        module: the LightningModule (after the rank-0 weights were broadcast).
        mode: the mode's pure counterpart.
        mesh: makes the device mesh the units are sharded on (called once the module passed the checks).
        layers: the model contract's repeated layers (each its own unit; the module is the root unit).
        coresident: modules kept out of the units (frozen, replicated).
        reshard_after_forward: FSDP's setting for every unit.
        offload_policy: FSDP's offload policy (default: none).
        nearest: the mode to name in errors when ``fully_shard`` refuses the module.

    Raises:
        ValueError: a parameter ``fully_shard`` cannot shard, a trainable co-resident module, or
            ``fully_shard`` refusing the module, naming the nearest mode that works.
    """

    sharded_checkpoint = True

    def __init__(self, module: nn.Module, mode: ShardingMode, mesh: Callable[[], Any], *, layers: Sequence[nn.Module],
                 coresident: Sequence[nn.Module] = (), reshard_after_forward: bool, offload_policy: Any = None,
                 nearest: str) -> None:
        from torch.distributed.fsdp import OffloadPolicy, fully_shard

        self.mode, self.coresident = mode, tuple(coresident)
        trainable = [name for name, m in module.named_children() for p in m.parameters()
                     if any(m is c for c in self.coresident) and p.requires_grad]
        if trainable:
            raise ValueError(f"sharding={mode.name!r}: co-resident module(s) {sorted(set(trainable))} have trainable "
                             "parameters; a co-resident module is a frozen replica (requires_grad=False), kept out of the "
                             "sharded units. Freeze it, or leave it out of dcp_coresident so it is sharded and trained")
        ignored = {p for m in self.coresident for p in m.parameters()}
        check_parameters(module, mode.name, nearest, {id(p) for p in ignored})
        self.mesh = mesh = mesh()
        units = shard_units(module, layers)
        policy = offload_policy if offload_policy is not None else OffloadPolicy()
        try:
            for unit in units:
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=policy)
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=policy,
                        ignored_params=ignored or None)
        except (NotImplementedError, ValueError, RuntimeError, AssertionError) as err:
            raise ValueError(f"sharding={mode.name!r} cannot shard {type(module).__name__}: torch's fully_shard refused "
                             f"it ({type(err).__name__}: {err}). Use {nearest}") from err
        self.layer_units = units
        self.units = [*units, module]
        # the root must know it is the root before any unit runs forward (the module's own forward never
        # runs: training_step calls submodules), else the first unit called would claim the root role
        module._get_fsdp_state()._lazy_init()
        self.module = module
        self._ignored = {id(p) for p in ignored}
        self.sharded = {n: p for n, p in module.named_parameters() if id(p) not in self._ignored}
        """Name -> the sharded DTensor parameter (what the optimizer steps; the module holds these until
        the first :meth:`unshard`, so ``configure_optimizers`` sees them)."""
        self.full: dict[str, nn.Parameter] = {}
        """Name -> the unsharded parameter (what forward and backward use; the same objects every step)."""

    # ------------------------------------------------------------------ setup
    def setup_optimizers(self, optimizers: list[Any], lr_scheduler_configs: Sequence[Any]) -> list[Any]:
        """Every optimized parameter must be a sharded one (an optimizer built over the full weights would
        step a copy FSDP overwrites at the next all-gather).

        Raises:
            ValueError: an optimizer holds a parameter that is not a sharded one.
        """
        sharded = {id(p) for p in self.sharded.values()} | self._ignored  # co-resident ones are frozen: never stepped
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in sharded:
                        raise ValueError(
                            f"sharding={self.mode.name!r}: {type(opt).__name__} holds a parameter of shape "
                            f"{tuple(p.shape)} that is not one of the module's sharded parameters; build the optimizer "
                            "in configure_optimizers from self.parameters() (the strategy shards the module before it "
                            "calls configure_optimizers)")
        return optimizers

    def optimized_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.sharded)

    def states(self, optimizers: Sequence[Any]) -> ModelStates:
        return measure_model_states(self.module, optimizers, self.mode, units=self.layer_units,
                                    coresident=self.coresident)

    @property
    def unsaveable_reason(self) -> str | None:
        return f"sharding={self.mode.name!r} shards the model states; gathering them needs every rank"

    # ------------------------------------------------------------------ unshard / reshard
    def _unshard_units(self) -> None:
        """All-gather every unit that is sharded (a collective of the mesh per such unit, in a fixed order)."""
        for unit in self.units:
            unit.unshard()
        if not self.full:
            self.full = {n: p for n, p in self.module.named_parameters() if id(p) not in self._ignored}
            if set(self.full) != set(self.sharded):
                raise RuntimeError(f"fully_shard renamed parameters: {sorted(set(self.full) ^ set(self.sharded))}")

    def reshard(self) -> None:
        """Free every unit's full weights (local, no collective)."""
        for unit in self.units:
            unit.reshard()

    # ------------------------------------------------------------------ checkpoints
    def model_state(self) -> dict[str, Any]:
        from lightning_dcp.runtime.checkpoint import model_state

        return model_state(self.module)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from lightning_dcp.runtime.checkpoint import optimizer_state

        return optimizer_state(self.module, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Path, *, rank: int, barrier: Callable[[], None]) -> None:
        from lightning_dcp.runtime.checkpoint import save_sharded

        save_sharded(checkpoint, path, rank=rank, barrier=barrier)
        self.at_rest()  # taking the state dicts resharded the weights; zero2 gathers them again

    def load_checkpoint(self, path: Path, optimizers: list[Any], *, strict: bool = True) -> dict[str, Any]:
        from lightning_dcp.runtime.checkpoint import load_sharded

        checkpoint = load_sharded(path, self.module, optimizers, strict=strict)
        self.at_rest()
        return checkpoint

    def at_rest(self) -> None:  # pragma: no cover - every mode defines its own
        raise NotImplementedError

    def _drop_sharded_grads(self) -> None:
        for p in self.sharded.values():
            p.grad = None
