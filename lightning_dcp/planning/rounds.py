"""How a step's items run, per sharding mode: free-running, or in lockstep rounds of a shard group.

Every mode has a :class:`RoundPlan` (:attr:`~lightning_dcp.planning.sharding.base.ShardingMode.rounds`,
and a cost model's ``rounds``): the planner, the simulator and the runtime read it and nothing else.

- :data:`FREE_RUNNING` (``none``, ``zero1``, ``zero2``, ``fsdp``: no collective inside the micro-batch
  loop but the SP groups'): each rank runs its items in plan order, one round per item; ranks run
  different numbers of items.
- :class:`Lockstep` (``hsdp``): under per-layer sharding every layer's weights are all-gathered before
  its forward and its backward, and its gradients reduce-scattered after its backward, over the ``K``
  ranks of a *shard group*. Those collectives need every rank of the group to run the same number of
  micro-batches, in lockstep: a rank with no item in a round runs a *dummy* round (the same
  collectives, no compute: :mod:`lightning_dcp.runtime.sharding.dummy`), and an SP item runs in the same
  round on all its ranks. Across shard groups nothing is shared inside a step (the gradients meet once
  per step), so accumulation varies freely there. A round lasts as long as its slowest item (a dummy
  computes nothing) plus the round's per-layer collectives.

**Round planning has one entry point**: :meth:`RoundPlan.plan_step`. :class:`Lockstep` plans the rounds
with :mod:`lightning_dcp.planning.lockstep`: items paired by cost where their ranks' queues meet and,
given a :class:`~lightning_dcp.planning.round_plan.LanePacker` (the dcp policy plans its rounds itself,
with its cost view), each SP group's samples re-packed for the rounds and moved between SP groups of
the shard group. The planner calls it on the steps of every other policy, which keep their own
micro-batches (:class:`~lightning_dcp.planning.planner.Planner`). Samples stay in their shard group:
the gradients are unchanged. :func:`align_rounds` is the former alignment after dispatch (each rank's
items sorted by cost), kept as the yardstick the tests hold the round planner to.
:func:`lockstep_rounds` is the deterministic assignment of a plan's items to rounds that the runtime
executes (:meth:`RoundPlan.rank_rounds`): every rank computes it from the same plan, and the round
planner lists items so that it finds the planned rounds. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from lightning_dcp.planning.lockstep import plan_lockstep
from lightning_dcp.planning.plan import PlanError, StepPlan, WorkItem
from lightning_dcp.planning.round_plan import FREE_RUNNING, FreeRunning, ItemTime, LanePacker, RoundPlan

__all__ = ["FREE_RUNNING", "FreeRunning", "Lockstep", "RoundPlan", "ShardGroupRounds", "align_rounds",
           "check_shard_groups", "lockstep_rounds", "round_span", "shard_groups"]


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
    """``step`` with each shard group's items reordered so that lockstep rounds pair items of similar cost (the
    alignment after dispatch that :mod:`lightning_dcp.planning.lockstep` replaced; its yardstick in the tests).

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
    return StepPlan(tuple(step.items[i] for i in order), step.notes)


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


# ---------------------------------------------------------------------------------------------- lockstep rounds
class Lockstep(RoundPlan):
    """Lockstep rounds inside shard groups of ``shard_group_size`` consecutive ranks.

    Args:
        shard_group_size: ``K``.
        dummy_round_s: what a round of dummies only lasts (its per-layer collectives; a dummy computes
            nothing, so a round with an item lasts as long as its slowest item's time, which the cost
            model already prices with the round's collectives).
    """

    lockstep = True

    def __init__(self, shard_group_size: int, dummy_round_s: float = 0.0) -> None:
        self.shard_group_size = self.domain = int(shard_group_size)
        self.dummy_round_s = float(dummy_round_s)

    def __repr__(self) -> str:
        return f"Lockstep(shard_group_size={self.shard_group_size})"

    def plan_step(self, step: StepPlan, world_size: int, item_time: ItemTime,
                  packer: LanePacker | None = None) -> StepPlan:
        """The rounds planned shard group by shard group (:func:`~lightning_dcp.planning.lockstep.plan_lockstep`):
        items paired by cost where the queues of their ranks meet, each lane re-packed against the others'
        rounds when a ``packer`` is given."""
        check_shard_groups(step, world_size, self.shard_group_size)
        return plan_lockstep(step, world_size, self.shard_group_size, item_time, packer)

    def rank_rounds(self, step: StepPlan, world_size: int, rank: int) -> list[int | None]:
        """Every rank of a group gets a list of the group's round count. A group without any item still runs
        one dummy round when there are replicas: every group takes part in the replicas' all-reduce."""
        k = self.shard_group_size
        group = lockstep_rounds(step, world_size, k)[int(rank) // k]
        mine = [i for i, item in enumerate(step.items) if rank in item.ranks]
        position = {index: pos for pos, index in enumerate(mine)}
        out: list[int | None] = []
        for rnd in group.rounds:
            hit = [position[i] for i in rnd if i in position]
            out.append(hit[0] if hit else None)
        if not out and int(world_size) > k and step.items:
            out.append(None)
        return out

    def starts(self, step: StepPlan, world_size: int, item_times: Sequence[float]) -> list[float]:
        """Each item starts with its round: a group's round begins when its previous round's slowest item ends."""
        out = [0.0] * len(step.items)
        for g in lockstep_rounds(step, world_size, self.shard_group_size):
            t0 = 0.0
            for rnd in g.rounds:
                for i in rnd:
                    out[i] = t0
                t0 += max((item_times[i] for i in rnd), default=0.0)
        return out

    def span(self, step: StepPlan, world_size: int, item_times: Sequence[float]) -> float | None:
        """The slowest group's sum over its rounds of the round's slowest item (``item_times``: the cost
        model's, which include the round's collectives); a group without an item (but replicas to meet)
        runs one dummy round."""
        groups = lockstep_rounds(step, world_size, self.shard_group_size)
        idle = int(world_size) > self.shard_group_size and bool(step.items)
        return max((round_span(g, item_times) if g.rounds else (self.dummy_round_s if idle else 0.0) for g in groups),
                   default=0.0)

    def dummy_rounds(self, step: StepPlan, world_size: int) -> int:
        groups = lockstep_rounds(step, world_size, self.shard_group_size)
        idle = sum(len(g.ranks) for g in groups if not g.rounds) if int(world_size) > self.shard_group_size else 0
        return sum(g.dummies(step) for g in groups) + (idle if step.items else 0)
