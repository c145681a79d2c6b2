"""The planner: from sample lengths to a :class:`~lightning_dcp.planning.plan.Plan`.

:class:`Planner` checks the input, builds the chosen policy once (with the dataset's lengths,
for DCP's candidate layouts and bucket tuning) and plans global batches:

- :meth:`Planner.plan_batch` — one global batch (a set of samples whose gradients form one
  optimizer step under plain data parallelism) to the steps the policy needs: exactly one for
  ``dcp``, ``dcp-inter``, ``dcp-intra``, ``packed`` and ``static``
  (``one_step_per_batch``); ``bucket`` needs several, as Open-Sora's bucket sampler does.
- :meth:`Planner.plan` — one epoch of a list of lengths (sample ``i`` has length ``lengths[i]``),
  cut into global batches by training's rule (:mod:`~lightning_dcp.planning.batches`: up to
  ``global_batch_tokens`` tokens or ``global_batch_size`` samples each, in a given order, optionally
  dropping an incomplete last one), each planned as the sampler plans it. ``bucket`` plans the epoch's
  samples at once (its sampler deals bucket micro-batches over the epoch).

Every policy puts every sample in exactly one item, keeps every item within the memory limit,
lists items in one global order (v1: each rank runs its items in that order, so the order is a
valid schedule by construction; dcp's groups may nest, a large group's ranks splitting into
smaller groups after its own micro-batches), and is
deterministic in (input, seed, step).

SP sizes: every divisor of the heads up to the world, ``max_sp_size`` and (under
``sharding="hsdp"``) the shard group, plus ring sizes past what the heads allow where the cost
model prices ring attention (:func:`~lightning_dcp.planning.sp_sizes.sp_splits`; ``ring=False``
turns them off). SP groups are the rank tuples :mod:`~lightning_dcp.planning.topology` allows
(consecutive ranks, inside one node when no larger than a node); :meth:`Planner.rank_tuples` lists
every one a plan of this planner may use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import numbers
from typing import Any, Callable, Sequence

from lightning_dcp.planning.batches import cut_batches, step_key
from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.item_pricing import item_memory_of
from lightning_dcp.planning.lengths import check_lengths
from lightning_dcp.planning.sample_names import SampleNamer, name_sample
from lightning_dcp.planning.sp_cap import cap_limits
from lightning_dcp.planning.speeds import check_rank_speeds, rank_speeds_of
from lightning_dcp.planning.plan import Plan, StepPlan, WorkItem
from lightning_dcp.planning.policies.base import Policy
from lightning_dcp.planning.policies.bucket import BucketPolicy
from lightning_dcp.planning.view import CostView
from lightning_dcp.planning.policies.dcp import DCPInterPolicy, DCPIntraPolicy, DCPPolicy
from lightning_dcp.planning.peers.flexsp import FlexSPPolicy
from lightning_dcp.planning.peers.hydraulis import HydraulisPolicy
from lightning_dcp.planning.peers.megatron import MegatronHCPPolicy
from lightning_dcp.planning.policies.packed import PackedPolicy
from lightning_dcp.planning.policies.static import StaticPolicy
from lightning_dcp.planning.peers.verl import VerlPolicy
from lightning_dcp.planning.topology import rank_tuples
from lightning_dcp.planning.units import describe_limit

POLICIES: dict[str, type[Policy]] = {
    "dcp": DCPPolicy,
    "dcp-inter": DCPInterPolicy,
    "dcp-intra": DCPIntraPolicy,
    "bucket": BucketPolicy,
    "packed": PackedPolicy,
    "static": StaticPolicy,
    "verl": VerlPolicy,
    "megatron-hcp": MegatronHCPPolicy,
    "hydraulis": HydraulisPolicy,
    "flexsp": FlexSPPolicy,
}
"""Policy name -> class. ``dcp`` is the default; ``dcp-inter``, ``dcp-intra``, ``bucket``, ``packed`` and
``static`` are ablations and baselines; ``verl``, ``megatron-hcp``, ``hydraulis`` and ``flexsp`` are the
field's planners as their sources describe them (:mod:`~lightning_dcp.planning.peers.verl` etc.)."""

DEFAULT_TOKENS_PER_GPU = 65536
"""Floor of the default global batch: this many tokens per GPU (amortizes the gradient all-reduce)."""

DEFAULT_WORK_MULTIPLE = 1.0
"""Default global batch: each step's mean per-GPU work is at least this many times the best-case
time of the dataset's longest sample (see :func:`default_global_batch_tokens`)."""


