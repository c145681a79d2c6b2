"""``hydraulis``: Hydraulis' dynamic heterogeneous ``<TP, PP>`` strategies and two-stage data assignment.

Source: Li et al., *Demystifying Workload Imbalances in Large Transformer Model Training over
Variable-length Sequences* (Hydraulis), ``/work/shared/papers/hydraulis-paper.txt`` §5-§7 and App. B-D;
its code is PKU-DAIR/Hetu ``examples/hydraulis`` (``/work/shared/NOTES.md``). The rules, as written:

1. **Strategies** (§5.1): a step runs ``D`` pipelines (data-parallel replicas), each with its own
   scheme ``<TP, PP>``; pipelines and schemes may change every step.
2. **Strategy proposal** (§7): once, from the dataset, a dynamic program over GPUs and length classes
   proposes the candidate strategies (:func:`~lightning_dcp.planning.peers.hydraulis_proposal.propose`).
3. **Per step** (§6): every candidate that can hold the step's longest sequence is evaluated by the
   two-stage assignment; the one with the lowest estimated latency runs.
4. **Stage 1, dispatch** (§6.2, App. D, Alg. 1): sequences go to pipelines by a randomized greedy --
   100 trials, each a random order of the sequences, each sequence to the pipeline (among those whose
   ``MaxLen`` holds it) that minimizes the largest ``C_j + E_j`` over pipelines, ``C_j`` the sum of
   ``T(l, P_j)`` it holds and ``E_j = T(l_max, P_j) (PP_j - 1)`` its bubble bound; the best trial wins.
   Ties (every pipeline but the slowest ties once one dominates; Alg. 1 would then take the first)
   go to the pipeline whose own ``C_j + E_j`` grows least.
5. **Stage 2, packing** (§6.1, eq. 1, App. C): inside a pipeline, ``V`` micro-batches minimizing
   ``max_j t_j * (PP - 1 + V)`` under ``MaxLen``, ``V`` enumerated between ``sum l / MaxLen`` and
   ``min(sum l / UtilLen, U)`` (``UtilLen``: the length at which the scheme reaches 85% of its best
   tokens/s). Hydraulis solves each ``V``'s packing as an ILP (0.5 s limit); here it is packed longest
   first into the least-loaded micro-batch with room (LPT, within 4/3 of the optimum of each ``V``).
6. **Costs** (App. B): ``T(l, P)`` and ``MaxLen(P)`` from the cost model through
   :mod:`~lightning_dcp.planning.parallel_costs` (TP all-reduces, pipeline point-to-point sends, the
   1F1B bubble, Hydraulis' state sharding).

Hydraulis runs without activation checkpointing; where a sequence fits no proposed scheme without it,
its micro-batch recomputes the fewest layers that fit (Megatron's ``--recompute-num-layers``), so the
data can run at all. Pipelines are aligned blocks of ``TP x PP`` ranks, TP inside the block's
consecutive ranks. The plan lists each pipeline's micro-batches as items on its ranks and declares the
pipelines in ``StepPlan.notes.pipelines`` (the simulator prices them as TP/PP micro-batches and adds
each pipeline's bubble). This policy is for planning and simulation only: the runtime executes SP
groups, not TP/PP pipelines.

Tuning (:mod:`~lightning_dcp.planning.peers.base`): the proposal *is* Hydraulis' tuning (it picks the
``<TP, PP>`` sets from the data): from the dataset's lengths (the run's, without one) for a step of the run's
mean global batch in tokens (``tune_tokens`` when planning starts before the run's batches are known).
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Sequence

import numpy as np

from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.parallel_costs import Pipeline, Scheme
from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem, interleave_items
from lightning_dcp.planning.view import CostView
from lightning_dcp.planning.peers.hydraulis_proposal import SchemeTable, Strategy, propose
from lightning_dcp.planning.peers.base import TUNE_TOKENS_PER_GPU, Axis, TunedPolicy, aligned_starts

TRIALS = 100
"""Alg. 1's random trials per dispatch (Hydraulis' T)."""

UTIL = 0.85
"""App. C: ``UtilLen`` is where a scheme's efficiency reaches this fraction of its best."""


