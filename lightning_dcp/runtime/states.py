"""The model states one rank holds under the runtime's sharding mode, and how the planner learns of them.

The planner's memory model has a static term (weights, buffers, gradients, optimizer state) plus the
micro-batch's activations. A measured profile's static term (``constant.memory_bytes``) is the
*full replica*: the profiler counts every parameter, buffer, gradient and optimizer-state byte of
the whole model whatever the sharding (so one cached profile serves every mode). :class:`ModelStates`
holds those bytes as measured on the module the runtime trains and says what one rank actually
holds under its sharding mode; the formulas (in the micro-batch loop, which the planner must budget,
and between steps) are :func:`lightning_dcp.planning.state_sharding.state_bytes`'s, the one place
they live, shared with the cost models. (``fully_shard`` keeps each rank's shard beside the full
weights while they are gathered; no collective runs inside the loop, so the loop holds the full
weights and this rank's full local gradients: :mod:`lightning_dcp.runtime.fsdp`.)

How the planner learns it (:func:`shard_cost_model`, called by
:class:`~lightning_dcp.runtime.planner_factory.PlannerFactory`): a cost model with a ``with_sharding(states)``
method (both of ours) gets :meth:`ModelStates.to_dict` and returns the cost model to plan with; a
cost model without it that declares a different ``sharding`` attribute is an error; any other is
used as given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.state_sharding import PLANNED_SHARDING_MODES as SHARDING_MODES, state_bytes

__all__ = ["ModelStates", "measure_model_states", "shard_cost_model"]


@dataclass(frozen=True)
class ModelStates:
    """Bytes of the full model's states and the rank's share of them under ``sharding``.

    Args:
        weights: parameter bytes of the full model (every parameter, trainable or frozen).
        buffers: buffer bytes (never sharded).
        gradients: gradient bytes of the full model (the trainable parameters, in their dtype).
        optimizer: optimizer-state bytes of the full model (measured, or estimated by optimizer class).
        sharding: ``"none"``, ``"zero1"``, ``"zero2"``, ``"fsdp"`` or ``"hsdp"``.
        world_size: ranks the states are sharded over.
        shard_group_size, layer_bytes, root_bytes, offload: ``"hsdp"`` only: ``K``, the largest repeated
            layer's and the root unit's weight bytes (from the model contract), states on the host.
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

    def __post_init__(self) -> None:
        if self.sharding not in SHARDING_MODES:
            raise ValueError(f"sharding must be one of {SHARDING_MODES}, got {self.sharding!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")

    def _bytes(self, at_rest: bool) -> float:
        return state_bytes(self.sharding, self.world_size, weights=self.weights, buffers=self.buffers,
                           gradients=self.gradients, optimizer=self.optimizer, at_rest=at_rest,
                           **(self._hsdp() if self.sharding == "hsdp" else {}))

    def _hsdp(self) -> dict[str, Any]:
        return {"shard_group_size": self.shard_group_size, "layer_bytes": self.layer_bytes,
                "root_bytes": self.root_bytes, "offload": self.offload}

    @property
    def replica_bytes(self) -> float:
        """A full replica's states (what a profile's ``constant.memory_bytes`` counts)."""
        return self.weights + self.buffers + self.gradients + self.optimizer

    @property
    def step_bytes(self) -> float:
        """Static bytes one rank holds during the micro-batch loop: what the planner must budget."""
        return self._bytes(at_rest=False)

    @property
    def rest_bytes(self) -> float:
        """Static bytes one rank holds between steps (after the optimizer step)."""
        return self._bytes(at_rest=True)

    def to_dict(self) -> dict[str, Any]:
        """What ``with_sharding`` receives: the fields, plus ``step_bytes``, ``rest_bytes`` and ``replica_bytes``."""
        return {**asdict(self), "step_bytes": self.step_bytes, "rest_bytes": self.rest_bytes,
                "replica_bytes": self.replica_bytes}


