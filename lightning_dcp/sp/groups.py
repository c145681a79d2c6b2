"""Sequence-parallel process groups: one per aligned power-of-two block of ranks, created once.

A DCP step may run any SP group the plan names, so every group has to exist before the first
step (creating a communicator costs 0.1-2.5 s on NCCL, and ``dist.new_group`` is a collective
every rank must call, in the same order). :class:`SPGroups` creates, in a fixed order on every
rank, the groups of every aligned block ``[k*p, ..., k*p + p - 1]`` with ``p`` a power of two,
``2 <= p <= max_sp_size`` and the block fully inside ``[0, world_size)``.

Group count: ``sum_{p = 2, 4, ..., P} floor(W / p) < W`` groups in all (``W/2 + W/4 + ...``),
each rank belonging to ``log2(P)`` of them. On a world size that is not a power of two, only
the blocks that fit are formed (``W = 6``: ``[0,1] [2,3] [4,5] [0..3]``); a plan naming any
other set of ranks is refused with an error.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Sequence

import torch.distributed as dist

__all__ = ["SPGroups", "aligned_blocks", "largest_power_of_two"]


def largest_power_of_two(n: int) -> int:
    """The largest power of two ``<= n`` (``n >= 1``)."""
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    return 1 << (n.bit_length() - 1)


def aligned_blocks(world_size: int, max_sp_size: int | None = None) -> list[tuple[int, ...]]:
    """All aligned power-of-two blocks of size ``>= 2`` inside ``[0, world_size)``, in creation order.

    Order: by size ascending, then by first rank. ``max_sp_size`` (a power of two) caps the size;
    ``None`` means the largest power of two ``<= world_size``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cap = largest_power_of_two(world_size) if max_sp_size is None else int(max_sp_size)
    if cap < 1 or cap & (cap - 1):
        raise ValueError(f"max_sp_size must be a power of two >= 1, got {max_sp_size}")
    blocks: list[tuple[int, ...]] = []
    p = 2
    while p <= min(cap, world_size):
        for start in range(0, world_size - p + 1, p):
            blocks.append(tuple(range(start, start + p)))
        p *= 2
    return blocks


class SPGroups:
    """Registry of the SP process groups of one world.

    Args:
        world_size: number of ranks.
        rank: this process's global rank.
        max_sp_size: largest SP size to create groups for (a power of two); ``None``: the
            largest power of two ``<= world_size``.
        backend: ``dist.new_group`` backend (``None``: the default group's).
        timeout: how long a collective of these groups may wait before it fails (``None``: the
            backend's default); the strategy passes its own ``timeout``.
        create: call ``dist.new_group`` (set False for a registry without torch.distributed,
            e.g. in planning-only tests; :meth:`group_for` then returns ``None`` for every group).

    Every rank must construct this with the same arguments at the same point (it is a
    sequence of collectives).
    """

    def __init__(self, world_size: int, rank: int = 0, max_sp_size: int | None = None, backend: str | None = None,
                 create: bool = True, timeout: timedelta | None = None) -> None:
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.blocks = aligned_blocks(self.world_size, max_sp_size)
        self.max_sp_size = max((len(b) for b in self.blocks), default=1)
        self._groups: dict[tuple[int, ...], object] = {}
        for block in self.blocks:
            kwargs = {"timeout": timeout} if timeout is not None else {}
            group = dist.new_group(list(block), backend=backend, **kwargs) if create else None
            # new_group returns a non-member placeholder on ranks outside the block; keep only ours.
            if self.rank in block:
                self._groups[block] = group

    @property
    def sizes(self) -> list[int]:
        """SP sizes available: 1 and every block size created."""
        return [1] + sorted({len(b) for b in self.blocks})

    def has(self, ranks: Sequence[int]) -> bool:
        """Whether ``ranks`` is SP size 1 or one of the created blocks."""
        ranks = tuple(int(r) for r in ranks)
        return len(ranks) == 1 and 0 <= ranks[0] < self.world_size or ranks in set(self.blocks)

    def group_for(self, ranks: Iterable[int]):
        """The process group of ``ranks`` (``None`` for a single rank).

        Raises:
            ValueError: ``ranks`` is not an aligned block this registry created, or this rank is
                not in it.
        """
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) == 1:
            return None
        if ranks not in self._groups:
            if ranks in set(self.blocks):
                raise ValueError(f"rank {self.rank} is not a member of SP group {list(ranks)}; it cannot run that item")
            raise ValueError(
                f"no SP group for ranks {list(ranks)}: groups exist only for aligned power-of-two blocks of size "
                f"2..{self.max_sp_size} inside a world of {self.world_size} ranks; fix the plan or raise max_sp_size"
            )
        return self._groups[ranks]

    def destroy(self) -> None:
        """Destroy this rank's SP process groups (at teardown; a group left alive at interpreter exit can
        abort the process from a C++ destructor after all work is done). Idempotent."""
        groups, self._groups = list(self._groups.values()), {}
        if dist.is_available() and dist.is_initialized():
            for group in groups:
                if group is not None:
                    dist.destroy_process_group(group)

    def __len__(self) -> int:
        return len(self.blocks)

    def __repr__(self) -> str:
        return f"SPGroups(world_size={self.world_size}, sizes={self.sizes}, groups={len(self.blocks)})"
