"""``megatron-hcp``: Megatron-Core's hybrid (dynamic) context parallel scheduler.

Source: the ``megatron-core`` 0.19.2 package (NVIDIA/Megatron-LM): ``megatron/core/pipeline_parallel/
hybrid_cp_schedule.py`` (``BalancedCPScheduler``: ``gpus_needed``, ``get_total_workload``,
``make_buckets_equal``, ``next_hdp_group``, ``get_groups_and_subsamples``;
``hybrid_context_parallel_forward_backward``), ``megatron/core/datasets/data_schedule.py``
(``HybridCPDataLoaderWrapper``: the whole global batch scheduled at once), ``megatron/core/parallel_state.py``
(``create_hybrid_dp_cp_groups``), ``megatron/core/extensions/transformer_engine.py`` (``cp_comm_type``). The
rules, as written there:

1. **CP size per sub-sample** (``gpus_needed``): ``max(1, 2 ** ceil(log2(L / max_seqlen_per_dp_cp_rank)))``,
   over the DP x CP ranks (the world here). A sample needing more than the world is never placed
   (``fill_empty_gpus`` then asserts): a :class:`~lightning_dcp.planning.errors.PlanningError`.
2. **Attention across a sub-sample's ranks** is Transformer Engine's context parallel with one run-wide
   ``cp_comm_type``: ``p2p`` (ring attention, any size: ``WorkItem.ring`` = the CP size) or ``a2a`` (Ulysses:
   TE needs the heads divisible by every CP size a step uses). ``a2a+p2p`` needs a list of two groups and the
   scheduler passes TE one dynamic group per sub-sample, so it is not offered.
3. **Workload** of a sub-sample: ``L**2 / cp`` (``get_total_workload``).
4. **Groups** (barrier-separated rounds over all ranks, ``next_hdp_group``), formed greedily from the samples
   sorted longest first: the samples are cut into as many *buckets* of about equal work as there are distinct
   CP sizes (a bucket closes at 110% of the target or when the remaining samples are needed for the
   remaining buckets); the first bucket whose head can be placed gives the next sample: on a new set of free
   ranks when enough are free (free ranks carry no work, so this always wins), else on the least-loaded
   existing set of its CP size. Once a sample with a smaller CP size than the round's first has been
   placed, the round closes as soon as every rank's work is within 5% of the busiest (``delta=0.05``; a
   rank with no work means it is not). No placeable sample closes it too. ``trim_overload`` then pops the
   last sample of the busiest set while that lowers the spread, and ``fill_empty_gpus`` doubles the CP size
   of the first smallest set while ranks are left free. Leftover samples go to the next round. Every round
   but the last ends with a barrier of all ranks (``StepPlan.notes.barriers``, honoured by
   :mod:`~lightning_dcp.planning.step_time`; DCPStrategy runs no world barrier inside a step, so this policy
   plans and simulates but does not train).
5. **One sub-sample per micro-batch**: every sample is its own forward/backward on its set's ranks.
6. **Recomputation** is one run-wide setting (``--recompute-num-layers``): every item recomputes the same
   number of layers; an item that does not fit at it is an out-of-memory error.

Megatron takes the lowest free ranks for a new set; here a set goes on an aligned block at the end of its
round (largest first: the plan contract's groups are aligned blocks); the rounds' sets, and so their times,
are the same.

**Tuning** (:mod:`~lightning_dcp.planning.peers.base`): ``cp_comm_type`` in {p2p, a2a} and
``max_seqlen_per_dp_cp_rank`` on the base's grid from the longest sequence over the world to what one rank
holds with every layer recomputed (or the longest sequence, if less). The schedule does not depend on the
recomputation and every item's time grows with it, so for each ``max_seqlen_per_dp_cp_rank`` the fewest
layers that fit every sequence of the run (and dataset) at its CP size is the best recompute setting: every
other value is slower or fails. ``cp_comm_type=``, ``max_seqlen_per_dp_cp_rank=`` and ``recompute=`` fix them.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any, NamedTuple, Sequence

from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.search.layouts import world_blocks
from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem
from lightning_dcp.planning.peers.base import Axis, TunedPolicy, aligned_starts
from lightning_dcp.planning.view import CostView

DELTA = 0.05
"""``next_hdp_group``'s balance slack."""


def gpus_needed(length: int, per_rank: int) -> int:
    """Megatron's CP size of a sub-sample: the next power of two of ``length / per_rank`` (at least 1)."""
    return max(1, 2 ** math.ceil(math.log2(length / per_rank))) if length > per_rank else 1


def total_workload(length: int, cp: int) -> float:
    """Megatron's sub-sample workload: ``L**2 / cp``."""
    return length * length / cp


COMM_TYPES = ("p2p", "a2a")
"""``cp_comm_type`` values a hybrid-CP run can use (rule 2)."""


