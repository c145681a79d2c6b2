"""The DCP policies: ``dcp`` (DCP + Hydraulis), and the ablations ``dcp-inter`` and ``dcp-intra``.

``dcp`` (default), per global batch:

1. *Per-sample costs.* For every usable SP size ``p`` a sample of length ``l`` is charged its
   amortized time on ``p`` ranks (:meth:`CostView.estimator`: its share of a well-packed
   micro-batch, with the recompute that micro-batch needs). Its *preferred* SP size minimizes
   GPU-seconds (time x ``p``) — usually the smallest that holds it, a larger one when that
   saves enough recomputation (the DCP-intra trade).
2. *Layout.* Candidate layouts (multisets of SP sizes, placed as :mod:`~lightning_dcp.planning.topology`
   allows: runs of consecutive ranks, inside a node when no larger than one): one
   fitted to this batch (ranks per SP class proportional to its preferred work, largest class
   at least the one the longest sample needs) plus the dataset's candidates proposed once
   (Hydraulis §7, :func:`~lightning_dcp.planning.layouts.propose_layouts`) for the same
   largest SP size.
3. *Dispatch* (Hydraulis App. D): longest first, each sample to the group where it finishes
   earliest among those that can hold it (heap per SP class). The candidate with the lowest
   estimated makespan wins.
4. *Packing* (Hydraulis §6.1): inside each group, time-balanced variable-length micro-batches
   within the group's best token budget; each micro-batch recomputes the fewest layers that
   fit it. A group's gradient accumulation count is its number of micro-batches.
5. *Refinement.* With exact item times, samples move from the slowest group to the group that
   finishes them earliest while that lowers the step's makespan (a few rounds).
6. *Buddy trees* (:mod:`~lightning_dcp.planning.policies.tree`). When that plan is more than
   0.5% above the step's bound (:class:`~lightning_dcp.planning.bound.StepBounder`) and the
   batch has at most 64 samples per rank, dcp also plans the step as a tree of aligned
   blocks that split over the step -- a block runs its own micro-batches on all its ranks,
   then its two halves go on independently, to any depth -- by a deadline greedy (each
   sample on the cheapest SP size that still ends by a deadline just above the bound, a few
   deadlines tried), and refines it and the layout plan (itself such a tree, two levels
   deep) by moving and swapping samples off the critical path with exact times, then
   balances both (:mod:`~lightning_dcp.planning.policies.tree_balance`: moves that shorten
   the longest paths, each checked exactly, costing time per move rather than per tree). The
   fastest of the three plans wins (the layout plan on ties). This is what balances steps of
   few, long samples (video, long documents at 0.5-1M tokens on 32 GPUs): a long sample's SP
   group, once done, splits into smaller groups for the short samples instead of running
   them at its own size or idling.

*Planning at scale.* A step of more than 8 samples per rank and 8,192 samples (the default
batches at 256-1024 GPUs: up to ~40,000 samples) plans the buddy tree first -- one deadline,
balancing without the per-round refinement -- and runs the layout scheduler (steps 2-5, whose
candidate dispatches over every sample were most of the planning time there) only when the
tree is more than 1.5% above the bound (:meth:`DCPPolicy._tree_first`), at any number of samples per rank
(step 6's cap of 64 is for the refined search; a 4x-default batch at 256 GPUs, 155 samples per rank, once got
the layout plan alone there: 82% of the bound, its largest group running short samples). Every limit is counted
in samples and packs, never in seconds, so every rank plans the same step.

*Lockstep rounds* (``sharding="hsdp"``: the cost model's ``rounds`` are lockstep). The ranks of a shard
group run their micro-batches in rounds that last as long as their slowest item, so dcp plans for them:
no item is taller than a round where an SP size holds it within one (:meth:`DCPPolicy._round_height`: a
micro-batch of the smallest SP size at its token capacity; :meth:`DCPPolicy._lockstep_sizes`), each
candidate plan (the layout plan, the buddy tree, the parts) gets its rounds planned
(:meth:`~lightning_dcp.planning.round_plan.RoundPlan.plan_step` with the policy's cost view, which
re-packs each SP group's samples for the rounds: :mod:`lightning_dcp.planning.lockstep`), and the
candidates are compared by the rounds' span.

``dcp-inter`` / ``dcp-intra`` follow the DCP paper: Algorithm 1 per length bucket, balance by
accumulation counts (:mod:`~lightning_dcp.planning.policies.algorithm_one`, re-exported here).

Layout of the dcp policy's code: this module holds the policy (per-run candidates, the per-step
driver and the safety net); :mod:`~lightning_dcp.planning.policies.dcp_schedule` the scheduler of
one block of ranks (steps 1-5); :mod:`~lightning_dcp.planning.policies.dcp_tree` the buddy-tree
search (step 6).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from lightning_dcp.planning.bound import StepBounder
from lightning_dcp.planning.item_pricing import item_cost_of
from lightning_dcp.planning.layouts import Layout, propose_layouts
from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem
from lightning_dcp.planning.policies.algorithm_one import AlgorithmOnePolicy, DCPInterPolicy, DCPIntraPolicy
from lightning_dcp.planning.policies.base import Policy, interleave_items, step_span
from lightning_dcp.planning.policies.costs import CostView
from lightning_dcp.planning.policies.dcp_schedule import LayoutScheduler
from lightning_dcp.planning.policies.dcp_tree import TREE_DEADLINES, TREE_REFINE_WIDTH, TREE_SLACK, BuddyTreeSearch
from lightning_dcp.planning.policies.dispatch import fill_costs
from lightning_dcp.planning.policies.objective import improves
from lightning_dcp.planning.policies.tree import BuddyTree

__all__ = [
    "DCPPolicy", "AlgorithmOnePolicy", "DCPInterPolicy", "DCPIntraPolicy", "fill_costs", "FALLBACK_MAX_SAMPLES_PER_RANK",
    "FALLBACK_MAX_WORLD",
    "TREE_MAX_SAMPLES_PER_RANK", "TREE_FIRST_SAMPLES_PER_RANK", "TREE_FIRST_MIN_SAMPLES", "LAYOUT_SKIP", "TREE_SLACK", "TREE_DEADLINES", "TREE_REFINE_WIDTH",
]


FALLBACK_MAX_SAMPLES_PER_RANK = 8
"""dcp's safety net (:meth:`DCPPolicy._best_of_parts`) runs for batches of at most this many samples per rank."""

