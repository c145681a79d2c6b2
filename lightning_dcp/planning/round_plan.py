"""What a cost model's ``rounds`` are: :class:`RoundPlan`, and :data:`FREE_RUNNING` (every mode without collectives
inside the micro-batch loop).

The base of every round plan, apart from :mod:`lightning_dcp.planning.rounds` (the lockstep rounds of a shard
group, :class:`~lightning_dcp.planning.rounds.Lockstep`) so that the cost-model interface
(:attr:`~lightning_dcp.planning.cost_model.CostModel.rounds`) needs nothing of the plan's modules; and
:class:`LanePacker`, what a round planner needs to re-pack an SP group's samples for its rounds. ``step`` is a
:class:`~lightning_dcp.planning.plan.StepPlan` throughout. Pure Python.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

__all__ = ["FREE_RUNNING", "FreeRunning", "ItemTime", "LanePacker", "RoundPlan"]

ItemTime = Callable[[Any], float]
"""The time of one of a step's items (a :class:`~lightning_dcp.planning.plan.WorkItem`)."""


@runtime_checkable
class LanePacker(Protocol):
    """What a round planner needs to re-pack the samples of one SP group into micro-batches (the dcp policy's
    :class:`~lightning_dcp.planning.view.CostView` is one)."""

    exact_memory: bool
    """Whether :meth:`capacities` are exact (else re-packing would need every micro-batch's memory checked)."""
    sp_sizes: list[int]
    """The usable SP sizes, ascending."""
    topology: Any
    """Where an SP group may go: ``topology.legal(start, size)`` (:class:`~lightning_dcp.planning.topology.Topology`)."""

    def ring_of(self, sp: int) -> int:
        """The ring degree of a group of ``sp`` ranks."""

    def capacities(self, sp: int) -> list[int]:
        """``caps[r]``: the most tokens a micro-batch on ``sp`` ranks holds with ``r`` layers recomputed."""

    def min_recompute(self, tokens: int, sp: int) -> int | None:
        """The fewest recomputed layers that fit ``tokens`` on ``sp`` ranks (None: none)."""

    def time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int | None = None) -> float:
        """The time of a micro-batch of ``lengths`` on ``sp`` ranks (ring degree ``ring``), at the cost model's pace."""

    def estimator(self, sp: int) -> Callable[[Any], Any]:
        """Per-sample estimated time on ``sp`` ranks, vectorized over an array of lengths."""

    def speed(self, ranks: Sequence[int]) -> float:
        """The pace of an item on ``ranks`` (its slowest rank's speed; 1.0 without rank speeds)."""


class RoundPlan:
    """How a step's items run (:mod:`lightning_dcp.planning.rounds`); the base is :data:`FREE_RUNNING`'s behaviour."""

    lockstep = False
    """Whether ranks run their items in lockstep rounds (collectives inside the micro-batch loop)."""
    domain: int | None = None
    """Consecutive ranks no SP group may cross (a shard group: its per-layer collectives are the group's)."""

    def plan_step(self, step: Any, world_size: int, item_time: ItemTime, packer: LanePacker | None = None) -> Any:
        """THE round planner's entry point: ``step`` (a policy's) as the rounds should run it. ``item_time``: an
        item's time at its pace; ``packer``: the round planner may re-pack each SP group's samples (None: it
        keeps the policy's micro-batches)."""
        return step

    def rank_rounds(self, step: Any, world_size: int, rank: int) -> list[int | None]:
        """Per round of ``rank``: the position of its item in its own micro-batch loop (``Step.items``
        order), or ``None`` for a dummy round. Free-running: one round per item, no dummy."""
        return list(range(sum(1 for item in step.items if rank in item.ranks)))

    def starts(self, step: Any, world_size: int, item_times: Sequence[float]) -> list[float] | None:
        """Each item's start (seconds, indexed like ``step.items``) when the rounds decide it; ``None``: each rank
        runs freely (:mod:`~lightning_dcp.planning.step_time` follows the ranks' queues)."""
        return None

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
