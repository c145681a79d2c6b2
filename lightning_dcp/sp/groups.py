"""Sequence-parallel process groups: any rank tuple a plan names, created as agreed across ranks, cached.

``dist.new_group`` is a collective every rank of the world must call, for every group, in the same
order (creating a communicator also costs 0.1-2.5 s on NCCL, so groups are made once and reused).
:class:`SPGroups` keeps one registry per world and creates groups at two agreed points:

* **up front** (the constructor, at setup): the aligned blocks ``[k*p, ..., k*p + p - 1]`` of every
  size ``p`` in ``sizes`` (``2 <= p``, the block fully inside ``[0, world_size)``), by size then first
  rank. These are the groups a profiler measures on and most plans use (``W = 6``, sizes 2, 3, 6:
  ``[0,1] [2,3] [4,5] [0,1,2] [3,4,5] [0..5]``).
* **per step** (:meth:`ensure`, before a step's first micro-batch): every group the step's plan
  needs that does not exist yet -- a contiguous run of any length at any offset, and for a ring item
  (:attr:`~lightning_dcp.planning.plan.WorkItem.ring` ``r > 1``, ``u = len(ranks) // r``) its ``r``
  Ulysses subgroups ``ranks[j*u:(j+1)*u]`` and its ``u`` rings ``ranks[i::u]``
  (:func:`groups_of_item`). Plans are identical on every rank (the executor compares their hashes), so
  every rank derives the same missing tuples; they are created sorted (by size, then ranks), so in the
  same order everywhere. Nothing is created when every tuple is cached: a run whose plans reuse groups
  pays the creation once.

Every group is destroyed by :meth:`destroy` (the strategy's teardown): a group left alive at
interpreter exit can abort the process (see :mod:`lightning_dcp.runtime.exit`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Iterable, Sequence

import torch.distributed as dist

__all__ = ["SPGroups", "aligned_blocks", "groups_of_item", "largest_power_of_two", "power_of_two_sizes"]


def largest_power_of_two(n: int) -> int:
    """The largest power of two ``<= n`` (``n >= 1``)."""
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    return 1 << (n.bit_length() - 1)


def power_of_two_sizes(limit: int) -> tuple[int, ...]:
    """``1, 2, 4, ...`` up to ``limit`` (``>= 1``)."""
    return tuple(1 << k for k in range(largest_power_of_two(max(1, int(limit))).bit_length()))


def aligned_blocks(world_size: int, max_sp_size: int | None = None,
                   sizes: Iterable[int] | None = None) -> list[tuple[int, ...]]:
    """The aligned blocks of size ``>= 2`` inside ``[0, world_size)``, in creation order (size, then first rank).

    ``sizes``: the block sizes (any positive integers); default the powers of two up to ``max_sp_size``
    (``None``: up to the world).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if sizes is None:
        cap = world_size if max_sp_size is None else int(max_sp_size)
        if cap < 1:
            raise ValueError(f"max_sp_size must be >= 1, got {max_sp_size}")
        sizes = power_of_two_sizes(cap)
    blocks: list[tuple[int, ...]] = []
    for p in sorted({int(p) for p in sizes}):
        if p < 1:
            raise ValueError(f"SP sizes must be >= 1, got {p}")
        if 2 <= p <= world_size:
            blocks.extend(tuple(range(start, start + p)) for start in range(0, world_size - p + 1, p))
    return blocks


def groups_of_item(ranks: Sequence[int], ring: int = 1) -> list[tuple[int, ...]]:
    """The process groups (rank tuples of size ``>= 2``) an item on ``ranks`` with ring degree ``ring`` runs on:
    the whole SP group; with ``ring > 1`` also its Ulysses subgroups and its rings (see the module docstring)."""
    ranks = tuple(int(r) for r in ranks)
    out = [ranks] if len(ranks) > 1 else []
    if ring > 1:
        u = len(ranks) // ring
        if u > 1:
            out.extend(ranks[j * u:(j + 1) * u] for j in range(ring))
        out.extend(ranks[i::u] for i in range(u))
    return out