def shard_cost_model(cost_model: CostModel, states: ModelStates | None) -> CostModel:
    """The cost model to plan with when the runtime shards the model states as ``states`` says:
    ``cost_model.with_sharding(states.to_dict())`` when it has that hook, else ``cost_model`` itself.

    Raises:
        ValueError: ``cost_model`` has no ``with_sharding`` and declares (attribute ``sharding``)
            another mode than the runtime runs.
    """
    if states is None:
        return cost_model
    if states.sharding == "hsdp":
        return _hsdp_cost_model(cost_model, states)
    hook = getattr(cost_model, "with_sharding", None)
    if callable(hook):
        return hook(states.to_dict())
    declared = getattr(cost_model, "sharding", None)
    if isinstance(declared, str) and declared != states.sharding:
        raise ValueError(f"the cost model plans for sharding={declared!r} but DCPStrategy runs "
                         f"sharding={states.sharding!r}; build the cost model with sharding={states.sharding!r} or "
                         f"pass DCPStrategy(sharding={declared!r})")
    return cost_model


def _hsdp_cost_model(cost_model: CostModel, states: ModelStates) -> CostModel:
    """``cost_model`` (its states as one full replica) seen through
    :class:`~lightning_dcp.planning.shard_group.ShardGroupCostModel`: the sharded states in the budget and
    the per-round collectives in the time, priced at an H100 node's bandwidths (an estimate)."""
    from dataclasses import replace

    from lightning_dcp.planning.hardware import get_hardware
    from lightning_dcp.planning.shard_group import ShardGroupCostModel

    full = replace(states, sharding="none")
    hook = getattr(cost_model, "with_sharding", None)
    base = hook(full.to_dict()) if callable(hook) else cost_model
    hw = get_hardware("h100")
    k = int(states.shard_group_size or states.world_size)
    params = states.weights / 4.0
    return ShardGroupCostModel(
        base, world_size=states.world_size, shard_group_size=k,
        state_parts={"weights": states.weights, "buffers": states.buffers, "gradients": states.gradients,
                     "optimizer": states.optimizer},
        layer_bytes=states.layer_bytes, root_bytes=states.root_bytes, gather_bw=hw.allreduce_bw_intra,
        gather_latency=hw.collective_latency, replica_bw=hw.allreduce_bw_inter,
        replica_latency=hw.collective_latency_inter, params=params, optimizer_step_s=16.0 * params / hw.hbm_bandwidth,
        base_state_bytes=float(getattr(base, "state_bytes", full.replica_bytes)),
        offload=states.offload)


def measure_model_states(module: Any, optimizers: Sequence[Any], *, sharding: str, world_size: int,
                         shard_group_size: int | None = None, offload: bool = False,
                         layers: Sequence[Any] = ()) -> ModelStates:
    """Bytes of ``module``'s full weights, buffers, gradients and its first optimizer's state, under ``sharding``
    (``"hsdp"``: also the largest layer's and the root unit's weight bytes of the contract's ``layers``)."""
    from lightning_dcp.profiling.measure import optimizer_state_estimate

    params = list(module.parameters())  # a DTensor counts its global size
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    optimizer = optimizers[0] if optimizers else None
    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    # by class, not the state allocated so far: equal on every rank (ZeroRedundancyOptimizer partitions are
    # uneven) and before and after a resume, so ranks and runs plan from the same memory
    opt_bytes = optimizer_state_estimate(optimizer, grads)
    hsdp: dict[str, Any] = {}
    if sharding == "hsdp":
        from lightning_dcp.runtime.hsdp import unit_bytes

        layer, root = unit_bytes(module, layers)
        hsdp = {"shard_group_size": shard_group_size, "layer_bytes": layer, "root_bytes": root, "offload": offload}
    return ModelStates(float(weights), float(buffers), float(grads), float(opt_bytes), sharding=sharding,
                       world_size=world_size, **hsdp)
