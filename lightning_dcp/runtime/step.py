"""The typed step: what travels from the sampler to the micro-batch loop, one frozen value per stage.

One optimizer step passes through four forms, each built from the one before, never edited in place:

1. :class:`Step` -- what :class:`~lightning_dcp.runtime.sampler.DCPBatchSampler` yields: the whole
   step plan (:class:`~lightning_dcp.planning.plan.StepPlan`), its position (epoch, index), its
   fingerprint, and this rank's :class:`RankItem` s in execution order;
2. :class:`LoadedStep` -- what the train DataLoader yields (:mod:`~lightning_dcp.runtime.loader`):
   the step and one loaded micro-batch per rank item (packed samples, or in safe mode the user's
   ``collate_fn`` output); it pickles, so DataLoader worker processes can build it;
3. :class:`PreparedStep` -- after the executor's host-side preparation: one :class:`MicroBatch` per
   rank item, holding this rank's shard and the counts the loop and the step-end gather need (so the
   loop never syncs the device); then moved to the device as a whole;
4. :class:`StepResult` -- what :meth:`~lightning_dcp.runtime.executor.StepExecutor.run_step` returns:
   the step's exact global loss, its metrics row and the plan it ran.

In Lightning hooks that receive the batch (``on_train_batch_start`` / ``on_train_batch_end``), the
batch is a :class:`PreparedStep`: ``batch.step.plan`` is the step plan, ``batch.step.items`` this
rank's work items, ``batch.micro_batches`` the local shards; in safe mode it also unpacks like this rank's
batch as the user's ``collate_fn`` makes it (``x, y = batch``: :attr:`PreparedStep.data`,
:mod:`~lightning_dcp.runtime.step_batch`). The plan's JSON form
(:meth:`StepPlan.to_dict`, ``lightning-dcp/plan/v1``) is unchanged.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.runtime.agreement import plan_fingerprint
from lightning_dcp.sp.context import RingGrid, SPContext

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from lightning_dcp.runtime.metrics import StepMetrics
    from lightning_dcp.sp.groups import SPGroups

__all__ = ["LoadedStep", "MicroBatch", "PreparedStep", "RankItem", "Step", "StepResult"]


@dataclass(frozen=True)
class RankItem:
    """One work item of the step as this rank runs it.

    Args:
        index: the item's position in the step plan (the same on every rank of its SP group).
        micro_batch: its position in this rank's micro-batch loop.
        ranks: the global ranks of its SP group (any increasing tuple the plan names).
        sp_rank: this rank's position inside ``ranks``.
        samples: dataset indices packed into the item, in packing order.
        lengths: each sample's length in tokens.
        recompute: how many repeated layers run with activation checkpointing.
        ring: the item's ring-attention degree (``WorkItem.ring``; 1: Ulysses only).
    """

    index: int
    micro_batch: int
    ranks: tuple[int, ...]
    sp_rank: int
    samples: tuple[int, ...]
    lengths: tuple[int, ...]
    recompute: int
    ring: int = 1

    @classmethod
    def of(cls, item: WorkItem, *, index: int, micro_batch: int, rank: int) -> "RankItem":
        """``rank``'s view of the plan's ``item`` (``rank`` must be one of its ranks)."""
        if rank not in item.ranks:
            raise ValueError(f"rank {rank} is not in item {index}'s SP group {list(item.ranks)}")
        return cls(index=index, micro_batch=micro_batch, ranks=item.ranks, sp_rank=item.ranks.index(rank),
                   samples=item.samples, lengths=item.lengths, recompute=item.recompute, ring=item.ring)

    @property
    def sp_size(self) -> int:
        return len(self.ranks)

    @property
    def work_item(self) -> WorkItem:
        """The plan's item (ranks, samples, lengths, recompute, ring)."""
        return WorkItem(self.ranks, self.samples, self.lengths, self.recompute, self.ring)

    @property
    def ulysses_size(self) -> int:
        """Ranks of one Ulysses subgroup (the heads are split this many ways)."""
        return self.sp_size // self.ring

    def sp_context(self, groups: "SPGroups | None", layout: str = "contiguous") -> SPContext:
        """The SP context this item runs in: its group (``None`` at SP 1), this rank's position, its recompute count;
        for a ring item its :class:`~lightning_dcp.sp.context.RingGrid` (subgroup, ring, token ``layout``)."""
        have = self.sp_size > 1 and groups is not None
        group = groups.group_for(self.ranks) if have else None
        grid = None
        if self.ring > 1:
            u = self.ulysses_size
            ring_ranks = self.ranks[self.sp_rank % u::u]
            position = self.sp_rank // u
            grid = RingGrid(degree=self.ring, ulysses=u,
                            ulysses_group=groups.group_for(self.ranks[position * u:(position + 1) * u])
                            if have and u > 1 else None,
                            ring_group=groups.group_for(ring_ranks) if have else None, ring_ranks=ring_ranks,
                            layout=layout)
        return SPContext(group=group, size=self.sp_size, rank=self.sp_rank, recompute=self.recompute,
                         item=self.work_item, ring=grid)

    def describe(self, sample_name: Callable[[int], str] | None = None) -> str:
        """``item 3 (samples [4, 9], lengths [120, 33], SP 2, recompute 1)`` (for errors; the dataset's
        ``sample_name`` adds each sample's name)."""
        from lightning_dcp.runtime.faults import describe_item

        return describe_item(self, sample_name=sample_name)


