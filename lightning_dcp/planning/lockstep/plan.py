"""The round planner's entry point: :func:`plan_lockstep` plans the rounds of every shard group of a step.

Per group (:func:`plan_group`): the items paired where their lanes' queues meet
(:mod:`~lightning_dcp.planning.lockstep.groups`); with a :class:`~lightning_dcp.planning.round_plan.LanePacker`
(dcp's), each lane re-packed for the rounds (:mod:`~lightning_dcp.planning.lockstep.packing`) and, where
the group has few samples per rank, long samples promoted to larger SP groups and low rounds dissolved
(:mod:`~lightning_dcp.planning.lockstep.moves`). The items are then priced with the caller's
``item_time`` and paired once more: the span the plan states is the one the simulator finds. Pure Python.
"""

from __future__ import annotations

from typing import Sequence

from lightning_dcp.planning.lockstep.groups import GroupRounds, ItemTime, first_fit, lanes_of, merge
from lightning_dcp.planning.lockstep.moves import DISSOLVES_MANY, MOVES_MAX_SAMPLES_PER_RANK, dissolve, promote
from lightning_dcp.planning.lockstep.packing import SWEEPS, Pricer, common_height, lane_samples, sweep
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.planning.round_plan import LanePacker

__all__ = ["plan_group", "plan_lockstep"]


def plan_lockstep(step: StepPlan, world_size: int, shard_group_size: int, item_time: ItemTime,
                  packer: LanePacker | None = None) -> StepPlan:
    """``step`` with each shard group's items in planned rounds, listed round by round.

    ``item_time``: an item's time (its round's collectives included, at its slowest rank's pace);
    ``packer``: re-pack each lane's samples and move samples between lanes (None, or a packer whose memory is
    not exact: keep the policy's items, only pair them). ``notes.estimated_time`` becomes the slowest
    group's span and ``notes.rounds`` each group's round count.
    """
    k = int(shard_group_size)
    by_group: dict[int, list[WorkItem]] = {}
    for item in step.items:
        by_group.setdefault(item.ranks[0] // k, []).append(item)
    if packer is not None and not packer.exact_memory:
        packer = None  # its token capacities are estimates: re-packing would need the memory checked again
    planned = {g: plan_group(items, item_time, packer) for g, items in sorted(by_group.items())}
    rounds = {g: [[p.items[lane][i] for lane, i in sorted(rnd)] for rnd in p.rounds] for g, p in planned.items()}
    out: list[WorkItem] = []
    for j in range(max((len(r) for r in rounds.values()), default=0)):
        for g in sorted(rounds):  # round j of every group (disjoint ranks: any order is deadlock-free)
            if j < len(rounds[g]):
                out.extend(rounds[g][j])
    notes = step.notes
    if planned:
        notes = notes.replace(estimated_time=max(p.span for p in planned.values()),
                              rounds=tuple(len(planned[g].rounds) if g in planned else 0 for g in range(int(world_size) // k)))
    return StepPlan(tuple(out), notes)


def plan_group(items: Sequence[WorkItem], item_time: ItemTime, packer: LanePacker | None = None) -> GroupRounds:
    """The rounds of one shard group's ``items`` (see the module docstring)."""
    group = lanes_of(items, item_time)
    if group is None:
        return first_fit(items, item_time)
    if packer is None:
        return group
    pricer = Pricer(packer, item_time)
    data = lane_samples(group, packer)
    best = common_height(group, data, pricer)
    for _ in range(SWEEPS):
        if not sweep(best, data, pricer):
            break
    ranks = len({r for lane in best.lanes for r in lane})
    if best.samples <= MOVES_MAX_SAMPLES_PER_RANK * ranks:
        best = dissolve(promote(best, pricer), pricer)
    else:  # many samples per rank: re-packing has the freedom promotions give; each move re-packs the whole group
        best = dissolve(best, pricer, DISSOLVES_MANY)
    return _priced(best, item_time)


def _priced(g: GroupRounds, item_time: ItemTime) -> GroupRounds:
    """``g`` with every item priced by ``item_time`` and its rounds paired for those times."""
    g.times = [[float(item_time(it)) for it in items] for items in g.items]
    g.rounds = merge(g)
    return g