def longest_sample_time(world_size: int, cost_model: CostModel, longest: int,
                        max_sp_size: int | None = None, *, ring: bool = True) -> tuple[float, int]:
    """Best-case time of one sample of ``longest`` tokens on this world: ``(seconds, sp)``.

    The fastest SP size the planner may use (up to the world and ``max_sp_size``) with the fewest
    recomputed layers that fit; ``(inf, 0)`` if none holds it.
    """
    max_sp = world_size if max_sp_size is None else min(world_size, int(max_sp_size))
    view = CostView(cost_model, max_sp, world_size=world_size, ring=ring)
    best = (math.inf, 0)
    for p in view.sp_sizes:
        r = view.min_recompute(longest, p)
        if r is None:
            continue
        t = view.time([longest], p, r)
        if t < best[0]:
            best = (t, p)
    return best


def default_global_batch_tokens(world_size: int, lengths: Sequence[int] | None = None,
                                cost_model: CostModel | None = None, *,
                                work_multiple: float = DEFAULT_WORK_MULTIPLE, max_sp_size: int | None = None) -> int:
    """Default step size in tokens, the same for every one-step policy.

    ``world_size * 65536`` (enough per GPU to amortize the gradient all-reduce of a 5B model),
    at least 4 times the longest sample, and -- given the dataset's ``lengths`` and a
    ``cost_model`` -- large enough that each step's mean per-GPU work is ``work_multiple`` times
    the best-case time of the dataset's longest sample (on the largest SP group the world and
    the heads allow, at most ``max_sp_size``). Below that, a step that draws the longest sample lasts as long as that
    one sample while the other ranks run out of work: no dispatch can balance it, since SP is
    capped by the head count (48 heads: SP <= 16). Mean per-GPU work is counted at the ideal
    rate (:meth:`CostModel.ideal_time` per token of the dataset), which errs towards larger
    batches. The bound is skipped when that SP group is the whole world (the longest sample then
    occupies every rank and unbalances nothing). The per-GPU figure does not depend on the world
    size, so the step in tokens grows linearly with it -- as a practitioner keeps per-GPU work
    fixed when scaling out. Pass ``global_batch_tokens`` to choose otherwise.
    """
    tokens = world_size * DEFAULT_TOKENS_PER_GPU
    if lengths:
        longest = max(lengths)
        tokens = max(tokens, 4 * longest)
        if cost_model is not None and work_multiple > 0:
            t_best, p = longest_sample_time(world_size, cost_model, longest, max_sp_size, ring=False)
            if math.isfinite(t_best) and p < world_size:
                sample = list(lengths)
                if len(sample) > 20000:
                    sample = sample[:: len(sample) // 20000 + 1]
                per_token = cost_model.ideal_time(sample) / max(sum(sample), 1)
                if per_token > 0:
                    tokens = max(tokens, int(math.ceil(world_size * work_multiple * t_best / per_token)))
    return int(tokens)


@contextlib.contextmanager
def _collector_paused():
    """Pause Python's cyclic garbage collector while one batch is planned.

    Planning builds tens of thousands of short-lived lists; each allocation burst triggers
    collections that walk every tracked object of the process -- with torch imported, about
    half of dcp's planning time at thousands of samples per step. The planner's garbage has no
    reference cycles (reference counting frees it), so nothing accumulates; the collector is
    re-enabled afterwards only if it was enabled before.
    """
    was = gc.isenabled()
    if was:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Planner:
    """Plans global batches for ``world_size`` ranks with ``cost_model`` under ``policy``.

    Args:
        world_size: number of ranks (any positive integer).
        cost_model: time and memory of micro-batches (analytic or profiled).
        policy: one of :data:`POLICIES` (default ``"dcp"``).
        seed: plans are a deterministic function of (inputs, seed, step).
        dataset_lengths: the whole dataset's lengths, used once: DCP proposes its candidate
            layouts from them, the fixed-SP baselines size their SP group for the longest,
            bucket tunes its batch sizes on them. Without it each batch is planned on its own.
        max_sp_size: the largest SP group any policy may use (default: the world); e.g. 8 keeps every
            SP group inside one node.
        sp_cap_reason: why ``max_sp_size`` cannot be raised (e.g. "the model's 3 attention
            heads"): errors name it instead of advising a larger ``max_sp_size`` or more ranks.
        rank_speeds: per-rank speeds (:mod:`~lightning_dcp.planning.speeds`): ``dcp`` places work
            so that an item on ranks ``R`` takes ``time / min(speed[r] for r in R)``. Default: the
            cost model's ``rank_speeds`` (a :class:`~lightning_dcp.planning.calibrated.CalibratedCostModel`'s),
            else none; all 1.0 plans exactly as without speeds. The other policies ignore them.
        ring: offer ring sizes (ring attention past the head count, Ulysses x ring across nodes) when
            the cost model prices them (default True; False: Ulysses sizes only).
        max_tp_size: the largest tensor-parallel degree an item may take inside its SP group (default 1: none).
            Above 1, dcp chooses per item among Ulysses x ring x TP splits whose TP groups stay inside a node
            (:mod:`~lightning_dcp.planning.tensor_parallel`); the cost model must price TP (``prices_tp``). For
            planning and simulation only: ``DCPStrategy`` refuses it (its runtime runs no TP items yet).
        sample_name: names a dataset index in errors, e.g. a sample too long for any setting (the train dataset's
            ``sample_name``: ``sample 17 (clips/cat.mp4)``; ``None``: the index alone).
        **policy_options: per-policy knobs (see each policy class), e.g. ``trials=`` for dcp,
            ``target=`` for bucket, ``g_max=`` for dcp-inter.

    Raises:
        PlanningError: unknown policy or options, bad world size, or a dataset sample that
            fits no setting.
    """

    def __init__(self, world_size: int, cost_model: CostModel, policy: str = "dcp", *, seed: int = 0,
                 dataset_lengths: Sequence[int] | None = None, max_sp_size: int | None = None,
                 sp_cap_reason: str | None = None, rank_speeds: Sequence[float] | None = None, ring: bool = True,
                 max_tp_size: int | None = None, sample_name: SampleNamer | None = None, **policy_options: Any):
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size <= 0:
            raise PlanningError(f"world size must be a positive integer, got {world_size!r}")
        if policy not in POLICIES:
            raise PlanningError(f"unknown policy {policy!r}; known policies: {', '.join(POLICIES)}")
        self.world_size = int(world_size)
        self.cost_model = cost_model
        self.policy_name = policy
        self.seed = int(seed)
        self.max_sp = self.world_size
        self.max_sp_size = None
        self.sp_cap_reason = sp_cap_reason
        self.sample_name = sample_name
        """Names a dataset index in errors (``Dataset.sample_name``, :mod:`~lightning_dcp.planning.sample_names`)."""
        if max_sp_size is not None:
            if isinstance(max_sp_size, bool) or not isinstance(max_sp_size, numbers.Integral) or max_sp_size <= 0:
                raise PlanningError(f"max_sp_size must be a positive integer (ranks), got {max_sp_size!r}")
            self.max_sp_size = int(max_sp_size)
            self.max_sp = min(self.max_sp, self.max_sp_size)
        self.rank_speeds = check_rank_speeds(rank_speeds if rank_speeds is not None else rank_speeds_of(cost_model),
                                             self.world_size)
        """The speeds the planner plans with (None: every rank at the cost model's pace)."""
        self.ring = bool(ring)
        self.max_tp_size = self._check_tp(max_tp_size, cost_model)
        """The largest tensor-parallel degree an item may take (1: none)."""
        self.view = CostView(cost_model, self.max_sp, self.rank_speeds, world_size=self.world_size, ring=self.ring,
                             max_tp=self.max_tp_size)
        self.max_sp = max(self.view.sp_sizes)
        if self.view.longest_fitting() <= 0:
            why, more = self._cap()
            raise PlanningError(
                f"the model does not fit in memory on any SP group of this world (largest group {self.max_sp} ranks"
                f"{why}; memory budget {describe_limit(cost_model)}): use {more}"
            )
        ds = None
        if dataset_lengths is not None:
            ds = check_lengths(dataset_lengths, "dataset_lengths")
            self._check_fit(range(len(ds)), ds)
        self.dataset_lengths = ds
        try:
            self.policy: Policy = POLICIES[policy](self.world_size, self.view, seed=self.seed, dataset_lengths=ds, **policy_options)
        except TypeError as err:
            raise PlanningError(str(err)) from None

    @staticmethod
    def _check_tp(max_tp_size: Any, cost_model: CostModel) -> int:
        """``max_tp_size`` as an int (None: 1); :class:`PlanningError` naming the fix for a bad value or a cost model
        that prices no tensor parallelism."""
        if max_tp_size is None:
            return 1
        if isinstance(max_tp_size, bool) or not isinstance(max_tp_size, numbers.Integral) or max_tp_size < 1:
            raise PlanningError(f"max_tp_size must be a positive integer (a TP degree; 1: no tensor parallelism), "
                                f"got {max_tp_size!r}")
        if max_tp_size > 1 and not (cost_model.prices_tp and cost_model.fast_paths):
            raise PlanningError(
                f"max_tp_size={max_tp_size}: the cost model ({type(cost_model).__name__}) prices no tensor parallelism "
                "(prices_tp, with fast paths); use an AnalyticCostModel or a ProfiledCostModel with hardware= and the "
                "profile's model.hidden_size, or max_tp_size=1")
        return int(max_tp_size)

    @property
    def item_splits(self) -> dict[int, tuple[tuple[int, int], ...]]:
        """Every SP size -> the ``(ring, tp)`` splits an item of that size may take (dcp chooses per item)."""
        return dict(self.view.item_splits)

    @property
    def ring_degrees(self) -> dict[int, int]:
        """Every SP size this planner's plans may use -> its default ring degree (1: Ulysses; the baselines' split)."""
        return {p: self.view.ring_of(p) for p in self.view.sp_sizes}

    @property
    def item_rings(self) -> dict[int, tuple[int, ...]]:
        """Every SP size -> the ring degrees an item of that size may take (dcp chooses per item)."""
        return dict(self.view.item_rings)

    def rank_tuples(self, *, min_size: int = 2) -> tuple[tuple[int, ...], ...]:
        """Every rank tuple an SP group of this planner's plans may be (sizes of at least ``min_size``):
        :func:`~lightning_dcp.planning.topology.rank_tuples` of :attr:`ring_degrees` on this world, the cost
        model's ``gpus_per_node`` and (``sharding="hsdp"``) shard group. The same list, in the same order,
        on every rank: what the runtime creates process groups for (up front, or lazily for a step's items)."""
        topo = self.view.topology
        sizes = dict(self.ring_degrees)
        for p, r in (getattr(self.policy, "group_sizes", None) or {}).items():  # a policy's own groups (megatron-hcp)
            sizes.setdefault(p, r)
        return rank_tuples(self.world_size, sizes, topo.node_size, topo.domain_size, min_size=min_size)

    @property
    def one_step_per_batch(self) -> bool:
        """True when :meth:`plan_batch` always returns exactly one step (every policy but bucket)."""
        return self.policy.one_step_per_batch

    def longest_fitting(self) -> int:
        """Longest sample (tokens) any setting on this world size and memory holds."""
        return self.view.longest_fitting()

    def _cap(self) -> tuple[str, str]:
        """``(why SP stops at max_sp, what to use)`` for the errors (:func:`~lightning_dcp.planning.sp_cap.cap_limits`)."""
        limits, fixes = cap_limits(self.view, self.world_size, self.max_sp_size, self.sp_cap_reason, self.ring)
        more = ["more memory per device"] + fixes
        if not limits:
            more.insert(0, "more ranks")
        return (": " + "; ".join(limits) if limits else ""), " / ".join(more)

    def _check_fit(self, samples: Sequence[int], lengths: Sequence[int]) -> None:
        limit = self.view.longest_fitting()
        for s, n in zip(samples, lengths):
            if n > limit:
                why, more = self._cap()
                raise PlanningError(
                    f"{name_sample(s, self.sample_name)} has length {n} tokens, but the longest that fits any setting on "
                    f"world size {self.world_size} is {limit} tokens (SP sizes {self.view.sp_sizes}, largest SP group "
                    f"{self.max_sp} ranks{why}; every layer recomputed; memory budget {describe_limit(self.cost_model)}): "
                    f"drop or split the sample, or use {more}"
                )

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> Plan:
        """Plan one global batch: ``samples`` (dataset indices) with their ``lengths``.

        Deterministic in (samples, lengths, seed, step). Raises :class:`PlanningError` on bad
        input (mismatched or empty lists, non-positive lengths, duplicate samples, a sample
        too long for any setting).
        """
        lengths = check_lengths(lengths)
        samples = [int(s) for s in samples]
        if len(samples) != len(lengths):
            raise PlanningError(f"{len(samples)} samples but {len(lengths)} lengths; give one length per sample")
        if len(set(samples)) != len(samples):
            dup = sorted({s for s in samples if samples.count(s) > 1})[:5]
            raise PlanningError(f"samples {dup} appear more than once in the batch; each sample goes in exactly once")
        self._check_fit(samples, lengths)
        with _collector_paused():
            steps = self.policy.plan_batch(samples, lengths, step)
        if not self.view.exact_memory:
            steps = [self._verify_memory(s) for s in steps]
        cm = self.cost_model
        if cm.rounds.lockstep and not (self.policy.plans_rounds and self.view.exact_memory):
            # the round planner's one entry point (lightning_dcp.planning.rounds): the policy's items as they are
            from lightning_dcp.planning.item_pricing import item_cost_of

            view = self.view
            steps = [cm.rounds.plan_step(s, self.world_size, lambda it: item_cost_of(cm, it).total / view.speed(it.ranks))
                     for s in steps]
        return Plan(self.policy_name, self.world_size, tuple(steps), {"seed": self.seed})

    def _verify_memory(self, step: StepPlan) -> StepPlan:
        """Cost models without a token-only memory fast path: re-check every item exactly."""
        cm = self.cost_model
        items = []
        for item in step.items:
            fits = lambda r, it=item: item_memory_of(cm, dataclasses.replace(it, recompute=r)) <= cm.memory_limit  # noqa: E731
            if not fits(item.recompute):
                r = next((x for x in range(item.recompute, cm.num_layers + 1) if fits(x)), None)
                if r is None:
                    raise PlanningError(
                        f"the {self.policy_name} policy built a micro-batch (lengths {list(item.lengths)}, SP {item.sp_size}) "
                        f"that the cost model says fits no recompute setting; the cost model's max_length and item_memory disagree"
                    )
                item = dataclasses.replace(item, recompute=r)
            items.append(item)
        return StepPlan(tuple(items), step.notes)

    def prepare(self, batches: Sequence[Sequence[int]]) -> None:
        """Show the policy the lengths of an epoch's global batches before any is planned (:meth:`Policy.prepare`);
        :meth:`plan` and the sampler call it once per epoch."""
        self.policy.prepare([[int(n) for n in b] for b in batches])

    def batches(self, lengths: Sequence[int], *, global_batch_tokens: int | None = None,
                global_batch_size: int | None = None, order: Sequence[int] | None = None,
                drop_last: bool = False) -> list[list[int]]:
        """Sample indices of each global batch: ``order`` (default index order) cut by training's rule
        (:func:`~lightning_dcp.planning.batches.cut_batches`); default tokens: :func:`default_global_batch_tokens`."""
        if global_batch_size is None and global_batch_tokens is None:
            global_batch_tokens = default_global_batch_tokens(self.world_size, self.dataset_lengths or lengths,
                                                              self.cost_model, max_sp_size=self.max_sp_size)
        return cut_batches(lengths, order, global_batch_tokens=global_batch_tokens,
                           global_batch_size=global_batch_size, drop_last=drop_last)

    def plan(self, lengths: Sequence[int], *, global_batch_tokens: int | None = None,
             global_batch_size: int | None = None, order: Sequence[int] | None = None, drop_last: bool = False,
             epoch: int = 0, progress: Callable[[int, int], None] | None = None) -> Plan:
        """Plan one epoch of ``lengths`` (sample ``i`` has length ``lengths[i]``) as the sampler does: its global
        batches (:meth:`batches`) shown to the policy (:meth:`prepare`), batch ``k`` planned as step
        :func:`~lightning_dcp.planning.batches.step_key` ``(epoch, k)``; ``bucket`` plans the epoch's batches as one
        set. ``progress(done, total)``, when given, is called after each planned batch.
        """
        lengths = check_lengths(lengths)
        self._check_fit(range(len(lengths)), lengths)
        batches = self.batches(lengths, global_batch_tokens=global_batch_tokens, global_batch_size=global_batch_size,
                               order=order, drop_last=drop_last)
        self.prepare([[lengths[i] for i in idx] for idx in batches])
        if not self.one_step_per_batch:
            batches = [[i for idx in batches for i in idx]] if batches else []
        steps: list[StepPlan] = []
        for k, idx in enumerate(batches):
            steps.extend(self.plan_batch(idx, [lengths[i] for i in idx], step=step_key(epoch, k)).steps)
            if progress is not None:
                progress(k + 1, len(batches))
        return Plan(self.policy_name, self.world_size, tuple(steps), {"seed": self.seed})


def plan(lengths: Sequence[int], world_size: int, cost_model: CostModel, policy: str = "dcp", seed: int = 0,
         *, global_batch_tokens: int | None = None, global_batch_size: int | None = None, **policy_options: Any) -> Plan:
    """Plan all of ``lengths`` in one call: ``Planner(..., dataset_lengths=lengths).plan(lengths)``."""
    planner = Planner(world_size, cost_model, policy, seed=seed, dataset_lengths=lengths, **policy_options)
    return planner.plan(lengths, global_batch_tokens=global_batch_tokens, global_batch_size=global_batch_size)
