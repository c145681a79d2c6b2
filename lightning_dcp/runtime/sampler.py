"""DCPBatchSampler: one dataloader item per optimizer step, holding this rank's work items.

Per epoch the sampler draws a seeded permutation of the dataset (:func:`epoch_order`: ``seed + epoch``,
the same on every rank, the permutation of torch's DistributedSampler), cuts it into global batches by
the rule ``lightning-dcp plan`` uses too (:func:`~lightning_dcp.planning.batches.cut_batches`:
``global_batch_size`` samples, or up to ``global_batch_tokens`` tokens each), shows the planner the
epoch's batches (``planner.prepare``), asks it for each batch's step plan and yields,
for every step, a typed :class:`~lightning_dcp.runtime.step.Step`: the whole step plan and this
rank's items. Every rank yields the same number of items (one per step, possibly with no work item for
this rank), so ``len()`` agrees across ranks whatever the accumulation counts.

The :class:`~lightning_dcp.runtime.loader.DCPDataLoader` built around it loads and packs the
samples of this rank's items; sample lengths come from :mod:`lightning_dcp.runtime.lengths`.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Mapping, Sequence

import torch

from lightning_dcp.planning.batches import STEP_KEY_STRIDE, check_batch_size, cut_batches, step_key
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.lengths import check_lengths
from lightning_dcp.planning.plan import Plan, PlanError, StepPlan
from lightning_dcp.planning.checks import validate_step
from lightning_dcp.planning.sample_names import SampleNamer, name_sample
from lightning_dcp.planning.units import describe_limit
from lightning_dcp.runtime.options import TP_REFUSAL
from lightning_dcp.runtime.step import Step

__all__ = ["DCPBatchSampler", "epoch_order"]


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order of the dataset's samples in ``epoch``: ``torch.randperm`` seeded ``seed + epoch`` (torch's
    DistributedSampler's permutation, so the data order matches DDP's), or index order without ``shuffle``.
    The sampler and ``lightning-dcp plan`` both draw it here."""
    if not shuffle:
        return list(range(num_samples))
    g = torch.Generator()
    g.manual_seed(int(seed) + int(epoch))
    return torch.randperm(num_samples, generator=g).tolist()


def _as_steps(result: Any) -> list[StepPlan]:
    if isinstance(result, Plan):
        return list(result.steps)
    if isinstance(result, StepPlan):
        return [result]
    return list(result)


class _EpochHook:
    """Exposed as ``batch_sampler.sampler`` so Lightning's ``_set_sampler_epoch`` reaches us."""

    def __init__(self, owner: "DCPBatchSampler") -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)


