"""Lockstep rounds (``sharding="hsdp"``); the free-running modes' rounds are :mod:`.round_plan`'s.

Per-layer collectives over a shard group's ranks need every rank of the group to run the same number of
micro-batches, in lockstep: a rank with no item in a round runs a *dummy* round (the collectives, no compute), an SP
item runs in one round on all its ranks, and a round lasts as long as its slowest item plus its collectives
(docs/sharding.md, "Per-layer sharding"). Across shard groups accumulation varies freely. :class:`Lockstep` plans
the rounds (:mod:`lightning_dcp.planning.lockstep`); :func:`lockstep_rounds` is the assignment of a plan's items to
rounds that the runtime executes. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_dcp.planning.lockstep import plan_lockstep
from lightning_dcp.planning.plan import PlanError, StepPlan
from lightning_dcp.planning.round_plan import FREE_RUNNING, FreeRunning, ItemTime, LanePacker, RoundPlan

__all__ = ["FREE_RUNNING", "FreeRunning", "Lockstep", "RoundPlan", "ShardGroupRounds", "check_shard_groups",
           "lockstep_rounds", "round_span", "shard_groups"]


def shard_groups(world_size: int, shard_group_size: int) -> list[tuple[int, ...]]:
    """The shard groups: consecutive blocks of ``shard_group_size`` ranks; :class:`PlanError` unless it is a positive
    divisor of ``world_size``."""
    world_size, k = int(world_size), int(shard_group_size)
    if k < 1 or world_size % k:
        raise PlanError(f"shard_group_size={shard_group_size} must be a positive divisor of the world size "
                        f"({world_size}); use e.g. the GPUs of one node, or the world for plain ZeRO-3")
    return [tuple(range(start, start + k)) for start in range(0, world_size, k)]


def check_shard_groups(step: StepPlan, world_size: int, shard_group_size: int) -> None:
    """Raise :class:`PlanError`, naming the item and the fix, when an SP item spans two shard groups (its per-layer
    collectives must stay in its group)."""
    k = int(shard_group_size)
    shard_groups(world_size, k)
    for item in step.items:
        if len({r // k for r in item.ranks}) > 1:
            raise PlanError(f"the item on ranks {list(item.ranks)} (SP {item.sp_size}) spans two shard groups of "
                            f"{k} ranks; under sharding='hsdp' an SP group must lie inside a shard group: cap "
                            f"max_sp_size at {k} or raise shard_group_size")


@dataclass(frozen=True)
class ShardGroupRounds:
    """The rounds of one shard group in one step: per round, the indices into ``step.items`` of its items (a rank
    of the group without an item in a round runs a dummy micro-batch there)."""

    ranks: tuple[int, ...]
    rounds: tuple[tuple[int, ...], ...]

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    def dummies(self, step: StepPlan) -> int:
        """Dummy micro-batches the group runs: rank-rounds without an item."""
        busy = sum(step.items[i].sp_size for r in self.rounds for i in r)
        return len(self.ranks) * len(self.rounds) - busy


def lockstep_rounds(step: StepPlan, world_size: int, shard_group_size: int) -> list[ShardGroupRounds]:
    """Every item of ``step`` in a round of its shard group: the first round after the previous item of each of its
    ranks (each rank's order kept). Every rank computes the same rounds from the same plan, which keeps the group's
    per-layer collectives matched. :class:`PlanError` if an item spans two shard groups."""
    check_shard_groups(step, world_size, shard_group_size)
    groups = shard_groups(world_size, shard_group_size)
    next_round = [0] * int(world_size)
    assigned: list[list[list[int]]] = [[] for _ in groups]
    k = int(shard_group_size)
    for index, item in enumerate(step.items):
        g = item.ranks[0] // k
        rnd = max(next_round[r] for r in item.ranks)
        while len(assigned[g]) <= rnd:
            assigned[g].append([])
        assigned[g][rnd].append(index)
        for r in item.ranks:
            next_round[r] = rnd + 1
    return [ShardGroupRounds(ranks, tuple(tuple(r) for r in rounds)) for ranks, rounds in zip(groups, assigned)]


def round_span(rounds: ShardGroupRounds, item_times: Sequence[float]) -> float:
    """The group's time for the step: the sum over its rounds of the round's slowest item (``item_times`` indexed
    like ``step.items``)."""
    total = 0.0
    for rnd in rounds.rounds:
        total += max((item_times[i] for i in rnd), default=0.0)
    return total


class Lockstep(RoundPlan):
    """Lockstep rounds inside shard groups of ``shard_group_size`` consecutive ranks. ``dummy_round_s``: a round of
    dummies only (its collectives; an item's time already includes its round's)."""

    lockstep = True

    def __init__(self, shard_group_size: int, dummy_round_s: float = 0.0) -> None:
        self.shard_group_size = self.domain = int(shard_group_size)
        self.dummy_round_s = float(dummy_round_s)

    def __repr__(self) -> str:
        return f"Lockstep(shard_group_size={self.shard_group_size})"

    def plan_step(self, step: StepPlan, world_size: int, item_time: ItemTime,
                  packer: LanePacker | None = None) -> StepPlan:
        """The rounds planned shard group by shard group (:func:`~lightning_dcp.planning.lockstep.plan_lockstep`)."""
        check_shard_groups(step, world_size, self.shard_group_size)
        return plan_lockstep(step, world_size, self.shard_group_size, item_time, packer)

    def rank_rounds(self, step: StepPlan, world_size: int, rank: int) -> list[int | None]:
        """A list of the group's round count; a group without an item runs one dummy round when there are replicas
        (every group takes part in the replicas' all-reduce)."""
        k = self.shard_group_size
        group = lockstep_rounds(step, world_size, k)[int(rank) // k]
        position = {index: pos for pos, index in enumerate(i for i, it in enumerate(step.items) if rank in it.ranks)}
        out: list[int | None] = [next((position[i] for i in rnd if i in position), None) for rnd in group.rounds]
        if not out and int(world_size) > k and step.items:
            out.append(None)
        return out

    def starts(self, step: StepPlan, world_size: int, item_times: Sequence[float]) -> list[float]:
        """A group's round begins when its previous round's slowest item ends."""
        out = [0.0] * len(step.items)
        for g in lockstep_rounds(step, world_size, self.shard_group_size):
            t0 = 0.0
            for rnd in g.rounds:
                for i in rnd:
                    out[i] = t0
                t0 += max((item_times[i] for i in rnd), default=0.0)
        return out

    def span(self, step: StepPlan, world_size: int, item_times: Sequence[float]) -> float | None:
        """The slowest group's :func:`round_span` (a group without an item, but replicas to meet: one dummy round)."""
        groups = lockstep_rounds(step, world_size, self.shard_group_size)
        idle = int(world_size) > self.shard_group_size and bool(step.items)
        return max((round_span(g, item_times) if g.rounds else (self.dummy_round_s if idle else 0.0) for g in groups),
                   default=0.0)

    def dummy_rounds(self, step: StepPlan, world_size: int) -> int:
        groups = lockstep_rounds(step, world_size, self.shard_group_size)
        idle = sum(len(g.ranks) for g in groups if not g.rounds) if int(world_size) > self.shard_group_size else 0
        return sum(g.dummies(step) for g in groups) + (idle if step.items else 0)
