"""Which sharding mode a run runs, on which shard group: the strategy's one handle on the mode registry.

:class:`RunSharding` turns ``DCPStrategy(sharding=..., shard_group_size=..., offload=...)`` and the world
into the mode's pure counterpart (:mod:`lightning_dcp.planning.sharding`) and gives the collectives' prices of the device's hardware spec (a fallback: a cost model's own, from its
profile or hardware, come first).

**The shard group a run picks** when ``sharding="hsdp"`` gets no ``shard_group_size``
(:meth:`RunSharding.pick`): at setup, before the module is sharded (the mesh needs ``K``), every rank
measures the module's state bytes (the optimizer's estimated as Adam's: it does not exist yet), reads
the train dataset's lengths and picks the smallest ``K`` that fits, at least the node's processes
(:func:`~lightning_dcp.planning.sharding.shard_group_size.choose_shard_group_size`): the states in the
memory limit of the cost model given to the strategy (with its data check: the longest sample must fit
some SP size up to ``K``), else of the device (the profiler's default budget: CUDA total x 0.9, 8 GiB on
CPU; states only, since the profile is measured after sharding). It says which ``K`` and why; the
strategy compares ``K`` across ranks before it builds the mesh.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.prices import CollectivePrices
from lightning_dcp.planning.sharding.base import ShardingMode
from lightning_dcp.planning.sharding.registry import DEFAULT_MODE, MODES, get_mode
from lightning_dcp.planning.sharding.shard_group_size import ShardGroupChoice, choose_shard_group_size
from lightning_dcp.runtime.settings import DCPSettings
from lightning_dcp.runtime.sharding.states import measure_model_states, plan_cost_model
from lightning_dcp.runtime.sharding.units import shard_units
from lightning_dcp.sp.contract import ModelContract

__all__ = ["RunSharding", "contract_units", "train_dataset"]


def contract_units(contract: ModelContract | None) -> dict[str, Any]:
    """``layers=`` and ``coresident=`` of the model contract (what every mode's runtime is built with)."""
    return {"layers": contract.layers if contract is not None else (),
            "coresident": contract.coresident if contract is not None else ()}


def train_dataset(trainer: Any) -> Any:
    """The train dataloader's dataset, from the trainer's data source (``None`` when it has none)."""
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is None or not source.is_defined():
        return None
    loaders = source.dataloader()
    loader = loaders if not isinstance(loaders, (list, tuple, dict)) else (
        next(iter(loaders.values())) if isinstance(loaders, dict) else loaders[0])
    return getattr(loader, "dataset", None)


class RunSharding:
    """The run's sharding mode (see the module docstring)."""

    def __init__(self, settings: DCPSettings) -> None:
        self.settings = settings
        self.picked: int | None = None
        """The shard group picked at setup (when the settings give none)."""

    def name(self, world_size: int) -> str:
        """The mode this run uses: the settings', full replicas on one rank."""
        return self.settings.sharding if world_size > 1 else DEFAULT_MODE

    def grouped(self, world_size: int) -> bool:
        """Whether the mode has a shard group."""
        return bool(MODES[self.name(world_size)].options)

    def shard_group_size(self, world_size: int) -> int | None:
        """``K`` of a mode that has one (given, or picked at setup); else ``None``."""
        if not self.grouped(world_size):
            return None
        return self.settings.shard_group_size if self.settings.shard_group_size is not None else self.picked

    def mode(self, world_size: int) -> ShardingMode:
        grouped = {"shard_group_size": self.shard_group_size(world_size), "offload": self.settings.offload} \
            if self.grouped(world_size) else {}
        return get_mode(self.name(world_size), world_size, **grouped)

    def shards_weights(self, world_size: int) -> bool:
        """Whether the run's weights are ``fully_shard`` DTensors (sharded checkpoints, restored after setup)."""
        return MODES[self.name(world_size)].shards_weights

    def may_shard_weights(self) -> bool:
        """Whether the asked mode shards the weights on more than one rank (before the world is known)."""
        return MODES[self.settings.sharding].shards_weights

    def pick(self, module: nn.Module, contract: ModelContract | None, world_size: int, device: torch.device, *,
             trainer: Any, cost_model: CostModel | None, lengths: Callable[[Any], Sequence[int]],
             gpus_per_node: int) -> ShardGroupChoice | None:
        """A mode with a shard group and none given: the smallest that fits, at least the node's ``gpus_per_node``
        processes (said on rank 0; ``None``: nothing to pick). ``lengths(dataset)``: the train dataset's lengths.

        Raises:
            NoShardGroupFits: none fits, listing the states' bytes per rank for each ``K``.
        """
        if not self.grouped(world_size) or self.shard_group_size(world_size) is not None:
            return None
        dataset = train_dataset(trainer) if trainer is not None else None
        data = list(lengths(dataset)) if dataset is not None and hasattr(dataset, "__getitem__") else None
        choice = _choose(self.name(world_size), module, contract, world_size, device, offload=self.settings.offload,
                         cost_model=cost_model, lengths=data, gpus_per_node=gpus_per_node)
        self.picked = choice.size
        rank_zero_info(f"DCPStrategy(sharding={self.name(world_size)!r}): shard_group_size={choice.size}, "
                       f"{choice.reason} (pass shard_group_size= to choose)")
        return choice

    @staticmethod
    def prices(device: torch.device, gpus_per_node: int) -> CollectivePrices | None:
        """The device's hardware spec's prices, where the hardware registry describes it."""
        if device.type != "cuda":
            return None
        from lightning_dcp.planning.hardware import hardware_named

        spec = hardware_named(torch.cuda.get_device_name(device))
        return None if spec is None else replace(CollectivePrices.from_hardware(spec), gpus_per_node=gpus_per_node)


def _choose(mode_name: str, module: nn.Module, contract: ModelContract | None, world_size: int, device: torch.device,
            *, offload: bool, cost_model: CostModel | None, lengths: Sequence[int] | None,
            gpus_per_node: int) -> ShardGroupChoice:
    from lightning_dcp.profiling.budget import resolve_budget

    units = contract_units(contract)
    states = measure_model_states(module, [], get_mode(mode_name, world_size, offload=offload),
                                  units=shard_units(module, units["layers"]), coresident=units["coresident"])
    if cost_model is not None and cost_model.memory_in_bytes:
        def holds(k: int) -> int:
            view = plan_cost_model(cost_model, replace(states, shard_group_size=k))
            return max((view.max_length(p) for p in view.sp_sizes(world_size)), default=0)

        return choose_shard_group_size(world_size, states.parts, cost_model.memory_limit, mode=mode_name, offload=offload,
                                       gpus_per_node=gpus_per_node,
                                       longest=max(lengths) if lengths else None,
                                       longest_fitting=holds if lengths else None, limit_source=cost_model.describe_limit())
    limit, source = resolve_budget(device)
    return choose_shard_group_size(world_size, states.parts, limit, mode=mode_name, offload=offload,
                                   gpus_per_node=gpus_per_node,
                                   limit_source=source + "; states only: the profile is measured after sharding")
