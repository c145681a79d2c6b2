"""Which SP sizes a model allows: the one rule the planner, the simulator and the runtime read.

**Ulysses** splits the attention heads over the SP group, so a Ulysses size ``u`` must divide the
model's query heads (28 heads: 1, 2, 4, 7, 14, 28). Grouped-query attention asks nothing more: the
key/value heads are repeated before the all-to-all as far as ``u`` needs
(:func:`lightning_dcp.sp.ulysses.kv_repeat_before_all_to_all`), which costs all-to-all bytes, not
legality. **Ring attention** splits a sequence further and is not bound by the heads: an SP group of
``s = r * u`` ranks runs ``r`` Ulysses subgroups of ``u`` ranks in a ring (``WorkItem.ring``).

Pure Python: no torch.
"""

from __future__ import annotations

import math

__all__ = ["MAX_RING", "best_split", "divisors", "kv_repeat", "node_ulysses", "sp_splits", "ulysses_sizes"]

MAX_RING = 8
"""The largest ring degree of the ring sizes the planner adds (8 rings of a node's Ulysses group: 64 ranks
on 8-GPU nodes). Longer rings hold samples of many million tokens but multiply the sizes a large world
plans over (every doubling up to the world) for samples that rarely need them."""


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
    """``(ring, ulysses)`` for an SP group of ``size`` ranks: the largest Ulysses size dividing both the
    heads and ``size``; the ring takes the rest (``ring == 1`` whenever the heads allow ``size``)."""
    size = int(size)
    if size < 1:
        raise ValueError(f"an SP group has >= 1 rank, got {size}")
    u = max(d for d in ulysses_sizes(num_heads, size) if size % d == 0)
    return size // u, u


def kv_repeat(num_heads: int, num_kv_heads: int | None, ulysses: int) -> int:
    """How many times each key/value head is repeated before a Ulysses all-to-all of ``ulysses`` ranks.

    The same rule as :func:`lightning_dcp.sp.ulysses.kv_repeat_before_all_to_all` (pure, for planning):
    the smallest divisor ``f`` of ``num_heads / num_kv_heads`` with ``num_kv_heads * f`` divisible by
    ``ulysses``, so every rank receives whole key/value heads. 1 without grouped-query attention
    (``num_kv_heads`` 0, None or equal to the heads). The all-to-all then moves ``num_kv_heads * f``
    key and value heads per token instead of ``num_kv_heads``: the cost models price those bytes.
    """
    heads, kv, u = int(num_heads), int(num_kv_heads or num_heads), int(ulysses)
    if kv < 1 or heads % kv or u < 1 or heads % u:
        raise ValueError(f"cannot split {heads} heads ({kv} key/value heads) over a Ulysses group of {u}: the "
                         "heads must be a multiple of the key/value heads and divisible by the group size")
    groups = heads // kv
    return next(f for f in divisors(groups) if (kv * f) % u == 0)


def node_ulysses(num_heads: int, gpus_per_node: int) -> int:
    """The largest Ulysses size dividing both the heads and a node's GPUs: the Ulysses subgroup of the
    ring sizes the planner adds (every subgroup of a ring group then fits in one node)."""
    return max(d for d in divisors(int(num_heads)) if int(gpus_per_node) % d == 0)


def sp_splits(num_heads: int | None, limit: int, gpus_per_node: int, *, ring: bool = True,
              usable: "set[int] | None" = None) -> dict[int, tuple[int, ...]]:
    """Every SP size the planner may use up to ``limit``, with its candidate ring degrees (ascending).

    * every Ulysses size (:func:`ulysses_sizes`: the divisors of the heads up to ``limit``), ring 1;
    * with ``ring``: ring sizes past what the heads allow, ``r * u`` with ``u = node_ulysses(heads,
      gpus_per_node)`` and ``r = 2, 4, 8, ...`` (sizes the heads do not already give), so a sample can
      get more ranks than the heads allow -- every ring subgroup inside one node, the ring across
      (``r`` up to :data:`MAX_RING`);
    * with ``ring``, for a Ulysses size ``s`` larger than a node, also the Ulysses x ring split (USP)
      ``s = r * u``, ``u`` the largest divisor of ``gcd(heads, s)`` that divides the node size: its
      all-to-alls stay inside nodes; the cost model decides which of the two is cheaper.

    Without ``ring`` (or without a head count) only the Ulysses sizes, each ring 1. ``usable``: the
    Ulysses sizes a cost model can price (a profile's measured ones; default every divisor): only
    those are sizes, and the Ulysses subgroups of the rings are drawn from them.
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
