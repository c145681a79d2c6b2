"""``static``: fixed SP, fixed global batch, round robin — the plainest data-parallel setup.

Every sample is its own micro-batch (micro-batch size 1) on the fixed SP size with the fixed
recompute count (see :class:`FixedSPPolicy`); sample ``j`` of the global batch goes to SP group
``j mod G``. One global batch is one optimizer step; a group's accumulation count is however
many samples it got.
"""

from __future__ import annotations

from typing import Sequence

from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem, interleave_items
from lightning_dcp.planning.policies.base import FixedSPPolicy


class StaticPolicy(FixedSPPolicy):
    """Fixed SP, micro-batch size 1, samples dealt round robin over the SP groups."""

    name = "static"

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        sp, rec = self.fixed(lengths)
        groups = self.groups(sp)
        per_group: list[list[WorkItem]] = [[] for _ in groups]
        for j, (s, n) in enumerate(zip(samples, lengths)):
            per_group[j % len(groups)].append(WorkItem(groups[j % len(groups)], (s,), (n,), rec, self.view.ring_of(sp)))
        return [StepPlan(tuple(interleave_items(per_group)), StepNotes(setting={"sp": sp}))]
