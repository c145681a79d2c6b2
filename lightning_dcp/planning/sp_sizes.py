"""Which SP sizes a model allows: the one rule the planner, the simulator and the runtime read.

**Ulysses** gives each rank whole attention heads, so a Ulysses size must divide the query heads (28: 1, 2, 4, 7, 14,
28); grouped-query attention repeats key/value heads as far as needed (:func:`kv_repeat`: bytes, not legality).
**Ring attention** is not bound by the heads: ``s = r * u`` ranks run ``r`` Ulysses subgroups of ``u`` in a ring
(``WorkItem.ring``). Details: docs/planner.md, "SP sizes". Pure Python.
"""

from __future__ import annotations

import math

__all__ = ["MAX_RING", "best_split", "divisors", "item_rings", "item_splits", "kv_repeat", "node_ulysses", "ring_candidates",
           "sp_splits", "tp_degrees", "ulysses_sizes"]

MAX_RING = 8
"""The largest ring degree of the ring sizes the planner adds (64 ranks on 8-GPU nodes): longer rings would multiply
the sizes a large world plans over for samples that rarely need them."""


def divisors(n: int) -> tuple[int, ...]:
    """The positive divisors of ``n >= 1``, increasing."""
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small) | {n // d for d in small}))


def ulysses_sizes(num_heads: int | None, limit: int) -> tuple[int, ...]:
    """Every Ulysses SP size ``<= limit`` that divides ``num_heads`` (all of ``1..limit`` when the head
    count is unknown), increasing."""
    limit = int(limit)
    if limit < 1:
        raise ValueError(f"the SP limit must be >= 1, got {limit}")
    if not num_heads:
        return tuple(range(1, limit + 1))
    return tuple(d for d in divisors(int(num_heads)) if d <= limit)


def best_split(size: int, num_heads: int | None) -> tuple[int, int]:
    """``(ring, ulysses)`` for ``size`` ranks: the largest Ulysses size dividing the heads and ``size``, the ring the
    rest."""
    size = int(size)
    if size < 1:
        raise ValueError(f"an SP group has >= 1 rank, got {size}")
    u = max(d for d in ulysses_sizes(num_heads, size) if size % d == 0)
    return size // u, u


def kv_repeat(num_heads: int, num_kv_heads: int | None, ulysses: int) -> int:
    """How many times each key/value head is repeated before a Ulysses all-to-all of ``ulysses`` ranks: the smallest
    divisor ``f`` of ``num_heads / num_kv_heads`` with ``num_kv_heads * f`` divisible by ``ulysses`` (every rank gets
    whole key/value heads; 1 without grouped-query attention). The rule of
    :func:`lightning_dcp.sp.ulysses.kv_repeat_before_all_to_all`, pure, for the cost models' all-to-all bytes.
    """
    heads, kv, u = int(num_heads), int(num_kv_heads or num_heads), int(ulysses)
    if kv < 1 or heads % kv or u < 1 or heads % u:
        raise ValueError(f"cannot split {heads} heads ({kv} key/value heads) over a Ulysses group of {u}: the "
                         "heads must be a multiple of the key/value heads and divisible by the group size")
    groups = heads // kv
    return next(f for f in divisors(groups) if (kv * f) % u == 0)


def node_ulysses(num_heads: int, gpus_per_node: int) -> int:
    """The largest Ulysses size dividing the heads and a node's GPUs (the subgroup of the planner's ring sizes)."""
    return max(d for d in divisors(int(num_heads)) if int(gpus_per_node) % d == 0)


def sp_splits(num_heads: int | None, limit: int, gpus_per_node: int, *, ring: bool = True,
              usable: "set[int] | None" = None) -> dict[int, tuple[int, ...]]:
    """Every SP size the planner may use up to ``limit``, with its candidate ring degrees (ascending).

    Every Ulysses size (ring 1); with ``ring`` and a head count also the sizes ``r * u`` past the heads, ``u`` =
    :func:`node_ulysses` and ``r = 2, 4, ..`` up to :data:`MAX_RING` (each subgroup inside a node, the ring across),
    and for a Ulysses size larger than a node the Ulysses x ring split (USP) beside it, ``u`` the largest divisor of
    ``gcd(heads, s)`` dividing the node size (the cost model picks the cheaper). ``usable``: the Ulysses sizes a cost
    model can price (a profile's measured ones; default all): only those are sizes and ring subgroups.
    """
    limit = int(limit)
    out = {s: (1,) for s in ulysses_sizes(num_heads, limit) if usable is None or s in usable}
    if not ring or not num_heads:
        return out
    heads, g = int(num_heads), max(1, int(gpus_per_node))
    ok = (lambda d: True) if usable is None else (lambda d: d in usable)
    for s in list(out):
        if s > g:
            u = max(d for d in divisors(math.gcd(heads, s)) if g % d == 0 and ok(d))
            if u < s:
                out[s] = (1, s // u)
    u = max(d for d in divisors(heads) if g % d == 0 and ok(d))
    r = 2
    while r * u <= limit and r <= MAX_RING:
        out.setdefault(r * u, (r,))
        r *= 2
    return dict(sorted(out.items()))


# -- the splits one item on ``p`` ranks may take (dcp's per-item split, :class:`~lightning_dcp.planning.view.CostView`) --
def ring_candidates(p: int, default: int, usable: "set[int] | None") -> list[int]:
    """Ring degrees of a group of ``p`` ranks whose Ulysses subgroup is in ``usable`` (the sizes the cost model prices;
    None: no rings), the default first, before the placement rule."""
    if usable is None or p == 1:
        return [default]
    return [default] + [r for r in divisors(p) if r != default and p // r in usable]


def item_rings(p: int, candidates: "list[int]", node: int | None, align: int) -> tuple[int, ...]:
    """The ``candidates`` an item on ``p`` ranks may take: a group larger than a node only the splits whose Ulysses
    subgroups its start alignment ``align`` keeps inside nodes."""
    return (candidates[0],) + tuple(r for r in candidates[1:] if not node or p <= node or align % (p // r) == 0)


def tp_degrees(candidates: "dict[int, list[int]]", node: int, max_tp: int) -> dict[int, tuple[int, ...]]:
    """Per SP size (``candidates``: its ring degrees), the TP degrees (2 .. ``max_tp``, dividing a node's GPUs) some
    of its splits may take: those dividing a Ulysses subgroup."""
    degrees = [t for t in divisors(node) if 2 <= t <= max_tp]
    out = {}
    for p, rings in candidates.items():
        ts = tuple(t for t in degrees if any((p // r) % t == 0 for r in rings))
        if ts:
            out[p] = ts
    return out


def item_splits(p: int, rings: "tuple[int, ...]", tps: "tuple[int, ...]", node: int | None,
                align: int) -> tuple[tuple[int, int], ...]:
    """Every ``(ring, tp)`` split of an item on ``p`` ranks, the default first: ``rings`` without TP, then each TP
    degree of ``tps`` on the rings whose subgroup it divides (a group larger than a node: the degrees its start
    alignment ``align`` keeps inside nodes)."""
    out = [(r, 1) for r in rings]
    for t in tps:
        if node and p > node and align % t:
            continue
        out.extend((r, t) for r in rings if (p // r) % t == 0)
    return tuple(out)
