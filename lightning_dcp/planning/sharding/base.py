"""What every sharding mode answers the planner: :class:`ShardingMode`, and the values it is asked about.

A mode is two files and one registry line (docs/sharding.md, "Sharding as one unit"): its :class:`ShardingMode` here
and its runtime :class:`~lightning_dcp.runtime.sharding.protocol.Shards` (named by :attr:`ShardingMode.runtime`).
From the state bytes alone the mode says its memory per phase, the step's collectives (priced by the cost model with
its :class:`~lightning_dcp.planning.prices.CollectivePrices`), its rounds and SP cap, and the cost model to plan with.
Pure Python.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from lightning_dcp.planning.prices import CollectivePrices
from lightning_dcp.planning.round_plan import FREE_RUNNING, RoundPlan

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.cost_model import CostModel

__all__ = ["CollectivePrices", "ShardingMode", "StateParts", "UnplannableCostModel"]

STATE_PARTS = ("weights", "buffers", "gradients", "optimizer")
"""The full model's state bytes every mode is computed from."""


class UnplannableCostModel(ValueError):
    """A cost model a sharding mode cannot plan with, naming why and the fix (refused at setup)."""


@dataclass(frozen=True)
class StateParts:
    """One replica's model-state bytes, and the unit sizes per-layer sharding needs.

    ``weights``: every parameter, trainable or frozen; ``gradients``: the trainable ones, in their dtype;
    ``optimizer``: with an fp32 master copy when kept; ``layer_bytes`` / ``root_bytes``: the weights of the largest
    repeated layer / outside the repeated layers; ``params``: the parameter count (a host optimizer step's price).
    """

    weights: float
    gradients: float
    optimizer: float
    buffers: float = 0.0
    layer_bytes: float = 0.0
    root_bytes: float = 0.0
    params: float = 0.0

    @property
    def replica(self) -> float:
        """A full replica's states: ``W + B + G + O``."""
        return self.weights + self.buffers + self.gradients + self.optimizer

    @classmethod
    def from_mapping(cls, given: "Mapping[str, Any] | StateParts", *, required: bool = True) -> "StateParts | None":
        """The parts of ``given`` (a cost model's ``state_parts=``, a ``ModelStates.to_dict()``); a missing part raises
        ``ValueError`` naming it, or with ``required=False`` gives ``None``."""
        if isinstance(given, StateParts):
            return given
        missing = [k for k in STATE_PARTS if isinstance(given.get(k), bool) or not isinstance(given.get(k), (int, float))]
        if missing and required:
            raise ValueError(f"the model-state bytes need {', '.join(STATE_PARTS)} (of the full model); "
                             f"{', '.join(missing)} missing in {dict(given)!r}")
        if missing:
            return None
        extra = {f.name: float(given[f.name]) for f in fields(cls)
                 if f.name not in STATE_PARTS and isinstance(given.get(f.name), (int, float))}
        return cls(**{k: float(given[k]) for k in STATE_PARTS}, **extra)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


class ShardingMode(abc.ABC):
    """The pure counterpart of one ``DCPStrategy(sharding=...)`` mode on ``world_size`` ranks.

    Subclasses set the class attributes and implement :meth:`state_bytes`; everything else has the replicated modes'
    answer. ``ValueError`` for an option (``shard_group_size``, ``offload``) the mode does not take.
    """

    name: ClassVar[str]
    runtime: ClassVar[str]
    """``"package.module:Class"`` of the runtime :class:`~lightning_dcp.runtime.sharding.protocol.Shards`."""
    summary: ClassVar[str] = ""
    """One line for ``--help`` and errors: what the mode shards and when."""
    options: ClassVar[tuple[str, ...]] = ()
    """The options it takes: ``"shard_group_size"``, ``"offload"``."""
    shards_weights: ClassVar[bool] = False
    """The weights are ``fully_shard`` DTensors: sharded checkpoints, the full state gathered for the launcher."""
    zero_stage: ClassVar[int | None] = None
    """The ZeRO stage alias (``zero_stage=`` of the analytic model), if any."""

    def __init__(self, world_size: int, *, shard_group_size: int | None = None, offload: bool = False) -> None:
        self.world_size = int(world_size)
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size!r}")
        given = {"shard_group_size": shard_group_size is not None, "offload": bool(offload)}
        extra = [k for k, v in given.items() if v and k not in self.options]
        if extra:
            raise ValueError(f"{' and '.join(extra)} apply to sharding='hsdp' only (got sharding={self.name!r}); drop "
                             "them or pass sharding='hsdp'")
        self.shard_group_size = shard_group_size
        self.offload = bool(offload)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size})"

    @abc.abstractmethod
    def state_bytes(self, parts: StateParts, *, at_rest: bool = False) -> float:
        """Model-state bytes one rank holds: in the micro-batch loop (what the planner budgets), or between
        steps (``at_rest``)."""

    def step_traffic(self, parts: StateParts) -> tuple[float, int]:
        """(bytes the step end moves through the world's ring, collectives per gradient bucket): the
        replicated modes all-reduce the gradients (``2G``, one per bucket)."""
        return 2.0 * parts.gradients, 1

    def optimizer_share(self) -> float:
        """The fraction of one replica's optimizer step a rank runs (``1/N`` when the optimizer state is sharded)."""
        return 1.0

    @property
    def rounds(self) -> RoundPlan:
        """How a step's items run: each rank its own items in plan order (no lockstep)."""
        return FREE_RUNNING

    def plan_with(self, cost_model: "CostModel", parts: StateParts | None, prices: CollectivePrices | None = None,
                  measured: Mapping[str, Any] | None = None) -> "CostModel":
        """The cost model to plan with when the runtime runs this mode with ``parts``: ``cost_model.with_sharding(
        measured)`` when it has that hook (``measured``: the runtime's ``ModelStates.to_dict()``), else ``cost_model``;
        :class:`UnplannableCostModel` if it states (``sharding``) another mode."""
        hook = getattr(cost_model, "with_sharding", None)
        if callable(hook) and measured is not None:
            return hook(dict(measured))
        declared = cost_model.sharding
        if declared is not None and declared != self.name:
            raise UnplannableCostModel(
                f"the cost model plans for sharding={declared!r} but DCPStrategy runs sharding={self.name!r}; build the "
                f"cost model with sharding={self.name!r} or pass DCPStrategy(sharding={declared!r})")
        return cost_model

    def describe(self) -> str:
        """``sharding zero1`` for headers and messages."""
        return f"sharding {self.name}"
