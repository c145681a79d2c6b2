"""The active sequence-parallel context: the one piece of state the runtime sets per micro-batch.

:class:`~lightning_dcp.DCPStrategy` (and the profiler) switch it for every work item; the
model-side helpers (:func:`~lightning_dcp.ulysses_attention`,
:class:`~lightning_dcp.RecomputeLayers`) read it. Outside a DCP run it is the trivial context:
SP size 1, no recomputation, so the helpers behave like plain single-device modules.

Batch contract: a DCP micro-batch is a ``dict``. Every tensor whose first dimension is the
packed token dimension is sharded along it for the SP group; the keys below are added by the
collate step and the strategy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # pragma: no cover
    import torch.distributed as dist

#: int32, ``[num_segments + 1]``: cumulative lengths over the *whole* packed (padded) sequence,
#: as flash-attn's varlen kernels take them. A trailing padding segment, if any, is its own segment.
CU_SEQLENS = "cu_seqlens"
#: int: the longest segment in ``cu_seqlens``.
MAX_SEQLEN = "max_seqlen"
#: int64, local shard: position of each token inside its own sample (RoPE etc.).
POSITION_IDS = "position_ids"
#: bool, local shard: False on padding tokens.
LOSS_MASK = "loss_mask"
#: int64, local shard: which sample (index into the item's ``samples``) each token belongs to; -1 on padding.
SEGMENT_IDS = "segment_ids"
#: float32, local shard: per-token weight that makes ``(token_loss * token_weight).sum()`` summed
#: over all ranks and items equal the global loss of the configured reduction.
TOKEN_WEIGHT = "token_weight"
#: list[int]: dataset indices of the item's samples (not sharded).
SAMPLE_INDICES = "sample_indices"
#: int: total real (non-padding) tokens of the whole packed micro-batch.
NUM_TOKENS = "num_tokens"

#: Keys the collate step and strategy add; never sharded as user data.
RESERVED_KEYS = (CU_SEQLENS, MAX_SEQLEN, POSITION_IDS, LOSS_MASK, SEGMENT_IDS, TOKEN_WEIGHT, SAMPLE_INDICES, NUM_TOKENS)


#: Token layouts of a ring item's shards (:func:`lightning_dcp.sp.tokens.shard_spans`).
RING_LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class RingGrid:
    """How an SP group of ``degree * ulysses`` ranks runs ring attention (``WorkItem.ring > 1``).

    SP rank ``k`` sits at ring position ``k // ulysses`` of Ulysses subgroup position ``k % ulysses``:
    the heads are split over the Ulysses subgroup (an all-to-all), the sequence over the ring (key/value
    blocks passed around it). See :mod:`lightning_dcp.sp.ring`.

    Args:
        degree: ranks in the ring (``r > 1``).
        ulysses: ranks in a Ulysses subgroup (``u``; ``1``: ring only).
        ulysses_group: this rank's Ulysses subgroup (``None`` when ``ulysses == 1``).
        ring_group: this rank's ring (the ranks at its Ulysses position in every subgroup).
        ring_ranks: the global ranks of that ring, in ring order.
        layout: how the packed tokens are dealt to the SP ranks (one of :data:`RING_LAYOUTS`).
    """

    degree: int
    ulysses: int
    ulysses_group: "dist.ProcessGroup | None"
    ring_group: "dist.ProcessGroup | None"
    ring_ranks: tuple[int, ...]
    layout: str = "contiguous"


@dataclass(frozen=True)
class SPContext:
    """Which SP group is active and how many repeated layers recompute.

    Args:
        group: the process group of the SP ranks, or ``None`` for SP size 1.
        size: SP size (1 when ``group`` is None).
        rank: this process's rank inside ``group``.
        recompute: number of layers of each :class:`~lightning_dcp.RecomputeLayers` to checkpoint.
        item: the executing work item (a :class:`~lightning_dcp.planning.plan.WorkItem`), if any.
        ring: the ring-attention grid of a ring item (``None``: Ulysses over ``group`` alone).
    """

    group: "dist.ProcessGroup | None" = None
    size: int = 1
    rank: int = 0
    recompute: int = 0
    item: Any = None
    ring: RingGrid | None = None


_DEFAULT = SPContext()
_active: SPContext = _DEFAULT


def active_context() -> SPContext:
    """The SP context in force now (the trivial one outside a DCP step)."""
    return _active


@contextlib.contextmanager
def sp_context(ctx: SPContext) -> Iterator[SPContext]:
    """Make ``ctx`` the active context for the ``with`` block (restores the previous one after).

    Backward passes run after the block has exited, so helpers that need the group in backward
    (the all-to-all) capture it in forward; :class:`~lightning_dcp.RecomputeLayers` captures the
    context for its recomputation too.
    """
    global _active
    previous, _active = _active, ctx
    try:
        yield ctx
    finally:
        _active = previous


def set_context(ctx: SPContext | None) -> None:
    """Set the active context until changed (``None`` restores the trivial one)."""
    global _active
    _active = _DEFAULT if ctx is None else ctx
