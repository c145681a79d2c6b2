"""Why a planner's SP groups are no larger than they are: every limit that binds, named with its fix.

A sample too long for any setting is refused with this text (:class:`~lightning_dcp.planning.planner.Planner`): the
world, ``max_sp_size`` (or the reason the runtime gave for its cap), the shard group, the heads (Ulysses gives each
rank whole heads), and why no ring was offered past them (ring attention off, or a cost model that prices none).
Pure Python.
"""

from __future__ import annotations

from lightning_dcp.planning.sp_sizes import ulysses_sizes
from lightning_dcp.planning.view import CostView

__all__ = ["cap_limits"]


def cap_limits(view: CostView, world_size: int, max_sp_size: int | None, reason: str | None,
               ring: bool) -> tuple[list[str], list[str]]:
    """``(limits, fixes)``: what keeps SP groups at ``max(view.sp_sizes)`` ranks on ``world_size`` ranks, and what
    would lift each (empty when only the world limits them)."""
    largest, cm = max(view.sp_sizes), view.cm
    limits: list[str] = []
    fixes: list[str] = []
    limit = world_size
    if reason:
        limits.append(f"capped by {reason}")
    elif max_sp_size is not None and max_sp_size < world_size:
        limits.append(f"capped by max_sp_size={max_sp_size}")
        fixes.append("a larger max_sp_size")
    if max_sp_size is not None:
        limit = min(limit, max_sp_size)
    domain = cm.rounds.domain
    if domain and domain < limit:
        if not reason or "shard group" not in reason:
            limits.append(f"SP groups stay inside blocks of {domain} ranks (sharding='hsdp')")
            fixes.append("a larger shard_group_size")
        limit = domain
    if largest >= limit:
        return limits, fixes
    heads = getattr(cm, "num_heads", None)
    if heads and not (reason and "heads" in reason):
        allowed = [p for p in ulysses_sizes(heads, limit) if p in set(cm.sp_sizes(limit))]
        if max(allowed, default=1) < limit:
            limits.append(f"the model's {heads} attention heads allow Ulysses sizes {allowed} up to {limit} ranks "
                          "(each rank holds whole heads)")
    if not ring:
        limits.append("ring attention is off (ring=False, or the module does not run ring attention), so no size "
                      "past the heads is offered")
        fixes.append("ring attention through lightning_dcp.ulysses_attention")
    elif not cm.prices_ring:
        limits.append(f"the cost model ({type(cm).__name__}) prices no ring attention, so no ring size past the heads "
                      "is offered")
        fixes.append("a cost model that prices rings (measure the model with DCPProfiler, or an AnalyticCostModel)")
    return limits, fixes
