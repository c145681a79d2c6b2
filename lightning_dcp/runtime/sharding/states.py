"""The model states one rank holds under the runtime's sharding mode, measured, and how the planner learns of them.

The planner's memory model has a static term (weights, buffers, gradients, optimizer state) plus the
micro-batch's activations. A measured profile's static term (``constant.memory_bytes``) is the
*full replica*: the profiler counts every parameter, buffer, gradient and optimizer-state byte of
the whole model whatever the sharding (so one cached profile serves every mode). :class:`ModelStates`
holds those bytes as measured on the module the runtime trains and says what one rank actually holds
under its mode (the formulas are the mode's:
:meth:`ShardingMode.state_bytes <lightning_dcp.planning.sharding.base.ShardingMode.state_bytes>`).

How the planner learns it (:func:`plan_cost_model`, called by
:class:`~lightning_dcp.runtime.planner_factory.PlannerFactory`): the mode's
:meth:`~lightning_dcp.planning.sharding.base.ShardingMode.plan_with` -- a cost model with a
``with_sharding(states)`` method (both of ours) gets :meth:`ModelStates.to_dict`; any other is used as
given, shifted by the states it says it counts, or refused by name where the mode cannot plan with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from torch import nn

from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.prices import CollectivePrices
from lightning_dcp.planning.sharding.base import ShardingMode, StateParts
from lightning_dcp.planning.sharding.registry import MODES, get_mode

__all__ = ["ModelStates", "measure_model_states", "plan_cost_model", "unit_bytes"]


@dataclass(frozen=True)
class ModelStates:
    """Bytes of the full model's states and the rank's share of them under ``sharding``.

    Args:
        weights: parameter bytes of the full model (every parameter, trainable or frozen).
        buffers: bytes held in full in every mode: buffers, and co-resident frozen modules' weights.
        gradients: gradient bytes of the full model (the trainable parameters, in their dtype).
        optimizer: optimizer-state bytes of the full model (measured, or estimated by optimizer class).
        sharding: a mode of :data:`~lightning_dcp.planning.sharding.registry.MODES`.
        world_size: ranks the states are sharded over.
        shard_group_size, layer_bytes, root_bytes, offload: the shard group's ``K``, the largest repeated
            layer's and the root unit's weight bytes (from the model contract), states on the host.
        params: parameters of the full model.
    """

    weights: float
    buffers: float
    gradients: float
    optimizer: float
    sharding: str = "none"
    world_size: int = 1
    shard_group_size: int | None = None
    layer_bytes: float = 0.0
    root_bytes: float = 0.0
    offload: bool = False
    params: float = 0.0

    def __post_init__(self) -> None:
        if self.sharding not in MODES:
            raise ValueError(f"sharding must be one of {tuple(MODES)}, got {self.sharding!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")

    @property
    def mode(self) -> ShardingMode:
        """The mode's pure counterpart on this world (and shard group)."""
        grouped = {"shard_group_size": self.shard_group_size, "offload": self.offload} if MODES[self.sharding].options \
            else {}
        return get_mode(self.sharding, self.world_size, **grouped)

    @property
    def parts(self) -> StateParts:
        return StateParts(weights=self.weights, buffers=self.buffers, gradients=self.gradients,
                          optimizer=self.optimizer, layer_bytes=self.layer_bytes, root_bytes=self.root_bytes,
                          params=self.params)

    @property
    def replica_bytes(self) -> float:
        """A full replica's states (what a profile's ``constant.memory_bytes`` counts)."""
        return self.parts.replica

    @property
    def step_bytes(self) -> float:
        """Static bytes one rank holds during the micro-batch loop: what the planner must budget."""
        return self.mode.state_bytes(self.parts)

    @property
    def rest_bytes(self) -> float:
        """Static bytes one rank holds between steps (after the optimizer step)."""
        return self.mode.state_bytes(self.parts, at_rest=True)

    def to_dict(self) -> dict[str, Any]:
        """What ``with_sharding`` receives: the fields, plus ``step_bytes``, ``rest_bytes`` and ``replica_bytes``."""
        return {**asdict(self), "step_bytes": self.step_bytes, "rest_bytes": self.rest_bytes,
                "replica_bytes": self.replica_bytes}


def plan_cost_model(cost_model: CostModel, states: ModelStates | None,
                    prices: CollectivePrices | None = None) -> CostModel:
    """The cost model to plan with when the runtime shards the model states as ``states`` says (``None``:
    ``cost_model`` as given): the mode's :meth:`~lightning_dcp.planning.sharding.base.ShardingMode.plan_with`.

    Raises:
        UnplannableCostModel: the mode cannot plan with ``cost_model`` (named, with the fix).
    """
    if states is None:
        return cost_model
    return states.mode.plan_with(cost_model, states.parts, prices, measured=states.to_dict())


def _size(params: Any) -> float:
    return float(sum(p.numel() * p.element_size() for p in params))


def unit_bytes(module: nn.Module, units: Sequence[nn.Module], coresident: Sequence[nn.Module] = ()) -> tuple[float, float]:
    """(largest unit's weight bytes ``L``, weight bytes outside the units and the co-resident modules ``R``)."""
    in_units = {id(p) for u in units for p in u.parameters()}
    held = {id(p) for m in coresident for p in m.parameters()}
    largest = max((_size(u.parameters()) for u in units), default=0.0)
    return largest, _size(p for p in module.parameters() if id(p) not in in_units and id(p) not in held)


def measure_model_states(module: nn.Module, optimizers: Sequence[Any], mode: ShardingMode, *,
                         units: Sequence[nn.Module] = (), coresident: Sequence[nn.Module] = ()) -> ModelStates:
    """Bytes of ``module``'s full weights, buffers, gradients and its first optimizer's state under ``mode``
    (``units``: the repeated layers sharded one by one; ``coresident``: modules held in full beside them)."""
    from lightning_dcp.profiling.measure import optimizer_state_estimate

    held = {id(p) for m in coresident for p in m.parameters()}
    params = [p for p in module.parameters() if id(p) not in held]  # a DTensor counts its global size
    weights = _size(params)
    grads = _size(p for p in params if p.requires_grad)
    buffers = _size(module.buffers()) + _size(p for m in coresident for p in m.parameters())
    optimizer = optimizers[0] if optimizers else None
    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    # by class, not the state allocated so far: equal on every rank (ZeroRedundancyOptimizer partitions are
    # uneven) and before and after a resume, so ranks and runs plan from the same memory; before the optimizer
    # exists (choosing a shard group), Adam-like
    opt_bytes = optimizer_state_estimate(optimizer, int(grads)) if optimizer is not None else 2.0 * grads
    layer, root = unit_bytes(module, units, coresident)
    return ModelStates(weights, buffers, grads, float(opt_bytes), sharding=mode.name, world_size=mode.world_size,
                       shard_group_size=mode.shard_group_size, layer_bytes=layer, root_bytes=root, offload=mode.offload,
                       params=float(sum(p.numel() for p in params)))
