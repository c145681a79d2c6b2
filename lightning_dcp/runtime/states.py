"""The model states one rank holds under each sharding mode, and how the planner learns of them.

The planner's memory model has a static term (weights, gradients, optimizer state) plus the
micro-batch's activations. A measured profile's static term (``constant.memory_bytes``) is the
*full replica*: the profiler counts every parameter, gradient and optimizer-state byte of the whole
model whatever the sharding (so one cached profile serves every mode). :class:`ModelStates` says
what one rank actually holds under the runtime's sharding mode (``W`` parameter bytes, ``B`` buffer
bytes, ``G`` gradient bytes, ``O`` optimizer-state bytes of the full model, ``N`` ranks):

============  ==================================  ==================================
mode          in the micro-batch loop (the peak)  between steps
============  ==================================  ==================================
``"none"``    ``W + B + G + O``                   the same
``"zero1"``   ``W + B + G + O/N``                 the same
``"zero2"``   ``W + W/N + B + G + O/N``           ``W + W/N + B + G/N + O/N``
``"fsdp"``    ``W + W/N + B + G + O/N``           ``W/N + B + G/N + O/N``
============  ==================================  ==================================

(``fully_shard`` keeps each rank's shard beside the full weights while they are gathered; no
collective runs inside the loop, so the loop holds the full weights and this rank's full local
gradients: :mod:`lightning_dcp.runtime.fsdp`.) The planner must budget the loop's column.

How the planner learns it (:func:`shard_cost_model`, called by
:class:`~lightning_dcp.runtime.planners.PlannerFactory`): a cost model with a ``with_sharding(states)``
method gets :meth:`ModelStates.to_dict` and returns the cost model to plan with; a
:class:`~lightning_dcp.planning.profiled.ProfiledCostModel` (whose static term is the full replica)
without it is wrapped in :class:`ShardedMemory`; any other cost model without it that declares a
different ``sharding`` attribute is an error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.lowered import LoweredMemory
from lightning_dcp.runtime.settings import SHARDING_MODES

__all__ = ["ModelStates", "ShardedMemory", "shard_cost_model"]


@dataclass(frozen=True)
class ModelStates:
    """Bytes of the full model's states and the rank's share of them under ``sharding``.

    Args:
        weights: parameter bytes of the full model (every parameter, trainable or frozen).
        buffers: buffer bytes (never sharded).
        gradients: gradient bytes of the full model (the trainable parameters, in their dtype).
        optimizer: optimizer-state bytes of the full model (measured, or estimated by optimizer class).
        sharding: ``"none"``, ``"zero1"``, ``"zero2"`` or ``"fsdp"``.
        world_size: ranks the states are sharded over.
    """

    weights: float
    buffers: float
    gradients: float
    optimizer: float
    sharding: str = "none"
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.sharding not in SHARDING_MODES:
            raise ValueError(f"sharding must be one of {SHARDING_MODES}, got {self.sharding!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")

    @property
    def replica_bytes(self) -> float:
        """A full replica's states (what a profile's ``constant.memory_bytes`` counts)."""
        return self.weights + self.buffers + self.gradients + self.optimizer

    @property
    def step_bytes(self) -> float:
        """Static bytes one rank holds during the micro-batch loop: what the planner must budget."""
        n, mode = self.world_size, self.sharding
        if mode == "none":
            return self.replica_bytes
        if mode == "zero1":
            return self.weights + self.buffers + self.gradients + self.optimizer / n
        return self.weights + self.weights / n + self.buffers + self.gradients + self.optimizer / n

    @property
    def rest_bytes(self) -> float:
        """Static bytes one rank holds between steps (after the optimizer step)."""
        n, mode = self.world_size, self.sharding
        if mode == "zero2":
            return self.weights + self.weights / n + self.buffers + (self.gradients + self.optimizer) / n
        if mode == "fsdp":
            return (self.weights + self.gradients + self.optimizer) / n + self.buffers
        return self.step_bytes

    def to_dict(self) -> dict[str, Any]:
        """What ``with_sharding`` receives: the fields, plus ``step_bytes``, ``rest_bytes`` and ``replica_bytes``."""
        return {**asdict(self), "step_bytes": self.step_bytes, "rest_bytes": self.rest_bytes,
                "replica_bytes": self.replica_bytes}


class ShardedMemory(LoweredMemory):
    """``base`` (static term = the full replica) with the static memory of a sharded rank:
    every ``item_memory`` is lowered by ``replica_bytes - step_bytes``; times and the memory limit
    are ``base``'s (the delegation is :class:`~lightning_dcp.planning.lowered.LoweredMemory`'s).

    Args:
        base: a cost model whose static memory is the full replica (a profiled one).
        states: the rank's model states under the runtime's sharding mode.
    """

    def __init__(self, base: CostModel, states: ModelStates) -> None:
        super().__init__(base, base.memory_limit)
        self.states = states
        self.freed = states.replica_bytes - states.step_bytes
        self.sharding = states.sharding

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int) -> float:
        return self.base.item_memory(lengths, sp, recompute) - self.freed

    def signature(self) -> dict:
        return {"kind": "sharded-memory", "sharding": self.sharding, "world_size": self.states.world_size,
                "step_bytes": self.states.step_bytes, "base": self.base.signature()}


def shard_cost_model(cost_model: CostModel, states: ModelStates | None) -> CostModel:
    """The cost model to plan with when the runtime shards the model states as ``states`` says.

    Raises:
        ValueError: ``cost_model`` declares (attribute ``sharding``) another mode than the runtime runs.
    """
    if states is None:
        return cost_model
    hook = getattr(cost_model, "with_sharding", None)
    if callable(hook):
        return hook(states.to_dict())
    declared = getattr(cost_model, "sharding", None)
    if isinstance(declared, str) and declared != states.sharding:
        raise ValueError(f"the cost model plans for sharding={declared!r} but DCPStrategy runs "
                         f"sharding={states.sharding!r}; build the cost model with sharding={states.sharding!r} or "
                         f"pass DCPStrategy(sharding={declared!r})")
    if states.sharding == "none" or isinstance(cost_model, ShardedMemory):
        return cost_model
    from lightning_dcp.planning.profiled import ProfiledCostModel

    return ShardedMemory(cost_model, states) if isinstance(cost_model, ProfiledCostModel) else cost_model
