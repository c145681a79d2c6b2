"""What a cost model's ``rounds`` are: :class:`RoundPlan`, and :data:`FREE_RUNNING` (every mode without collectives
inside the micro-batch loop).

The base of every round plan, apart from :mod:`lightning_dcp.planning.rounds` (the lockstep rounds of a shard
group, :class:`~lightning_dcp.planning.rounds.Lockstep`) so that the cost-model interface
(:attr:`~lightning_dcp.planning.cost_model.CostModel.rounds`) needs nothing of the plan's modules. ``step`` is a
:class:`~lightning_dcp.planning.plan.StepPlan` throughout. Pure Python.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["FREE_RUNNING", "FreeRunning", "ItemTime", "RoundPlan"]

ItemTime = Callable[[Any], float]
"""The time of one of a step's items (a :class:`~lightning_dcp.planning.plan.WorkItem`)."""


class RoundPlan:
    """How a step's items run (:mod:`lightning_dcp.planning.rounds`); the base is :data:`FREE_RUNNING`'s behaviour."""

    lockstep = False
    """Whether ranks run their items in lockstep rounds (collectives inside the micro-batch loop)."""
    domain: int | None = None
    """Consecutive ranks no SP group may cross (a shard group: its per-layer collectives are the group's)."""

    def plan_step(self, step: Any, world_size: int, item_time: ItemTime) -> Any:
        """THE round planner's entry point: ``step`` (a policy's) as the rounds should run it."""
        return step

    def rank_rounds(self, step: Any, world_size: int, rank: int) -> list[int | None]:
        """Per round of ``rank``: the position of its item in its own micro-batch loop (``Step.items``
        order), or ``None`` for a dummy round. Free-running: one round per item, no dummy."""
        return list(range(sum(1 for item in step.items if rank in item.ranks)))

    def span(self, step: Any, world_size: int, item_times: Sequence[float]) -> float | None:
        """The step's compute span when the rounds decide it (``item_times`` indexed like ``step.items``);
        ``None``: each rank runs freely (the simulator's per-rank schedule decides)."""
        return None

    def dummy_rounds(self, step: Any, world_size: int) -> int:
        """Rank-rounds without an item in ``step`` (the dummies every group runs)."""
        return 0


class FreeRunning(RoundPlan):
    """The replicated modes' rounds: none in lockstep."""

    def __repr__(self) -> str:
        return "FREE_RUNNING"


FREE_RUNNING = FreeRunning()
"""The rounds of every mode without collectives inside the micro-batch loop."""
