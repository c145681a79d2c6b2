"""The round planner's entry point: :func:`plan_lockstep` plans the rounds of every shard group of a step."""

from __future__ import annotations

from typing import Sequence

from lightning_dcp.planning.lockstep.groups import GroupRounds, ItemTime, first_fit, lanes_of, merge
from lightning_dcp.planning.lockstep.moves import DISSOLVES_MANY, MOVES_MAX_SAMPLES_PER_RANK, dissolve, promote
from lightning_dcp.planning.lockstep.packing import SWEEPS, Pricer, repacked
from lightning_dcp.planning.plan import StepPlan, WorkItem, interleave_items
from lightning_dcp.planning.round_plan import LanePacker

__all__ = ["plan_group", "plan_lockstep"]


def plan_lockstep(step: StepPlan, world_size: int, shard_group_size: int, item_time: ItemTime,
                  packer: LanePacker | None = None) -> StepPlan:
    """``step`` with each shard group's items in planned rounds, listed round by round.

    ``item_time``: an item's time (its round's collectives included, at its slowest rank's pace); ``packer``:
    re-pack each lane's samples and move samples between lanes (None, or a packer whose memory is not exact: keep
    the policy's items, only pair them). ``notes.estimated_time`` becomes the slowest group's span and
    ``notes.rounds`` each group's round count.
    """
    k = int(shard_group_size)
    by_group: dict[int, list[WorkItem]] = {}
    for item in step.items:
        by_group.setdefault(item.ranks[0] // k, []).append(item)
    if packer is not None and not packer.exact_memory:
        packer = None  # its token capacities are estimates: re-packing would need the memory checked again
    planned = {g: plan_group(items, item_time, packer) for g, items in sorted(by_group.items())}
    rounds = [[[p.items[lane][i] for lane, i in sorted(rnd)] for rnd in p.rounds] for p in planned.values()]
    out = [it for rnd in interleave_items(rounds) for it in rnd]  # disjoint groups: any order is deadlock-free
    notes = step.notes
    if planned:
        notes = notes.replace(estimated_time=max(p.span for p in planned.values()),
                              rounds=tuple(len(planned[g].rounds) if g in planned else 0 for g in range(int(world_size) // k)))
    return StepPlan(tuple(out), notes)


def plan_group(items: Sequence[WorkItem], item_time: ItemTime, packer: LanePacker | None = None) -> GroupRounds:
    """The rounds of one shard group's ``items``.

    The items paired where their lanes' queues meet; with a ``packer`` (dcp's), each lane re-packed for the rounds
    and low rounds dissolved, and where the group has few samples per rank long samples promoted to larger SP
    groups. The items are then priced with ``item_time`` and paired once more: the span the plan states is the
    simulator's.
    """
    group = lanes_of(items, item_time)
    if group is None:
        return first_fit(items, item_time)
    if packer is None:
        return group
    pricer = Pricer(packer, item_time)
    best = repacked(group, pricer, SWEEPS)
    ranks = len({r for lane in best.lanes for r in lane})
    if best.samples <= MOVES_MAX_SAMPLES_PER_RANK * ranks:
        best = dissolve(promote(best, pricer), pricer)
    else:  # many samples per rank: re-packing has the freedom promotions give; each move re-packs the whole group
        best = dissolve(best, pricer, DISSOLVES_MANY)
    best.times = [[float(item_time(it)) for it in items] for items in best.items]
    best.rounds = merge(best)
    return best
