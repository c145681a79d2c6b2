"""The DCP paper's ablation policies ``dcp-inter`` and ``dcp-intra`` (Algorithm 1 per length bucket).

Samples are bucketed by length (2 per octave); for every bucket Algorithm 1 picks the
micro-batch size ``b`` and SP size ``p`` of highest per-GPU throughput ``b*s / (p*T)`` under the
memory limit -- with all layers recomputed for ``dcp-inter`` (§3.3, as the static configuration
would), with the fewest recomputed layers that fit for ``dcp-intra`` (§3.4, Alg. 1). Ranks are
split into groups of the chosen SP sizes in proportion to their work, micro-batches go longest
first to the group where they finish earliest (each group's accumulation count ``g_i`` balances
eq. 3), and the accumulation counts are scaled up (smaller micro-batches, App. C's ``G_min``)
while that lowers the makespan. Both run the whole global batch in one step. See
:class:`AlgorithmOnePolicy`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from lightning_dcp.planning.layouts import Layout, allocate, place
from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem
from lightning_dcp.planning.policies.base import Policy, interleave_items, log_buckets
from lightning_dcp.planning.policies.costs import CostView
from lightning_dcp.planning.policies.dispatch import fill_costs, lpt_dispatch
from lightning_dcp.planning.policies.objective import improves, makespan


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
        topo = self.view.topology
        if size < self.world_size:  # a group's ranks: only the sizes every group of `size` ranks holds
            barred = [k for k, c in enumerate(classes) if not self.view.contains(size, c)]
            if barred:
                cs = cs.copy()
                cs[barred] = np.inf
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
        C, F, ep = fill_costs(cs, pref, cols, gp, classes, fill_ok=self.view.fill_ok(len(classes)))
        min_groups = None
        if self.g_max:
            counts = np.bincount(pref, minlength=len(classes))
            min_groups = {p: max(1, math.ceil(int(counts[classes.index(p)]) / int(self.g_max))) for p in present}
        cands = self._candidate_layouts(cs, classes, present, must, work, min_groups, offset, size)
        key = cs[pref, cols]
        flat_ok = place(sorted(present, reverse=True), topo, offset, size) is not None
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
                if best is None or improves(span, best[2]):
                    best = (lay, members, span)
            if best is None:
                continue
            got = self._realize(best[0], best[1], ids, cs, F if mode_fill else None, size, offset, ctx)
            if result is None or improves(got[1], result[1]):
                result = got
        assert result is not None
        return result

    def _candidate_layouts(self, cs: np.ndarray, classes: list[int], present: list[int], must: int,
                           work: dict[int, float], min_groups: dict[int, int] | None, offset: int,
                           size: int) -> list[Layout]:
        """The rounded split of the ranks over the chosen sizes and its neighbours; and the same with the largest
        size one step up (its group runs the others as fills)."""
        topo = self.view.topology
        cands: list[Layout] = []
        musts = [must] + [q for q in classes if q > must and np.isfinite(cs[classes.index(q)]).any()][:1]
        for m in musts:
            sizes = sorted(set(present) | {m})
            for bias in (0.0, 0.35, -0.35):
                try:
                    lay = allocate(work, topo, sizes, m, min_groups=min_groups, bias=bias, start=offset, size=size)
                except ValueError:
                    continue
                lay = tuple(p for p in lay if p in sizes)
                if lay and lay not in cands and place(lay, topo, offset, size) is not None:
                    cands.append(lay)
        if not cands:
            cands.append((must,) * max(1, topo.count(topo.free_runs(offset, size), must)))
        return cands

    def _realize(self, layout, members, ids, cs, F, size, offset, ctx):
        cost_all, recs, pref_all = ctx
        classes = list(self.view.sp_sizes)
        groups = place(layout, self.view.topology, offset, size) or []
        blocks, times = [], []
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
            times.append(t)
        return blocks, makespan(times), layout

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
        ring = self.view.ring_of
        per_group = [[WorkItem(ranks, tuple(samples[i] for i in units[j][0]), tuple(lengths[i] for i in units[j][0]), rec,
                               ring(len(ranks))) for ranks, j, rec in blk] for blk in blocks]
        notes = StepNotes(estimated_time=float(span), layout=tuple(layout), setting={"accumulation_scale": scale})
        return [StepPlan(tuple(interleave_items(per_group)), notes)]


class DCPIntraPolicy(AlgorithmOnePolicy):
    """``dcp-intra``: Algorithm 1 with the fewest recomputed layers that fit (on top of DCP-inter)."""

    name = "dcp-intra"
    full_recompute = False


class DCPInterPolicy(AlgorithmOnePolicy):
    """``dcp-inter``: Algorithm 1's (b, p) with every layer recomputed; balance by accumulation."""

    name = "dcp-inter"
    full_recompute = True
