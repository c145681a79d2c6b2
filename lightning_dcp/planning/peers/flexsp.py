"""``flexsp``: FlexSP's flexible sequence parallelism -- per micro-batch, SP groups chosen by a MILP.

Source: Wang et al., *FlexSP: Accelerating Large Language Model Training via Flexible Sequence
Parallelism* (ASPLOS '25) and its solver (PKU-DAIR Hetu-Galvatron, ``galvatron/flexsp_solver``:
``solve_flexSP_globalbatch``, ``get_min_valid_microbatch_num``, ``chunk_globalbatch``,
``solve_flexSP_bucket_seqs``). The rules, as written there:

1. **Micro-batches.** The global batch is cut into the fewest micro-batches whose tokens each stay under
   the cluster's token capacity (devices x tokens one device holds): the sequences sorted longest first,
   cut into that many consecutive chunks with the smallest largest chunk (``sort_consec``); one more
   micro-batch whenever a chunk is over capacity or its MILP is infeasible.
2. **Per micro-batch, a MILP** (:mod:`~lightning_dcp.planning.peers.flexsp_milp`): which SP groups
   (Ulysses, power-of-two sizes from 2 -- ``get_sp_options`` skips 1 -- that the heads allow, every device in
   exactly one group) to form and which
   sequences (bucketed to at most 16 length buckets, more while the padding exceeds half the spare
   capacity) each runs, minimizing the slowest group's time under each group's memory. Each group runs
   its sequences as **one packed micro-batch**; the groups are formed anew for the next micro-batch.
   Solved with HiGHS (``scipy.optimize.milp``) within ``time_limit`` seconds per step (default 10 s,
   FlexSP's SCIP limit), shared evenly by the step's micro-batches still to solve (FlexSP solves them
   in parallel processes, 10 s each: the same wall time), and a node limit. The limit holds per solve
   round: when a micro-batch's MILP is infeasible, a micro-batch is added and the round is solved
   again. The solve seconds of each step are in :attr:`FlexSPPolicy.solve_log` (the plan stays a
   deterministic function of its input); whether each micro-batch kept the MILP's or the greedy
   solution is in ``notes.setting["solutions"]``.
3. **Activation checkpointing** is one setting for the run (``r`` recomputed layers for every group);
   the memory constraints use the capacity at that setting.

Group sizes are Ulysses (ring degree 1) whatever size: a group of 16 on 8-GPU nodes runs its all-to-all
across two nodes, as FlexSP's does.

**Tuning** (:mod:`~lightning_dcp.planning.peers.base`; a FlexSP user's one knob here): the recomputed layers
``r`` in {0, L/2, L} that hold the run's longest sequence on the largest group, each planned on the run's
global batches with the MILP's limit at ``TUNE_TIME_LIMIT_S`` per step, the fastest kept (``recompute=`` fixes
it). A finer ``r`` grid would need a MILP solve per value and batch; the plans use the full limit.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem
from lightning_dcp.planning.view import CostView
from lightning_dcp.planning.peers.flexsp_milp import Bucket, Solution, bucketize, chunk_sorted, solve
from lightning_dcp.planning.peers.base import Axis, TunedPolicy, aligned_starts

BUCKETS = 16
"""FlexSP's starting bucket count per micro-batch."""

MAX_BUCKETS = 64
"""Bucket count at which the padding rule stops adding buckets (a bound on the MILP's size)."""

TIME_LIMIT_S = 10.0
"""Default MILP time limit per step (FlexSP's SCIP limit)."""

TUNE_TIME_LIMIT_S = 2.0
"""MILP time limit per step while tuning (the tuning compares settings; the plans use the full limit)."""


