"""The SP sizes a model allows on this world: the cap, the Ulysses sizes and whether ring attention extends them.

The rule is :mod:`lightning_dcp.planning.sp_sizes`: a Ulysses group splits the attention heads, so its
size divides them (12 heads: 1, 2, 3, 4, 6, 12); ring attention (:mod:`lightning_dcp.sp.ring`) splits a
sequence further and is not bound by the heads, so a module that can run it (its attention goes through
:func:`~lightning_dcp.sp.ulysses.ulysses_attention` and its batches are sharded by the package's token
layout, :attr:`~lightning_dcp.sp.contract.ModelContract.ring_layout`) may use any SP size up to the cap,
as ``ring x ulysses`` (:func:`~lightning_dcp.planning.sp_sizes.best_split`). The heads and the repeated
layers are read once, by :func:`lightning_dcp.sp.contract.read_model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dcp.planning.sp_sizes import best_split, ulysses_sizes
from lightning_dcp.sp.groups import power_of_two_sizes

__all__ = ["SPCap", "item_refusal", "largest_dividing_power_of_two", "resolve_sp_cap"]


def largest_dividing_power_of_two(heads: int | None) -> int:
    """The largest power of two dividing ``heads`` (unbounded when the head count is unknown)."""
    if not heads:
        return 1 << 30
    return heads & -heads


@dataclass(frozen=True)
class SPCap:
    """The SP sizes the runtime runs, and why.

    Attributes:
        size: the largest SP size.
        heads_cap: set when the head count (not the world or the user) caps SP: the planner names it in
            its errors.
        ulysses: the Ulysses sizes up to ``size`` (divisors of the heads; the powers of two when the heads
            are unknown): the runtime creates their aligned blocks up front. Empty: ``1..size`` unchecked.
        ring: SP sizes the heads do not divide run as ring x Ulysses (the module supports ring attention).
    """

    size: int
    heads_cap: int | None = None
    ulysses: tuple[int, ...] = ()
    ring: bool = False
    reason: str | None = field(default=None, compare=False)
    """What caps SP when neither the world nor ``max_sp_size`` does (the heads, the shard group, the support
    level), in words the planner's errors quote; ``None``: the planner names the world or ``max_sp_size``."""

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """The sizes whose aligned blocks are created at setup (the rest per step, as plans name them)."""
        return self.ulysses or power_of_two_sizes(self.size)


def _sizes_text(sizes: tuple[int, ...]) -> str:
    return ", ".join(str(s) for s in sizes)


def resolve_sp_cap(requested: int | None, world_size: int, heads: int | None, ring: bool = False) -> SPCap:
    """The SP sizes for ``world_size`` ranks (or a shard group's) and a model with ``heads`` attention heads.

    Args:
        requested: ``DCPStrategy(max_sp_size=...)``: any positive size the model allows -- a divisor of the
            heads, or with ``ring`` any size. Above the world it is lowered to it (warned).
        world_size: the ranks an SP group may span (the world, or under ``sharding="hsdp"`` a shard group).
        heads: the model's attention heads (``None``: unknown, every size allowed).
        ring: the module can run ring attention (sizes past the heads' divisors).

    Without ``requested``: the world (with ring, or with unknown heads), else the largest divisor of the
    heads that fits the world (warned once when the heads are what caps it).

    Raises:
        ValueError: ``requested`` is a size the heads cannot split and the module has no ring attention
            (the message names the sizes it can use and the fix).
    """
    world_size = int(world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if requested is not None:
        requested = int(requested)
        if requested < 1:
            raise ValueError(f"max_sp_size must be a positive number of ranks, got {requested}")
        if heads and not ring and heads % requested:
            allowed = ulysses_sizes(heads, max(requested, heads))
            raise ValueError(
                f"max_sp_size={requested} allows SP size {requested}, which does not divide the model's {heads} attention "
                f"heads: Ulysses gives every SP rank whole heads, so the SP sizes are {_sizes_text(allowed)}. Use "
                f"max_sp_size={max(d for d in allowed if d <= requested)} (or another of those), or run attention through "
                "lightning_dcp.ulysses_attention with the package's token sharding (no dcp_shard_batch hook, "
                "dcp_ring_layout not None) so ring attention can take the sizes past the heads")
        if requested > world_size:
            rank_zero_warn(f"max_sp_size={requested} exceeds the world ({world_size} ranks); using {world_size}")
        size = min(requested, world_size)
        return SPCap(size, ulysses=_ulysses(heads, size), ring=ring and size > 1)
    if not heads or ring:
        return SPCap(world_size, ulysses=_ulysses(heads, world_size), ring=ring and world_size > 1)
    size = max(ulysses_sizes(heads, world_size))
    if size >= world_size:
        return SPCap(size, ulysses=_ulysses(heads, size))
    fix = ("; give the model a head count with a divisor above 1, or let ring attention split sequences past the heads "
           "(attention through lightning_dcp.ulysses_attention, the package's token sharding)") if size == 1 else ""
    rank_zero_warn(f"the model has {heads} attention heads: SP sizes must divide it, so SP is capped at {size} on this "
                   f"world of {world_size} ranks{fix}")
    return SPCap(size, heads_cap=size, ulysses=_ulysses(heads, size),
                 reason=f"the model's {heads} attention heads (SP sizes must divide them)")


def _ulysses(heads: int | None, size: int) -> tuple[int, ...]:
    return ulysses_sizes(heads, size) if heads else ()


def item_refusal(sp_size: int, ring: int, heads: int | None, ring_layout: str | None) -> str | None:
    """Why an item of ``sp_size`` ranks with ring degree ``ring`` cannot run on a model with ``heads`` attention heads
    (``ring_layout``: the module's ring token layout, ``None`` when it has no ring attention), or ``None`` when it can.

    The rule (:mod:`lightning_dcp.planning.sp_sizes`): the Ulysses size ``sp_size / ring`` divides the heads; a ring
    degree above 1 needs a module that runs ring attention."""
    u = sp_size // ring if ring >= 1 and sp_size % ring == 0 else None
    if u is None:
        return f"its ring degree {ring} does not divide its SP size {sp_size}; fix the plan"
    if ring > 1 and ring_layout is None:
        return (f"it runs SP {sp_size} as ring {ring} x Ulysses {u}, but the module cannot run ring attention (it shards "
                "its own batches, sets dcp_ring_layout = None, or is below support level 'sp'); plan SP sizes that divide "
                f"the heads{f' ({heads})' if heads else ''} only")
    if heads and heads % u:
        split = best_split(sp_size, heads)
        fix = (f"plan it as ring {split[0]} x Ulysses {split[1]} (WorkItem(..., ring={split[0]}))" if ring_layout is not None
               else f"cap the planner at SP sizes dividing {heads} (max_sp_size={max(ulysses_sizes(heads, sp_size))})")
        return (f"its Ulysses size {u} (SP {sp_size}{f' / ring {ring}' if ring > 1 else ''}) does not divide the model's "
                f"{heads} attention heads (Ulysses gives every rank whole heads); {fix}")
    return None
