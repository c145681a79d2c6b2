"""``verl``: verl's dynamic batching (``use_dynamic_bsz``) on a static Ulysses SP size.

Source: the ``verl`` 0.9.1 package (volcengine/verl): ``verl/utils/seqlen_balancing.py``
(``calculate_workload``, ``karmarkar_karp``, ``get_seqlen_balanced_partitions``, ``rearrange_micro_batches``),
``verl/trainer/ppo/ray_trainer.py`` (``RayPPOTrainer._balance_batch``), ``verl/workers/engine/utils.py``
(``prepare_micro_batches``), ``verl/workers/engine/fsdp/transformer_impl.py`` (the ``(dp, sp)`` device mesh),
``verl/models/transformers/monkey_patch.py`` (the head check). The rules, as written there:

1. **Static Ulysses SP** (``ulysses_sequence_parallel_size``, one for the run): the ``(dp, sp)`` device mesh
   needs ``sp`` to divide the world (``dp = world / sp`` replicas of ``sp`` consecutive ranks) and the
   attention heads (``num_attention_heads % ulysses_sp_size == 0``; key/value heads divide it or it them).
   No ring attention. (A size whose mesh blocks would cross a node boundary without spanning whole nodes,
   SP 3 on nodes of 4, is left out: the plan contract keeps a group of at most a node inside one. Power-of-two
   sizes on power-of-two nodes never do.)
2. **Workload** ``24576 * s + s**2`` per sequence of ``s`` tokens (``calculate_workload``).
3. **Data-parallel split** (``_balance_batch``, ``trainer.balance_batch``, on by default):
   ``get_seqlen_balanced_partitions(workloads, k_partitions=dp, equal_size=True)``: Karmarkar-Karp with
   every replica getting the same number of sequences -- the batch's sample count must be a multiple of
   ``dp`` (an ``assert`` there; ``DataProto.chunk`` asserts it too). Each replica's sequences are then
   ordered by workload, the even positions first and the odd ones reversed after them.
4. **Micro-batches** (``rearrange_micro_batches``, ``max_token_len = ppo_max_token_len_per_gpu * sp``):
   ``max_token_len`` must be at least the batch's longest sequence (an ``assert``); a replica needs
   ``min(n, ceil(tokens / max_token_len))`` micro-batches and every replica takes the largest count
   (``same_micro_num_in_dp``, an all-reduce MAX); its sequences are cut into that many by Karmarkar-Karp on
   the workloads (``equal_size=False``); while any replica has a micro-batch over ``max_token_len`` tokens,
   every replica takes one more (all-reduce MIN of "within limit"), and more micro-batches than a replica
   has sequences is a ``ValueError``. Micro-batches run by workload, the even positions reversed to the
   front (``use_dynamic_bsz_balance``).
5. **Activation checkpointing** is one switch (``enable_gradient_checkpointing``): every layer or none. A
   micro-batch its group cannot hold at that switch is an out-of-memory error.

Each failure is a :class:`~lightning_dcp.planning.errors.PlanningError` naming the rule; while tuning, a
setting that fails on any global batch of the run is out (a verl run would stop there).

**Tuning** (:mod:`~lightning_dcp.planning.peers.base`): every SP size rule 1 allows whose group holds the
dataset's longest sequence at the switch, checkpointing off and on, and ``ppo_max_token_len_per_gpu`` on the
base's grid from the longest sequence over ``sp`` to 1.25 x what the group holds at the switch (past it a
micro-batch may still fit; one that does not fails). ``sp=``, ``checkpointing=`` and
``max_token_len_per_gpu=`` fix them.
"""

from __future__ import annotations

import functools
import heapq
import math
from typing import NamedTuple, Sequence

from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem, interleave_items
from lightning_dcp.planning.peers.base import Axis, TunedPolicy

WORKLOAD_LINEAR = 24576
"""verl's ``calculate_workload``: ``24576 * s + s**2``."""

OVER_CAPACITY = 1.25
"""The token budget's grid reaches this many times what the group holds (a micro-batch over it fails)."""


def workload(length: int) -> int:
    """verl's workload estimate of one sequence of ``length`` tokens."""
    return WORKLOAD_LINEAR * length + length * length


class _Part:
    """One part of a partial solution; ordered as verl's ``Set``: by sum, then item count, then the items."""

    __slots__ = ("sum", "items")

    def __init__(self, items: list[tuple[int, int]], total: int | None = None):
        self.items = items
        self.sum = sum(v for _, v in items) if total is None else total

    def key(self) -> tuple:
        return (self.sum, len(self.items), self.items)


class _State:
    """A partial solution of ``k`` parts, largest first; the heap pops the largest spread (ties: largest part)."""

    __slots__ = ("parts", "spread", "top")

    def __init__(self, parts: list[_Part]):
        self.parts = sorted(parts, key=_Part.key, reverse=True)
        self.spread = self.parts[0].sum - self.parts[-1].sum
        self.top = self.parts[0].key()

    @classmethod
    def of_sorted(cls, parts: list[_Part]) -> "_State":
        """A state whose ``parts`` are already in order (the fast path of the start states)."""
        state = cls.__new__(cls)
        state.parts, state.spread, state.top = parts, parts[0].sum - parts[-1].sum, parts[0].key()
        return state

    def __lt__(self, other: "_State") -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.top > other.top


