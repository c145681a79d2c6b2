"""``megatron-hcp``: Megatron-Core's hybrid (dynamic) context parallel scheduler.

Source: NVIDIA/Megatron-LM, ``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``
(``BalancedCPScheduler``: ``gpus_needed``, ``get_total_workload``, ``make_buckets_equal``,
``next_hdp_group``, ``get_groups_and_subsamples``; ``hybrid_context_parallel_forward_backward``).
The rules, as written there:

1. **CP size per sub-sample**: ``max(1, 2 ** ceil(log2(L / max_seqlen_per_dp_cp_rank)))`` -- the next
   power of two of the sample's length over the per-rank capacity, over all DP x CP ranks (the world).
   Context parallel is ring attention (``cp_comm_type="p2p"`` by default), so the size is not bound
   by the head count; every item here is a pure ring (``WorkItem.ring`` = its SP size).
2. **Workload** of a sub-sample: ``L**2 / cp``.
3. **Groups** (barrier-separated rounds over all ranks), formed greedily from the samples sorted
   longest first: the samples are cut into as many *buckets* of about equal work as there are distinct
   CP sizes (a bucket closes at 110% of the target or when the remaining samples are needed for the
   remaining buckets); the first bucket whose head can be placed gives the next sample: on a new set
   of free ranks when enough are free (free ranks carry no work, so this always wins), else on the
   least-loaded existing set of its CP size. Once a sample with a smaller CP size than the round's
   first has been placed, the round closes as soon as every rank's work is within 5% of the busiest
   (``delta=0.05``; a rank with no work means it is not). No placeable sample closes it too.
   ``trim_overload`` then pops the last sample of the busiest set while that lowers the spread, and
   ``fill_empty_gpus`` doubles the CP size of the first smallest set while ranks are left free.
   Leftover samples go to the next round. Every round ends with a barrier of all ranks
   (``StepPlan.notes.barriers``, honoured by :mod:`~lightning_dcp.planning.step_time`; DCPStrategy does not
   run world barriers inside a step, so this policy plans and simulates but does not train).
4. **One sub-sample per micro-batch**: every sample is its own forward/backward on its set's ranks.

Megatron allocates a new set from the lowest free ranks; here a set is placed on an aligned block at
the end of its round (largest first), since the plan contract's groups are aligned power-of-two
blocks; the rounds' sets are the same. Recomputation is Megatron's global setting
(``--recompute-num-layers``): every item recomputes the same number of layers.

**Tuning** (a Megatron user's search): the recomputed layers ``r`` in {0, L/4, L/2, L}, with
``max_seqlen_per_dp_cp_rank`` = the tokens one rank holds at that ``r`` (what fits), or half of it;
the fastest on the tuning batches wins. ``recompute=`` and ``max_seqlen_per_dp_cp_rank=`` fix them.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any, Sequence

from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.layouts import world_blocks
from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem
from lightning_dcp.planning.policies.base import Policy
from lightning_dcp.planning.policies.costs import CostView
from lightning_dcp.planning.peers.base import Tuner, aligned_starts

DELTA = 0.05
"""``next_hdp_group``'s balance slack."""


def gpus_needed(length: int, per_rank: int) -> int:
    """Megatron's CP size of a sub-sample: the next power of two of ``length / per_rank`` (at least 1)."""
    return max(1, 2 ** math.ceil(math.log2(length / per_rank))) if length > per_rank else 1


def total_workload(length: int, cp: int) -> float:
    """Megatron's sub-sample workload: ``L**2 / cp``."""
    return length * length / cp


def make_buckets_equal(seqs: list[tuple[int, int]], per_rank: int) -> list[deque]:
    """``make_buckets_equal``: as many buckets of about equal work as there are distinct CP sizes."""
    k = len({gpus_needed(n, per_rank) for _, n in seqs})
    work = [total_workload(n, gpus_needed(n, per_rank)) for _, n in seqs]
    target = sum(work) / k
    buckets: list[deque] = []
    cur: list[tuple[int, int]] = []
    cur_work = 0.0
    remaining_k = k
    for i, (s, n) in enumerate(seqs):
        w = work[i]
        if cur and (cur_work + w > target * 1.1 or len(seqs) - i <= remaining_k - len(buckets)):
            buckets.append(deque(cur))
            cur, cur_work = [], 0.0
            remaining_k -= 1
        cur.append((s, n))
        cur_work += w
    if cur:
        buckets.append(deque(cur))
    return buckets


