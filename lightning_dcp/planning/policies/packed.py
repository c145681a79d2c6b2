"""``packed``: fixed SP, first-fit-decreasing packing to a fixed token budget, packs spread evenly.

The packed-parallel baseline (NaViT-style Patch n' Pack): the fixed SP size and recompute count
of :class:`FixedSPPolicy`; every global batch is packed first-fit-decreasing into micro-batches
of at most ``pack_tokens`` tokens (default: what the fixed setting holds, i.e. the longest
sample's micro-batch capacity — a careful user packs to the memory limit), and the packs are
dealt round robin in FFD order over the SP groups, so every group gets the same number of packs
(±1). One global batch is one optimizer step.
"""

from __future__ import annotations

from typing import Sequence

from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem, interleave_items
from lightning_dcp.planning.policies.base import FixedSPPolicy
from lightning_dcp.planning.search.packing import pack_ffd


class PackedPolicy(FixedSPPolicy):
    """Fixed SP, FFD packing to a fixed token budget, packs round robin over groups."""

    name = "packed"

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("sp", "recompute", "pack_tokens")

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        sp, rec = self.fixed(lengths)
        cap = self.view.capacities(sp)[rec]
        budget = int(self.options.get("pack_tokens") or cap)
        budget = max(min(budget, cap), max(lengths))
        groups = self.groups(sp)
        packs = pack_ffd(list(lengths), budget)
        per_group: list[list[WorkItem]] = [[] for _ in groups]
        for j, pack in enumerate(packs):
            g = j % len(groups)
            per_group[g].append(WorkItem(groups[g], tuple(samples[i] for i in pack), tuple(lengths[i] for i in pack), rec,
                                         self.view.ring_of(sp)))
        return [StepPlan(tuple(interleave_items(per_group)), StepNotes(setting={"sp": sp, "pack_tokens": budget}))]
