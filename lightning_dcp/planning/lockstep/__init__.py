"""The round planner of a shard group under ``sharding="hsdp"``: lockstep rounds planned, not aligned afterwards.

Entry point :func:`~lightning_dcp.planning.lockstep.plan.plan_lockstep` (behind :meth:`Lockstep.plan_step
<lightning_dcp.planning.rounds.Lockstep.plan_step>`): :mod:`.groups` pairs a group's lanes (SP groups) into rounds,
:mod:`.packing` re-packs each lane for the others' rounds, :mod:`.moves` moves samples between lanes. Samples stay in
their shard group (the gradients are unchanged). Deterministic; pure Python.
"""

from lightning_dcp.planning.lockstep.groups import GroupRounds, first_fit, lanes_of, merge
from lightning_dcp.planning.lockstep.plan import plan_group, plan_lockstep

__all__ = ["GroupRounds", "first_fit", "lanes_of", "merge", "plan_group", "plan_lockstep"]
