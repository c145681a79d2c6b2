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

from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem, interleave_items
from lightning_dcp.planning.policies.base import Policy, log_buckets
from lightning_dcp.planning.search.blocks import Block, BlockPlan, Blocks, GroupPlan, Preference
from lightning_dcp.planning.search.layouts import Layout, allocate, place
from lightning_dcp.planning.search.problem import Placed
from lightning_dcp.planning.view import CostView


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

    def _dispatch(self, units: list[tuple[list[int], int]], lengths: Sequence[int]) -> BlockPlan:
        """The block engine's plan of these micro-batches on the world (an item's ``members`` is one unit index)."""
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
            if self.view.fast_paths:
                cost[k, ok] = self.view.time_many(tokens[ok], sq[ok], cnt[ok], q, r[ok])
            else:
                for j in np.nonzero(ok)[0].tolist():
                    cost[k, j] = self.view.time([lengths[i] for i in units[j][0]], q, int(r[j]))
        engine = MicroBatchBlocks(self.view, self.world_size, cost, recs, pref, self.g_max)
        return engine.solve(np.arange(n), self.world_size, 0, len(classes) - 1)

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        buckets = []
        for _, idx in sorted(log_buckets(lengths, self.per_octave).items()):
            lens = [lengths[i] for i in idx]
            b, p = self.algorithm_one(max(lens), float(np.mean(lens)))
            buckets.append((sorted(idx, key=lambda i: (-lengths[i], i)), b, p))
        scale = 1
        units = self._units(buckets, lengths, scale)
        best = (self._dispatch(units, lengths), units, scale)
        g = max((len(m) for m in best[0].groups), default=0)
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
            if got.span < best[0].span * (1 - 1e-3):
                best, misses = (got, units, scale), 0
            else:
                misses += 1
        (blocks, span, layout), units, scale = best
        ring = self.view.ring_of
        per_group = [[WorkItem(it.ranks, tuple(samples[i] for i in units[it.members[0]][0]),
                               tuple(lengths[i] for i in units[it.members[0]][0]), it.recompute, ring(len(it.ranks)))
                      for it in blk] for blk in blocks]
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


class MicroBatchBlocks(Blocks):
    """Algorithm 1's rules for the block engine: units are micro-batches cut per bucket beforehand.

    A unit's preferred size is its bucket's; one longer than the block's mean rank load moves to the smallest size on
    which it takes at most that long. Candidates: the rounded split of the ranks over the preferred sizes and its
    neighbours, and the same with the largest size one step up (its group runs the others as fills); ``g_max`` keeps
    at least ``ceil(M_p / g_max)`` groups of a size with ``M_p`` micro-batches. A flat plan uses only preferred sizes.
    """

    flat_present_only = True
    fills_after_own = False

    def __init__(self, view: CostView, world_size: int, cost: np.ndarray, recs: np.ndarray, pref: np.ndarray,
                 g_max: int | None) -> None:
        super().__init__(view, world_size, cost)
        self.recs, self.pref_all, self.g_max = recs, pref, g_max

    def prefer(self, Es: np.ndarray, ids: np.ndarray, size: int, offset: int, classes: list[int], top: bool,
               barred: bool) -> Preference:
        cols = np.arange(len(ids))
        pref = np.minimum(self.pref_all[ids], len(classes) - 1)
        bad = ~np.isfinite(Es[pref, cols])
        if bad.any():  # its size is not allowed here: the smallest that holds it
            pref[bad] = np.argmax(np.isfinite(Es[:, bad]), axis=0)
        parr = np.array(classes, dtype=np.float64)
        mean_load = float((Es[pref, cols] * parr[pref]).sum()) / size
        for j in np.nonzero(Es[pref, cols] > mean_load)[0].tolist():
            ok = np.nonzero(Es[:, j] <= mean_load)[0]
            pref[j] = max(int(pref[j]), int(ok[0]) if len(ok) else int(np.argmin(Es[:, j])))
        top_k = int(pref.max())
        return Preference(pref, Es[pref, cols] * parr[pref], mean_load, top_k, top_k, -math.inf)

    def modes(self, block: Block, full: bool) -> tuple[bool, ...]:
        flat = place(sorted(block.present, reverse=True), self.view.topology, block.offset, block.size) is not None
        return (False, True) if flat else (True,)

    def candidates(self, block: Block, top: bool) -> list[Layout]:
        classes, pref, Es = block.classes, block.pref, block.Es
        present = sorted(block.present)
        wk = np.bincount(pref, weights=block.prefs.gpu_s, minlength=len(classes))
        work = {p: float(wk[classes.index(p)]) for p in present}
        must = max(present)
        min_groups = None
        if self.g_max:
            counts = np.bincount(pref, minlength=len(classes))
            min_groups = {p: max(1, math.ceil(int(counts[classes.index(p)]) / int(self.g_max))) for p in present}
        topo, offset, size = self.view.topology, block.offset, block.size
        cands: list[Layout] = []
        musts = [must] + [q for q in classes if q > must and np.isfinite(Es[classes.index(q)]).any()][:1]
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

    def own(self, block: Block, units: list[int], ranks: tuple[int, ...], k: int) -> GroupPlan:
        ids = block.ids
        ring = self.view.ring_of(len(ranks))
        items = [Placed(ranks, [int(ids[j])], int(self.recs[k, ids[j]]), ring) for j in units]
        return GroupPlan(items, float(sum(block.Es[k, j] for j in units)))