class SPGroups:
    """Registry of the SP process groups of one world.

    Args:
        world_size: number of ranks.
        rank: this process's global rank.
        max_sp_size: with ``sizes`` unset, create the aligned power-of-two blocks up to it up front
            (``None``: up to the world).
        backend: ``dist.new_group`` backend (``None``: the default group's).
        create: call ``dist.new_group`` (set False for a registry without torch.distributed, e.g. in
            planning-only tests; :meth:`group_for` then returns ``None`` for every group).
        timeout: how long a collective of these groups may wait before it fails (``None``: the
            backend's default); the strategy passes its own ``timeout``.
        sizes: the SP sizes whose aligned blocks are created up front (e.g. the divisors of the heads
            up to the SP cap); other rank tuples are created by :meth:`ensure`.

    Every rank must construct this with the same arguments at the same point, and call :meth:`ensure`
    with the same plan at the same point (they are sequences of collectives).
    """

    def __init__(self, world_size: int, rank: int = 0, max_sp_size: int | None = None, backend: str | None = None,
                 create: bool = True, timeout: timedelta | None = None, sizes: Iterable[int] | None = None) -> None:
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.backend = backend
        self.timeout = timeout
        self.creates = bool(create)
        self.blocks = aligned_blocks(self.world_size, max_sp_size, sizes)
        self.max_sp_size = max((len(b) for b in self.blocks), default=1)
        self._known: set[tuple[int, ...]] = set()  # every tuple created (also those this rank is not in)
        self._groups: dict[tuple[int, ...], Any] = {}  # this rank's groups
        self.created_per_step = 0
        """Groups :meth:`ensure` created over the registry's life (the up-front blocks not counted)."""
        self._create(self.blocks)

    def _create(self, tuples: Iterable[tuple[int, ...]]) -> None:
        kwargs = {"timeout": self.timeout} if self.timeout is not None else {}
        for ranks in tuples:
            group = dist.new_group(list(ranks), backend=self.backend, **kwargs) if self.creates else None
            self._known.add(ranks)
            # new_group returns a non-member placeholder on ranks outside the tuple; keep only ours.
            if self.rank in ranks:
                self._groups[ranks] = group

    @property
    def sizes(self) -> list[int]:
        """SP sizes created up front: 1 and every aligned block size."""
        return [1] + sorted({len(b) for b in self.blocks})

    def has(self, ranks: Sequence[int]) -> bool:
        """Whether ``ranks`` is SP size 1 or a group that exists (up front or ensured)."""
        ranks = tuple(int(r) for r in ranks)
        return len(ranks) == 1 and 0 <= ranks[0] < self.world_size or ranks in self._known

    def missing(self, items: Iterable[Any]) -> list[tuple[int, ...]]:
        """The groups ``items`` (objects with ``ranks`` and ``ring``, e.g. a step's work items) need and that
        do not exist yet, in creation order (size, then ranks). Raises ``ValueError`` for a rank tuple that
        is not strictly increasing inside the world."""
        need: set[tuple[int, ...]] = set()
        for item in items:
            ranks = tuple(int(r) for r in item.ranks)
            if any(b <= a for a, b in zip(ranks, ranks[1:])) or not ranks or ranks[0] < 0 or ranks[-1] >= self.world_size:
                raise ValueError(f"SP group {list(ranks)} must be distinct increasing ranks inside a world of "
                                 f"{self.world_size}; fix the plan")
            need.update(groups_of_item(ranks, int(getattr(item, "ring", 1))))
        return sorted(need - self._known, key=lambda t: (len(t), t))

    def ensure(self, items: Iterable[Any]) -> int:
        """Create every group ``items`` need that does not exist yet (see the module docstring); returns how
        many were created. A collective of the world when it creates any: every rank must call it with the
        same items (a step's whole plan, not only this rank's items)."""
        todo = self.missing(items)
        self._create(todo)
        self.created_per_step += len(todo)
        return len(todo)

    def group_for(self, ranks: Iterable[int]):
        """The process group of ``ranks`` (``None`` for a single rank).

        Raises:
            ValueError: ``ranks`` was never created (fix the plan, or call :meth:`ensure` first), or this rank
                is not in it.
        """
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) == 1:
            return None
        if ranks not in self._groups:
            if ranks in self._known:
                raise ValueError(f"rank {self.rank} is not a member of SP group {list(ranks)}; it cannot run that item")
            raise ValueError(
                f"no SP group for ranks {list(ranks)} in a world of {self.world_size} ranks: the groups of a step are "
                "created before its first micro-batch (SPGroups.ensure(step.plan.items) on every rank); fix the plan "
                "or create the group first")
        return self._groups[ranks]

    def destroy(self) -> None:
        """Destroy this rank's SP process groups (at teardown; a group left alive at interpreter exit can
        abort the process from a C++ destructor after all work is done). Idempotent."""
        groups, self._groups = list(self._groups.values()), {}
        self._known = set()
        if dist.is_available() and dist.is_initialized():
            for group in groups:
                if group is not None:
                    dist.destroy_process_group(group)

    def __len__(self) -> int:
        return len(self._known)

    def __repr__(self) -> str:
        return f"SPGroups(world_size={self.world_size}, sizes={self.sizes}, groups={len(self._known)})"
