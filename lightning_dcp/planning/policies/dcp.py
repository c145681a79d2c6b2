"""The DCP policies: ``dcp`` (DCP + Hydraulis), and the ablations ``dcp-inter`` and ``dcp-intra``.

``dcp`` (default), per global batch:

1. *Per-sample costs.* For every usable SP size ``p`` a sample of length ``l`` is charged its
   amortized time on ``p`` ranks (:meth:`CostView.estimator`: its share of a well-packed
   micro-batch, with the recompute that micro-batch needs). Its *preferred* SP size minimizes
   GPU-seconds (time x ``p``) — usually the smallest that holds it, a larger one when that
   saves enough recomputation (the DCP-intra trade).
2. *Layout.* Candidate layouts (multisets of SP sizes on aligned power-of-two blocks): one
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
   deep) by moving and swapping samples off the critical path with exact times. The fastest
   of the three plans wins (the layout plan on ties). This is what balances steps of few,
   long samples (video, long documents at 0.5-1M tokens on 32 GPUs): a long sample's SP
   group, once done, splits into smaller groups for the short samples instead of running
   them at its own size or idling.

``dcp-inter`` / ``dcp-intra`` follow the DCP paper (see :class:`AlgorithmOnePolicy`): samples
are bucketed by length (2 per octave); for every bucket Algorithm 1 picks the micro-batch size
``b`` and SP size ``p`` of highest per-GPU throughput ``b*s / (p*T)`` under the memory limit --
with all layers recomputed for ``dcp-inter`` (§3.3, as the static configuration would), with the
fewest recomputed layers that fit for ``dcp-intra`` (§3.4, Alg. 1). Ranks are split into groups
of the chosen SP sizes in proportion to their work, micro-batches go longest first to the group
where they finish earliest (each group's accumulation count ``g_i`` balances eq. 3), and the
accumulation counts are scaled up (smaller micro-batches, App. C's ``G_min``) while that lowers
the makespan. Both run the whole global batch in one step.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Sequence

import numpy as np

from lightning_dcp.planning.bound import StepBounder
from lightning_dcp.planning.layouts import Layout, allocate, place, propose_layouts
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.planning.policies.base import Policy, interleave_items, log_buckets, step_span
from lightning_dcp.planning.policies.costs import CostView
from lightning_dcp.planning.policies.dispatch import lpt_dispatch
from lightning_dcp.planning.policies.packing import pack_time_balanced, recompute_for
from lightning_dcp.planning.policies.tree import BuddyTree


FALLBACK_MAX_SAMPLES_PER_RANK = 8
"""dcp's safety net (:meth:`DCPPolicy._best_of_parts`) runs for batches of at most this many samples per rank."""

TREE_MAX_SAMPLES_PER_RANK = 64
"""dcp tries buddy-tree schedules (:meth:`DCPPolicy._tree_schedule`) for batches of at most this many samples per rank."""

TREE_SLACK = 0.005
"""dcp keeps its layout plan without trying buddy-tree schedules when that plan is within this fraction of the step bound."""

TREE_DEADLINES = (1.0, 1.02, 1.05, 1.1, 1.2)
"""Deadlines of the buddy-tree greedy, as multiples of the step bound's compute part (larger ones never won
on the benchmark grid)."""

TREE_REFINE_WIDTH = 8
"""Tree refinement looks at the largest this-many samples of a node (moves and swaps)."""


