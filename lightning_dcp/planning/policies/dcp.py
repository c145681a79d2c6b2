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
        minidx = np.searchsorted(self.maxlens, L, side="left")
        must_k = int(minidx.max())
        must = self.classes[must_k]
        pref = np.argmin(G, axis=0)
        cols = np.arange(len(L))
        # A sample longer (in time) than the mean rank load cannot be balanced on its preferred
        # SP size: promote it to the smallest SP size on which it takes at most that long.
        mean_load = float(G[pref, cols].sum()) / self.world_size
        over = np.nonzero(E[pref, cols] > mean_load)[0]
        for i in over.tolist():
            ok = np.nonzero(E[:, i] <= mean_load)[0]
            k = int(ok[0]) if len(ok) else int(np.argmin(E[:, i]))
            pref[i] = max(int(pref[i]), k)
        must_k = max(must_k, int(pref.max()))
        must = self.classes[must_k]
        w = np.bincount(pref, weights=G[pref, cols], minlength=len(self.classes))
        work = {p: float(w[k]) for k, p in enumerate(self.classes)}
        cands: list[Layout] = [allocate(work, self.world_size, self.classes, must)]
        for lay in self.candidates.get(must, []):
            if lay not in cands:
                cands.append(lay)
        rng = self.rng(step, 2)
        best = None
        for lay in cands:
            members, loads, span = lpt_dispatch(E, lay, self.classes, L.astype(np.float64), self.trials, rng)
            if best is None or span < best[3] * (1 - 1e-9):
                best = (lay, members, loads, span)
        layout, members, _, span = best  # type: ignore[misc]
        groups = place(layout, self.world_size)
        assert groups is not None
        packed = [self._pack(members[g], len(groups[g]), L, E) for g in range(len(groups))]
        if self.refine_rounds:
            packed = self._refine(packed, groups, L, E)
        per_group = []
        for g, packs in enumerate(packed):
            per_group.append([
                WorkItem(groups[g], tuple(samples[i] for i in idx), tuple(int(L[i]) for i in idx), rec)
                for idx, rec, _ in packs
            ])
        extra = {"layout": list(layout), "estimated_time": max((sum(t for *_, t in pk) for pk in packed), default=0.0)}
        return [StepPlan(tuple(interleave_items(per_group)), extra)]

    def _pack(self, idx: list[int], sp: int, L: np.ndarray, E: np.ndarray) -> list[tuple[list[int], int, float]]:
        """Micro-batches ``(sample indices, recompute, time)`` of one group."""
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

    def _refine(self, packed, groups, L: np.ndarray, E: np.ndarray):
        """Move samples off the slowest group while that lowers the makespan (exact times)."""
        times = [sum(t for *_, t in pk) for pk in packed]
        sizes = [len(g) for g in groups]
        tried: set[tuple[int, int]] = set()
        for _ in range(self.refine_rounds):
            slow = max(range(len(times)), key=times.__getitem__)
            span = times[slow]
            cand = sorted((i for idx, _, _ in packed[slow] for i in idx), key=lambda i: int(L[i]))
            moved = False
            for i in cand[:4]:
                if (slow, i) in tried:
                    continue
                tried.add((slow, i))
                best = None
                for g in range(len(groups)):
                    if g == slow or not np.isfinite(E[self.classes.index(sizes[g]), i]):
                        continue
                    gain_est = times[g] + E[self.classes.index(sizes[g]), i]
                    if gain_est < span and (best is None or gain_est < best[0]):
                        best = (gain_est, g)
                if best is None:
                    continue
                g = best[1]
                src = [j for idx, _, _ in packed[slow] for j in idx if j != i]
                dst = [j for idx, _, _ in packed[g] for j in idx] + [i]
                new_src = self._pack(src, sizes[slow], L, E)
                new_dst = self._pack(dst, sizes[g], L, E)
                t_src = sum(t for *_, t in new_src)
                t_dst = sum(t for *_, t in new_dst)
                if max(t_src, t_dst) < span * (1 - 1e-9):
                    packed[slow], packed[g] = new_src, new_dst
                    times[slow], times[g] = t_src, t_dst
                    moved = True
                    break
            if not moved:
                break
        return packed


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