class FlexSPPolicy(TunedPolicy):
    """FlexSP: per micro-batch, heterogeneous SP groups and their sequences from a MILP."""

    name = "flexsp"
    peer = "flexsp"
    setting_options = ("recompute",)
    runtime_refusal = ("its MILP stops at a time limit, so ranks (and reruns) can get different plans, and every rank "
                       "must plan the same step")

    def __init__(self, world_size: int, view: CostView, **kw: Any):
        super().__init__(world_size, view, **kw)
        self.time_limit = float(self.options.get("time_limit", TIME_LIMIT_S))
        self._t: dict[tuple[int, int, int], float] = {}
        self.solve_log: list[float] = []
        """MILP seconds of every step planned (tuning left out), in order: the solve time this policy reports."""

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return super().option_names() + ("time_limit", "node_limit")

    # -- costs ---------------------------------------------------------------------------
    def cap(self, sp: int, r: int) -> int:
        return self.view.capacities(sp, ring=1)[r]

    @property
    def sizes(self) -> list[int]:
        """FlexSP's group sizes (``get_sp_options``): powers of two from 2 up to the world that divide the heads
        (Ulysses); 1 only on a world of one."""
        heads = int(self.view.cm.num_heads)
        out = [p for p in (1 << k for k in range(1, self.world_size.bit_length()))
               if p <= min(self.world_size, self.view.max_sp) and heads % p == 0]
        return out or [1]

    def t_seq(self, length: int, sp: int, r: int) -> float:
        """One sequence's own time on ``sp`` ranks (its micro-batch's constant left out)."""
        key = (length, sp, r)
        t = self._t.get(key)
        if t is None:
            t = self._t[key] = max(self.view.time([length], sp, r, ring=1) - self.const(sp, r), 0.0)
        return t

    def const(self, sp: int, r: int) -> float:
        """The per-micro-batch constant of a Ulysses group of ``sp`` ranks."""
        key = (0, sp, r)
        t = self._t.get(key)
        if t is None:
            t = self._t[key] = max(0.0, 2 * self.view.time([1], sp, r, ring=1) - self.view.time([1, 1], sp, r, ring=1))
        return t

    # -- tuning --------------------------------------------------------------------------
    def axes(self, batches: Sequence[Sequence[int]]) -> list[Axis]:
        L = self.view.num_layers
        longest = max(max(b) for b in batches)
        recs = [int(self.options["recompute"])] if "recompute" in self.options else sorted({0, L // 2, L})
        out = [Axis(r) for r in recs if self.cap(self.sizes[-1], r) >= longest]
        if not out:
            raise PlanningError(f"flexsp: no recompute setting holds the longest sequence ({longest} tokens) on its largest "
                                f"group ({self.sizes[-1]} ranks, Ulysses): use more memory per GPU or drop the sequence")
        return out

    def setting_of(self, choice: int, knob: int) -> int:
        return int(choice)

    def tune(self, batches: Sequence[Sequence[int]]) -> Any:
        full, self.time_limit = self.time_limit, min(self.time_limit, TUNE_TIME_LIMIT_S)
        try:
            return super().tune(batches)
        finally:
            self.time_limit = full
            self.solve_log.clear()

    # -- planning ------------------------------------------------------------------------
    def plan_with(self, r: int, samples: Sequence[int], lengths: Sequence[int]) -> list[StepPlan]:
        N = self.world_size
        cluster = N * self.cap(self.sizes[-1], r) // self.sizes[-1]  # devices x one device's tokens
        mb = max(1, math.ceil(sum(lengths) / max(cluster, 1)))
        while True:
            chunks = chunk_sorted(lengths, mb)
            if mb < len(lengths) and any(sum(lengths[i] for i in c) >= cluster for c in chunks):
                mb += 1  # get_min_valid_microbatch_num: every chunk under the cluster's capacity
                continue
            sols = []
            budget = self.time_limit
            for k, c in enumerate(chunks):
                t0 = time.perf_counter()
                sol = self.solve_micro_batch([lengths[i] for i in c], r, cluster, budget / (len(chunks) - k))
                budget = max(budget - (time.perf_counter() - t0), 0.0)
                if sol is None:
                    break
                sols.append((c, sol))
            if len(sols) == len(chunks):
                break
            if mb >= len(lengths):
                raise PlanningError(f"flexsp: no micro-batching of {len(lengths)} sequences fits {N} ranks")
            mb += 1
        items: list[WorkItem] = []
        for c, sol in sols:
            starts = aligned_starts(sol.sizes, N)
            if starts is None:
                raise PlanningError(f"flexsp: groups {sol.sizes} do not fit {N} ranks")
            for start, s, g in zip(starts, sol.sizes, sol.groups):
                if not g:
                    continue
                idx = [c[j] for j in g]
                items.append(WorkItem(tuple(range(start, start + s)), tuple(samples[i] for i in idx),
                                      tuple(lengths[i] for i in idx), r))  # the MILP kept every group within cap(s, r)
        self.solve_log.append(sum(s.solve_s for _, s in sols))
        return [StepPlan(tuple(items), StepNotes(setting={"recompute": r, "micro_batches": len(sols),
                                                          "solutions": [s.source for _, s in sols]}))]

    def solve_micro_batch(self, lengths: Sequence[int], r: int, cluster: int, time_limit: float) -> Solution | None:
        """The micro-batch's groups (indices into ``lengths``): bucketing, then the MILP."""
        n = len(lengths)
        count = min(BUCKETS, n)
        while True:
            buckets = bucketize(lengths, count)
            padded = sum(b.bound * len(b.members) for b in buckets)
            if padded <= (sum(lengths) + cluster) / 2 or count >= min(n, MAX_BUCKETS):
                break
            count += 1
        if len(buckets) >= n:
            buckets = [Bucket(int(lengths[i]), (i,)) for i in range(n)]
        sizes = list(self.sizes)
        return solve(self.world_size, buckets, sizes, lambda s: self.cap(s, r), lambda b, s: self.t_seq(b, s, r),
                     lambda s: self.const(s, r), time_limit=time_limit,
                     node_limit=int(self.options.get("node_limit", 2000)))