@dataclass(frozen=True)
class Step:
    """One optimizer step of the run, as this rank sees it.

    Args:
        epoch: the epoch.
        index: the step's index in the epoch.
        plan: the whole step plan (every rank's items).
        items: this rank's items, in execution order (empty when the plan gives this rank no work).
        rank: this rank.
        world_size: the world the step was planned for.
        plan_hash: :func:`~lightning_dcp.runtime.agreement.plan_fingerprint` of the plan at this position.
    """

    epoch: int
    index: int
    plan: StepPlan
    items: tuple[RankItem, ...]
    rank: int
    world_size: int
    plan_hash: float

    @classmethod
    def build(cls, plan: StepPlan, *, epoch: int, index: int, rank: int, world_size: int) -> "Step":
        """The step ``plan`` at (``epoch``, ``index``) for ``rank`` of ``world_size``."""
        mine = [(i, item) for i, item in enumerate(plan.items) if rank in item.ranks]
        items = tuple(RankItem.of(item, index=i, micro_batch=k, rank=rank) for k, (i, item) in enumerate(mine))
        return cls(epoch=int(epoch), index=int(index), plan=plan, items=items, rank=int(rank),
                   world_size=int(world_size), plan_hash=plan_fingerprint(plan.to_dict(), epoch, index))

    def with_plan(self, plan: StepPlan) -> "Step":
        """The same step position and rank with another plan (a re-plan after an out-of-memory error)."""
        return Step.build(plan, epoch=self.epoch, index=self.index, rank=self.rank, world_size=self.world_size)

    @property
    def global_tokens(self) -> int:
        """Tokens of the whole step (every rank)."""
        return self.plan.tokens

    @property
    def global_samples(self) -> int:
        return len(self.plan.samples)

    @property
    def plan_lengths(self) -> list[int]:
        """Every sample length of the whole step, in plan order."""
        return [n for item in self.plan.items for n in item.lengths]

    def where(self) -> str:
        """``step 3 of epoch 0`` (for errors)."""
        return f"step {self.index} of epoch {self.epoch}"


class LoadedStep:
    """What the train DataLoader yields per optimizer step: the step and one loaded micro-batch per rank item.

    Immutable (``with_batches`` gives a new one) and picklable. Not a dataclass on purpose: Lightning
    runs its precision plugin's ``convert_input`` (``apply_to_collection``, which refuses frozen
    dataclasses) over the batch before the strategy sees it; this value passes through unchanged,
    and the executor converts the micro-batches itself (:attr:`RankRuntime.convert_input
    <lightning_dcp.runtime.rank.RankRuntime>`), before preparing them, as Lightning would have.
    """

    __slots__ = ("step", "batches")
    step: Step
    batches: tuple[Any, ...]

    def __init__(self, step: Step, batches: Sequence[Any]) -> None:
        batches = tuple(batches)
        if len(batches) != len(step.items):
            raise ValueError(f"{step.where()}: {len(batches)} loaded micro-batches for {len(step.items)} work items "
                             f"of rank {step.rank}")
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "batches", batches)

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}: a LoadedStep is immutable (use with_batches)")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}: a LoadedStep is immutable")

    def __reduce__(self) -> tuple:
        return (LoadedStep, (self.step, self.batches))

    def __repr__(self) -> str:
        return f"LoadedStep(step={self.step!r}, batches=<{len(self.batches)} micro-batches>)"

    def with_batches(self, batches: Sequence[Any]) -> "LoadedStep":
        """The same step with other micro-batches (converted, pinned...)."""
        return LoadedStep(self.step, batches)

    def pin_memory(self) -> "LoadedStep":
        """The DataLoader's ``pin_memory=True`` calls this: every micro-batch's tensors pinned."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return self.with_batches([pin_memory(b) for b in self.batches])


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the loop runs it: this rank's shard of a work item and what was counted on the host.

    Args:
        item: the work item.
        data: this rank's shard (host memory until the step moves to the device).
        loss_units: the item's loss units toward the global divisor (counted by its first SP rank only).
        local_loss_tokens: loss tokens in this rank's shard.
        item_loss_tokens: loss tokens of the whole item (all its SP ranks).
        real_tokens: real (non-padding) tokens in this rank's shard.
    """

    item: RankItem
    data: Any
    loss_units: int
    local_loss_tokens: int
    item_loss_tokens: int
    real_tokens: int

    def with_data(self, data: Any) -> "MicroBatch":
        return replace(self, data=data)

    @property
    def log_weight(self) -> float:
        """The weight of a value this micro-batch logs with ``sync_dist=True`` in the step's value
        (:mod:`~lightning_dcp.runtime.step_logs`): its item's samples, split over an SP item's shards by their loss
        tokens (an item without loss tokens: evenly)."""
        samples = len(self.item.samples)
        if self.item_loss_tokens > 0:
            return samples * self.local_loss_tokens / self.item_loss_tokens
        return samples / self.item.sp_size


