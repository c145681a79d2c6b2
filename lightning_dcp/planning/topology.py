"""Which rank tuples a plan's SP groups may be: the placement rule the planner and the runtime share.

An SP group of ``s`` ranks, ring degree ``r``, Ulysses size ``u = s / r``, may be the consecutive ranks
``[a, a + s)`` inside the world (and one shard group, ``domain_size``) when ``s <= gpus_per_node`` puts it inside
one node (priced at intra-node bandwidth) and ``r > 1`` starts it at a multiple of ``u`` (each Ulysses subgroup then
inside a node); a group larger than a node may start anywhere else. Layouts are placed largest first, first fit
(docs/planner.md, "SP sizes"). Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

__all__ = ["Topology", "group_problem", "rank_tuples"]


@dataclass(frozen=True)
class Topology:
    """The world's ranks as the placement rule sees them.

    ``node_size``: GPUs per node (``None``: no node boundaries); ``domain_size``: ranks of a shard group no SP group
    may cross (``None``: the world); ``align``: start alignment per SP size (a ring size's Ulysses size ``u``).
    """

    world_size: int
    node_size: int | None = None
    domain_size: int | None = None
    align: Mapping[int, int] = field(default_factory=dict)
    _placed: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if int(self.world_size) < 1:
            raise ValueError(f"world size must be positive, got {self.world_size}")
        object.__setattr__(self, "align", {int(k): int(v) for k, v in self.align.items() if int(v) > 1})

    @classmethod
    def of(cls, world: "int | Topology") -> "Topology":
        """``world`` itself, or a bare topology (no nodes) of ``world`` ranks."""
        return world if isinstance(world, Topology) else cls(int(world))

    def legal(self, start: int, size: int) -> bool:
        """Whether ``[start, start + size)`` may be an SP group of ``size`` ranks."""
        end = start + size
        if start < 0 or end > self.world_size or start % self.align.get(size, 1):
            return False
        g = self.node_size
        if g and size <= g and start // g != (end - 1) // g:
            return False
        d = self.domain_size
        return not (d and start // d != (end - 1) // d)

    def next_start(self, lo: int, size: int, hi: int) -> int | None:
        """The smallest ``x >= lo`` with ``[x, x + size)`` legal and inside ``[lo, hi)``, or None."""
        al = self.align.get(size, 1)
        g, d = self.node_size, self.domain_size
        x = -(-lo // al) * al
        while x + size <= hi:
            end = x + size - 1
            if g and size <= g and x // g != end // g:
                x = -(-((end // g) * g) // al) * al  # the next node's first aligned rank
                continue
            if d and x // d != end // d:
                x = -(-((end // d) * d) // al) * al
                continue
            return x if x + size <= self.world_size else None
        return None

    def _starts(self, lo: int, hi: int, size: int, limit: int) -> list[int]:
        """Where first fit puts up to ``limit`` groups of ``size`` in the free run ``[lo, hi)``, in order."""
        al = self.align.get(size, 1)
        g = self.node_size
        out: list[int] = []
        if self.domain_size is None:  # closed forms: consecutive groups, per node when a group fits in one
            if not g or size > g:
                x = -(-lo // al) * al
                n = min((hi - x) // size, limit) if hi > x else 0
                return list(range(x, x + n * size, size))
            for k in range(lo // g, -(-hi // g)):  # node by node, until ``limit`` groups
                a, b = max(lo, k * g), min(hi, (k + 1) * g)
                x = -(-a // al) * al
                n = min((b - x) // size, limit - len(out)) if b > x else 0
                out.extend(range(x, x + n * size, size))
                if len(out) >= limit:
                    break
            return out
        x = self.next_start(lo, size, hi)
        while x is not None and len(out) < limit:
            out.append(x)
            x = self.next_start(x + size, size, hi)
        return out

    def count(self, free: Sequence[Sequence[int]], size: int) -> int:
        """How many groups of ``size`` first fit places in the free runs ``free`` (``[lo, hi)`` each)."""
        return sum(len(self._starts(lo, hi, size, hi - lo)) for lo, hi in free)

    def take(self, free: list[list[int]], size: int, count: int) -> list[tuple[int, ...]]:
        """Place up to ``count`` groups of ``size`` first fit in ``free`` (runs ``[lo, hi)`` in rank order,
        updated in place: a group's ranks leave it, a gap it skips stays free). Returns the groups placed."""
        out: list[tuple[int, ...]] = []
        new: list[list[int]] = []
        for lo, hi in free:
            starts = self._starts(lo, hi, size, count - len(out)) if len(out) < count else []
            pos = lo
            for x in starts:
                if x > pos:
                    new.append([pos, x])
                out.append(tuple(range(x, x + size)))
                pos = x + size
            if pos < hi:
                new.append([pos, hi])
        free[:] = new
        return out

    def place(self, layout: Iterable[int], start: int = 0, size: int | None = None) -> list[tuple[int, ...]] | None:
        """Rank tuples of ``layout``'s groups inside ``[start, start + size)`` (default: the world), placed largest
        first at the first legal offset, in that order; None if one does not fit."""
        end = self.world_size if size is None else start + int(size)
        key = (tuple(layout), int(start), end)
        if key in self._placed:  # deterministic: placed once per (layout, block)
            got = self._placed[key]
            return None if got is None else list(got)
        free = [[int(start), end]]
        groups: list[tuple[int, ...]] | None = []
        sizes = sorted(layout, reverse=True)
        for p in dict.fromkeys(sizes):  # first fit of n groups of one size at once = one by one
            n = sizes.count(p)
            got = self.take(free, int(p), n)
            if len(got) < n:
                groups = None
                break
            groups.extend(got)  # type: ignore[union-attr]
        if len(self._placed) < 100_000:
            self._placed[key] = groups
        return None if groups is None else list(groups)

    def free_runs(self, start: int = 0, size: int | None = None) -> list[list[int]]:
        """The block ``[start, start + size)`` as one free run, for :meth:`count` and :meth:`take`."""
        return [[int(start), self.world_size if size is None else int(start) + int(size)]]

    def always_contains(self, outer: int, inner: int) -> bool:
        """Whether every legal group of ``outer`` ranks holds a legal group of ``inner`` ranks (so it can run work
        planned for ``inner`` ranks as a fill, wherever it was placed)."""
        if inner > outer:
            return False
        # whether [a, a + outer) holds a legal inner group depends on a only through a's offset within a node,
        # a shard group and the two alignments: one period of those covers every start
        period = math.lcm(self.node_size or 1, self.domain_size or 1, self.align.get(outer, 1), self.align.get(inner, 1))
        for a in range(0, min(self.world_size - outer + 1, period)):
            if self.legal(a, outer) and self.next_start(a, inner, a + outer) is None:
                return False
        return True


def group_problem(ranks: Sequence[int], ring: int, topology: Topology, num_heads: int | None = None, *,
                  tp: int = 1) -> str | None:
    """Why ``ranks`` (with ``ring``, and ``tp``-way tensor parallelism in each subgroup) may not be an SP group under
    ``topology``'s rule, or None if it may. A TP group (``tp`` consecutive ranks of a subgroup) stays inside a node:
    ``tp`` divides a node's GPUs and a group larger than a node starts at a multiple of ``tp``."""
    ranks = list(ranks)
    s = len(ranks)
    if not s or ranks != list(range(ranks[0], ranks[0] + s)):
        return f"ranks {ranks} are not a run of consecutive ranks"
    if ranks[0] < 0 or ranks[-1] >= topology.world_size:
        return f"ranks {ranks} leave the world of {topology.world_size} ranks"
    u = s // max(1, int(ring))
    if num_heads and num_heads % u:
        return (f"its Ulysses size {u} (SP {s}, ring {ring}) does not divide the model's {num_heads} heads: Ulysses "
                "gives each rank whole heads")
    g, d, a = topology.node_size, topology.domain_size, ranks[0]
    if g and s <= g and a // g != ranks[-1] // g:
        return f"the SP group of {s} ranks crosses a node boundary (nodes of {g} GPUs); a group of at most a node stays in one"
    if ring > 1 and a % u:
        return f"the ring group starts at rank {a}, not a multiple of its Ulysses size {u}"
    if tp > 1:
        if u % tp:
            return f"its tensor-parallel degree {tp} does not divide its Ulysses subgroup of {u} ranks (SP {s}, ring {ring})"
        if g and g % tp:
            return f"its tensor-parallel degree {tp} does not divide a node's {g} GPUs: a TP group stays inside a node"
        if g and s > g and a % tp:
            return (f"the group of {s} ranks starts at rank {a}, not a multiple of its tensor-parallel degree {tp}: "
                    "its TP groups would cross a node boundary")
    if d and a // d != ranks[-1] // d:
        return f"ranks {ranks} span two shard groups of {d} ranks"
    return None


def rank_tuples(world_size: int, splits: Mapping[int, int] | Iterable[int], gpus_per_node: int | None,
                domain_size: int | None = None, *, min_size: int = 2) -> tuple[tuple[int, ...], ...]:
    """Every rank tuple a plan may use as an SP group (what the runtime needs process groups for).

    ``splits``: SP size -> its ring degree (:attr:`Planner.ring_degrees <lightning_dcp.planning.planner.Planner>`),
    or plain sizes (ring 1); sizes below ``min_size`` are left out (a single rank needs no process group). A ring
    group's Ulysses subgroups are in the list too (their size is a planner's Ulysses size). Ordered by size, then
    first rank: the same list on every rank, an order to create process groups in.
    """
    ring = dict(splits) if isinstance(splits, Mapping) else {int(s): 1 for s in splits}
    align = {s: s // r for s, r in ring.items() if r > 1}
    topo = Topology(int(world_size), gpus_per_node, domain_size, align)
    out = []
    for s in sorted(ring):
        if min_size <= s <= world_size:
            out.extend(tuple(range(a, a + s)) for a in range(world_size - s + 1) if topo.legal(a, s))
    return tuple(out)
