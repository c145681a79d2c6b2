"""What a LightningModule supports under DCP, and the safe mode for modules that declare nothing.

Three levels, each a superset of the one before:

- ``"safe"``: the module is unchanged. Every micro-batch is built by the train DataLoader's own
  ``collate_fn`` from whole samples (no packing across samples, the user's own padding), SP size 1,
  no recomputation; the planner still balances ranks by choosing how many micro-batches each
  rank accumulates and which samples go together (similar lengths pad less).
- ``"packed"``: the model attends within samples of a packed micro-batch (it reads
  ``cu_seqlens`` / ``segment_ids`` / ``position_ids``): samples are packed with
  :func:`~lightning_dcp.sp.packing.pack_samples`; SP size 1.
- ``"sp"``: also sequence parallel: attention through :func:`~lightning_dcp.ulysses_attention`
  (or a Hugging Face model prepared by :func:`lightning_dcp.hf.adapt`), repeated layers in
  :class:`~lightning_dcp.RecomputeLayers` or exposed by ``dcp_repeated_layers()``.

A module declares its level with a ``dcp_support`` attribute. Without one, a module that holds a
:class:`~lightning_dcp.RecomputeLayers` or defines ``dcp_repeated_layers`` is taken as ``"sp"``
(the documented recipe); any other module runs in safe mode, never silently wrong.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from lightning_dcp.planning.cost_model import CostModel, ItemCost
from lightning_dcp.planning.plan import Plan, StepPlan, WorkItem

__all__ = ["SUPPORT_LEVELS", "PaddedCostModel", "PaddedPlanner", "micro_batch_loss_units", "resolve_support", "safe_mode_message",
           "uniform_lengths"]

SUPPORT_LEVELS = ("safe", "packed", "sp")


def _has_layer_stack(module: Any) -> bool:
    from lightning_dcp.sp.recompute import find_recompute_layers

    if find_recompute_layers(module):
        return True
    return any(callable(getattr(m, "dcp_repeated_layers", None)) for m in module.modules())


def resolve_support(module: Any, requested: str | None = None) -> str:
    """The level the strategy runs ``module`` at: ``requested`` (``DCPStrategy(support=...)``),
    else the module's ``dcp_support``, else detected (see the module docstring).

    Raises:
        ValueError: an unknown level.
    """
    level = requested if requested is not None else getattr(module, "dcp_support", None)
    if level is None:
        level = "sp" if _has_layer_stack(module) else "safe"
    if level not in SUPPORT_LEVELS:
        source = "DCPStrategy(support=...)" if requested is not None else f"{type(module).__name__}.dcp_support"
        raise ValueError(f"{source} is {level!r}; use one of {SUPPORT_LEVELS}")
    return level


def safe_mode_message(module: Any) -> str:
    """The one line the strategy prints at fit start for a module in safe mode."""
    name = type(module).__name__
    return (f"DCPStrategy: {name} declares no DCP support (no RecomputeLayers, no dcp_repeated_layers(), no "
            "dcp_support attribute), so it runs in safe mode: SP size 1, every micro-batch built by your DataLoader's "
            "collate_fn from whole samples (no packing across samples), per-rank accumulation balanced by the planner, "
            "no recomputation. To pack samples, make the model attend only within each sample (read cu_seqlens / "
            f"segment_ids / position_ids) and set {name}.dcp_support = 'packed'; for sequence parallelism too, use "
            "lightning_dcp.ulysses_attention and RecomputeLayers (Hugging Face models: lightning_dcp.hf.adapt) and set "
            "dcp_support = 'sp'. See the README, 'Using it'.")


def micro_batch_loss_units(module: Any, batch: Any, num_samples: int, reduction: str) -> int:
    """How many units a safe-mode micro-batch's mean loss averages over (counted on the host).

    ``module.dcp_loss_units(batch)`` when defined; else, in token mode, the ``labels`` entries
    other than -100 when the batch is a mapping with an integer ``labels`` tensor; else the
    number of samples (a per-sample mean, e.g. MSE over a ``TensorDataset`` batch).
    """
    hook = getattr(module, "dcp_loss_units", None)
    if callable(hook):
        return int(hook(batch))
    if reduction == "token" and isinstance(batch, Mapping):
        labels = batch.get("labels")
        if labels is not None and hasattr(labels, "is_floating_point") and not labels.is_floating_point():
            return int((labels != -100).sum())
    return int(num_samples)


class PaddedCostModel(CostModel):
    """Safe mode's cost model: a micro-batch of ``n`` samples costs -- in time and memory -- ``n``
    samples of its longest length (the user's collate pads to it), on one rank, with no
    recomputation. It holds at most ``max_padded_tokens`` padded tokens: the DataLoader's
    ``batch_size`` times the dataset's longest sample, the largest batch the user's own loader
    can produce, so no planned micro-batch is larger than one the user already runs.

    Args:
        base: the per-token cost model (times only; its memory model is not used).
        max_padded_tokens: the most padded tokens (samples x longest) one micro-batch may hold.
    """

    def __init__(self, base: CostModel, max_padded_tokens: int) -> None:
        self.base = base
        self.num_layers = 0
        self.num_heads = 1
        self.max_padded_tokens = max(1, int(max_padded_tokens))
        self.memory_limit = float(self.max_padded_tokens)
        self.gpus_per_node = getattr(base, "gpus_per_node", 8)

    @staticmethod
    def _padded(lengths: Sequence[int]) -> list[int]:
        return [max(lengths)] * len(lengths) if lengths else []

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int) -> ItemCost:
        return self.base.item_cost(self._padded(lengths), sp, 0)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int) -> float:
        """Tokens, as the planner's packing sees them; :class:`PaddedPlanner` then splits any
        micro-batch whose padded size (:meth:`padded_tokens`) exceeds the limit."""
        return float(sum(lengths)) if sp == 1 else float("inf")

    @staticmethod
    def padded_tokens(lengths: Sequence[int]) -> int:
        return len(lengths) * max(lengths, default=0)

    def step_overhead(self, world_size: int) -> float:
        return self.base.step_overhead(world_size)

    def signature(self) -> dict:
        return {"kind": "padded", "max_padded_tokens": self.max_padded_tokens, "base": self.base.signature()}


def uniform_lengths(dataset: Any) -> list[int]:
    """Safe mode's lengths when the dataset gives none: every sample as long as the first
    tensor's second dimension of a ``TensorDataset`` (1 when it has none), else 1: ranks are then
    balanced by sample count."""
    tensors = getattr(dataset, "tensors", None)
    size = len(dataset)
    if tensors and getattr(tensors[0], "dim", lambda: 0)() >= 2:
        return [int(tensors[0].shape[1])] * size
    return [1] * size


class PaddedPlanner:
    """Safe mode's planner: the wrapped planner's plan, with every micro-batch whose padded size
    exceeds the limit split into consecutive micro-batches of the same rank (samples sorted by
    length, so each piece pads little). Deterministic; every sample stays in exactly one item.

    Args:
        planner: a :class:`~lightning_dcp.planning.planner.Planner` over a :class:`PaddedCostModel`.
        cost_model: that cost model (its ``max_padded_tokens`` is the limit).
    """

    def __init__(self, planner: Any, cost_model: PaddedCostModel) -> None:
        self.planner = planner
        self.limit = cost_model.max_padded_tokens

    @property
    def one_step_per_batch(self) -> bool:
        return bool(getattr(self.planner, "one_step_per_batch", True))

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
        return [WorkItem(item.ranks, tuple(s for _, s in p), tuple(n for n, _ in p), item.recompute) for p in pieces]
