"""How a step's items run: :class:`RoundPlan`, a cost model's and a sharding mode's ``rounds``, which the planner,
the simulator and the runtime read. :data:`FREE_RUNNING` (every mode without collectives in the micro-batch loop):
each rank runs its items in plan order, one round per item. The lockstep rounds live in
:mod:`~lightning_dcp.planning.rounds`, so the cost-model interface needs nothing of the round planner. Pure Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.plan import StepPlan, WorkItem
    from lightning_dcp.planning.topology import Topology

__all__ = ["FREE_RUNNING", "FreeRunning", "ItemTime", "LanePacker", "RoundPlan"]

ItemTime = Callable[["WorkItem"], float]
"""An item's time: its round's collectives included, at its slowest rank's pace."""


@runtime_checkable
class LanePacker(Protocol):
    """What a round planner needs to re-pack the samples of one SP group into micro-batches (the dcp policy's
    :class:`~lightning_dcp.planning.view.CostView` is one)."""

    exact_memory: bool
    """Whether the capacities are exact (else re-packing would need every micro-batch's memory checked)."""
    sp_sizes: list[int]
    """The usable SP sizes, ascending."""
    topology: Topology
    """Where an SP group may go (``topology.legal(start, size)``)."""

    def setting(self, lengths: Sequence[int], sp: int) -> Any:
        """The fastest split that holds a micro-batch of ``lengths`` on ``sp`` ranks, as a
        :class:`~lightning_dcp.planning.view.Setting` (``ring``, ``recompute``, ``time`` at the cost model's pace,
        ``tp``); None if none does."""

    def item_capacities(self, sp: int) -> list[int]:
        """``caps[r]``: the most tokens a micro-batch on ``sp`` ranks holds with ``r`` layers recomputed (any split)."""

    def item_estimator(self, sp: int) -> Callable[[Any], Any]:
        """Per-sample estimated time on ``sp`` ranks, vectorized over an array of lengths."""

    def speed(self, ranks: Sequence[int]) -> float:
        """The pace of an item on ``ranks`` (its slowest rank's speed; 1.0 without rank speeds)."""


class RoundPlan:
    """How a step's items run; the base is :data:`FREE_RUNNING`'s behaviour."""

    lockstep = False
    """Whether ranks run their items in lockstep rounds (collectives inside the micro-batch loop)."""
    domain: int | None = None
    """Consecutive ranks no SP group may cross (a shard group: its per-layer collectives are the group's)."""

    def plan_step(self, step: StepPlan, world_size: int, item_time: ItemTime,
                  packer: LanePacker | None = None) -> StepPlan:
        """THE round planner's entry point: a policy's ``step`` as the rounds should run it; with a ``packer`` the
        round planner may re-pack each SP group's samples (None: it keeps the policy's micro-batches)."""
        return step

    def rank_rounds(self, step: StepPlan, world_size: int, rank: int) -> list[int | None]:
        """Per round of ``rank``: the position of its item in its own micro-batch loop, or ``None`` for a dummy
        round."""
        return list(range(sum(1 for item in step.items if rank in item.ranks)))

    def starts(self, step: StepPlan, world_size: int, item_times: Sequence[float]) -> list[float] | None:
        """Each item's start (seconds, indexed like ``step.items``) when the rounds decide it; ``None``: each rank
        runs freely."""
        return None

    def span(self, step: StepPlan, world_size: int, item_times: Sequence[float]) -> float | None:
        """The step's compute span when the rounds decide it; ``None``: each rank runs freely."""
        return None

    def dummy_rounds(self, step: StepPlan, world_size: int) -> int:
        """Rank-rounds without an item in ``step``."""
        return 0


class FreeRunning(RoundPlan):
    """The replicated modes' rounds: none in lockstep."""

    def __repr__(self) -> str:
        return "FREE_RUNNING"


FREE_RUNNING = FreeRunning()
"""The rounds of every mode without collectives inside the micro-batch loop."""