class DCPPolicy(Policy):
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
        self.budget = [view.pack_target(p) for p in self.classes]
        self.trials = int(self.options.get("trials", 1))
        self.refine_rounds = int(self.options.get("refine_rounds", 64))
        self.dispatch_chunk = float(self.options.get("dispatch_chunk", 0.0))
        self.fallback = bool(self.options.get("fallback", True))
        self.tree = bool(self.options.get("tree", True))
        self._tree: BuddyTree | None = None
        self._parts: list[Policy] | None = None
        self._bounder: StepBounder | None = None
        self.candidates: dict[int, list[Layout]] = {}
        self._work_cache: dict[int, float] = {}  # attention work per length (recurs across steps)
        self._Ll: list[int] = []
        self._Wl: list[float] = []
        self._Erows: dict[int, list[float]] = {}
        self._packs: dict[tuple, list] = {}
        self._E = None
        self._ET: list | None = None
        if self.dataset_lengths:
            self.candidates = self._propose(self.dataset_lengths)

    # -- once per run ---------------------------------------------------------------------
    def _costs(self, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        E = np.vstack([est(L) for est in self.est])  # classes x samples (inf: does not fit)
        return E, E * self.class_arr[:, None]

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
        return propose_layouts(class_work, self.world_size, self.classes, int(self.options.get("max_candidates", 3)))

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
        self._E = E
        self._ET = E.T.tolist()  # per-sample rows for the nested dispatches (lpt_dispatch reads row[k], k <= kmax)
        fast = self.view._time_fast
        if fast is not None:
            wc = self._work_cache
            w = self.view.work
            self._Wl = [wc[n] if n in wc else wc.setdefault(n, float(w(n))) for n in self._Ll]
        try:
            blocks, span, layout = self._schedule(ids, L, E, G, self.world_size, 0, len(self.classes) - 1, rng, top=True)
            extra = {"layout": list(layout), "estimated_time": span}
            if self.tree and len(L) <= TREE_MAX_SAMPLES_PER_RANK * self.world_size:
                floor = self._bound_span(lengths)
                if span > floor * (1 + TREE_SLACK):
                    got = self._tree_schedule(L, E, floor, span, blocks)
                    if got is not None:
                        blocks, span, sizes = got
                        extra = {"layout": sizes, "estimated_time": span, "schedule": "buddy-tree"}
        finally:
            self._Erows, self._E, self._packs, self._ET = {}, None, {}, None
        Ll = self._Ll
        per_group = [[WorkItem(ranks, tuple(samples[i] for i in idx), tuple(Ll[i] for i in idx), rec)
                      for ranks, idx, rec in blk] for blk in blocks]
        if extra.get("schedule") == "buddy-tree":  # levels, largest SP first: ancestors' items before their halves'
            plan = StepPlan(tuple(it for level in per_group for it in level), extra)
        else:
            plan = StepPlan(tuple(interleave_items(per_group)), extra)
        if self.fallback:
            plan = self._best_of_parts(samples, lengths, step, plan)
        return [plan]

    def _bound_span(self, lengths: Sequence[int]) -> float:
        """The step bound's compute part, ``max(work / W, heaviest)`` (seconds, no all-reduce)."""
        bound = self._step_bounder().parts(lengths)
        return max(bound.work_s, bound.heaviest_s)

    def _tree_schedule(self, L: np.ndarray, E: np.ndarray, floor: float, span: float, blocks: list):
        """A buddy-tree schedule of the step (:mod:`~lightning_dcp.planning.policies.tree`) if it beats ``span``.

        Tries the deadlines ``floor x TREE_DEADLINES`` (``floor``: the step bound's compute
        part), keeps the lowest exact span, then moves samples off its critical path while that
        lowers the span (:meth:`_tree_refine`); the layout plan (``blocks``: its groups, then
        their fills on sub-blocks, is a tree schedule too) is refined the same way. Returns
        ``(item lists per level, largest SP first; span; SP size of every node that runs
        items)``, or None when no tree schedule is faster than ``span``.
        """
        if self._tree is None:
            self._tree = BuddyTree(self.world_size, self.classes)
        tree = self._tree
        Ll = self._Ll
        var, const = [], []
        for p in self.classes:
            v, c = self.view.split_costs(L, p)
            var.append(v.tolist())
            const.append(c.tolist())
        order = np.argsort(-L, kind="stable").tolist()
        best = None
        for f in TREE_DEADLINES:
            for best_fit in (False, True):
                where = tree.assign(var, const, Ll, self.budget, order, floor * f, best_fit=best_fit)
                packs, own = self._tree_realize(tree, where, L, E)
                got = tree.span(own)
                if best is None or got < best[0] * (1 - 1e-9):
                    best = (got, where, packs, own)
            if best[0] <= floor * (1 + TREE_SLACK):
                break
        if self.refine_rounds:
            got, where, packs, own = self._tree_refine(tree, best[1], best[2], best[3], L, E, var)
            best = (got, where, packs, own)
            # the layout plan is a tree schedule too (groups, then fills on their sub-blocks): refine it as well
            node = {(tree.offset[v], tree.size[v]): v for v in range(len(tree.size))}
            where = [-1] * len(Ll)
            for blk in blocks:
                for ranks, idx, _ in blk:
                    v = node[(ranks[0], len(ranks))]
                    for i in idx:
                        where[i] = v
            packs, own = self._tree_realize(tree, where, L, E)
            got, where, packs, own = self._tree_refine(tree, where, packs, own, L, E, var)
            if got < best[0] * (1 - 1e-9):
                best = (got, where, packs, own)
        got, where, packs, own = best  # type: ignore[misc]
        if got >= span * (1 - 1e-9):
            return None
        levels: dict[int, list[list]] = {}
        nodes = sorted(packs, key=lambda u: (-tree.size[u], tree.offset[u]))
        for v in nodes:
            ranks = tree.ranks(v)
            levels.setdefault(tree.size[v], []).append([(ranks, idx, rec) for idx, rec, _ in packs[v]])
        return [interleave_items(levels[p]) for p in sorted(levels, reverse=True)], got, [tree.size[v] for v in nodes]

    def _tree_realize(self, tree: BuddyTree, where: Sequence[int], L: np.ndarray, E: np.ndarray):
        """Micro-batches of every node that holds samples, and every node's exact own time."""
        members: dict[int, list[int]] = {}
        for i, v in enumerate(where):
            members.setdefault(v, []).append(i)
        own = [0.0] * len(tree.size)
        packs = {}
        for v, mem in members.items():
            packs[v] = self._pack(mem, tree.size[v], L, E)
            own[v] = sum(t for _, _, t in packs[v])
        return packs, own

    def _tree_refine(self, tree: BuddyTree, where: list[int], packs: dict, own: list[float], L: np.ndarray,
                     E: np.ndarray, var: list[list[float]]):
        """Move or swap samples off the critical path of a tree schedule while that lowers its exact span.

        Each round looks at the nodes on the slowest root-to-leaf paths and, for their samples,
        at moves to the three least-loaded nodes of each SP size that holds them (off those
        paths) and at swaps with the samples there, ranked by the estimated span of the pair
        afterwards (own times, ``var``); it makes the first of the best six that lowers the
        exact span (both nodes re-packed).
        """
        where = list(where)
        members: dict[int, list[int]] = {}
        for i, v in enumerate(where):
            members.setdefault(v, []).append(i)
        span = tree.span(own)
        spread = tree.spread(own)
        inf = math.inf
        kof = {p: k for k, p in enumerate(self.classes)}
        tried: set[tuple[int, int, int, int]] = set()
        anc = tree.ancestors
        for _ in range(self.refine_rounds):
            thr = tree.through(own)
            cut = span * (1 - 1e-12)
            crit = [v for v in members if thr[v] >= cut]
            # per SP size, its least-loaded nodes off the critical paths (destinations)
            light = {p: sorted((u for u in nodes if thr[u] < cut), key=lambda u: (thr[u], u))[:3 + len(crit)]
                     for p, nodes in tree.level.items() if p in kof}
            cands = []
            for s_ in crit:
                rs = var[kof[tree.size[s_]]]
                mine = sorted(members[s_], key=lambda i: (-rs[i], i))[:TREE_REFINE_WIDTH]
                for p, nodes in light.items():
                    rd = var[kof[p]]
                    dests = [u for u in nodes if s_ not in anc[u] and u not in anc[s_]][:3]
                    for d in dests:
                        theirs = sorted(members.get(d, ()), key=lambda j: (-rd[j], j))[:TREE_REFINE_WIDTH]
                        for i in mine:
                            ti = rd[i]
                            if ti == inf:
                                continue
                            gain = rs[i]
                            est = thr[d] + ti
                            if est < span and (s_, i, d, -1) not in tried:
                                cands.append((max(est, span - gain), -int(L[i]), s_, i, d, -1))
                            for j in theirs:
                                back = rs[j]
                                if back == inf or back >= gain:
                                    continue
                                e2 = max(span - gain + back, thr[d] - rd[j] + ti)
                                if e2 < span and (s_, i, d, j) not in tried:
                                    cands.append((e2, -int(L[i]), s_, i, d, j))
            cands.sort()
            moved = False
            for _, _, s_, i, d, j in cands[:6]:
                tried.add((s_, i, d, j))
                src = [x for x in members[s_] if x != i] + ([j] if j >= 0 else [])
                dst = [x for x in members.get(d, []) if x != j] + [i]
                ps = self._pack(src, tree.size[s_], L, E) if src else []
                pd = self._pack(dst, tree.size[d], L, E)
                new = list(own)
                new[s_] = sum(t for _, _, t in ps)
                new[d] = sum(t for _, _, t in pd)
                got = tree.span(new)
                sq = tree.spread(new)
                if got < span * (1 - 1e-9) or (got <= span and sq < spread * (1 - 1e-9)):
                    spread = sq
                    members[s_], members[d] = src, dst
                    packs[d] = pd
                    if src:
                        packs[s_] = ps
                    else:
                        packs.pop(s_, None)
                        members.pop(s_)
                    own, span = new, got
                    where[i] = d
                    if j >= 0:
                        where[j] = s_
                    moved = True
                    break
            if not moved:
                break
        return span, where, packs, own

    def _best_of_parts(self, samples: Sequence[int], lengths: Sequence[int], step: int, plan: StepPlan) -> StepPlan:
        """Safety net: dcp never loses to its own parts, ``dcp-intra`` and ``dcp-inter``.

        Skipped when it cannot matter or would cost too much, both deterministic: dcp's plan is
        within 1% of the step's achievable bound
        (:class:`~lightning_dcp.planning.bound.StepBounder`: no plan beats it by more), or the
        batch has more than ``FALLBACK_MAX_SAMPLES_PER_RANK`` samples per rank (there the parts
        take 5-10x dcp's planning time, and dcp's per-sample estimates, which this net guards,
        are accurate: many samples share each micro-batch). Otherwise both parts plan the same
        batch and the plan with the lowest exact span (:func:`step_span`, as the simulator runs
        it) wins; ties keep dcp's.
        """
        if len(lengths) > FALLBACK_MAX_SAMPLES_PER_RANK * self.world_size:
            return plan
        best, best_span = plan, step_span(plan, self.view)
        if best_span <= self._bound_span(lengths) * 1.01:
            return plan
        if self._parts is None:
            self._parts = [cls(self.world_size, self.view, seed=self.seed) for cls in (DCPIntraPolicy, DCPInterPolicy)]
        for part in self._parts:
            cand = part.plan_batch(samples, lengths, step)[0]
            span = step_span(cand, self.view)
            if span < best_span * (1 - 1e-9):
                extra = dict(cand.extra, estimated_time=span, chosen=part.name)
                best, best_span = StepPlan(cand.items, extra), span
        return best

    # -- one block of ranks (the world, or a group's ranks after its own items) -------------
    def _schedule(self, ids: np.ndarray, L: np.ndarray, E: np.ndarray, G: np.ndarray, size: int, offset: int,
                  kmax: int, rng: np.random.Generator, top: bool = False):
        """Plan samples ``ids`` on ranks ``offset .. offset+size-1`` using SP classes ``<= kmax``.

        Returns ``(per-group item lists, estimated span, layout)``; an item is ``(ranks, sample
        indices, recompute)``. A group of ``P`` ranks runs its *own* samples (those cheapest on
        ``P`` ranks) as ``P``-rank micro-batches first, then its *fill* samples (those that prefer
        a smaller SP size) on a nested plan of the same ``P`` ranks with SP sizes ``< P``: a
        long sample gets the large group it needs and the group's ranks are not left idle or
        spent on short samples at a large, communication-heavy SP size afterwards.
        """
        classes = self.classes[: kmax + 1]
        Es, Gs = E[: kmax + 1][:, ids], G[: kmax + 1][:, ids]
        n = len(ids)
        cols = np.arange(n)
        minidx = np.searchsorted(self.maxlens[: kmax + 1], L[ids], side="left")
        pref = np.argmin(Gs, axis=0)
        # A sample longer (in time) than the mean rank load cannot be balanced on its preferred
        # SP size: promote it to the smallest SP size on which it takes at most that long.
        mean_load = float(Gs[pref, cols].sum()) / size
        # With no more samples than ranks, such a sample runs in a micro-batch of its own, so it is
        # judged by its time *alone* (its own recompute, the whole per-micro-batch constant), not
        # by its share of a full micro-batch, which understates constant-heavy SP sizes.
        over = np.nonzero(Es[pref, cols] > mean_load)[0]
        alone = n <= size  # so few samples that each may get a micro-batch (and group) of its own
        for i in over.tolist():
            t = np.maximum(Es[:, i], self._alone_times(int(L[ids[i]]), classes)) if alone else Es[:, i]
            ok = np.nonzero(t <= mean_load)[0]
            k = int(ok[0]) if len(ok) else int(np.argmin(t))
            pref[i] = max(int(pref[i]), k) if len(ok) else k
        must_k = max(int(minidx.max()), int(pref.max()))
        must = classes[must_k]
        gp = Gs[pref, cols]
        w = np.bincount(pref, weights=gp, minlength=len(classes))
        work = {p: float(w[k]) for k, p in enumerate(classes)}
        # dispatch cost: a sample on a group of class k either runs on all its ranks, or (when it
        # prefers a smaller SP size) as fill, costing its GPU-seconds spread over the group
        C, F, ep = fill_costs(Es, pref, cols, gp, classes)
        # samples over half the mean rank load cannot share a group without making it the
        # slowest: each class gets at least one group per such sample it prefers (as far as the
        # block holds them), so many equally long samples do not queue up on too few large groups
        big = ep > 0.5 * mean_load
        min_groups = None
        if big.any():
            nbig = np.bincount(pref[big], minlength=len(classes))
            min_groups, used = {}, 0
            for k in range(len(classes) - 1, 0, -1):
                if nbig[k] > 1:
                    c = int(min(nbig[k], (size - used) // classes[k]))
                    if c > 1:
                        min_groups[classes[k]] = c
                        used += c * classes[k]
            min_groups = min_groups or None
        cands: list[Layout] = []
        for bias in (0.0, 0.35, -0.35):  # the rounded layout and its neighbours (Hydraulis §7)
            lay = allocate(work, size, classes, must, bias=bias)
            if lay not in cands:
                cands.append(lay)
            if min_groups:
                lay = allocate(work, size, classes, must, min_groups=min_groups, bias=bias)
                if lay not in cands:
                    cands.append(lay)
        if top:
            for lay in self.candidates.get(must, []):
                if lay not in cands:
                    cands.append(lay)
        key = L[ids].astype(np.float64)
        result = None
        # two modes, each with its best layout by dispatch estimate: nested (groups may run fill
        # samples on sub-blocks) and flat (every sample on all ranks of its group); the one with
        # the lower exact span wins
        # (only the top level nests; a nested sub-plan is flat and unrefined, which keeps the
        # planner's time linear in the samples)
        # early exit: a dispatch estimate within 1% of the lower bound (mean rank load at the
        # preferred sizes, or the longest sample's best time) cannot be beaten by much
        bound = max(mean_load, float(np.min(Es, axis=0).max()) if n else 0.0) * 1.01
        EsT = CT = FT = None
        for nested in ((True, False) if top else (False,)):
            cost, floor = (C, F) if nested else (Es, None)
            if nested:
                CT, FT = C.T.tolist(), F.T.tolist()
                costT, floorT = CT, FT
            else:
                if EsT is None:  # rows of the step's E.T (cached once per step)
                    EsT = Es.T.tolist() if self._ET is None else [self._ET[i] for i in ids.tolist()]
                costT, floorT = EsT, None
            best = None
            chunk_cache: dict = {}  # the same chunks of small samples for every candidate
            for lay in cands:
                members, loads, span = lpt_dispatch(cost, lay, classes, key, self.trials, rng, floor=floor,
                                                    costT=costT, floorT_all=floorT, chunk=self.dispatch_chunk,
                                                    chunk_groups=len(cands[0]), chunk_cache=chunk_cache,
                                                    fills_after_own=True,
                                                    cutoff=best[3] * (1 - 1e-9) if best is not None else math.inf)
                if best is None or span < best[3] * (1 - 1e-9):
                    best = (lay, members, loads, span)
                if span <= bound:
                    break
            layout, members, _, _ = best  # type: ignore[misc]
            groups = place(layout, size)
            assert groups is not None
            groups = [tuple(r + offset for r in g) for g in groups]
            # fill[k][j]: sample j runs as a fill (on a sub-block) on a group of class k
            isfill = (Es > C).tolist() if nested else None
            ctx = (ids, L, E, G, Es, C if nested else Es, pref, rng, isfill, ids.tolist())
            plans = [self._group(list(members[g]), groups[g], ctx) for g in range(len(groups))]
            span = max((t for _, t in plans), default=0.0)
            if result is None or span < result[1] * (1 - 1e-9):
                result = (plans, span, layout, groups, members, ctx)
            if not np.any(F) or span <= bound:  # nothing can be a fill (the flat plan is the same), or close enough
                break
        plans, span, layout, groups, members, ctx = result  # type: ignore[misc]
        if self.refine_rounds and top:  # refine the winner only
            plans = self._refine(plans, groups, members, ctx)
            span = max((t for _, t in plans), default=0.0)
        return [items for items, _ in plans], span, layout

    def _alone_times(self, length: int, classes: Sequence[int]) -> np.ndarray:
        """Time of one sample of ``length`` alone on each SP size of ``classes`` (inf where it does not fit)."""
        return self._step_bounder().alone_times(length)[: len(classes)]

    def _step_bounder(self) -> StepBounder:
        """The step bounder on this policy's cost view (its SP sizes are ``self.classes``), built once."""
        if self._bounder is None:
            self._bounder = StepBounder(self.view.cm, self.world_size, self.view.sp_sizes[-1], view=self.view)
        return self._bounder

    def _group(self, mem: list[int], ranks: tuple[int, ...], ctx) -> tuple[list, float]:
        """Items and estimated time of one group running the (local) samples ``mem``."""
        ids, L, E, G, Es, C, pref, rng, isfill, idl = ctx
        if not mem:
            return [], 0.0
        P = len(ranks)
        k = self.classes.index(P)
        if k > 0 and isfill is not None:
            fk = isfill[k]
            own = [j for j in mem if not fk[j]]
            fill = [j for j in mem if fk[j]]
        else:
            own, fill = list(mem), []
        items, t = [], 0.0
        if own:
            for idx, rec, ti in self._pack([idl[j] for j in own], P, L, E):
                items.append((ranks, idx, rec))
                t += ti
        if fill:
            sub, span, _ = self._schedule(ids[fill], L, E, G, P, ranks[0], k - 1, rng)
            items.extend(interleave_items(sub))
            t += span
        return items, t

    def _pack(self, idx: list[int], sp: int, L: np.ndarray, E: np.ndarray) -> list[tuple[list[int], int, float]]:
        """Micro-batches ``(sample indices, recompute, time)`` of ``sp`` ranks running samples ``idx``."""
        if not idx:
            return []
        k = self.classes.index(sp)
        live = self._E is E and len(self._Ll) == len(L)
        if live:  # the same samples on the same SP size pack the same way (refinement repeats them)
            ckey = (sp, tuple(idx))
            got = self._packs.get(ckey)
            if got is not None:
                return got
        if live:
            Ll = self._Ll
            Ek = self._Erows.get(k)
            if Ek is None:
                Ek = self._Erows[k] = E[k].tolist()
            lens = [Ll[i] for i in idx]
            est = [Ek[i] for i in idx]
            Wl = self._Wl if self.view._time_fast is not None else None
        else:
            lens = [int(L[i]) for i in idx]
            est = [float(E[k, i]) for i in idx]
            Wl = None
        fast = self.view._time_fast
        caps = self.view.capacities(sp)
        cap_max = caps[-1]
        out = []
        for pack in pack_time_balanced(lens, est, self.budget[k]):
            pl = [lens[j] for j in pack]
            tok = sum(pl)
            # fewest recomputed layers that fit (recompute_for, inlined)
            rec = bisect.bisect_left(caps, tok) if tok <= cap_max else recompute_for(self.view, tok, sp)
            members = [idx[j] for j in pack]
            if Wl is not None:  # same sum, in the same order, as CostView.time
                t = fast(tok, float(sum([Wl[i] for i in members])), len(pl), sp, rec)
            else:
                t = self.view.time(pl, sp, rec)
            out.append((members, rec, t))
        if live:
            self._packs[ckey] = out
        return out

    def _refine(self, plans, groups, members, ctx):
        """Move samples off the slowest group while that lowers the makespan (exact times).

        Each round looks at the moves of one sample from the slowest group to one of the three
        least-loaded groups that can hold it, ranked by the estimated makespan of the pair
        afterwards (``max(slow - its cost there, dst + its cost here)``: the move that evens
        the pair best, not merely the smallest sample), and makes the first of the best four
        that lowers the makespan when both groups are re-planned exactly.
        """
        ids, L, E, G, Es, C, pref, rng, isfill, idl = ctx
        members = [list(m) for m in members]
        times = [t for _, t in plans]
        sizes = [len(g) for g in groups]
        kidx = [self.classes.index(p) for p in sizes]
        tried: set[tuple[int, int]] = set()
        for _ in range(self.refine_rounds):
            slow = max(range(len(times)), key=times.__getitem__)
            span = times[slow]
            moves = self._refine_moves(slow, span, members, times, kidx, C, L, ids)
            moved = False
            for _, j, g in moves:
                if (slow, j) in tried:
                    continue
                tried.add((slow, j))
                src = [x for x in members[slow] if x != j]
                dst = members[g] + [j]
                new_src = self._group(src, groups[slow], ctx)
                new_dst = self._group(dst, groups[g], ctx)
                if max(new_src[1], new_dst[1]) < span * (1 - 1e-9):
                    plans[slow], plans[g] = new_src, new_dst
                    times[slow], times[g] = new_src[1], new_dst[1]
                    members[slow], members[g] = src, dst
                    moved = True
                    break
            if not moved:
                break
        return plans

    @staticmethod
    def _refine_moves(slow, span, members, times, kidx, C, L, ids, top=4):
        """Candidate moves ``(estimated pair makespan, sample, destination)``, best first."""
        mem = np.asarray(members[slow], dtype=np.int64)
        if len(mem) == 0:
            return []
        here = C[kidx[slow], mem]
        order = sorted((g for g in range(len(times)) if g != slow), key=lambda g: (times[g], g))[:3]
        out = []
        lens = L[ids[mem]]
        for g in order:
            there = C[kidx[g], mem]
            est = np.maximum(span - here, times[g] + there)
            ok = np.isfinite(there) & (est < span)
            if not ok.any():
                continue
            cand = np.nonzero(ok)[0]
            best = cand[np.lexsort((lens[cand], est[cand]))[:top]]
            out.extend((float(est[i]), int(mem[i]), g) for i in best)
        out.sort(key=lambda m: (m[0], int(L[ids[m[1]]]), m[2]))
        return out[:top]


class AlgorithmOnePolicy(Policy):
    """DCP-paper policies: per-bucket (b, p, r) by Algorithm 1, balance by accumulation counts.

    Per global batch (every sample exactly once, one optimizer step):

    1. *Buckets.* Samples are grouped by length (``per_octave`` buckets per doubling, default 2):
       the paper's "batches of similar sequence lengths".
    2. *Algorithm 1 per bucket.* For every SP size ``p`` and micro-batch size ``b`` (powers of
       two up to the memory limit, and the limit itself) the recompute count ``r`` is all
       layers (``dcp-inter``, §3.3: the static configuration's full checkpointing) or the
       fewest that fit (``dcp-intra``, §3.4, Alg. 1: ``T - (L - r) t_f``); the ``(b, p)`` of
       highest per-GPU throughput ``b s / (p T)`` wins. The bucket is cut into micro-batches of
       ``b`` samples (longest first), each run on a group of ``p`` ranks.
    3. *Groups and accumulation counts* (eq. 3, App. C). Ranks are split into groups of the SP
       sizes the buckets chose, proportionally to each size's GPU-seconds (the rounded split and
       its neighbours are candidates); micro-batches are dealt longest first to the group where
       they finish earliest (a group's accumulation count ``g_i`` is how many it gets), which
       minimizes ``max_j g_j T_j``, i.e. eq. 3's idle time. A micro-batch may run on a group of
       another chosen SP size when that finishes it earlier and it fits in memory there (with
       the recompute that size needs), so rounding the split into whole groups leaves no rank
       idle. The candidate layout with the lowest makespan wins.
    4. *G_min* (App. C): if every group accumulates fewer than ``g_min`` micro-batches
       (default 4), the accumulation counts are scaled up by ``ceil(g_min / g)``: with the
       global batch fixed, every bucket's micro-batch size is divided by that factor (at least
       one sample), and step 3 is redone. *G_max* (optional ``g_max``): the layout keeps at
       least ``ceil(M_p / g_max)`` groups of each SP size ``p`` that has ``M_p``
       micro-batches, so no group needs more than ``g_max`` accumulation steps on its own size.
    """

    name = "dcp-intra"
    full_recompute = False

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("per_octave", "g_min", "g_max")

    def __init__(self, world_size: int, view: CostView, **kw: Any):
        super().__init__(world_size, view, **kw)
        self.per_octave = int(self.options.get("per_octave", 2))
        self.g_min = int(self.options.get("g_min", 4))
        self.g_max = self.options.get("g_max")
        self._cache: dict[tuple[int, int], tuple[int, int]] = {}

    def _rec(self, tokens: int, p: int) -> int | None:
        if self.full_recompute:
            return self.view.num_layers if tokens <= self.view.max_len(p) else None
        return self.view.min_recompute(tokens, p)

    def algorithm_one(self, max_len: int, mean_len: float) -> tuple[int, int]:
        """(micro-batch size, SP size) of highest throughput for a bucket (paper Alg. 1)."""
        key = (max_len, int(mean_len))
        got = self._cache.get(key)
        if got is not None:
            return got
        best = None
        for p in self.view.sp_sizes:
            cap = self.view.max_len(p)
            if cap < max_len:
                continue
            b_max = cap // max_len
            bs = sorted({b_max} | {1 << j for j in range(b_max.bit_length()) if (1 << j) <= b_max})
            for b in bs:
                r = self._rec(b * max_len, p)
                if r is None:
                    continue
                t = self.view.time_uniform(mean_len, b, p, r)
                thr = b * mean_len / (p * t)
                if best is None or thr > best[0] * (1 + 1e-9):
                    best = (thr, b, p)
        assert best is not None, f"length {max_len} fits no SP size"
        self._cache[key] = (best[1], best[2])
        return best[1], best[2]

    def _units(self, buckets, lengths, scale: int) -> list[tuple[list[int], int]]:
        units: list[tuple[list[int], int]] = []  # (sample indices, preferred sp)
        for idx, b, p in buckets:
            b = max(1, -(-b // scale))
            cap = self.view.max_len(p)
            cur: list[int] = []
            tok = 0
            for i in idx:
                if cur and (len(cur) >= b or tok + lengths[i] > cap):
                    units.append((cur, p))
                    cur, tok = [], 0
                cur.append(i)
                tok += lengths[i]
            if cur:
                units.append((cur, p))
        return units

    def _dispatch(self, units, lengths):
        """``(per-group item lists, estimated span, layout)`` for these micro-batches.

        An item is ``(ranks, unit index, recompute)``.
        """
        classes = list(self.view.sp_sizes)
        n = len(units)
        w = self.view.work
        tokens = np.array([sum(lengths[i] for i in u) for u, _ in units], dtype=np.int64)
        sq = np.array([sum(w(lengths[i]) for i in u) for u, _ in units], dtype=np.float64)
        cnt = np.array([len(u) for u, _ in units], dtype=np.int64)
        pref = np.array([classes.index(p) for _, p in units], dtype=np.int64)
        cost = np.full((len(classes), n), np.inf)
        recs = np.zeros((len(classes), n), dtype=np.int64)
        L = self.view.num_layers
        for k, q in enumerate(classes):
            if self.full_recompute:
                r = np.where(tokens <= self.view.max_len(q), L, -1)
            else:
                r = self.view.min_recompute_many(tokens, q)
            ok = r >= 0
            if not ok.any():
                continue
            recs[k, ok] = r[ok]
            if self.view._time_fast is not None:
                cost[k, ok] = self.view.time_many(tokens[ok], sq[ok], cnt[ok], q, r[ok])
            else:
                for j in np.nonzero(ok)[0].tolist():
                    cost[k, j] = self.view.time([lengths[i] for i in units[j][0]], q, int(r[j]))
        ctx = (cost, recs, pref)
        return self._solve(np.arange(n), self.world_size, 0, len(classes) - 1, ctx)

    def _solve(self, ids: np.ndarray, size: int, offset: int, kmax: int, ctx):
        """Micro-batches ``ids`` on ranks ``offset .. offset+size-1`` with SP sizes ``<= classes[kmax]``.

        Groups of the chosen SP sizes; when they do not all fit side by side (a micro-batch
        needs a group as large as the block), a large group runs its own micro-batches first
        and then, split into smaller groups, the micro-batches that chose smaller SP sizes
        (groups change size between accumulation steps, as DCP switches the SP size per batch).
        """
        cost_all, recs, pref_all = ctx
        classes = list(self.view.sp_sizes)[: kmax + 1]
        cs = cost_all[: kmax + 1][:, ids]
        n = len(ids)
        cols = np.arange(n)
        pref = np.minimum(pref_all[ids], kmax)
        bad = ~np.isfinite(cs[pref, cols])
        if bad.any():  # its size is not allowed here: the smallest that holds it
            pref[bad] = np.argmax(np.isfinite(cs[:, bad]), axis=0)
        parr = np.array(classes, dtype=np.float64)
        # a micro-batch longer than the mean rank load cannot be balanced by accumulation on its
        # own SP size (the step would last as long as it): it moves to the smallest SP size on
        # which it takes at most that long (the fastest one if none)
        mean_load = float((cs[pref, cols] * parr[pref]).sum()) / size
        for j in np.nonzero(cs[pref, cols] > mean_load)[0].tolist():
            ok = np.nonzero(cs[:, j] <= mean_load)[0]
            pref[j] = max(int(pref[j]), int(ok[0]) if len(ok) else int(np.argmin(cs[:, j])))
        gp = cs[pref, cols] * parr[pref]
        wk = np.bincount(pref, weights=gp, minlength=len(classes))
        present = sorted({classes[k] for k in pref.tolist()})
        work = {p: float(wk[classes.index(p)]) for p in present}
        must = max(present)
        # a micro-batch may run on a larger group than it chose: on all its ranks, or as a fill
        # (after the group's own micro-batches, on a sub-group of the size it chose), costing
        # the group its GPU-seconds spread over the ranks but lasting at least its own time
        C, F, ep = fill_costs(cs, pref, cols, gp, classes)
        min_groups = None
        if self.g_max:
            counts = np.bincount(pref, minlength=len(classes))
            min_groups = {p: max(1, math.ceil(int(counts[classes.index(p)]) / int(self.g_max))) for p in present}
        # candidates: the rounded split of the ranks over the chosen sizes and its neighbours;
        # and the same with the largest size one step up (its group runs the others as fills)
        cands: list[Layout] = []
        musts = [must] + [q for q in classes if q > must][:1]
        for m in musts:
            sizes = sorted(set(present) | {m})
            for bias in (0.0, 0.35, -0.35):
                try:
                    lay = allocate(work, size, sizes, m, min_groups=min_groups, bias=bias)
                except ValueError:
                    continue
                lay = tuple(p for p in lay if p in sizes)
                if lay and lay not in cands and place(lay, size) is not None:
                    cands.append(lay)
        if not cands:
            cands.append((must,) * (size // must))
        key = cs[pref, cols]
        flat_ok = place(sorted(present, reverse=True), size) is not None
        result = None
        # two modes, each with its best layout by the dispatch estimate: flat (every micro-batch
        # on all ranks of its group) and with fills; the lower realized span wins
        for mode_fill in ((False, True) if flat_ok else (True,)):
            cost, floor = (C, F) if mode_fill else (cs, None)
            best = None
            for lay in cands:
                if not mode_fill and any(p not in present for p in lay):
                    continue
                try:
                    members, _, span = lpt_dispatch(cost, lay, classes, key, floor=floor)
                except ValueError:
                    continue
                if best is None or span < best[2] * (1 - 1e-9):
                    best = (lay, members, span)
            if best is None:
                continue
            got = self._realize(best[0], best[1], ids, cs, F if mode_fill else None, size, offset, ctx)
            if result is None or got[1] < result[1] * (1 - 1e-9):
                result = got
        assert result is not None
        return result

    def _realize(self, layout, members, ids, cs, F, size, offset, ctx):
        cost_all, recs, pref_all = ctx
        classes = list(self.view.sp_sizes)
        groups = [tuple(r + offset for r in g) for g in (place(layout, size) or [])]
        blocks, span = [], 0.0
        for g, mem in enumerate(members):
            P = len(groups[g])
            k = classes.index(P)
            own = [j for j in mem if F is None or F[k, j] == 0.0]
            fill = [j for j in mem if F is not None and F[k, j] > 0.0]
            items = [(groups[g], int(ids[j]), int(recs[k, ids[j]])) for j in own]
            t = float(sum(cs[k, j] for j in own))
            if fill:
                sub, sub_span, _ = self._solve(ids[fill], P, groups[g][0], k - 1, ctx)
                items.extend(interleave_items(sub))
                t += sub_span
            blocks.append(items)
            span = max(span, t)
        return blocks, span, layout

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        buckets = []
        for _, idx in sorted(log_buckets(lengths, self.per_octave).items()):
            lens = [lengths[i] for i in idx]
            b, p = self.algorithm_one(max(lens), float(np.mean(lens)))
            buckets.append((sorted(idx, key=lambda i: (-lengths[i], i)), b, p))
        scale = 1
        units = self._units(buckets, lengths, scale)
        best = (self._dispatch(units, lengths), units, scale)
        g = max((len(m) for m in best[0][0]), default=0)
        if self.g_min > 1 and 0 < g < self.g_min:  # App. C: scale every accumulation count up
            scale = -(-self.g_min // g)
            units = self._units(buckets, lengths, scale)
            best = (self._dispatch(units, lengths), units, scale)
        # eq. 3 search over the accumulation counts: with the global batch fixed, more
        # accumulation steps mean smaller micro-batches; keep doubling them while the makespan
        # improved within the last two doublings
        b_top = max(b for _, b, _ in buckets)
        misses, last = 0, len(best[1])
        while scale < b_top and misses < 2:
            scale *= 2
            units = self._units(buckets, lengths, scale)
            if len(units) <= last:
                continue
            last = len(units)
            got = self._dispatch(units, lengths)
            if got[1] < best[0][1] * (1 - 1e-3):
                best, misses = (got, units, scale), 0
            else:
                misses += 1
        (blocks, span, layout), units, scale = best
        per_group = [[WorkItem(ranks, tuple(samples[i] for i in units[j][0]), tuple(lengths[i] for i in units[j][0]), rec)
                      for ranks, j, rec in blk] for blk in blocks]
        extra = {"layout": list(layout), "estimated_time": float(span), "accumulation_scale": scale}
        return [StepPlan(tuple(interleave_items(per_group)), extra)]


class DCPIntraPolicy(AlgorithmOnePolicy):
    """``dcp-intra``: Algorithm 1 with the fewest recomputed layers that fit (on top of DCP-inter)."""

    name = "dcp-intra"
    full_recompute = False


class DCPInterPolicy(AlgorithmOnePolicy):
    """``dcp-inter``: Algorithm 1's (b, p) with every layer recomputed; balance by accumulation."""

    name = "dcp-inter"
    full_recompute = True


def fill_costs(times: np.ndarray, pref: np.ndarray, cols: np.ndarray, gpu_s: np.ndarray,
               classes: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dispatch costs of units on groups of each SP class, and the floors fills impose.

    ``times[k, i]``: unit i's time on a group of ``classes[k]`` ranks; ``pref[i]``: the class it
    prefers; ``gpu_s[i]``: its GPU-seconds at that class. On a larger class than it prefers, a
    unit either runs on all the group's ranks (``times``) or as a fill on a sub-group of its own
    size, costing the group its GPU-seconds spread over the ranks (whichever is cheaper); a fill
    still lasts its own time, returned as the floor ``F``. Returns ``(C, F, own_time)``.
    """
    C = times.copy()
    F = np.zeros_like(times)
    own = times[pref, cols]
    for k in range(1, len(classes)):
        fill = pref < k
        if fill.any():
            spread = gpu_s[fill] / classes[k]
            use = spread < times[k, fill]
            C[k, fill] = np.where(use, spread, times[k, fill])
            F[k, fill] = np.where(use, own[fill], 0.0)
    return C, F, own