class HydraulisPolicy(TunedPolicy):
    """Hydraulis: per-step heterogeneous ``<TP, PP>`` pipelines, randomized greedy dispatch, balanced packing."""

    name = "hydraulis"
    peer = "hydraulis"
    runtime_refusal = "it plans tensor/pipeline-parallel pipelines, which DCPStrategy does not run"

    def __init__(self, world_size: int, view: CostView, **kw: Any):
        super().__init__(world_size, view, **kw)
        sizes, p = [], 1
        while p <= view.max_sp:
            sizes.append(p)
            p *= 2
        self.table = SchemeTable(view.cm, sizes, view.work)
        if not self.table.schemes:
            raise PlanningError("hydraulis: no <TP, PP> scheme holds even one token here")
        self.trials = int(self.options.get("trials", TRIALS))
        self.util_len = {s: self._util_len(s) for s in self.table.schemes}
        self.strategies: list[Strategy] = []

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return super().option_names() + ("trials",)

    def tune(self, batches: Sequence[Sequence[int]]) -> str:
        """§7's proposal from the dataset for a step of the batches' mean tokens (the one setting: the candidates)."""
        lengths = self.dataset_lengths or [n for b in batches for n in b]
        tokens = int(round(sum(sum(b) for b in batches) / max(len(batches), 1)))
        self.strategies = propose(self.table, lengths, self.world_size, tokens)
        return "proposal"

    def fallback_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        if not self.dataset_lengths:
            return [list(lengths)]
        tokens = int(self.options.get("tune_tokens") or max(self.world_size * TUNE_TOKENS_PER_GPU,
                                                             4 * max(self.dataset_lengths)))
        return [[tokens]]  # only the step's token count matters to the proposal

    def axes(self, batches: Sequence[Sequence[int]]) -> list[Axis]:
        return [Axis("proposal")]

    def setting_of(self, choice: str, knob: int) -> str:
        return choice

    def _util_len(self, s: Scheme) -> int:
        """``UtilLen(P)``: the shortest micro-batch whose time per token is within ``UTIL`` of the best."""
        grid = np.unique(np.geomspace(64, max(self.table.budget(s), 64), 24).astype(np.int64))
        per_tok = np.array([self.table.stage_time(s, g, self.view.work(int(g)), 1, 0) / g for g in grid.tolist()])
        ok = grid[per_tok <= per_tok.min() / UTIL]
        return int(ok[0]) if len(ok) else int(grid[-1])

    # -- per step ------------------------------------------------------------------------
    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        if self.setting is None:
            self.prepare(self.fallback_batches(lengths))
        return self.plan_with(self.setting, samples, lengths, step)

    def plan_with(self, setting: str, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        longest = max(lengths)
        cands = [st for st in self.strategies if max(self.table.max_len(s) for s, _ in st) >= longest
                 and aligned_starts([s.size for s, d in st for _ in range(d)], self.world_size) is not None]
        if not cands:
            cands = [self._fallback(longest)]
        rng = self.rng(step)
        best = None
        for st in cands:
            pipes = [s for s, d in st for _ in range(d)]
            groups = self.dispatch(pipes, lengths, rng)
            packs = [self.pack(s, [lengths[i] for i in g]) for s, g in zip(pipes, groups)]
            est = max((p[1] for p in packs), default=0.0)
            if best is None or est < best[0]:
                best = (est, st, pipes, groups, packs)
        _, st, pipes, groups, packs = best
        starts = aligned_starts([s.size for s in pipes], self.world_size)
        placed = [Pipeline(a, s) for a, s in zip(starts, pipes)]
        per_pipe = []
        for pipe, g, (mbs, _) in zip(placed, groups, packs):
            items = []
            for mb in mbs:
                idx = [g[j] for j in mb]
                tokens = sum(lengths[i] for i in idx)
                r = int(self.table.recompute(pipe.scheme, np.array([tokens]))[0])
                items.append(WorkItem(pipe.ranks, tuple(samples[i] for i in idx), tuple(lengths[i] for i in idx), r))
            per_pipe.append(items)
        used = [p for p, items in zip(placed, per_pipe) if items]
        return [StepPlan(tuple(interleave_items(per_pipe)), StepNotes(
            estimated_time=best[0], pipelines=tuple(used),
            setting={"strategy": " + ".join(f"{d}x{s}" for s, d in st)}))]

    def _fallback(self, longest: int) -> Strategy:
        """A homogeneous strategy of the cheapest scheme that holds ``longest`` (no proposal, or none holds it)."""
        ok = [s for s in self.table.schemes if self.table.max_len(s) >= longest]
        if not ok:
            raise PlanningError(f"hydraulis: no <TP, PP> scheme holds a sequence of {longest} tokens")
        s = min(ok, key=lambda x: (float(self.table.seq_time(x, np.array([longest]))[0]) * x.size, x.size))
        return ((s, self.world_size // s.size),)

    def dispatch(self, pipes: Sequence[Scheme], lengths: Sequence[int], rng: np.random.Generator) -> list[list[int]]:
        """Alg. 1, all trials at once: sequence indices per pipeline, from the best of ``trials`` random orders."""
        B, D = len(lengths), len(pipes)
        L = np.asarray(lengths, dtype=np.int64)
        kinds = sorted(set(pipes), key=lambda s: (s.tp, s.pp))
        cols = {s: np.array([j for j, p in enumerate(pipes) if p == s]) for s in kinds}
        Tm = np.empty((B, D))
        for s in kinds:
            Tm[:, cols[s]] = self.table.seq_time(s, L)[:, None]
        uniq = np.unique(L)
        t_of = {s: dict(zip(uniq.tolist(), self.table.seq_time(s, uniq).tolist())) for s in kinds}
        T = max(1, min(self.trials, int(2e6 // max(B * D, 1)) or 1))
        perms = np.stack([rng.permutation(B) for _ in range(T)])
        C = np.zeros((T, D))
        E = np.zeros((T, D))
        Lmax = np.zeros((T, D), dtype=np.int64)
        assign = np.empty((T, B), dtype=np.int64)
        rows = np.arange(T)
        for k in range(B):
            seq = perms[:, k]
            newC = C + Tm[seq]
            newL = np.maximum(Lmax, L[seq][:, None])
            newE = np.zeros((T, D))
            for s in kinds:
                if s.pp > 1:
                    c = cols[s]
                    lut = t_of[s]
                    newE[:, c] = np.vectorize(lut.__getitem__, otypes=[float])(newL[:, c]) * (s.pp - 1)
            cur = C + E
            top2 = np.partition(cur, -2, axis=1)[:, -2:] if D > 1 else np.concatenate([np.full((T, 1), -np.inf), cur], 1)
            first, second = top2.max(1), top2.min(1)
            others = np.where(cur >= first[:, None], second[:, None], first[:, None])
            own = newC + newE
            omax = np.maximum(own, others)
            tied = omax <= omax.min(1, keepdims=True)  # ties go to the pipeline whose own load grows least
            j = np.argmin(np.where(tied, own, np.inf), axis=1)
            assign[:, k] = j
            C[rows, j] = newC[rows, j]
            E[rows, j] = newE[rows, j]
            Lmax[rows, j] = newL[rows, j]
        best = int(np.argmin((C + E).max(1)))
        groups: list[list[int]] = [[] for _ in range(D)]
        for k in range(B):
            groups[int(assign[best, k])].append(int(perms[best, k]))
        return groups

    def pack(self, s: Scheme, lengths: Sequence[int]) -> tuple[list[list[int]], float]:
        """Eq. (1) inside one pipeline: ``(micro-batches as indices, estimated pipeline time)``."""
        if not lengths:
            return [], 0.0
        budget = self.table.budget(s)
        L = np.asarray(lengths, dtype=np.int64)
        t = self.table.seq_time(s, L)
        lone = [i for i in range(len(L)) if L[i] > budget]
        rest = [i for i in range(len(L)) if L[i] <= budget]
        tokens = int(L[rest].sum()) if rest else 0
        v_lo = max(1, math.ceil(tokens / budget)) if rest else 0
        v_hi = max(v_lo, min(math.floor(tokens / max(self.util_len[s], 1)), len(rest))) if rest else 0
        vs = sorted(set(np.unique(np.geomspace(max(v_lo, 1), max(v_hi, 1), 12).astype(np.int64)).tolist()) | {v_lo}) if rest else [0]
        best = None
        for V in vs:
            mbs = [[i] for i in lone] + (self._lpt(rest, L, t, V, budget) if V else [])
            times = [self._mb_time(s, [int(L[i]) for i in mb]) for mb in mbs]
            obj = max(times) * (s.pp - 1 + len(mbs))
            if best is None or obj < best[0]:
                best = (obj, mbs, sum(times) + (s.pp - 1) * max(times))
        return best[1], best[2]

    @staticmethod
    def _lpt(idx: list[int], L: np.ndarray, t: np.ndarray, V: int, budget: int) -> list[list[int]]:
        """Longest first, each to the least-loaded micro-batch with room (ties: the first), a new one when none
        has room. The micro-batches wait in a heap by ``(load, index)``: the first with room is that one."""
        order = sorted(idx, key=lambda i: (-t[i], i))
        loads = [0.0] * V
        room = [budget] * V
        bins: list[list[int]] = [[] for _ in range(V)]
        heap = [(0.0, b) for b in range(V)]  # sorted, so a heap; one entry per micro-batch, always current
        for i in order:
            need = int(L[i])
            skipped = []
            while heap and room[heap[0][1]] < need:
                skipped.append(heapq.heappop(heap))
            if heap:
                b = heapq.heappop(heap)[1]
            else:
                b = len(bins)
                bins.append([])
                loads.append(0.0)
                room.append(budget)
            for entry in skipped:
                heapq.heappush(heap, entry)
            bins[b].append(i)
            loads[b] += t[i]
            room[b] -= need
            heapq.heappush(heap, (loads[b], b))
        return [b for b in bins if b]

    def _mb_time(self, s: Scheme, lengths: list[int]) -> float:
        tokens = sum(lengths)
        r = int(self.table.recompute(s, np.array([tokens]))[0])
        return self.table.stage_time(s, tokens, sum(self.view.work(n) for n in lengths), len(lengths), max(r, 0))