@dataclass(frozen=True)
class PreparedStep:
    """A step ready for the micro-batch loop: one :class:`MicroBatch` per rank item, in execution order.

    ``on_device``: the shards were moved to the device (``batch_to_device``). ``collated``: every micro-batch is
    the user's ``collate_fn`` output (safe mode); then the step unpacks like this rank's whole batch
    (``x, y = batch``, ``batch["image"]``, ``len(batch)``): :attr:`data` (:mod:`~lightning_dcp.runtime.step_batch`).
    """

    step: Step
    micro_batches: tuple[MicroBatch, ...]
    on_device: bool = False
    collated: bool = False

    @cached_property
    def data(self) -> Any:
        """This rank's samples of the step as the user's ``collate_fn`` batches them: the micro-batches (as
        ``training_step`` saw them) joined along the batch dimension, built on first use
        (:func:`~lightning_dcp.runtime.step_batch.join_batches`).

        Raises:
            StepBatchError: the micro-batches are packed shards (support level ``"packed"`` / ``"sp"``), this rank
                has no micro-batch in the step, or they do not join (the message names which and the fix).
        """
        from lightning_dcp.runtime.step_batch import StepBatchError, join_batches

        if not self.collated:
            raise StepBatchError(
                f"{self.step.where()}: the micro-batches are packed shards (pack_samples), not your collate_fn's "
                "batches, so the step does not unpack like one; read batch.micro_batches[i].data (what training_step "
                "gets) and batch.step.items (samples, lengths, SP group)")
        if not self.micro_batches:
            raise StepBatchError(f"{self.step.where()}: the plan gives rank {self.step.rank} no sample this step, so "
                                 "there is no batch to unpack; check `if batch.micro_batches:` first")
        return join_batches([mb.data for mb in self.micro_batches])

    def __iter__(self) -> Iterator[Any]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key: Any) -> Any:
        return self.data[key]

    def __contains__(self, key: Any) -> bool:
        return key in self.data

    def __bool__(self) -> bool:  # a step is never falsy (``len`` is the batch's)
        return True

    def keys(self) -> Any:
        """The batch's keys, for a dict batch (so ``dict(batch)`` and ``**batch`` work)."""
        return self.data.keys()

    def values(self) -> Any:
        return self.data.values()

    def items(self) -> Any:
        return self.data.items()

    @property
    def real_tokens(self) -> int:
        return sum(mb.real_tokens for mb in self.micro_batches)

    @property
    def loss_units(self) -> int:
        return sum(mb.loss_units for mb in self.micro_batches)

    def to_device(self, move: Callable[[Any], Any]) -> "PreparedStep":
        """The shards moved by one call of ``move`` on the tuple of them (Lightning's ``batch_to_device``,
        so the module's batch-transfer hooks run once per step)."""
        moved = move(tuple(mb.data for mb in self.micro_batches))
        if len(moved) != len(self.micro_batches):
            raise ValueError(f"moving {self.step.where()} to the device gave {len(moved)} micro-batches for "
                             f"{len(self.micro_batches)}; a batch-transfer hook must keep the tuple of micro-batches")
        micro_batches = tuple(mb.with_data(data) for mb, data in zip(self.micro_batches, moved))
        return replace(self, micro_batches=micro_batches, on_device=True)


@dataclass(frozen=True)
class StepResult:
    """What one step did: the exact global loss (detached), its metrics row and the plan that ran.

    ``step`` is the step as it finally ran (after out-of-memory re-plans, its ``plan`` differs from
    the sampler's).
    """

    loss: "Tensor"
    metrics: "StepMetrics"
    step: Step

    @property
    def plan(self) -> StepPlan:
        return self.step.plan
