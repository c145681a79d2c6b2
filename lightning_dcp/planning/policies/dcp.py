"""The DCP policies: ``dcp`` (DCP + Hydraulis), and the ablations ``dcp-inter`` and ``dcp-intra``.

``dcp``, per global batch (:mod:`lightning_dcp.planning.search` does the work, on a
:class:`~lightning_dcp.planning.search.problem.StepProblem` built here):

1. *Per-sample costs*: every sample's amortized time on every usable SP size (its share of a well-packed
   micro-batch there); its preferred size has the fewest GPU-seconds.
2. *Layout plan* (:mod:`~lightning_dcp.planning.search.sample_blocks`): candidate layouts of SP groups (one
   fitted to the batch, the dataset's proposed once: Hydraulis §7), longest-first dispatch (Hydraulis App. D),
   time-balanced packing inside each group (§6.1) with the fewest recomputed layers per micro-batch, groups that
   run their own samples then split into smaller groups for the shorter ones (fills), refinement with exact times.
3. *Buddy trees* (:mod:`~lightning_dcp.planning.search.trees`): when the layout plan is more than 0.5% above the
   step bound (:class:`~lightning_dcp.planning.bound.StepBounder`) and the batch has at most 64 samples per rank,
   the step as a tree of groups that split over the step, by a deadline greedy, refined and balanced; the layout
   plan refined as a tree too. The fastest plan wins (the layout plan on ties).

*At scale* (more than 8 samples per rank and 8,192 samples): the buddy tree first, the layout plan only when the
tree is more than 1.5% above the bound. *Tensor parallelism* (a view with TP splits, ``Planner(max_tp_size=...)``):
each step is also planned without them, and the TP plan is kept only when it is faster. *Lockstep rounds* (``sharding="hsdp"``): every candidate gets its rounds
planned (:meth:`~lightning_dcp.planning.round_plan.RoundPlan.plan_step` with the policy's cost view) and candidates
are compared by the rounds' span; SP groups inside a shard group first, then (while the step is more than
``WIDER_SLACK`` above the bound) inside blocks of 2, 4, ... shard groups whose rounds meet, the fastest kept. *Safety net*: dcp never loses to its own parts, ``dcp-intra`` and ``dcp-inter``
(:mod:`~lightning_dcp.planning.policies.algorithm_one`), on small steps. Every limit counts samples and packs,
never seconds, so every rank plans the same step.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from lightning_dcp.planning.item_pricing import item_cost_of
from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem, interleave_items
from lightning_dcp.planning.policies.algorithm_one import AlgorithmOnePolicy, DCPInterPolicy, DCPIntraPolicy
from lightning_dcp.planning.policies.base import Policy, step_span
from lightning_dcp.planning.search.layouts import Layout, propose_layouts
from lightning_dcp.planning.search.objective import improves
from lightning_dcp.planning.search.problem import Placed, SearchSpace, StepProblem
from lightning_dcp.planning.search.sample_blocks import SampleBlocks
from lightning_dcp.planning.search.trees import TREE_SLACK, TreeSchedule, TreeSearch
from lightning_dcp.planning.view import CostView

__all__ = ["DCPPolicy", "AlgorithmOnePolicy", "DCPInterPolicy", "DCPIntraPolicy", "FALLBACK_MAX_SAMPLES_PER_RANK",
           "FALLBACK_MAX_WORLD", "TREE_MAX_SAMPLES_PER_RANK", "TREE_FIRST_SAMPLES_PER_RANK", "TREE_FIRST_MIN_SAMPLES",
           "LAYOUT_SKIP", "TREE_SLACK", "WIDER_GAIN", "WIDER_SLACK"]

FALLBACK_MAX_SAMPLES_PER_RANK = 8
"""The safety net runs for batches of at most this many samples per rank ..."""

FALLBACK_MAX_WORLD = 256
"""... on worlds of at most this many ranks (above, Algorithm 1's nested plans cost several times dcp's planning)."""

TREE_MAX_SAMPLES_PER_RANK = 64
"""Below the tree-first sizes, buddy trees are tried for batches of at most this many samples per rank."""

TREE_FIRST_SAMPLES_PER_RANK = 8
"""Batches of more samples per rank than this ..."""

TREE_FIRST_MIN_SAMPLES = 8192
"""... and more samples than this plan the buddy tree first (the layout plan's dispatches were most of the time)."""

LAYOUT_SKIP = 0.015
"""... and skip the layout plan when the tree is within this fraction of the step bound's compute part."""

WIDER_SLACK = 0.01
"""SP groups across shard groups are tried while the step is more than this fraction above the bound's compute part
..."""

WIDER_GAIN = 0.005
"""... on blocks whose larger SP sizes lower the bound by more than this fraction."""


class DCPPolicy(Policy):
    """Heterogeneous SP groups per step, LPT dispatch, time-balanced packing, recompute per item.

    Options: ``trials`` (dispatch trials, default 1: longest first; more add seeded perturbed orders),
    ``max_candidates`` (dataset layouts per largest SP size, default 3), ``refine_rounds`` (default 64),
    ``fallback`` (default True: the safety net), ``tree`` (default True: buddy trees).
    """

    name = "dcp"
    plans_rounds = True

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("trials", "max_candidates", "refine_rounds", "fallback", "tree")

    def __init__(self, world_size: int, view: CostView, **kw: Any):
        super().__init__(world_size, view, **kw)
        opts = self.options
        self.space = SearchSpace(view, world_size, trials=int(opts.get("trials", 1)),
                                 refine_rounds=int(opts.get("refine_rounds", 64)))
        self.fallback = bool(opts.get("fallback", True))
        self.tree = bool(opts.get("tree", True))
        self._parts: list[Policy] | None = None
        self._work_cache: dict[int, float] = {}  # attention work per length (recurs across steps)
        if self.dataset_lengths:
            self.space.candidates = self._propose(self.dataset_lengths)
        self._plain: DCPPolicy | None = None
        self._narrower: list[DCPPolicy] | None = None
        if view.has_tp:  # TP is one more option: each step also planned without it, the faster kept
            self._plain = DCPPolicy(world_size, view.without_tp(), seed=self.seed, dataset_lengths=self.dataset_lengths,
                                    **opts)
            self._plain._narrower = []  # this policy tries the narrower domains itself

    def _propose(self, lengths: Sequence[int]) -> dict[int, list[Layout]]:
        """The dataset's candidate layouts per largest SP size (Hydraulis §7): the GPU-seconds per preferred size of
        the samples each largest size holds."""
        space = self.space
        L = np.asarray(lengths, dtype=np.int64)
        if len(L) > 200000:
            L = self.rng(0, 3).choice(L, 200000, replace=False)
        L = L[L <= space.maxlens[-1]]
        if len(L) == 0:
            return {}
        _, G = space.costs(L)
        minidx = np.searchsorted(space.maxlens, L, side="left")
        class_work = {}
        for k, m in enumerate(space.classes):
            sel = minidx <= k
            if not sel.any() or (k > 0 and not (minidx == k).any()):
                continue
            sub = G[: k + 1, sel]
            pref = np.argmin(sub, axis=0)
            w = np.bincount(pref, weights=sub[pref, np.arange(sub.shape[1])], minlength=k + 1)
            class_work[m] = {space.classes[j]: float(w[j]) for j in range(k + 1)}
        return propose_layouts(class_work, self.view.topology, space.classes, int(self.options.get("max_candidates", 3)))

    def _narrower_domains(self) -> list["DCPPolicy"]:
        """Under lockstep rounds whose SP groups may span shard groups: the policies planning SP groups inside blocks
        of the shard group, twice it, ... (below this policy's domain), narrowest first; else none."""
        if self._narrower is None:
            self._narrower = []
            rounds = self.view.cm.rounds
            if rounds.lockstep and rounds.domain > rounds.shard_group_size:
                d = rounds.shard_group_size
                while d < rounds.domain:
                    if rounds.domain % d == 0:
                        other = DCPPolicy(self.world_size, self.view.with_domain(d), seed=self.seed,
                                          dataset_lengths=self.dataset_lengths, **self.options)
                        other._narrower = []
                        self._narrower.append(other)
                    d *= 2
        return self._narrower

    # -- per step -------------------------------------------------------------------------
    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        narrower = self._narrower_domains()
        if not narrower:
            return [self._plan_step(samples, lengths, step)]
        # SP groups may span shard groups: SP inside a shard group first; a wider block where the step is faster
        # (exact spans, the groups' rounds meeting where an item spans them), tried while the plan is over the bound
        # and only where the block's larger SP sizes lower the bound
        longest = max(lengths, default=0)
        first, *wider = [p for p in narrower + [self] if p.space.maxlens[-1] >= longest]  # the blocks that hold it
        best = first._plan_step(samples, lengths, step)
        best_span = step_span(best, self.view)
        floor = self.space.bound_span(lengths)
        prev = first.space.bound_span(lengths)
        for other in wider:
            if best_span <= floor * (1 + WIDER_SLACK):
                break
            bound = other.space.bound_span(lengths)
            if bound >= prev * (1 - WIDER_GAIN):
                continue
            prev = bound
            cand = other._plan_step(samples, lengths, step)
            span = step_span(cand, self.view)
            if improves(span, best_span):
                best, best_span = cand, span
        return [best.with_notes(estimated_time=best_span)]  # the span its shard groups' rounds run in

    def _plan_step(self, samples: Sequence[int], lengths: Sequence[int], step: int) -> StepPlan:
        problem = StepProblem.build(self.space, samples, lengths, self.rng(step, 2), self._work_cache)
        n, W = len(problem.L), self.world_size
        if self.tree and n > max(TREE_FIRST_SAMPLES_PER_RANK * W, TREE_FIRST_MIN_SAMPLES):
            plan = self._in_rounds(self._tree_first(problem, lengths))
        else:
            plan = self._layout_or_tree(problem, lengths, self.tree and n <= TREE_MAX_SAMPLES_PER_RANK * W)
        if self.fallback:
            plan = self._best_of_parts(samples, lengths, step, plan)
        if self._plain is not None:
            plain = self._plain.plan_batch(samples, lengths, step)[0]
            if not improves(self._span(plan), self._span(plain)):
                plan = plain
        return plan

    def _span(self, plan: StepPlan) -> float:
        """A candidate's span: its planned rounds' under lockstep rounds, else the step's with the view's times."""
        if self.space.lockstep and plan.notes.estimated_time is not None:
            return plan.notes.estimated_time
        return step_span(plan, self.view)

    def _layout(self, problem: StepProblem):
        return SampleBlocks(self.space, problem).solve(np.arange(len(problem.L)), self.world_size, 0,
                                                       len(self.space.classes) - 1, top=True)

    def _layout_or_tree(self, problem: StepProblem, lengths: Sequence[int], tree: bool) -> StepPlan:
        """The layout plan, or the buddy tree when the layout plan is more than ``TREE_SLACK`` above the step bound
        and the tree is faster (under lockstep rounds both compared in their planned rounds)."""
        got = self._layout(problem)
        plan = self._in_rounds(self._as_plan(problem, got.groups, StepNotes(estimated_time=got.span,
                                                                             layout=tuple(got.layout))))
        if not tree:
            return plan
        floor = self.space.bound_span(lengths)
        if plan.notes.estimated_time <= floor * (1 + TREE_SLACK):
            return plan
        search = TreeSearch(self.space, problem)
        if not search.holds_all:
            return plan
        best = _faster(search.search(floor), search.of_layout(got.groups))
        if not improves(best.span, math.inf if self.space.lockstep else got.span):
            return plan
        cand = self._in_rounds(self._tree_plan(problem, best))
        if not self.space.lockstep or improves(cand.notes.estimated_time, plan.notes.estimated_time):
            return cand
        return plan

    def _tree_first(self, problem: StepProblem, lengths: Sequence[int]) -> StepPlan:
        """Many samples per rank: the tree first; the layout plan (and it refined as a tree) only when the tree is over
        ``1 + LAYOUT_SKIP`` times the bound's compute part. The fastest wins, the layout plan on ties."""
        floor = self.space.bound_span(lengths)
        search = TreeSearch(self.space, problem)
        if not search.holds_all:
            return self._layout_or_tree(problem, lengths, tree=False)
        best = search.search(floor, many=True)
        if best.span > floor * (1 + LAYOUT_SKIP):
            got = self._layout(problem)
            best = _faster(best, search.of_layout(got.groups))
            if not improves(best.span, got.span):
                return self._as_plan(problem, got.groups, StepNotes(estimated_time=got.span, layout=tuple(got.layout)))
        return self._tree_plan(problem, best)

    def _tree_plan(self, problem: StepProblem, sched: TreeSchedule) -> StepPlan:
        levels, span, sizes = TreeSearch.levels(sched)
        return self._as_plan(problem, levels, StepNotes(estimated_time=span, layout=tuple(sizes), schedule="buddy-tree"))

    def _as_plan(self, problem: StepProblem, groups: list[list[Placed]], notes: StepNotes) -> StepPlan:
        """The step plan of per-group items: a buddy tree's levels in order (largest SP first), a layout's groups
        interleaved."""
        samples, Ll = problem.samples, problem.lengths
        per_group = [[WorkItem(it.ranks, tuple(samples[i] for i in it.members), tuple(Ll[i] for i in it.members),
                               it.recompute, it.ring, it.tp) for it in grp] for grp in groups]
        if notes.schedule == "buddy-tree":
            return StepPlan(tuple(it for level in per_group for it in level), notes)
        return StepPlan(tuple(interleave_items(per_group)), notes)

    def _in_rounds(self, plan: StepPlan) -> StepPlan:
        """Under lockstep rounds, ``plan`` in its planned rounds (each SP group's samples re-packed for them;
        ``notes.estimated_time`` becomes the rounds' span); ``plan`` itself otherwise."""
        if not self.space.lockstep:
            return plan
        cm, view = self.view.cm, self.view
        return cm.rounds.plan_step(plan, self.world_size, lambda it: item_cost_of(cm, it).total / view.speed(it.ranks),
                                   view)

    def _best_of_parts(self, samples: Sequence[int], lengths: Sequence[int], step: int, plan: StepPlan) -> StepPlan:
        """Safety net: the faster of dcp's plan and its parts' (``dcp-intra``, ``dcp-inter``) by exact span; ties keep
        dcp's. Skipped (deterministically) where it cannot matter or costs too much: dcp's plan within 1% of the step
        bound, more than ``FALLBACK_MAX_WORLD`` ranks, or more than ``FALLBACK_MAX_SAMPLES_PER_RANK`` samples per
        rank (there dcp's per-sample estimates, which this net guards, are accurate)."""
        if len(lengths) > FALLBACK_MAX_SAMPLES_PER_RANK * self.world_size or self.world_size > FALLBACK_MAX_WORLD:
            return plan
        lockstep = self.space.lockstep
        span_of = (lambda p: p.notes.estimated_time) if lockstep else (lambda p: step_span(p, self.view))
        best, best_span = plan, span_of(plan)
        if best_span <= self.space.bound_span(lengths) * 1.01:
            return plan
        if self._parts is None:
            self._parts = [cls(self.world_size, self.view, seed=self.seed) for cls in (DCPIntraPolicy, DCPInterPolicy)]
        for part in self._parts:
            cand = self._in_rounds(part.plan_batch(samples, lengths, step)[0])
            span = span_of(cand)
            if improves(span, best_span):
                best, best_span = cand.with_notes(estimated_time=span, chosen=part.name), span
        return best


def _faster(a: TreeSchedule, b: TreeSchedule | None) -> TreeSchedule:
    """``b`` when it is faster than ``a``."""
    return b if b is not None and improves(b.span, a.span) else a