def karmarkar_karp(values: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """verl's ``karmarkar_karp`` (:func:`_karmarkar_karp`), remembered: tuning asks for the same partition at every
    ``max_token_len`` that gives a replica the same micro-batch count."""
    return [list(p) for p in _karmarkar_karp(tuple(int(v) for v in values), int(k), bool(equal_size))]


@functools.lru_cache(maxsize=8192)
def _karmarkar_karp(values: tuple[int, ...], k: int, equal_size: bool) -> tuple[tuple[int, ...], ...]:
    """verl's ``karmarkar_karp``: indices of ``values`` in ``k`` parts by the largest differencing method, the
    parts largest first (``equal_size``: ``k`` consecutive values of the sorted list start each partial
    solution, so every part gets ``len(values) / k``). Same ordering and tie rules as verl's, so the same parts."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    srt = sorted((int(v), i) for i, v in enumerate(values))
    heap: list[_State] = []
    if equal_size:
        if len(srt) % k:
            raise PlanningError(f"{len(srt)} values do not split into {k} parts of equal count")
        for off in range(0, len(srt), k):
            heapq.heappush(heap, _State([_Part([(i, v)], v) for v, i in srt[off:off + k]]))
    else:
        empty = [_Part([], 0)] * (k - 1)  # never changed: a merge makes new parts
        start = _State.of_sorted if not srt or srt[0][0] >= 0 else _State  # one value first, then the empty parts
        for v, i in srt:
            heapq.heappush(heap, start([_Part([(i, v)], v)] + empty))
    if not heap:
        return tuple(() for _ in range(k))
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        heapq.heappush(heap, _State([_Part(a.parts[j].items + b.parts[k - 1 - j].items, a.parts[j].sum + b.parts[k - 1 - j].sum)
                                     for j in range(k)]))
    return tuple(tuple(i for i, _ in p.items) for p in heap[0].parts)


def balanced_partitions(values: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """verl's ``get_seqlen_balanced_partitions``: :func:`karmarkar_karp`, each part sorted; fewer values than parts
    or an empty part fails as its ``assert`` does."""
    if len(values) < k:
        raise PlanningError(f"{len(values)} sequences for {k} parts (get_seqlen_balanced_partitions asserts at least one each)")
    parts = karmarkar_karp(values, k, equal_size)
    if any(not p for p in parts):
        raise PlanningError(f"a part of {k} came out empty (get_seqlen_balanced_partitions asserts none is)")
    return [sorted(p) for p in parts]


def dp_order(part: list[int], work: Sequence[int]) -> list[int]:
    """``_balance_batch``'s order inside a replica: by workload, even positions first, the odd ones reversed after."""
    part = sorted(part, key=lambda x: (work[x], x))
    return part[::2] + part[1::2][::-1]


def order_micro_batches(parts: list[list[int]], work: Sequence[int]) -> list[list[int]]:
    """``use_dynamic_bsz_balance``: by workload descending, every other one reversed to the front."""
    parts = sorted(parts, key=lambda p: (sum(work[i] for i in p), p[0] if p else 0), reverse=True)
    return parts[::2][::-1] + parts[1::2]


class VerlSetting(NamedTuple):
    sp: int
    checkpointing: bool
    max_token_len_per_gpu: int


class VerlPolicy(TunedPolicy):
    """verl dynamic batching: static Ulysses SP, equal-count KK over replicas, KK micro-batches under a token budget."""

    name = "verl"
    peer = "verl"
    setting_options = ("sp", "checkpointing", "max_token_len_per_gpu")

    @property
    def sp_sizes(self) -> list[int]:
        """Rule 1: the Ulysses sizes dividing the world and the heads (key/value heads divide it or it them)."""
        cm = self.view.cm
        heads = int(cm.num_heads)
        kv = int(getattr(cm, "num_kv_heads", None) or heads)
        node = self.view.topology.node_size or self.world_size
        return [p for p in range(1, min(self.world_size, self.view.max_sp, heads) + 1)
                if self.world_size % p == 0 and heads % p == 0 and (kv % p == 0 or p % kv == 0)
                and (node % p == 0 if p <= node else p % node == 0)]  # mesh blocks the plan contract allows

    def holds(self, sp: int, checkpointing: bool) -> int:
        """Tokens one micro-batch on ``sp`` ranks holds (Ulysses, no ring) with checkpointing on or off."""
        return self.view.capacities(sp, ring=1)[self.view.num_layers if checkpointing else 0]

    def axes(self, batches: Sequence[Sequence[int]]) -> list[Axis]:
        longest = max(max(b) for b in batches)
        if self.dataset_lengths:
            longest = max(longest, max(self.dataset_lengths))  # a run may draw the dataset's longest
        sps = self.sp_sizes
        if self.options.get("sp"):
            if int(self.options["sp"]) not in sps:
                raise PlanningError(f"verl: sp={self.options['sp']} is not a Ulysses size verl allows here (it must divide "
                                    f"the {self.world_size} GPUs and the {self.view.cm.num_heads} heads): use one of {sps}")
            sps = [int(self.options["sp"])]
        ckpts = [bool(self.options["checkpointing"])] if "checkpointing" in self.options else [False, True]
        fixed = self.options.get("max_token_len_per_gpu")
        out = []
        for sp in sps:
            for ck in ckpts:
                cap = self.holds(sp, ck)
                if cap < longest and not fixed:
                    continue
                lo = math.ceil(longest / sp)
                hi = max(lo, int(OVER_CAPACITY * cap) // sp)
                out.append(Axis((sp, ck), int(fixed), int(fixed)) if fixed else Axis((sp, ck), lo, hi))
        if not out:
            best = max(self.holds(p, True) for p in sps)
            raise PlanningError(f"verl: no Ulysses SP size holds the longest sequence ({longest} tokens): the sizes verl "
                                f"allows here ({sps}) hold {best} tokens at most, every layer checkpointed; verl has no "
                                "ring attention: use more memory per GPU or drop the sequence")
        return out

    def setting_of(self, choice: tuple[int, bool], knob: int) -> VerlSetting:
        return VerlSetting(choice[0], choice[1], int(knob))

    # -- one step ------------------------------------------------------------------------
    def split(self, lengths: Sequence[int], dp: int) -> list[list[int]]:
        """Rule 3: the batch's indices per replica, in the order the replica gets them."""
        n = len(lengths)
        if n % dp or n < dp:
            raise PlanningError(f"verl: the global batch's {n} sequences do not split evenly over {dp} data-parallel "
                                f"replicas (SP {self.world_size // dp} on {self.world_size} GPUs): _balance_batch's "
                                f"get_seqlen_balanced_partitions(..., equal_size=True) needs the count to be a multiple "
                                f"of {dp}; use a global batch size that is one")
        work = [workload(x) for x in lengths]
        return [dp_order(p, work) for p in balanced_partitions(work, dp, equal_size=True)]

    def micro_batches(self, replicas: list[list[int]], lengths: list[int], work: list[int],
                      max_token_len: int) -> list[list[list[int]]]:
        """Rule 4: each replica's micro-batches (indices into ``lengths``), every replica the same count."""
        longest = max(lengths[i] for r in replicas for i in r)
        if longest > max_token_len:
            raise PlanningError(f"verl: a sequence of {longest} tokens is over max_token_len = {max_token_len} "
                                "(rearrange_micro_batches asserts it holds the longest): raise ppo_max_token_len_per_gpu")
        counts = [min(len(r), math.ceil(sum(lengths[i] for i in r) / max_token_len)) for r in replicas]
        num = max(counts)
        fewest = min(len(r) for r in replicas)
        while True:
            if num > fewest:
                raise PlanningError(f"verl: no split into micro-batches of at most max_token_len = {max_token_len} tokens "
                                    f"leaves every replica its own sequences: {num} micro-batches for a replica of "
                                    f"{fewest} (rearrange_micro_batches raises ValueError); raise "
                                    "ppo_max_token_len_per_gpu")
            local = [balanced_partitions([work[i] for i in r], num, equal_size=False) for r in replicas]
            if all(sum(lengths[r[j]] for j in p) <= max_token_len for r, parts in zip(replicas, local) for p in parts):
                return [[[r[j] for j in p] for p in order_micro_batches(parts, [work[i] for i in r])]
                        for r, parts in zip(replicas, local)]
            num += 1

    def plan_with(self, setting: VerlSetting, samples: Sequence[int], lengths: Sequence[int]) -> list[StepPlan]:
        sp, ckpt, per_gpu = setting
        dp = self.world_size // sp
        lengths = [int(n) for n in lengths]
        max_token_len = per_gpu * sp
        work = [workload(x) for x in lengths]
        mbs = self.micro_batches(self.split(lengths, dp), lengths, work, max_token_len)
        rec = self.view.num_layers if ckpt else 0
        cap = self.holds(sp, ckpt)
        per_group = []
        for j, rep in enumerate(mbs):
            ranks = tuple(range(j * sp, (j + 1) * sp))
            items = []
            for mb in rep:
                tokens = sum(lengths[i] for i in mb)
                if tokens > cap:
                    raise PlanningError(f"verl: a micro-batch of {tokens} tokens does not fit SP {sp} with gradient "
                                        f"checkpointing {'on' if ckpt else 'off'} (it holds {cap}): out of memory; lower "
                                        "ppo_max_token_len_per_gpu or turn checkpointing on")
                items.append(WorkItem(ranks, tuple(samples[i] for i in mb), tuple(lengths[i] for i in mb), rec))
            per_group.append(items)
        return [StepPlan(tuple(interleave_items(per_group)), StepNotes(setting={
            "sp": sp, "checkpointing": ckpt, "max_token_len_per_gpu": per_gpu, "micro_batches": len(mbs[0])}))]

    @property
    def group_sizes(self) -> dict[int, int]:
        """Its own SP sizes (for :meth:`Planner.rank_tuples`): every Ulysses size it may use, ring degree 1."""
        return {p: 1 for p in self.sp_sizes}
