"""The checks a plan passes before it trains: :func:`validate_step` (placement, samples, recompute, memory),
:func:`check_deadlock_free` (the execution rule) and :func:`validate_plan` (each sample once, lengths as given).
Pure Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from lightning_dcp.planning.cost_model import shard_domain
from lightning_dcp.planning.plan import Plan, PlanError, StepPlan
from lightning_dcp.planning.topology import Topology, group_problem
from lightning_dcp.planning.units import describe_limit, format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.cost_model import CostModel

__all__ = ["check_deadlock_free", "validate_plan", "validate_step"]


def validate_step(step: StepPlan, world_size: int, cost_model: "CostModel | None" = None) -> None:
    """Raise :class:`PlanError` when ``step`` breaks the contract: every item's ranks a group the placement rule
    allows (:mod:`~lightning_dcp.planning.topology`; nodes, heads and shard groups with a cost model), samples and
    positive lengths paired, recompute in ``[0, num_layers]``, and with a cost model no item over its memory limit."""
    if cost_model is None:
        topo, heads = Topology(max(int(world_size), 1)), None
    else:
        topo = Topology(max(int(world_size), 1), cost_model.gpus_per_node or None, shard_domain(cost_model))
        heads = cost_model.num_heads
    for idx, item in enumerate(step.items):
        if item.ranks[-1] >= world_size or item.ranks[0] < 0:
            raise PlanError(f"item {idx} names rank {max(item.ranks)} but the world has {world_size} ranks")
        problem = group_problem(item.ranks, item.ring, topo, heads, tp=item.tp)
        if problem:
            tp = f", tp {item.tp}" if item.tp > 1 else ""
            raise PlanError(f"item {idx} (ranks {list(item.ranks)}, ring {item.ring}{tp}) is not a valid SP group: "
                            f"{problem}")
        if not item.samples or len(item.samples) != len(item.lengths):
            raise PlanError(f"item {idx} has {len(item.samples)} samples and {len(item.lengths)} lengths; both must match and be non-empty")
        if min(item.lengths) <= 0:
            raise PlanError(f"item {idx} has a non-positive length {min(item.lengths)}")
        if item.recompute < 0 or (cost_model is not None and item.recompute > cost_model.num_layers):
            raise PlanError(f"item {idx} recomputes {item.recompute} layers; allowed is 0..{getattr(cost_model, 'num_layers', '?')}")
        if cost_model is not None:
            need = (cost_model.tp_memory(item.lengths, item.sp_size, item.recompute, item.ring, item.tp) if item.tp > 1
                    else cost_model.ring_memory(item.lengths, item.sp_size, item.recompute, item.ring))
            if need > cost_model.memory_limit:
                tp = f", tp {item.tp}" if item.tp > 1 else ""
                raise PlanError(
                    f"item {idx} (lengths {list(item.lengths)}, sp {item.sp_size}, ring {item.ring}{tp}, recompute {item.recompute}) "
                    f"needs {format_bytes(need)} per device; the budget is {describe_limit(cost_model)}"
                )
    check_deadlock_free(step, world_size)


def check_deadlock_free(step: StepPlan, world_size: int) -> None:
    """Run the step symbolically: an item starts once it is at the head of all its ranks' queues.

    In v1 this cannot fail for in-range ranks: every rank runs its items in the order of the step's one list, so the
    first unfinished item is always at the head of all its ranks' queues. Kept because it is cheap and documents the
    execution rule; a schema with per-rank orders would need it.
    """
    queues: list[list[int]] = [[] for _ in range(world_size)]
    for idx, item in enumerate(step.items):
        for r in item.ranks:
            queues[r].append(idx)
    heads = [0] * world_size
    remaining = len(step.items)
    progressed = True
    while remaining and progressed:
        progressed = False
        for idx, item in enumerate(step.items):
            if all(heads[r] < len(queues[r]) and queues[r][heads[r]] == idx for r in item.ranks):
                for r in item.ranks:
                    heads[r] += 1
                remaining -= 1
                progressed = True
    if remaining:
        stuck = [r for r in range(world_size) if heads[r] < len(queues[r])]
        raise PlanError(f"the item order makes ranks {stuck} wait on each other in a cycle")


def validate_plan(plan: Plan, lengths: Sequence[int] | Mapping[int, int] | None = None, cost_model: "CostModel | None" = None,
                  samples: Iterable[int] | None = None) -> None:
    """Raise :class:`PlanError` unless ``plan`` is valid, each sample at most once (given ``samples``: exactly
    those), and (given ``lengths``, indexed by sample) every item's lengths match."""
    if plan.world_size <= 0:
        raise PlanError(f"world_size must be positive, got {plan.world_size}")
    seen: dict[int, int] = {}
    for s_idx, step in enumerate(plan.steps):
        validate_step(step, plan.world_size, cost_model)
        for item in step.items:
            for sample, length in zip(item.samples, item.lengths):
                if sample in seen:
                    raise PlanError(f"sample {sample} appears twice (steps {seen[sample]} and {s_idx})")
                seen[sample] = s_idx
                if lengths is not None and lengths[sample] != length:
                    raise PlanError(f"sample {sample} has length {lengths[sample]} but the plan says {length}")
    if samples is not None:
        expected = set(int(s) for s in samples)
        missing = sorted(expected - set(seen))
        extra = sorted(set(seen) - expected)
        if missing or extra:
            raise PlanError(f"plan misses samples {missing[:10]} and adds samples {extra[:10]}")
