"""The round planner of a shard group: lockstep rounds planned, not aligned afterwards (``sharding="hsdp"``).

Under per-layer sharding the ranks of a shard group run their micro-batches in lockstep *rounds*
(:class:`~lightning_dcp.planning.rounds.Lockstep`): a round lasts as long as its slowest item, so a
group's step lasts the sum over its rounds of the round's slowest item. The round planner plans those
rounds for the step a policy made (:meth:`Lockstep.plan_step <lightning_dcp.planning.rounds.Lockstep.plan_step>`,
its one entry point: :func:`~lightning_dcp.planning.lockstep.plan.plan_lockstep`), shard group by shard
group:

- :mod:`~lightning_dcp.planning.lockstep.groups`: the group's lanes (SP groups) and rounds, items
  paired where their lanes' queues meet (optimal for fixed items);
- :mod:`~lightning_dcp.planning.lockstep.packing`: each lane's samples packed for the rounds of the
  others (dcp's lanes; a baseline keeps its packing);
- :mod:`~lightning_dcp.planning.lockstep.moves`: long samples onto larger SP groups, low rounds
  emptied into the others (steps of few samples per rank).

Samples stay in their shard group: no gradient changes. Deterministic; pure Python.
"""

from lightning_dcp.planning.lockstep.groups import GroupRounds, first_fit, lanes_of, merge
from lightning_dcp.planning.lockstep.plan import plan_group, plan_lockstep

__all__ = ["GroupRounds", "first_fit", "lanes_of", "merge", "plan_group", "plan_lockstep"]