FALLBACK_MAX_WORLD = 256
"""... and on worlds of at most this many ranks: above, Algorithm 1's nested plans over every SP size cost several
times dcp's own planning (on ``benchmarks/planner_speed.py``'s 1024-GPU grid they never won a step)."""

TREE_MAX_SAMPLES_PER_RANK = 64
"""Below the tree-first sizes, dcp tries buddy-tree schedules (:meth:`DCPPolicy._tree_schedule`, refined per round)
for batches of at most this many samples per rank."""

TREE_FIRST_SAMPLES_PER_RANK = 8
"""Batches of more samples per rank than this, whatever their number above it, plan the buddy tree
first (:meth:`DCPPolicy._tree_first`): with many samples per rank it is the faster plan on
``benchmarks/simulate_scaling.py``'s grid, and the layout scheduler's candidate dispatches over every sample are
most of the planning time."""

TREE_FIRST_MIN_SAMPLES = 8192
"""... and of more samples than this (below, the layout scheduler is cheap: a few tens of ms)."""

LAYOUT_SKIP = 0.015
"""... and keep it without running the layout scheduler when its span is within this fraction of the step
bound's compute part (a layout plan was never more than 1% above that bound on the grid's 256- and 1024-GPU
cells where the tree was within 1.5%, and never won there)."""


