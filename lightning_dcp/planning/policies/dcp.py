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

``dcp-inter`` / ``dcp-intra`` follow the DCP paper: samples are bucketed by length (2 per
octave); for every bucket Algorithm 1 picks the micro-batch size ``b`` and SP size ``p`` of
highest throughput ``b*s / (p*T)`` under the memory limit — with all layers recomputed for
``dcp-inter`` (§3.3), with the fewest recomputed layers that fit for ``dcp-intra`` (§3.4, which
the paper runs on top of DCP-inter). Micro-batches then go, longest first, to the
least-loaded group of their SP size; ranks per SP size follow the work, and each group's
accumulation count ``g`` is bounded by ``[g_min, g_max]`` through the number of groups of each
size (Appendix C, with a fixed global batch: ``g <= g_max`` asks for at least
``ceil(M_p / g_max)`` groups, ``g >= g_min`` for at most ``floor(M_p / g_min)``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from lightning_dcp.planning.layouts import Layout, allocate, place, propose_layouts
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.planning.policies.base import Policy, interleave_items, log_buckets
from lightning_dcp.planning.policies.costs import CostView
from lightning_dcp.planning.policies.dispatch import lpt_dispatch
from lightning_dcp.planning.policies.packing import pack_time_balanced, recompute_for


class DCPPolicy(Policy):
    """Heterogeneous SP groups per step, LPT dispatch, time-balanced packing, recompute per item.

    Options: ``trials`` (dispatch trials per candidate, default 1: the longest-first order; more
    add seeded perturbed orders),
    ``max_candidates`` (dataset candidates per largest SP size, default 3), ``refine_rounds``
    (default 64).
    """

    name = "dcp"

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("trials", "max_candidates", "refine_rounds")

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
        self.candidates: dict[int, list[Layout]] = {}
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
        blocks, span, layout = self._schedule(ids, L, E, G, self.world_size, 0, len(self.classes) - 1, rng, top=True)
        per_group = [[WorkItem(ranks, tuple(samples[i] for i in idx), tuple(int(L[i]) for i in idx), rec)
                      for ranks, idx, rec in blk] for blk in blocks]
        extra = {"layout": list(layout), "estimated_time": span}
        return [StepPlan(tuple(interleave_items(per_group)), extra)]

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
        over = np.nonzero(Es[pref, cols] > mean_load)[0]
        for i in over.tolist():
            ok = np.nonzero(Es[:, i] <= mean_load)[0]
            k = int(ok[0]) if len(ok) else int(np.argmin(Es[:, i]))
            pref[i] = max(int(pref[i]), k)
        must_k = max(int(minidx.max()), int(pref.max()))
        must = classes[must_k]
        gp = Gs[pref, cols]
        w = np.bincount(pref, weights=gp, minlength=len(classes))
        work = {p: float(w[k]) for k, p in enumerate(classes)}
        # dispatch cost: a sample on a group of class k either runs on all its ranks, or (when it
        # prefers a smaller SP size) as fill, costing its GPU-seconds spread over the group
        C = Es.copy()
        F = np.zeros_like(Es)  # a fill sample still lasts its own time on its sub-block
        ep = Es[pref, cols]
        for k in range(1, len(classes)):
            fill = pref < k
            if fill.any():
                spread = gp[fill] / classes[k]
                use = spread < Es[k, fill]
                C[k, fill] = np.where(use, spread, Es[k, fill])
                F[k, fill] = np.where(use, ep[fill], 0.0)
        cands: list[Layout] = []
        for bias in (0.0, 0.35, -0.35):  # the rounded layout and its neighbours (Hydraulis §7)
            lay = allocate(work, size, classes, must, bias=bias)
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
        for nested in ((True, False) if top else (False,)):
            cost, floor = (C, F) if nested else (Es, None)
            best = None
            for lay in cands:
                members, loads, span = lpt_dispatch(cost, lay, classes, key, self.trials, rng, floor=floor)
                if best is None or span < best[3] * (1 - 1e-9):
                    best = (lay, members, loads, span)
            layout, members, _, _ = best  # type: ignore[misc]
            groups = place(layout, size)
            assert groups is not None
            groups = [tuple(r + offset for r in g) for g in groups]
            ctx = (ids, L, E, G, Es, C if nested else Es, pref, rng)
            plans = [self._group(list(members[g]), groups[g], ctx) for g in range(len(groups))]
            span = max((t for _, t in plans), default=0.0)
            if result is None or span < result[1] * (1 - 1e-9):
                result = (plans, span, layout, groups, members, ctx)
            if not np.any(F):  # nothing can be a fill: the flat plan is the same
                break
        plans, span, layout, groups, members, ctx = result  # type: ignore[misc]
        if self.refine_rounds and top:  # refine the winner only
            plans = self._refine(plans, groups, members, ctx)
            span = max((t for _, t in plans), default=0.0)
        return [items for items, _ in plans], span, layout

    def _group(self, mem: list[int], ranks: tuple[int, ...], ctx) -> tuple[list, float]:
        """Items and estimated time of one group running the (local) samples ``mem``."""
        ids, L, E, G, Es, C, pref, rng = ctx
        if not mem:
            return [], 0.0
        P = len(ranks)
        k = self.classes.index(P)
        own = [j for j in mem if Es[k, j] <= C[k, j]] if k > 0 else list(mem)
        fill = [j for j in mem if Es[k, j] > C[k, j]] if k > 0 else []
        items, t = [], 0.0
        if own:
            for idx, rec, ti in self._pack([int(ids[j]) for j in own], P, L, E):
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
        lens = [int(L[i]) for i in idx]
        est = [float(E[k, i]) for i in idx]
        out = []
        for pack in pack_time_balanced(lens, est, self.budget[k]):
            pl = [lens[j] for j in pack]
            tok = sum(pl)
            rec = recompute_for(self.view, tok, sp)
            out.append(([idx[j] for j in pack], rec, self.view.time(pl, sp, rec)))
        return out

    def _refine(self, plans, groups, members, ctx):
        """Move samples off the slowest group while that lowers the makespan (exact times)."""
        ids, L, E, G, Es, C, pref, rng = ctx
        members = [list(m) for m in members]
        times = [t for _, t in plans]
        sizes = [len(g) for g in groups]
        kidx = [self.classes.index(p) for p in sizes]
        tried: set[tuple[int, int]] = set()
        for _ in range(self.refine_rounds):
            slow = max(range(len(times)), key=times.__getitem__)
            span = times[slow]
            cand = sorted(members[slow], key=lambda j: int(L[ids[j]]))
            moved = False
            for j in cand[:4]:
                if (slow, j) in tried:
                    continue
                tried.add((slow, j))
                best = None
                for g in range(len(groups)):
                    c = C[kidx[g], j]
                    if g == slow or not np.isfinite(c):
                        continue
                    est = times[g] + c
                    if est < span and (best is None or est < best[0]):
                        best = (est, g)
                if best is None:
                    continue
                g = best[1]
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


class AlgorithmOnePolicy(Policy):
    """DCP-paper policies: per-bucket (b, p, r) by Algorithm 1, balance by accumulation.

    Options: ``per_octave`` (bucket width, default 2), ``g_min`` (default 1), ``g_max``
    (default None: unbounded).
    """

    name = "dcp-intra"
    full_recompute = False

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("per_octave", "g_min", "g_max")

    def __init__(self, world_size: int, view: CostView, **kw: Any):
        super().__init__(world_size, view, **kw)
        self.per_octave = int(self.options.get("per_octave", 2))
        self.g_min = int(self.options.get("g_min", 1))
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

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        units: list[tuple[list[int], int]] = []  # (sample indices, sp)
        for key, idx in sorted(log_buckets(lengths, self.per_octave).items()):
            lens = [lengths[i] for i in idx]
            b, p = self.algorithm_one(max(lens), float(np.mean(lens)))
            idx = sorted(idx, key=lambda i: (-lengths[i], i))
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
        # SP sizes present; drop the smallest ones into larger groups until the layout fits.
        present = sorted({p for _, p in units}, reverse=True)
        while len(present) > 1 and place(present, self.world_size) is None:
            present.pop()
        units = [(u, p if p in present else min(q for q in present if q >= p)) for u, p in units]
        times = []
        for u, p in units:
            tok = sum(lengths[i] for i in u)
            r = self._rec(tok, p)
            times.append((r, self.view.time([lengths[i] for i in u], p, r)))
        counts = {p: sum(1 for _, q in units if q == p) for p in present}
        work = {p: 0.0 for p in present}
        for (u, p), (_, t) in zip(units, times):
            work[p] += t * p
        min_groups = {p: 1 for p in present}
        max_groups = {p: max(1, counts[p] // max(self.g_min, 1)) for p in present}
        if self.g_max:
            for p in present:
                min_groups[p] = min(max(1, math.ceil(counts[p] / int(self.g_max))), max_groups[p])
        layout = allocate(work, self.world_size, present, present[0], min_groups=min_groups, max_groups=max_groups)
        layout = tuple(p for p in layout if p in present) or (present[0],)
        cost = np.full((len(present), len(units)), np.inf)
        row = {p: k for k, p in enumerate(sorted(present))}
        for j, ((u, p), (_, t)) in enumerate(zip(units, times)):
            cost[row[p], j] = t
        key = np.array([t for _, t in times])
        members, _, _ = lpt_dispatch(cost, layout, sorted(present), key)
        groups = place(layout, self.world_size)
        assert groups is not None
        per_group = []
        for g, mem in enumerate(members):
            per_group.append([
                WorkItem(groups[g], tuple(samples[i] for i in units[j][0]), tuple(lengths[i] for i in units[j][0]), times[j][0])
                for j in mem
            ])
        return [StepPlan(tuple(interleave_items(per_group)), {"layout": list(layout)})]


class DCPIntraPolicy(AlgorithmOnePolicy):
    """``dcp-intra``: Algorithm 1 with the fewest recomputed layers that fit (on top of DCP-inter)."""

    name = "dcp-intra"
    full_recompute = False


class DCPInterPolicy(AlgorithmOnePolicy):
    """``dcp-inter``: Algorithm 1's (b, p) with every layer recomputed; balance by accumulation."""

    name = "dcp-inter"
    full_recompute = True
