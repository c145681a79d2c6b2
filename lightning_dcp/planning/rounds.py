"""Lockstep rounds (``sharding="hsdp"``); the free-running modes' rounds are :mod:`.round_plan`'s.

Per-layer collectives over a shard group's ranks need every rank of the group to run the same number of
micro-batches, in lockstep: a rank with no item in a round runs a *dummy* round (the collectives, no compute), an SP
item runs in one round on all its ranks, and a round lasts as long as its slowest item plus its collectives
(docs/sharding.md, "Per-layer sharding"). Across shard groups accumulation varies freely.

An SP item may span shard groups (``Lockstep(k, domain=d)``: SP groups inside blocks of ``d``, a multiple of ``k``):
it runs in the same round index of every shard group it touches, so those groups' rounds *meet* there -- each of
them starts that round when the last of them has finished the round before, and per layer every rank of the item
runs its own group's collectives and the item's all-to-all. Every group runs its rounds in index order and an item
waits only for rounds of a lower index, so no order of the groups' collectives can wait in a cycle.

:class:`Lockstep` plans the rounds (:mod:`lightning_dcp.planning.lockstep`); :func:`lockstep_rounds` is the
assignment of a plan's items to rounds that the runtime executes. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_dcp.planning.lockstep import plan_lockstep
from lightning_dcp.planning.plan import PlanError, StepPlan
from lightning_dcp.planning.round_plan import FREE_RUNNING, FreeRunning, ItemTime, LanePacker, RoundPlan

__all__ = ["FREE_RUNNING", "FreeRunning", "Lockstep", "RoundPlan", "ShardGroupRounds", "check_shard_groups",
           "lockstep_rounds", "round_ends", "round_span", "shard_groups"]


def shard_groups(world_size: int, shard_group_size: int) -> list[tuple[int, ...]]:
    """The shard groups: consecutive blocks of ``shard_group_size`` ranks; :class:`PlanError` unless it is a positive
    divisor of ``world_size``."""
    world_size, k = int(world_size), int(shard_group_size)
    if k < 1 or world_size % k:
        raise PlanError(f"shard_group_size={shard_group_size} must be a positive divisor of the world size "
                        f"({world_size}); use e.g. the GPUs of one node, or the world for plain ZeRO-3")
    return [tuple(range(start, start + k)) for start in range(0, world_size, k)]


def check_shard_groups(step: StepPlan, world_size: int, shard_group_size: int, domain: int | None = None) -> None:
    """Raise :class:`PlanError`, naming the item and the fix, when an SP item leaves its block of ``domain`` ranks
    (default ``shard_group_size``: its shard group)."""
    k = int(shard_group_size)
    shard_groups(world_size, k)
    d = k if domain is None else int(domain)
    if d % k or int(world_size) % d:
        raise PlanError(f"domain={domain} must be a multiple of shard_group_size={k} that divides the world size "
                        f"({world_size})")
    for item in step.items:
        if len({r // d for r in item.ranks}) > 1:
            if d == k:
                raise PlanError(f"the item on ranks {list(item.ranks)} (SP {item.sp_size}) spans two shard groups of "
                                f"{k} ranks; under sharding='hsdp' an SP group must lie inside a shard group: cap "
                                f"max_sp_size at {k}, raise shard_group_size or let SP groups span shard groups")
            raise PlanError(f"the item on ranks {list(item.ranks)} (SP {item.sp_size}) spans two blocks of {d} ranks; "
                            f"SP groups may span shard groups of {k} ranks only inside blocks of {d}")


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
        mine = set(self.ranks)
        busy = sum(len(mine.intersection(step.items[i].ranks)) for r in self.rounds for i in r)
        return len(self.ranks) * len(self.rounds) - busy


def lockstep_rounds(step: StepPlan, world_size: int, shard_group_size: int) -> list[ShardGroupRounds]:
    """Every item of ``step`` in a round of each shard group it touches: the first round after the previous item of
    each of its ranks (each rank's order kept), the same round index in every group (module docstring). Every rank
    computes the same rounds from the same plan, which keeps each group's per-layer collectives matched; a group's
    round without an item of its own (an item elsewhere came later) is a round of dummies. When an item spans shard
    groups every group runs as many rounds as the one with the most (its last round, where the replicas' all-reduce
    runs layer by layer, is every group's: a group's last round meeting another group's earlier one through an SP item
    would wait on it in a cycle)."""
    groups = shard_groups(world_size, shard_group_size)
    next_round = [0] * int(world_size)
    assigned: list[list[list[int]]] = [[] for _ in groups]
    k = int(shard_group_size)
    for index, item in enumerate(step.items):
        rnd = max(next_round[r] for r in item.ranks)
        for g in sorted({r // k for r in item.ranks}):
            while len(assigned[g]) <= rnd:
                assigned[g].append([])
            assigned[g][rnd].append(index)
        for r in item.ranks:
            next_round[r] = rnd + 1
    if any(len({r // k for r in item.ranks}) > 1 for item in step.items):
        most = max(len(a) for a in assigned)  # the replicas' all-reduce runs in every group's last round: the same one
        for a in assigned:
            a.extend([] for _ in range(most - len(a)))
    return [ShardGroupRounds(ranks, tuple(tuple(r) for r in rounds)) for ranks, rounds in zip(groups, assigned)]


def round_ends(step: StepPlan, groups: Sequence[ShardGroupRounds], item_times: Sequence[float],
               dummy_round_s: float = 0.0) -> tuple[list[list[float]], list[float]]:
    """``(ends, starts)``: ``ends[g][r]`` when round ``r`` of group ``g`` ends, ``starts[i]`` when item ``i`` starts.

    Groups that an item joins in round ``r`` (transitively) start it together, when the last of them has ended round
    ``r - 1``; each group's round then lasts as long as its slowest item (a round of dummies ``dummy_round_s``)."""
    ends: list[list[float]] = [[] for _ in groups]
    starts = [0.0] * len(step.items)
    k = len(groups[0].ranks) if groups else 1
    for r in range(max((g.num_rounds for g in groups), default=0)):
        parent = list(range(len(groups)))

        def find(g: int) -> int:
            while parent[g] != g:
                parent[g] = parent[parent[g]]
                g = parent[g]
            return g

        live = [g for g, grp in enumerate(groups) if r < grp.num_rounds]
        for g in live:
            for i in groups[g].rounds[r]:
                first = find(step.items[i].ranks[0] // k)
                for rank in step.items[i].ranks:
                    parent[find(rank // k)] = first
        begin: dict[int, float] = {}
        for g in live:
            root = find(g)
            begin[root] = max(begin.get(root, 0.0), ends[g][r - 1] if r else 0.0)
        for g in live:
            t0 = begin[find(g)]
            items = groups[g].rounds[r]
            for i in items:
                starts[i] = t0
            ends[g].append(t0 + max((item_times[i] for i in items), default=dummy_round_s))
    return ends, starts


def round_span(rounds: ShardGroupRounds, item_times: Sequence[float]) -> float:
    """The group's time for the step on its own: the sum over its rounds of the round's slowest item (``item_times``
    indexed like ``step.items``); rounds that meet other groups' can start later (:func:`round_ends`)."""
    total = 0.0
    for rnd in rounds.rounds:
        total += max((item_times[i] for i in rnd), default=0.0)
    return total


class Lockstep(RoundPlan):
    """Lockstep rounds inside shard groups of ``shard_group_size`` consecutive ranks. ``dummy_round_s``: a round of
    dummies only (its collectives; an item's time already includes its round's). ``domain``: SP groups lie inside
    blocks of that many ranks (a multiple of the shard group; default the shard group), and the round planner plans
    each block's rounds as one."""

    lockstep = True

    def __init__(self, shard_group_size: int, dummy_round_s: float = 0.0, domain: int | None = None) -> None:
        self.shard_group_size = int(shard_group_size)
        self.domain = self.shard_group_size if domain is None else int(domain)
        if self.domain % self.shard_group_size:
            raise ValueError(f"domain={domain} must be a multiple of shard_group_size={shard_group_size}")
        self.dummy_round_s = float(dummy_round_s)

    def __repr__(self) -> str:
        wider = f", domain={self.domain}" if self.domain != self.shard_group_size else ""
        return f"Lockstep(shard_group_size={self.shard_group_size}{wider})"

    def with_domain(self, domain: int) -> "Lockstep":
        """The same shard groups with SP groups inside blocks of ``domain`` ranks."""
        return Lockstep(self.shard_group_size, self.dummy_round_s, domain)

    def plan_step(self, step: StepPlan, world_size: int, item_time: ItemTime,
                  packer: LanePacker | None = None) -> StepPlan:
        """The rounds planned block by block (:func:`~lightning_dcp.planning.lockstep.plan_lockstep`; a block of
        ``domain`` ranks as one shard group: its rounds meet wherever an item spans its groups)."""
        check_shard_groups(step, world_size, self.shard_group_size, self.domain)
        return plan_lockstep(step, world_size, self.domain, item_time, packer)

    def rank_rounds(self, step: StepPlan, world_size: int, rank: int) -> list[int | None]:
        """A list of the group's round count; a group without an item runs one dummy round when there are replicas
        (every group takes part in the replicas' all-reduce)."""
        k = self.shard_group_size
        check_shard_groups(step, world_size, k, self.domain)
        group = lockstep_rounds(step, world_size, k)[int(rank) // k]
        position = {index: pos for pos, index in enumerate(i for i, it in enumerate(step.items) if rank in it.ranks)}
        out: list[int | None] = [next((position[i] for i in rnd if i in position), None) for rnd in group.rounds]
        if not out and int(world_size) > k and step.items:
            out.append(None)
        return out

    def starts(self, step: StepPlan, world_size: int, item_times: Sequence[float]) -> list[float]:
        """A group's round begins when its previous round's slowest item ends (rounds that meet: :func:`round_ends`)."""
        check_shard_groups(step, world_size, self.shard_group_size, self.domain)
        groups = lockstep_rounds(step, world_size, self.shard_group_size)
        return round_ends(step, groups, item_times, self.dummy_round_s)[1]

    def span(self, step: StepPlan, world_size: int, item_times: Sequence[float]) -> float | None:
        """The slowest group's last round end (a group without an item, but replicas to meet: one dummy round)."""
        check_shard_groups(step, world_size, self.shard_group_size, self.domain)
        groups = lockstep_rounds(step, world_size, self.shard_group_size)
        idle = int(world_size) > self.shard_group_size and bool(step.items)
        ends = round_ends(step, groups, item_times, self.dummy_round_s)[0]
        return max((e[-1] if e else (self.dummy_round_s if idle else 0.0) for e in ends), default=0.0)

    def dummy_rounds(self, step: StepPlan, world_size: int) -> int:
        groups = lockstep_rounds(step, world_size, self.shard_group_size)
        idle = sum(len(g.ranks) for g in groups if not g.rounds) if int(world_size) > self.shard_group_size else 0
        return sum(g.dummies(step) for g in groups) + (idle if step.items else 0)