def make_buckets_equal(seqs: list[tuple[int, int]], per_rank: int, need: dict[int, int] | None = None) -> list[deque]:
    """``make_buckets_equal``: as many buckets of about equal work as there are distinct CP sizes (``need``: each
    length's CP size, when the caller has them)."""
    if need is None:
        need = {n: gpus_needed(n, per_rank) for _, n in seqs}
    k = len({need[n] for _, n in seqs})
    work = [n * n / need[n] for _, n in seqs]
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
        self._used = 0  # ranks of the sets :meth:`add` opened
        self._top = 0.0  # the largest load so far (loads only grow while sets are filled)
        self._all: list[tuple[float, int]] = []  # heap of (load, set id): the smallest

    @property
    def used(self) -> int:
        return sum(self.sizes)

    def can_open(self, size: int) -> bool:
        if self.world_size & (self.world_size - 1) == 0:
            return self._used + size <= self.world_size
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
            self._used += size
        self.samples[gid].append(sample)
        self.loads[gid] += work
        heapq.heappush(self.by_size.setdefault(size, []), (self.loads[gid], gid))
        heapq.heappush(self._all, (self.loads[gid], gid))
        self._top = max(self._top, self.loads[gid])

    def filling_spread(self) -> tuple[float, float]:
        """:meth:`spread` while :meth:`add` fills the round (loads only grow): the same values, without a scan."""
        if self._used < self.world_size:
            return self._top, 0.0
        while self._all[0][0] != self.loads[self._all[0][1]]:
            heapq.heappop(self._all)  # stale entry
        return self._top, self._all[0][0]

    def spread(self) -> tuple[float, float]:
        """``(max, min)`` work over all ranks (a free rank has none)."""
        top = max(self.loads, default=0.0)
        low = 0.0 if self.used < self.world_size else min(self.loads, default=0.0)
        return top, low


class MegatronSetting(NamedTuple):
    max_seqlen_per_dp_cp_rank: int
    cp_comm_type: str
    recompute: int
    """Layers every item recomputes; -1: none fits every sequence of the run, -2: a2a on a CP size that does not
    divide the heads (the setting fails)."""