class Round:
    """One barrier-separated group of ``next_hdp_group``: sets of ranks (by creation order) and their samples."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.sizes: list[int] = []
        self.samples: list[list[tuple[int, int]]] = []
        self.loads: list[float] = []
        self.by_size: dict[int, list[tuple[float, int]]] = {}  # heaps of (load, set id)

    @property
    def used(self) -> int:
        return sum(self.sizes)

    def can_open(self, size: int) -> bool:
        if self.world_size & (self.world_size - 1) == 0:
            return self.used + size <= self.world_size
        return aligned_starts(self.sizes + [size], self.world_size) is not None

    def least_loaded(self, size: int) -> int | None:
        heap = self.by_size.get(size)
        while heap:
            load, gid = heap[0]
            if load == self.loads[gid] and self.sizes[gid] == size:
                return gid
            heapq.heappop(heap)  # stale entry
        return None

    def add(self, gid: int | None, size: int, sample: tuple[int, int], work: float) -> None:
        if gid is None:
            gid = len(self.sizes)
            self.sizes.append(size)
            self.samples.append([])
            self.loads.append(0.0)
        self.samples[gid].append(sample)
        self.loads[gid] += work
        heapq.heappush(self.by_size.setdefault(size, []), (self.loads[gid], gid))

    def spread(self) -> tuple[float, float]:
        """``(max, min)`` work over all ranks (a free rank has none)."""
        top = max(self.loads, default=0.0)
        low = 0.0 if self.used < self.world_size else min(self.loads, default=0.0)
        return top, low


class MegatronHCPPolicy(Policy):
    """Megatron-Core hybrid context parallel: power-of-two ring CP per sample, L^2/cp balancing in barrier rounds."""

    name = "megatron-hcp"
    runtime_refusal = ("its rounds end in barriers of every rank, and DCPStrategy runs no world collective inside a "
                       "step (a barrier there would be one per round); it plans and simulates Megatron-Core's scheduler")

    def __init__(self, world_size: int, view: CostView, **kw: Any):
        super().__init__(world_size, view, **kw)
        self.max_cp = min(view.max_sp, world_blocks(world_size)[0][1])
        self.setting = self._setting()
        """``(max_seqlen_per_dp_cp_rank, recompute)`` the plans use."""

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("max_seqlen_per_dp_cp_rank", "recompute", "tune_tokens")

    @property
    def group_sizes(self) -> dict[int, int]:
        """SP sizes of its own (for :meth:`Planner.rank_tuples`): every power of two up to ``max_cp``, on the
        aligned blocks (pure rings: no Ulysses subgroup to align)."""
        return {1 << k: 1 for k in range(self.max_cp.bit_length()) if 1 << k <= self.max_cp}

    def candidates(self, longest: int) -> list[tuple[int, int]]:
        L = self.view.num_layers
        recs = [int(self.options["recompute"])] if "recompute" in self.options else sorted({0, L // 4, L // 2, L})
        caps = self.view.capacities(1)
        out = []
        for r in recs:
            if caps[r] <= 0:
                continue
            per = ([int(self.options["max_seqlen_per_dp_cp_rank"])] if self.options.get("max_seqlen_per_dp_cp_rank")
                   else sorted({caps[r], max(caps[r] // 2, 1)}, reverse=True))
            for p in per:
                if gpus_needed(longest, p) <= self.max_cp and (r, p) not in [(c[1], c[0]) for c in out]:
                    out.append((p, r))
        return out

    def _setting(self) -> tuple[int, int] | None:
        if not self.dataset_lengths:
            return None
        cands = self.candidates(max(self.dataset_lengths))
        if not cands:
            raise PlanningError(f"megatron-hcp: no recompute setting holds the longest sequence "
                             f"({max(self.dataset_lengths)} tokens) on {self.max_cp} ranks")
        if len(cands) == 1:
            return cands[0]
        tuner = Tuner.for_policy(self)
        return tuner.best(cands, lambda c: (lambda s, ls: self.plan_with(c, s, ls)))

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        setting = self.setting
        if setting is None or gpus_needed(max(lengths), setting[0]) > self.max_cp:
            cands = self.candidates(max(lengths))
            if not cands:
                raise PlanningError(f"megatron-hcp: no setting holds a sequence of {max(lengths)} tokens")
            setting = cands[0]
        return self.plan_with(setting, samples, lengths)

    # -- the scheduler -------------------------------------------------------------------
    def rounds(self, lengths: Sequence[int], per_rank: int) -> list[Round]:
        """``get_groups_and_subsamples``: rounds until every sample is placed (samples by index)."""
        seqs = sorted(((i, int(n)) for i, n in enumerate(lengths)), key=lambda x: (-x[1], x[0]))
        out = []
        while seqs:
            rnd, seqs = self.next_round(seqs, per_rank)
            out.append(rnd)
        return out

    def next_round(self, seqs: list[tuple[int, int]], per_rank: int) -> tuple[Round, list[tuple[int, int]]]:
        """``next_hdp_group``: one balanced round and the leftover samples."""
        W = self.world_size
        rnd = Round(W)
        buckets = make_buckets_equal(seqs, per_rank)
        need = {n: min(gpus_needed(n, per_rank), self.max_cp) for _, n in seqs}
        first_needed, check_balance = None, False
        while buckets:
            pick = None
            for b_idx, bucket in enumerate(buckets):
                if not bucket:
                    continue
                size = need[bucket[0][1]]
                if rnd.least_loaded(size) is not None or rnd.can_open(size):
                    pick = b_idx
                    break
            if pick is None:
                break
            sample = buckets[pick].popleft()
            size = need[sample[1]]
            if first_needed is None:
                first_needed = size
            gid = None if rnd.can_open(size) else rnd.least_loaded(size)  # free ranks carry no work: a new set wins
            rnd.add(gid, size, sample, total_workload(sample[1], size))
            while buckets and not buckets[0]:
                buckets.pop(0)
            if size < first_needed:
                check_balance = True
            if check_balance and buckets:
                top, low = rnd.spread()
                if top - low <= DELTA * top:
                    break
        leftovers = [s for b in buckets for s in b]
        self._trim_overload(rnd, leftovers)
        self._fill_empty(rnd)
        return rnd, leftovers

    @staticmethod
    def _trim_overload(rnd: Round, leftovers: list[tuple[int, int]]) -> None:
        """``trim_overload``: pop the busiest set's last sample while that lowers the spread over all ranks."""
        while True:
            top, low = rnd.spread()
            if top - low <= DELTA * top or low == 0:
                return
            gid = rnd.loads.index(top)
            if len(rnd.samples[gid]) <= 1:
                return
            s = rnd.samples[gid][-1]
            w = total_workload(s[1], rnd.sizes[gid])
            loads = rnd.loads[:]
            loads[gid] -= w
            if max(loads) - min(loads) >= top - low:
                return
            rnd.samples[gid].pop()
            rnd.loads[gid] -= w
            leftovers.append(s)

    def _fill_empty(self, rnd: Round) -> None:
        """``fill_empty_gpus``: while ranks are free, the first of the smallest sets doubles its CP size."""
        while rnd.used < self.world_size and rnd.sizes:
            small = min(rnd.sizes)
            bigger = min(small * 2, self.world_size)
            if bigger > self.max_cp or bigger == small:
                return
            gid = rnd.sizes.index(small)
            trial = rnd.sizes[:]
            trial[gid] = bigger
            if aligned_starts(trial, self.world_size) is None:
                return
            rnd.sizes[gid] = bigger
            rnd.loads[gid] = sum(total_workload(n, bigger) for _, n in rnd.samples[gid])

    def plan_with(self, setting: tuple[int, int], samples: Sequence[int], lengths: Sequence[int]) -> list[StepPlan]:
        per_rank, rec = setting
        caps1 = self.view.capacities(1)
        items: list[WorkItem] = []
        barriers: list[int] = []
        for rnd in self.rounds(lengths, per_rank):
            starts = aligned_starts(rnd.sizes, self.world_size)
            if starts is None:
                raise ValueError(f"megatron-hcp: sets {rnd.sizes} do not fit {self.world_size} ranks")
            per_set = []
            for start, size, group in zip(starts, rnd.sizes, rnd.samples):
                ranks = tuple(range(start, start + size))
                out = []
                for i, n in group:
                    share = math.ceil(n / size)
                    r = rec if caps1[rec] >= share else self.view.min_recompute(share, 1)
                    if r is None:
                        raise ValueError(f"megatron-hcp: {share} tokens per rank fit no recompute setting")
                    out.append(WorkItem(ranks, (samples[i],), (n,), r, ring=size))
                per_set.append(out)
            items.extend(it for g in per_set for it in g)
            barriers.append(len(items))
        return [StepPlan(tuple(items), StepNotes(barriers=tuple(barriers[:-1]),
                                                 setting={"max_seqlen_per_dp_cp_rank": per_rank, "recompute": rec}))]