class DCPPolicy(BuddyTreeSearch, LayoutScheduler, Policy):
    """Heterogeneous SP groups per step, LPT dispatch, time-balanced packing, recompute per item.

    Options: ``trials`` (dispatch trials per candidate, default 1: the longest-first order; more
    add seeded perturbed orders),
    ``max_candidates`` (dataset candidates per largest SP size, default 3), ``refine_rounds``
    (default 64), ``dispatch_chunk`` (default 0: every sample dispatched on its own; e.g.
    0.01: runs of small samples move as chunks of about 1% of a group's load, the smallest 4%
    of the work one by one -- 10-25% less planner time at thousands of samples per step, same
    quality over 6 steps at 256 GPUs but not bit-identical plans, so off by default),
    ``fallback`` (default True: the safety net of :meth:`_best_of_parts`), ``tree`` (default
    True: also try buddy-tree schedules, step 6 of the module docstring).
    """

    name = "dcp"
    plans_rounds = True

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("trials", "max_candidates", "refine_rounds", "dispatch_chunk", "fallback", "tree")

    def __init__(self, world_size: int, view: CostView, **kw: Any):
        super().__init__(world_size, view, **kw)
        self.classes = list(view.sp_sizes)
        self.class_arr = np.array(self.classes, dtype=np.float64)
        # running maximum: "the first SP size that holds l" stays a sorted search even if a
        # profiled model's capacities are not monotone in the SP size
        self.maxlens = np.maximum.accumulate(np.array([view.max_len(p) for p in self.classes], dtype=np.int64))
        self.est = [view.estimator(p) for p in self.classes]
        self._lockstep = bool(view.cm.rounds.lockstep)
        self._round_cap = self._round_height() if self._lockstep else None
        self.budget = [view.pack_target(p) for p in self.classes]
        self.trials = int(self.options.get("trials", 1))
        self.refine_rounds = int(self.options.get("refine_rounds", 64))
        self.dispatch_chunk = float(self.options.get("dispatch_chunk", 0.0))
        self.fallback = bool(self.options.get("fallback", True))
        self.tree = bool(self.options.get("tree", True))
        self._tree: BuddyTree | None = None
        self._group_trees: dict[frozenset, BuddyTree] = {}
        self._parts: list[Policy] | None = None
        self._bounder: StepBounder | None = None
        self.candidates: dict[int, list[Layout]] = {}
        self._work_cache: dict[int, float] = {}  # attention work per length (recurs across steps)
        self._Ll: list[int] = []
        self._Wl: list[float] = []
        self._Erows: dict[int, list[float]] = {}
        self._packs: dict[tuple, list] = {}
        self._nested: dict[tuple, tuple] = {}  # nested plans of a group's fills (per step)
        self._E = None
        self._ET: list | None = None
        if self.dataset_lengths:
            self.candidates = self._propose(self.dataset_lengths)

    # -- once per run ---------------------------------------------------------------------
    def _round_height(self) -> float | None:
        """Under lockstep rounds: the tallest a round's items should be, what a micro-batch of the smallest SP
        size holds at its token capacity with every layer recomputed (samples of 2,048 and 8,192 tokens, the
        taller). The other ranks of a shard group cannot fill a taller round: a sample that alone takes longer
        on an SP size goes to a larger one that holds it within this height (:meth:`_costs`)."""
        view = self.view
        for p in self.classes:
            cap = view.max_len(p)
            if cap > 0:
                return max(view.time_uniform(min(cap, ell), cap / min(cap, ell), p, view.num_layers)
                           for ell in (2048, 8192))
        return None


    def _costs(self, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        E = np.vstack([est(L) for est in self.est])  # classes x samples (inf: does not fit)
        if self._round_cap is not None and E.size:
            E = self._lockstep_sizes(E)
        return E, E * self.class_arr[:, None]

    def _lockstep_sizes(self, E: np.ndarray) -> np.ndarray:
        """Under lockstep rounds: ``E`` without the SP sizes on which a sample would hold its shard group's round
        up. A sample that alone takes longer than a round (:meth:`_round_height`) on a size keeps only the sizes
        that hold it within the round where there are any; where there are none, only the size with the fewest
        lockstep GPU-seconds: ``p t + (K - p)(t - height)``, its own plus the group's other ranks' wait."""
        cap, k = self._round_cap, float(self.view.cm.rounds.domain or self.world_size)
        fits = np.isfinite(E)
        over = E > cap
        held = (fits & ~over).any(axis=0)
        E = np.where(over & held[None, :], np.inf, E)
        loose = ~held & fits.any(axis=0)
        if loose.any():
            p = self.class_arr[:, None]
            sub = E[:, loose]
            cost = np.where(np.isfinite(sub), sub * p + np.maximum(k - p, 0.0) * np.maximum(sub - cap, 0.0), np.inf)
            keep = np.argmin(cost, axis=0)
            mask = np.full(sub.shape, np.inf)
            mask[keep, np.arange(sub.shape[1])] = 0.0
            E[:, loose] = sub + mask
        return E

    def _propose(self, lengths: Sequence[int]) -> dict[int, list[Layout]]:
        L = np.asarray(lengths, dtype=np.int64)
        if len(L) > 200000:
            L = self.rng(0, 3).choice(L, 200000, replace=False)
        L = L[L <= self.maxlens[-1]]
        if len(L) == 0:
            return {}
        _, G = self._costs(L)
        minidx = np.searchsorted(self.maxlens, L, side="left")
        class_work = {}
        for k, m in enumerate(self.classes):
            sel = minidx <= k
            if not sel.any() or (k > 0 and not (minidx == k).any()):
                continue
            sub = G[: k + 1, sel]
            pref = np.argmin(sub, axis=0)
            w = np.bincount(pref, weights=sub[pref, np.arange(sub.shape[1])], minlength=k + 1)
            class_work[m] = {self.classes[j]: float(w[j]) for j in range(k + 1)}
        return propose_layouts(class_work, self.view.topology, self.classes, int(self.options.get("max_candidates", 3)))

    # -- per step -------------------------------------------------------------------------
    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        L = np.asarray(lengths, dtype=np.int64)
        E, G = self._costs(L)
        rng = self.rng(step, 2)
        ids = np.arange(len(L))
        # per-step Python-side copies for the scalar loops (packing, item times)
        self._Ll = L.tolist()
        self._Erows: dict[int, list[float]] = {}
        self._packs: dict[tuple, list] = {}
        self._nested = {}
        self._E = E
        self._ET = E.T.tolist()  # per-sample rows for the nested dispatches (lpt_dispatch reads row[k], k <= kmax)
        fast = self.view._time_fast
        if fast is not None:
            wc = self._work_cache
            w = self.view.work
            self._Wl = [wc[n] if n in wc else wc.setdefault(n, float(w(n))) for n in self._Ll]
        try:
            many = len(L) > max(TREE_FIRST_SAMPLES_PER_RANK * self.world_size, TREE_FIRST_MIN_SAMPLES)
            if self.tree and many:
                blocks, notes = self._tree_first(ids, L, E, G, lengths, rng)
                plan = self._in_rounds(self._as_plan(samples, blocks, notes))
            else:
                tree = self.tree and len(L) <= TREE_MAX_SAMPLES_PER_RANK * self.world_size
                plan = self._layout_or_tree(samples, ids, L, E, G, lengths, rng, tree)
        finally:
            self._Erows, self._E, self._packs, self._ET, self._nested = {}, None, {}, None, {}
        if self.fallback:
            plan = self._best_of_parts(samples, lengths, step, plan)
        return [plan]

    def _layout_or_tree(self, samples: Sequence[int], ids: np.ndarray, L: np.ndarray, E: np.ndarray, G: np.ndarray,
                        lengths: Sequence[int], rng: np.random.Generator, tree: bool) -> StepPlan:
        """The layout plan (steps 1-5), or the buddy tree (step 6) when the layout plan is more than
        ``TREE_SLACK`` above the step bound and the tree is faster. Under lockstep rounds both are compared in their
        planned rounds (:meth:`_in_rounds`), and the tree is searched whatever its free-running span."""
        blocks, span, layout = self._schedule(ids, L, E, G, self.world_size, 0, len(self.classes) - 1, rng, top=True)
        plan = self._in_rounds(self._as_plan(samples, blocks, StepNotes(estimated_time=span, layout=tuple(layout))))
        if tree:
            floor = self._bound_span(lengths)
            if plan.notes.estimated_time > floor * (1 + TREE_SLACK):
                got = self._tree_schedule(L, E, floor, math.inf if self._lockstep else span, blocks)
                if got is not None:
                    blocks, span, sizes = got
                    cand = self._in_rounds(self._as_plan(samples, blocks, StepNotes(
                        estimated_time=span, layout=tuple(sizes), schedule="buddy-tree")))
                    if not self._lockstep or improves(cand.notes.estimated_time, plan.notes.estimated_time):
                        plan = cand
        return plan

    def _as_plan(self, samples: Sequence[int], blocks: list, notes: StepNotes) -> StepPlan:
        """The step plan of ``blocks`` (per group its ``(ranks, sample indices, recompute)`` items): a buddy tree's
        levels largest SP first (ancestors' items before their halves'), a layout's groups interleaved."""
        Ll, ring = self._Ll, self.view.ring_of
        per_group = [[WorkItem(ranks, tuple(samples[i] for i in idx), tuple(Ll[i] for i in idx), rec, ring(len(ranks)))
                      for ranks, idx, rec in blk] for blk in blocks]
        if notes.schedule == "buddy-tree":
            return StepPlan(tuple(it for level in per_group for it in level), notes)
        return StepPlan(tuple(interleave_items(per_group)), notes)

    def _in_rounds(self, plan: StepPlan) -> StepPlan:
        """Under lockstep rounds (``sharding="hsdp"``): ``plan`` in its planned rounds, each SP group's samples
        re-packed for them (:meth:`~lightning_dcp.planning.round_plan.RoundPlan.plan_step` with this policy's cost
        view; ``notes.estimated_time`` becomes the rounds' span). ``plan`` itself otherwise."""
        if not self._lockstep:
            return plan
        cm, view = self.view.cm, self.view
        return cm.rounds.plan_step(plan, self.world_size, lambda it: item_cost_of(cm, it).total / view.speed(it.ranks),
                                   view)

    def _tree_first(self, ids: np.ndarray, L: np.ndarray, E: np.ndarray, G: np.ndarray, lengths: Sequence[int],
                    rng: np.random.Generator) -> tuple[list, dict]:
        """A step of many samples per rank: the buddy-tree search first (:meth:`_tree_search`), the layout
        scheduler only when the tree's span is over ``1 + LAYOUT_SKIP`` times the bound's compute part.

        Then the fastest of the tree, the layout plan refined as a tree and the layout plan wins (the layout
        plan on ties), as in :meth:`plan_batch`'s other order. Returns ``(blocks, notes)``.
        """
        floor = self._bound_span(lengths)
        best = self._tree_search(L, E, floor, many=True)
        if best[0] > floor * (1 + LAYOUT_SKIP):
            blocks, span, layout = self._schedule(ids, L, E, G, self.world_size, 0, len(self.classes) - 1, rng, top=True)
            got = self._tree_of_layout(blocks, L, E)
            if got is not None and improves(got[0], best[0]):
                best = got
            if not improves(best[0], span):
                return blocks, StepNotes(estimated_time=span, layout=tuple(layout))
        blocks, span, sizes = self._tree_levels(best)
        return blocks, StepNotes(estimated_time=span, layout=tuple(sizes), schedule="buddy-tree")

    def _bound_span(self, lengths: Sequence[int]) -> float:
        """The step bound's compute part, ``max(work / W, heaviest)`` (seconds, no all-reduce)."""
        bound = self._step_bounder().parts(lengths)
        return max(bound.work_s, bound.heaviest_s)

    def _best_of_parts(self, samples: Sequence[int], lengths: Sequence[int], step: int, plan: StepPlan) -> StepPlan:
        """Safety net: dcp never loses to its own parts, ``dcp-intra`` and ``dcp-inter``.

        Skipped when it cannot matter or would cost too much, both deterministic: dcp's plan is
        within 1% of the step's achievable bound
        (:class:`~lightning_dcp.planning.bound.StepBounder`: no plan beats it by more), the world has
        more than ``FALLBACK_MAX_WORLD`` ranks, or the
        batch has more than ``FALLBACK_MAX_SAMPLES_PER_RANK`` samples per rank (there the parts
        take 5-10x dcp's planning time, and dcp's per-sample estimates, which this net guards,
        are accurate: many samples share each micro-batch). Otherwise both parts plan the same
        batch and the plan with the lowest exact span (:func:`step_span`, as the simulator runs
        it) wins; ties keep dcp's.
        """
        if len(lengths) > FALLBACK_MAX_SAMPLES_PER_RANK * self.world_size or self.world_size > FALLBACK_MAX_WORLD:
            return plan
        span_of = (lambda p: p.notes.estimated_time) if self._lockstep else (lambda p: step_span(p, self.view))
        best, best_span = plan, span_of(plan)
        if best_span <= self._bound_span(lengths) * 1.01:
            return plan
        if self._parts is None:
            self._parts = [cls(self.world_size, self.view, seed=self.seed) for cls in (DCPIntraPolicy, DCPInterPolicy)]
        for part in self._parts:
            cand = self._in_rounds(part.plan_batch(samples, lengths, step)[0])
            span = span_of(cand)
            if improves(span, best_span):
                best, best_span = cand.with_notes(estimated_time=span, chosen=part.name), span
        return best

    def _alone_times(self, length: int, classes: Sequence[int]) -> np.ndarray:
        """Time of one sample of ``length`` alone on each SP size of ``classes`` (inf where it does not fit)."""
        return self._step_bounder().alone_times(length)[: len(classes)]

    def _step_bounder(self) -> StepBounder:
        """The step bounder on this policy's cost view (its SP sizes are ``self.classes``), built once."""
        if self._bounder is None:
            self._bounder = StepBounder(self.view.cm, self.world_size, self.view.sp_sizes[-1], view=self.view,
                                        rank_speeds=self.view.speeds)
        return self._bounder
