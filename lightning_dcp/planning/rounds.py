"""Lockstep micro-batch rounds of a shard group (``sharding="hsdp"``): which item runs in which round.

Under per-layer sharding every layer's weights are all-gathered before its forward and its backward,
and its gradients reduce-scattered after its backward, over the ``K`` ranks of a *shard group*. Those
collectives need every rank of the group to run the same number of micro-batches, and to run them
in lockstep: a rank with fewer items runs zero-weight empty micro-batches (*dummies*), and an SP item
must run in the same round on all its ranks. Across shard groups nothing is shared inside a step
(the gradients meet once per step), so accumulation varies freely there, as under the other modes.

:func:`lockstep_rounds` assigns each item of a step to a round, keeping every rank's order;
:func:`align_rounds` reorders each rank's items so that a round's items cost about the same (a round
lasts as long as its slowest item: sorting each rank's items by cost, largest first, pairs items of
similar cost; it never moves an item to another rank, so the gradients are unchanged). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from lightning_dcp.planning.plan import PlanError, StepPlan, WorkItem

__all__ = ["ShardGroupRounds", "align_rounds", "check_shard_groups", "lockstep_rounds", "round_span", "shard_groups"]


def shard_groups(world_size: int, shard_group_size: int) -> list[tuple[int, ...]]:
    """The shard groups: consecutive blocks of ``shard_group_size`` ranks (the GPUs of a node by default).

    Raises:
        PlanError: ``shard_group_size`` does not divide ``world_size`` or is not positive.
    """
    world_size, k = int(world_size), int(shard_group_size)
    if k < 1 or world_size % k:
        raise PlanError(f"shard_group_size={shard_group_size} must be a positive divisor of the world size "
                        f"({world_size}); use e.g. the GPUs of one node, or the world for plain ZeRO-3")
    return [tuple(range(start, start + k)) for start in range(0, world_size, k)]


def check_shard_groups(step: StepPlan, world_size: int, shard_group_size: int) -> None:
    """Every SP item must lie inside one shard group (its per-layer collectives stay in the group).

    Raises:
        PlanError: an item spans two shard groups, naming it and the fix.
    """
    k = int(shard_group_size)
    shard_groups(world_size, k)
    for item in step.items:
        if len({r // k for r in item.ranks}) > 1:
            raise PlanError(f"the item on ranks {list(item.ranks)} (SP {item.sp_size}) spans two shard groups of "
                            f"{k} ranks; under sharding='hsdp' an SP group must lie inside a shard group: cap "
                            f"max_sp_size at {k} or raise shard_group_size")


@dataclass(frozen=True)
class ShardGroupRounds:
    """The rounds of one shard group in one step.

    Args:
        ranks: the group's ranks.
        rounds: per round, the indices (into ``step.items``) of the items that run in it; a rank of the
            group without an item in a round runs a dummy micro-batch there.
    """

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
    """Assign every item of ``step`` to a round of its shard group, keeping each rank's item order.

    An item goes to the first round after the previous item of each of its ranks (so an SP item waits
    for the slowest of its ranks' queues). Deterministic; every rank computes the same rounds from the
    same plan, which is what keeps the group's per-layer collectives matched.

    Raises:
        PlanError: an item spans two shard groups (see :func:`check_shard_groups`).
    """
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


def align_rounds(step: StepPlan, world_size: int, shard_group_size: int,
                 item_time: Callable[[WorkItem], float]) -> StepPlan:
    """``step`` with each shard group's items reordered so that lockstep rounds pair items of similar cost.

    Inside a group, SP items (SP > 1) come first, largest SP and then costliest first, so each one
    starts a round on all its ranks together; then each rank's SP-1 items follow, costliest first.
    Sorting every rank's queue the same way pairs the i-th costliest items of the ranks in round i,
    which minimises the sum over rounds of the slowest item when every round holds one SP-1 item
    per rank (the rearrangement inequality). No item changes rank, SP group, samples or recompute:
    the step's gradients are the same; only the order of the micro-batches changes.
    """
    check_shard_groups(step, world_size, shard_group_size)
    costs = [float(item_time(item)) for item in step.items]
    order = sorted(range(len(step.items)),
                   key=lambda i: (step.items[i].ranks[0] // int(shard_group_size), step.items[i].sp_size == 1,
                                  -step.items[i].sp_size, -costs[i], step.items[i].ranks[0], i))
    return StepPlan(tuple(step.items[i] for i in order), step.extra)


def round_span(rounds: ShardGroupRounds, item_times: Sequence[float],
               round_time: Callable[[float], float] | None = None) -> float:
    """The group's time for the step: the sum over rounds of the round's time, where a round lasts as
    long as its slowest item (``item_times`` indexed like ``step.items``); ``round_time`` maps that to
    the round's time with its per-layer collectives (default: unchanged)."""
    total = 0.0
    for rnd in rounds.rounds:
        slowest = max((item_times[i] for i in rnd), default=0.0)
        total += round_time(slowest) if round_time is not None else slowest
    return total
