"""Safe mode's planning: micro-batches cost what the user's own collate pads them to.

A module in safe mode (:mod:`lightning_dcp.runtime.support`) gets every micro-batch from its
DataLoader's ``collate_fn``, which pads the samples to the longest one. :class:`PaddedCostModel`
prices a micro-batch that way and :class:`PaddedPlanner` splits any micro-batch whose padded size
exceeds the largest batch the user's own loader produces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from lightning_dcp.planning.cost_model import CostModel, DelegatingCostModel, ItemCost
from lightning_dcp.planning.plan import Plan, StepPlan, WorkItem
from lightning_dcp.planning.round_plan import FREE_RUNNING

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.planner import Planner

__all__ = ["PaddedCostModel", "PaddedPlanner"]


class PaddedCostModel(DelegatingCostModel):
    """Safe mode's cost model: a micro-batch of ``n`` samples costs -- in time and memory -- ``n`` samples of its
    longest length (the user's collate pads to it), on one rank, with no recomputation. It holds at most
    ``max_padded_tokens`` padded tokens: the DataLoader's ``batch_size`` times the dataset's longest sample, so no
    planned micro-batch is larger than one the user's own loader produces. Only the base's times are used.

    Args:
        base: the per-token cost model.
        max_padded_tokens: the most padded tokens (samples x longest) one micro-batch may hold.
    """

    # a model of its own on the base's times (one rank, l^2 work, no collectives)
    sp_sizes = CostModel.sp_sizes
    attention_work = CostModel.attention_work
    collective_prices = CostModel.collective_prices

    def __init__(self, base: CostModel, max_padded_tokens: int) -> None:
        super().__init__(base)
        self.num_layers, self.num_heads = 0, 1
        self.max_padded_tokens = max(1, int(max_padded_tokens))
        self.memory_limit = float(self.max_padded_tokens)
        self.memory_limit_source = ""
        self.prices_ring = self.prices_tp = self.fast_paths = self.memory_in_bytes = False
        self.sharding, self.state_bytes, self.rounds = None, None, FREE_RUNNING

    def describe_limit(self) -> str:
        """The limit is padded tokens, not bytes."""
        return (f"{self.max_padded_tokens} padded tokens per micro-batch (safe mode: the DataLoader's batch_size x the "
                "dataset's longest sample)")

    @staticmethod
    def _padded(lengths: Sequence[int]) -> list[int]:
        return [max(lengths)] * len(lengths) if lengths else []

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        return self.base.item_cost(self._padded(lengths), sp, 0)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        """Tokens, as the planner's packing sees them; :class:`PaddedPlanner` then splits any
        micro-batch whose padded size (:meth:`padded_tokens`) exceeds the limit."""
        return float(sum(lengths)) if sp == 1 and ring == 1 else float("inf")

    @staticmethod
    def padded_tokens(lengths: Sequence[int]) -> int:
        return len(lengths) * max(lengths, default=0)

    def signature(self) -> dict:
        return {"kind": "padded", "max_padded_tokens": self.max_padded_tokens, "base": self.base.signature()}


class PaddedPlanner:
    """Safe mode's planner: the wrapped planner's plan, with every micro-batch whose padded size
    exceeds the limit split into consecutive micro-batches of the same rank (samples sorted by
    length, so each piece pads little). Deterministic; every sample stays in exactly one item.

    Args:
        planner: a :class:`~lightning_dcp.planning.planner.Planner` over a :class:`PaddedCostModel`.
        cost_model: that cost model (its ``max_padded_tokens`` is the limit).
    """

    def __init__(self, planner: "Planner", cost_model: PaddedCostModel) -> None:
        self.planner = planner
        self.limit = cost_model.max_padded_tokens

    @property
    def one_step_per_batch(self) -> bool:
        return bool(getattr(self.planner, "one_step_per_batch", True))

    def prepare(self, batches: Sequence[Sequence[int]]) -> None:
        self.planner.prepare(batches)

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> Plan:
        plan = self.planner.plan_batch(samples, lengths, step=step)
        steps = tuple(StepPlan(tuple(piece for item in st.items for piece in self._split(item))) for st in plan.steps)
        return Plan(plan.policy, plan.world_size, steps, plan.extra)

    def _split(self, item: WorkItem) -> list[WorkItem]:
        if PaddedCostModel.padded_tokens(item.lengths) <= self.limit:
            return [item]
        pairs = sorted(zip(item.lengths, item.samples), reverse=True)
        pieces: list[list[tuple[int, int]]] = [[]]
        for n, s in pairs:
            cur = pieces[-1]
            if cur and (len(cur) + 1) * cur[0][0] > self.limit:  # sorted: cur[0] is its longest
                pieces.append([])
            pieces[-1].append((n, s))
        return [WorkItem(item.ranks, tuple(s for _, s in p), tuple(n for n, _ in p), item.recompute, item.ring,
                         item.tp)
                for p in pieces]