class MegatronHCPPolicy(TunedPolicy):
    """Megatron-Core hybrid context parallel: power-of-two CP per sample, L^2/cp balancing in barrier rounds."""

    name = "megatron-hcp"
    peer = "megatron-hcp"
    setting_options = ("max_seqlen_per_dp_cp_rank", "cp_comm_type", "recompute")
    runtime_refusal = ("its rounds end in barriers of every rank, and DCPStrategy runs no world collective inside a "
                       "step (a barrier there would be one per round); it plans and simulates Megatron-Core's scheduler")

    def __init__(self, world_size: int, view: CostView, **kw: Any):
        super().__init__(world_size, view, **kw)
        self.max_cp = min(view.max_sp, world_blocks(world_size)[0][1])
        """The largest CP set: the world's largest aligned block (the world, for a power of two), within the planner's
        cap (``max_sp_size``, a shard group)."""
        self._longest: list[int] = list(self.dataset_lengths or [])
        self._recompute: dict[tuple[int, str], int] = {}
        self._rings = bool(view.cm.prices_ring)
        self._holds: dict[tuple[int, int, str], int | None] = {}
        self._items: dict[tuple, WorkItem] = {}

    @property
    def group_sizes(self) -> dict[int, int]:
        """SP sizes of its own (for :meth:`Planner.rank_tuples`): every power of two up to ``max_cp`` on the aligned
        blocks, ring degree as its ``cp_comm_type`` (p2p: a pure ring; a2a: Ulysses)."""
        a2a = self.setting is not None and self.setting.cp_comm_type == "a2a"
        return {1 << k: (1 if a2a else 1 << k) for k in range(self.max_cp.bit_length()) if 1 << k <= self.max_cp}

    def ring(self, size: int, comm: str) -> int:
        """Ring degree of a CP set of ``size`` ranks under ``comm`` (rule 2)."""
        return size if comm == "p2p" else 1

    def a2a_ok(self, size: int) -> bool:
        """Whether Transformer Engine's all-to-all CP runs on ``size`` ranks: the heads divide evenly (rule 2)."""
        return int(self.view.cm.num_heads) % size == 0

    def holds(self, n: int, size: int, comm: str) -> int | None:
        """Fewest recomputed layers for a sub-sample of ``n`` tokens on a CP set of ``size`` ranks; None if none fits
        (a ring on a cost model that does not price rings: its per-rank share on one rank)."""
        key = (n, size, comm)
        if key in self._holds:
            return self._holds[key]
        ring = self.ring(size, comm)
        if ring > 1 and not self._rings:
            got = self.view.min_recompute(math.ceil(n / size), 1)
        else:
            got = self.view.min_recompute(n, size, ring=ring)
        self._holds[key] = got
        return got

    def axes(self, batches: Sequence[Sequence[int]]) -> list[Axis]:
        self._longest = sorted(set(self.dataset_lengths or []) | {int(n) for b in batches for n in b})
        self._recompute.clear()
        longest = self._longest[-1]
        comms = [str(self.options["cp_comm_type"])] if "cp_comm_type" in self.options else list(COMM_TYPES)
        bad = [c for c in comms if c not in COMM_TYPES]
        if bad:
            raise PlanningError(f"megatron-hcp: cp_comm_type {bad[0]!r} is not one a hybrid-CP run can use: use one of "
                                f"{list(COMM_TYPES)} (a2a+p2p needs two groups; the scheduler gives TE one)")
        fixed = self.options.get("max_seqlen_per_dp_cp_rank")
        lo = max(1, math.ceil(longest / self.max_cp))
        hi = max(lo, min(longest, self.view.capacities(1, ring=1)[-1]))
        return [Axis(c, int(fixed), int(fixed)) if fixed else Axis(c, lo, hi) for c in comms]

    def setting_of(self, comm: str, per_rank: int) -> MegatronSetting:
        if "recompute" in self.options:
            return MegatronSetting(int(per_rank), comm, int(self.options["recompute"]))
        key = (int(per_rank), comm)
        r = self._recompute.get(key)
        if r is None:
            r = 0
            for n in self._longest:  # the fewest layers that fit every sequence of the run at its CP size
                size = gpus_needed(n, per_rank)
                if comm == "a2a" and not self.a2a_ok(min(size, self.max_cp)):
                    r = -2
                    break
                need = self.holds(n, min(size, self.max_cp), comm) if size <= self.max_cp else None
                if need is None:
                    r = -1
                    break
                r = max(r, need)
            self._recompute[key] = r
        return MegatronSetting(int(per_rank), comm, r)

    # -- the scheduler -------------------------------------------------------------------
    def rounds(self, lengths: Sequence[int], per_rank: int) -> list[Round]:
        """``get_groups_and_subsamples``: rounds until every sample is placed (samples by index)."""
        seqs = sorted(((i, int(n)) for i, n in enumerate(lengths)), key=lambda x: (-x[1], x[0]))
        need = {n: gpus_needed(n, per_rank) for _, n in seqs}
        out = []
        while seqs:
            rnd, seqs = self.next_round(seqs, per_rank, need)
            out.append(rnd)
        return out

    def next_round(self, seqs: list[tuple[int, int]], per_rank: int,
                   need: dict[int, int]) -> tuple[Round, list[tuple[int, int]]]:
        """``next_hdp_group``: one balanced round and the leftover samples (``need``: each length's CP size)."""
        W = self.world_size
        rnd = Round(W)
        buckets = make_buckets_equal(seqs, per_rank, need)
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
                top, low = rnd.filling_spread()
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

    def plan_with(self, setting: MegatronSetting, samples: Sequence[int], lengths: Sequence[int]) -> list[StepPlan]:
        per_rank, comm, rec = setting
        longest = max(lengths)
        if gpus_needed(longest, per_rank) > self.max_cp:
            raise PlanningError(f"megatron-hcp: a sequence of {longest} tokens needs CP {gpus_needed(longest, per_rank)} at "
                                f"max_seqlen_per_dp_cp_rank = {per_rank}, more than the {self.max_cp} DP x CP ranks (the "
                                "scheduler never places it; fill_empty_gpus asserts): raise max_seqlen_per_dp_cp_rank")
        heads = int(self.view.cm.num_heads)
        if rec == -2:
            raise PlanningError(f"megatron-hcp: at max_seqlen_per_dp_cp_rank = {per_rank} a sequence of the run needs a CP "
                                f"size that does not divide the {heads} heads, which cp_comm_type a2a needs (Transformer "
                                "Engine's all-to-all): use p2p")
        if rec < 0:
            raise PlanningError(f"megatron-hcp: at max_seqlen_per_dp_cp_rank = {per_rank} ({comm}) a sequence of the run "
                                "fits no recompute setting at its CP size: out of memory; lower max_seqlen_per_dp_cp_rank")
        items: list[WorkItem] = []
        barriers: list[int] = []
        for rnd in self.rounds(lengths, per_rank):
            starts = aligned_starts(rnd.sizes, self.world_size)
            if starts is None:
                raise PlanningError(f"megatron-hcp: sets {rnd.sizes} do not fit {self.world_size} ranks")
            for start, size, group in zip(starts, rnd.sizes, rnd.samples):
                if comm == "a2a" and not self.a2a_ok(size):
                    raise PlanningError(f"megatron-hcp: a CP set of {size} ranks with cp_comm_type a2a needs the "
                                        f"{heads} heads divisible by {size} (Transformer Engine's all-to-all): use p2p")
                ranks = tuple(range(start, start + size))
                for i, n in group:
                    need = self.holds(n, size, comm)
                    if need is None or need > rec:
                        raise PlanningError(f"megatron-hcp: a sequence of {n} tokens on CP {size} ({comm}) does not fit "
                                            f"with {rec} layers recomputed: out of memory; recompute more layers")
                    key = (start, size, samples[i], n, rec, comm)  # the same item recurs across settings: built once
                    item = self._items.get(key)
                    if item is None:
                        if len(self._items) > 200_000:
                            self._items.clear()
                        item = self._items[key] = WorkItem(ranks, (samples[i],), (n,), rec, ring=self.ring(size, comm))
                    items.append(item)
            barriers.append(len(items))
        return [StepPlan(tuple(items), StepNotes(barriers=tuple(barriers[:-1]), setting={
            "max_seqlen_per_dp_cp_rank": per_rank, "cp_comm_type": comm, "recompute": rec}))]
