"""What the runtime reads off the user's module: attention heads, repeated layers, the SP cap they allow."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dcp.sp.groups import largest_power_of_two
from lightning_dcp.sp.recompute import find_recompute_layers

__all__ = ["SPCap", "count_recompute_layers", "find_num_heads", "largest_dividing_power_of_two", "resolve_sp_cap"]


def find_num_heads(module: torch.nn.Module) -> int | None:
    """The attention head count SP sizes must divide: ``dcp_num_heads`` or ``num_heads`` on the
    module or (first found) on a submodule or its ``spec``; ``None`` when nothing says."""
    for attr in ("dcp_num_heads", "num_heads"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    spec = getattr(module, "spec", None)
    if isinstance(getattr(spec, "num_heads", None), int):
        return spec.num_heads
    for sub in module.modules():
        if sub is module:
            continue
        for attr in ("dcp_num_heads", "num_heads"):
            value = getattr(sub, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def count_recompute_layers(module: torch.nn.Module) -> int:
    """Repeated layers: the longest RecomputeLayers, or a ``dcp_repeated_layers()`` list (HF models)."""
    stacks = [len(r) for r in find_recompute_layers(module)]
    stacks += [len(m.dcp_repeated_layers()) for m in module.modules() if callable(getattr(m, "dcp_repeated_layers", None))]
    return max(stacks, default=0)


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
    return SPCap(size, heads_cap=size)