class DCPBatchSampler:
    """Seeded global batches -> planned steps -> this rank's work items, one step per item.

    Args:
        lengths: sequence length of every dataset sample.
        planner: an object with ``plan_batch(samples, lengths, step=0)`` returning a
            :class:`~lightning_dcp.planning.plan.Plan` (or a list of ``StepPlan``) and a
            ``one_step_per_batch`` flag (e.g. :class:`lightning_dcp.planning.planner.Planner`).
        global_batch_size: samples per global batch (exclusive with ``global_batch_tokens``).
        global_batch_tokens: token budget per global batch: samples are taken in order while
            the sum stays within it (at least one sample per batch;
            :func:`~lightning_dcp.planning.batches.cut_batches`).
        num_replicas: world size; rank: this rank.
        seed: permutation seed (the epoch is added), the same on every rank.
        shuffle: permute the dataset each epoch (else dataset order).
        drop_last: drop the last global batch when incomplete (fewer samples or tokens than a full one).
        plan_ahead: plan step ``k+1`` in a background thread while step ``k`` trains
            (planners with ``one_step_per_batch``); other planners plan the whole epoch at the
            first ``len()`` / ``iter()``.
        cost_model: when given, samples longer than the largest setting holds
            (``cost_model.max_length(max_sp_size)``) are refused before their step, by name.
        max_sp_size: the largest SP size the runtime offers (for that check).
        sample_name: names a dataset index in errors (the dataset's ``sample_name``, e.g. its clip file).

    Each yielded item is ``[step]`` (a one-element list, as a DataLoader batch sampler yields lists
    of dataset keys): ``step`` is a :class:`~lightning_dcp.runtime.step.Step` -- the whole step plan,
    its epoch and index, and this rank's items in execution order
    (:class:`~lightning_dcp.runtime.step.RankItem`).
    """

    def __init__(self, lengths: Sequence[int], *, planner: Any, global_batch_size: int | None = None,
                 global_batch_tokens: int | None = None, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True, plan_ahead: bool = True, cost_model: Any = None,
                 max_sp_size: int | None = None, sample_name: SampleNamer | None = None) -> None:
        check_batch_size(global_batch_tokens, global_batch_size)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside a world of {num_replicas} ranks")
        self.lengths = check_lengths(lengths, "lengths")
        self.planner = planner
        self.global_batch_size = global_batch_size
        self.global_batch_tokens = global_batch_tokens
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.plan_ahead = plan_ahead
        self.cost_model = cost_model
        self.max_sp_size = max_sp_size
        self.sample_name = sample_name
        self.epoch = 0
        self._start_step = 0  # first step of the next iteration of self.epoch (mid-epoch resume)
        self._consumed: tuple[int, int] = (0, 0)  # (epoch, steps of that epoch the strategy ran)
        self._cache: dict[tuple[int, int], Future] = {}
        self._epoch_steps: dict[int, list[StepPlan]] = {}
        self._batches: dict[int, list[list[int]]] = {}
        self._prepared: int | None = None  # the epoch the planner was last prepared for
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._max_len: int | None = None
        self._recent: dict[tuple[int, int], StepPlan] = {}  # plans yielded lately, for next_plan()
        self.planned_upto = -1
        """The largest step key (:func:`~lightning_dcp.runtime.calibration.step_key`) handed to the planner so far
        (set in the main thread when a step is submitted, before any planning thread runs it)."""
        self.sampler = _EpochHook(self)

    # -- pickling (DataLoader workers never need the sampler, but be safe) ------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_executor=None, _cache={}, _lock=None, _recent={})
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- epochs and batches -------------------------------------------------------------------
    @property
    def one_step_per_batch(self) -> bool:
        return bool(getattr(self.planner, "one_step_per_batch", True))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``iter()`` yields (Lightning calls this each epoch)."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self._start_step = 0

    def global_batches(self, epoch: int) -> list[list[int]]:
        """The sample indices of each global batch of ``epoch`` (deterministic in seed and epoch)."""
        if epoch in self._batches:
            return self._batches[epoch]
        order = epoch_order(len(self.lengths), self.seed, epoch, self.shuffle)
        batches = cut_batches(self.lengths, order, global_batch_tokens=self.global_batch_tokens,
                              global_batch_size=self.global_batch_size, drop_last=self.drop_last)
        self._batches = {epoch: batches}  # keep one epoch
        return batches

    def left_out(self, epoch: int) -> int:
        """Samples of ``epoch`` in no global batch: the last, incomplete one, with ``drop_last`` (else 0)."""
        return len(self.lengths) - sum(len(b) for b in self.global_batches(epoch))

    def _prepare(self, epoch: int) -> None:
        """Show the planner ``epoch``'s global batches (``planner.prepare``, when it has one) before it plans any
        step of that epoch, as :meth:`Planner.plan <lightning_dcp.planning.planner.Planner.plan>` does; no
        planning thread runs meanwhile (a step of another epoch still planned ahead is waited for and dropped)."""
        if self._prepared == epoch:
            return
        for fut in self._cache.values():
            if not fut.cancel():
                fut.exception()
        self._cache.clear()
        prepare = getattr(self.planner, "prepare", None)
        if callable(prepare):
            prepare([[self.lengths[i] for i in batch] for batch in self.global_batches(epoch)])
        self._prepared = epoch

    def _check_fits(self, batch: Sequence[int]) -> None:
        if self.cost_model is None:
            return
        if self._max_len is None:
            sp = self.max_sp_size or self.num_replicas
            sizes = [s for s in getattr(self.cost_model, "sp_sizes", lambda w: [1])(self.num_replicas) if s <= sp] or [1]
            self._max_len = int(self.cost_model.max_length(max(sizes)))
            self._max_sp = max(sizes)
        for idx in batch:
            if self.lengths[idx] > self._max_len:
                raise PlanningError(
                    f"{name_sample(idx, self.sample_name)} has {self.lengths[idx]} tokens, but the largest setting (SP size {self._max_sp}, all "
                    f"{getattr(self.cost_model, 'num_layers', '?')} layers recomputed) holds at most {self._max_len} "
                    f"tokens within the memory budget of {describe_limit(self.cost_model)}; "
                    "drop or split that sample (filter the dataset by length), or run on more ranks / larger devices"
                )

    def _plan_batch(self, epoch: int, index: int, batch: list[int], planner: Any = None, seed_offset: int = 0) -> list[StepPlan]:
        self._check_fits(batch)
        lengths = [self.lengths[i] for i in batch]
        planner = self.planner if planner is None else planner
        try:
            steps = _as_steps(planner.plan_batch(list(batch), lengths, step=step_key(epoch, index) + seed_offset))
        except PlanningError:
            raise
        except PlanError as err:
            raise PlanningError(f"epoch {epoch}, global batch {index}: the planner returned an invalid plan: {err}") from err
        planned = sorted(s for st in steps for s in st.samples)
        if planned != sorted(batch):
            raise PlanningError(f"epoch {epoch}, global batch {index}: the plan covers samples {planned[:10]}... but the "
                                f"batch holds {sorted(batch)[:10]}...; every sample must appear in exactly one item")
        for st in steps:
            try:
                validate_step(st, self.num_replicas)
            except PlanError as err:
                raise PlanningError(f"epoch {epoch}, global batch {index}: invalid step plan: {err}") from err
            tp = next((it for it in st.items if it.tp > 1), None)
            if tp is not None:
                raise PlanningError(f"epoch {epoch}, global batch {index}: " + TP_REFUSAL.format(
                    what=f"the plan's item on ranks {list(tp.ranks)} has tp={tp.tp} (Planner(max_tp_size=...))"))
        return steps

    def _epoch_plan(self, epoch: int) -> list[StepPlan]:
        """All steps of ``epoch`` (planners that may return several steps per batch, e.g. bucket).

        Such a planner gets the whole epoch's samples at once, as Open-Sora's bucket sampler works
        over an epoch: its step count then depends only on the epoch's lengths, which are the same
        every epoch, so ``len()`` stays what Lightning measured in the first epoch.
        """
        if epoch not in self._epoch_steps:
            self._prepare(epoch)
            self.planned_upto = max(self.planned_upto, step_key(epoch, STEP_KEY_STRIDE - 1))
            samples = [i for batch in self.global_batches(epoch) for i in batch]
            self._epoch_steps = {epoch: self._plan_batch(epoch, 0, samples)}
        return self._epoch_steps[epoch]

    def num_steps(self, epoch: int | None = None) -> int:
        epoch = self.epoch if epoch is None else epoch
        if self.one_step_per_batch:
            return len(self.global_batches(epoch))
        return len(self._epoch_plan(epoch))

    def __len__(self) -> int:
        return self.num_steps(self.epoch)

    def _submit(self, epoch: int, step: int) -> Future:
        key = (epoch, step)
        fut = self._cache.get(key)
        if fut is None:
            self._prepare(epoch)
            batch = self.global_batches(epoch)[step]
            self.planned_upto = max(self.planned_upto, step_key(epoch, step))
            if self.plan_ahead:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-planner")
                fut = self._executor.submit(self._plan_one, epoch, step, batch)
            else:
                fut = Future()
                try:
                    fut.set_result(self._plan_one(epoch, step, batch))
                except BaseException as err:  # noqa: BLE001 - re-raised by result()
                    fut.set_exception(err)
            self._cache[key] = fut
        return fut

    def _plan_one(self, epoch: int, step: int, batch: list[int]) -> StepPlan:
        steps = self._plan_batch(epoch, step, batch)
        if len(steps) != 1:
            raise PlanningError(f"planner {type(self.planner).__name__} says one_step_per_batch but returned "
                                f"{len(steps)} steps for global batch {step} of epoch {epoch}")
        return steps[0]

    def replan(self, epoch: int, step: int, plan: StepPlan, planner: Any, seed_offset: int = 0) -> StepPlan:
        """The samples of ``plan`` planned again by ``planner`` as one step, checked like any plan (after an
        out-of-memory error, :mod:`lightning_dcp.runtime.oom`)."""
        steps = self._plan_batch(epoch, step, plan.samples, planner=planner, seed_offset=seed_offset)
        if len(steps) != 1:
            raise PlanningError(f"re-planning step {step} of epoch {epoch} gave {len(steps)} steps; a step is re-planned "
                                "as one step (policies with one_step_per_batch)")
        return steps[0]

    def step_plan(self, epoch: int, step: int) -> StepPlan:
        """The plan of step ``step`` of ``epoch`` (planning it now if needed)."""
        if not self.one_step_per_batch:
            return self._epoch_plan(epoch)[step]
        return self._submit(epoch, step).result()

    def next_plan(self, epoch: int, step: int) -> StepPlan | None:
        """The plan of step ``step`` of ``epoch`` for an agreement check one step ahead: the one
        already yielded or being planned ahead (never planned twice); ``None`` past the epoch's end."""
        if step >= self.num_steps(epoch):
            return None
        plan = self._recent.get((epoch, step))
        return plan if plan is not None else self.step_plan(epoch, step)

    def step_for(self, epoch: int, index: int, plan: StepPlan) -> Step:
        """The :class:`~lightning_dcp.runtime.step.Step` this rank yields for ``plan`` at (``epoch``, ``index``)."""
        return Step.build(plan, epoch=epoch, index=index, rank=self.rank, world_size=self.num_replicas)

    def __iter__(self) -> Iterator[list[Step]]:
        epoch, start = self.epoch, self._start_step
        self._start_step = 0  # a resume offset applies to one iteration only
        total = self.num_steps(epoch)
        for step in range(start, total):
            if self.one_step_per_batch:
                fut = self._submit(epoch, step)
                if step + 1 < total:
                    self._submit(epoch, step + 1)  # plan ahead while this step trains
                plan = fut.result()
                self._cache.pop((epoch, step), None)
                self._recent[(epoch, step)] = plan
                while len(self._recent) > 16:
                    self._recent.pop(next(iter(self._recent)))
            else:
                plan = self._epoch_plan(epoch)[step]
            yield [self.step_for(epoch, step, plan)]

    # -- resume -------------------------------------------------------------------------------
    def mark_consumed(self, epoch: int, step: int) -> None:
        """Called by the strategy when it has run ``step`` of ``epoch`` (what :meth:`state_dict` saves)."""
        self._consumed = (int(epoch), int(step) + 1)

    def state_dict(self) -> dict[str, Any]:
        """``epoch``, ``step`` (steps of that epoch already trained), ``seed``, ``num_replicas``."""
        epoch, step = self._consumed
        return {"epoch": epoch, "step": step, "seed": self.seed, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue with step ``state["step"]`` of epoch ``state["epoch"]`` at the next ``iter()``."""
        if int(state.get("seed", self.seed)) != self.seed:
            raise ValueError(f"the checkpoint's sampler seed is {state['seed']} but this run uses seed {self.seed}; "
                             "resume with the same seed to continue the same data order")
        if int(state.get("num_replicas", self.num_replicas)) != self.num_replicas:
            raise ValueError(f"the checkpoint was written by {state['num_replicas']} ranks but this run has "
                             f"{self.num_replicas}; mid-epoch resume needs the same world size (the plans depend on it)")
        epoch, step = int(state["epoch"]), int(state["step"])
        if step >= self.num_steps(epoch):
            epoch, step = epoch + 1, 0
        self.epoch, self._start_step = epoch, step
        self._consumed = (epoch, step)

    def shutdown(self) -> None:
        """Stop the planning thread (pending plans are dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self._cache.clear()
        self._recent.clear()
