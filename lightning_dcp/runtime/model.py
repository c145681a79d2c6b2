"""The SP cap the model's attention heads allow (the heads and the repeated layers are read once, by
:func:`lightning_dcp.sp.contract.read_model`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dcp.sp.groups import largest_power_of_two

__all__ = ["SPCap", "largest_dividing_power_of_two", "resolve_sp_cap"]


def largest_dividing_power_of_two(heads: int | None) -> int:
    """The largest power of two dividing ``heads`` (unbounded when the head count is unknown)."""
    if not heads:
        return 1 << 30
    return heads & -heads


@dataclass(frozen=True)
class SPCap:
    """The largest SP size the runtime creates groups for, and why."""

    size: int
    heads_cap: int | None = None
    """Set when the head count (not the world or the user) caps SP: the planner names it in its errors."""
    reason: str | None = field(default=None, compare=False)
    """What caps SP when neither the world nor ``max_sp_size`` does (the heads, the shard group, the support
    level), in words the planner's errors quote; ``None``: the planner names the world or ``max_sp_size``."""


def resolve_sp_cap(requested: int | None, world_size: int, heads: int | None) -> SPCap:
    """The SP cap for ``world_size`` ranks and a model with ``heads`` attention heads.

    ``requested`` (``DCPStrategy(max_sp_size=...)``) must divide the heads at every power of two up to
    it; it is lowered to the world's largest power of two (warned). Without it: the largest power of
    two that fits the world and divides the heads (warned once when the heads are what caps it).

    Raises:
        ValueError: ``requested`` allows an SP size that does not divide the heads.
    """
    world_cap = largest_power_of_two(world_size)
    if requested is not None:
        if heads is not None:
            p = 2
            while p <= requested:
                if heads % p:
                    raise ValueError(
                        f"max_sp_size={requested} allows SP size {p}, which does not divide the model's {heads} "
                        f"attention heads; use max_sp_size <= {largest_dividing_power_of_two(heads)} or a head count "
                        f"divisible by {requested}")
                p *= 2
        if requested > world_cap:
            rank_zero_warn(f"max_sp_size={requested} exceeds the world ({world_size} ranks); using {world_cap}")
        return SPCap(min(requested, world_cap))
    if not heads:
        return SPCap(world_cap)
    size = min(world_cap, largest_dividing_power_of_two(heads))
    if size >= world_cap:
        return SPCap(size)
    fix = "; use a head count with a power-of-two factor (e.g. 4 or 8) for sequence parallelism" if size == 1 else ""
    rank_zero_warn(f"the model has {heads} attention heads: SP sizes must divide it, so SP is capped at {size} on this "
                   f"world of {world_size} ranks{fix}")
    return SPCap(size, heads_cap=size, reason=f"the model's {heads} attention heads (SP sizes must divide them)")
