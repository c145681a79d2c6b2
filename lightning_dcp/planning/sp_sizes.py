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

__all__ = ["best_split", "divisors", "ulysses_sizes"]


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
