"""``verl``: verl's dynamic batching (``use_dynamic_bsz``) on a static Ulysses SP size.

Source: volcengine/verl, ``verl/utils/seqlen_balancing.py`` (``calculate_workload``,
``karmarkar_karp``, ``get_seqlen_balanced_partitions``, ``rearrange_micro_batches``) and
``RayPPOTrainer._balance_batch`` (``verl/trainer/ppo/ray_trainer.py``). The rules, as written there:

1. **Static SP.** One Ulysses SP size ``ulysses_sequence_parallel_size`` for the whole run; the
   world is ``world / sp`` data-parallel replicas (each an SP group of consecutive ranks).
2. **Workload estimate** ``24576 * s + s**2`` per sequence of ``s`` tokens (``calculate_workload``:
   ``12 h^2 s + 2 h s^2`` FLOPs up to a factor, calibrated by verl for ``h = 4096``; used verbatim).
3. **Balance across data-parallel ranks** (``_balance_batch``, on by default): the global batch is
   split over the replicas by Karmarkar-Karp on the workloads with ``equal_size=True`` (every replica
   gets the same number of sequences). A batch whose size the replica count does not divide is padded
   with zero-workload placeholders for the split (verl requires divisibility; placeholders are dropped).
4. **Micro-batches under a token budget** (``rearrange_micro_batches``): ``max_token_len =
   ppo_max_token_len_per_gpu * sp``; a replica with ``n`` sequences of ``T`` tokens needs ``min(n,
   ceil(T / max_token_len))`` micro-batches; with ``same_micro_num_in_dp`` (the default) every replica
   takes the largest count (an all-reduce MAX in verl), at most its own sequence count; the replica's
   sequences are split into that many micro-batches by Karmarkar-Karp on the workloads
   (``equal_size=False``), which balances estimated work, not tokens: a micro-batch may exceed the
   budget, and verl then runs it as is. Micro-batches run heaviest-last-and-first
   (``use_dynamic_bsz_balance``: sorted by workload, alternate ones reversed to the front).
5. **Activation checkpointing** is one switch (``enable_gradient_checkpointing``): every layer or none.

Where verl would run out of memory (a balanced micro-batch over what the group holds with the chosen
checkpointing), the micro-batch recomputes the fewest layers that fit it, and is split in two by
Karmarkar-Karp if even full recomputation does not: the plan stays valid, the peer is not penalised
beyond the extra recomputation.

**Tuning** (what a verl user does by hand, here a search over the dataset when the planner is given
it): every usable SP size that holds the dataset's longest sequence, checkpointing off and on, and a
per-GPU token budget of the group's capacity at that setting (``max_token_len`` = what fits) or half
of it, each simulated on :data:`~lightning_dcp.planning.peers.base.TUNE_BATCHES` global
batches of ``tune_tokens`` tokens drawn from the dataset; the fastest wins. ``sp=``, ``checkpointing=``
and ``max_token_len_per_gpu=`` fix any of them.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem
from lightning_dcp.planning.policies.base import Policy, interleave_items
from lightning_dcp.planning.policies.costs import CostView
from lightning_dcp.planning.peers.base import Tuner, aligned_starts, karmarkar_karp

WORKLOAD_LINEAR = 24576
"""verl's ``calculate_workload``: ``24576 * s + s**2``."""


def workload(length: int) -> int:
    """verl's workload estimate of one sequence of ``length`` tokens."""
    return WORKLOAD_LINEAR * length + length * length


def order_micro_batches(parts: list[list[int]], work: Sequence[float]) -> list[list[int]]:
    """verl's ``use_dynamic_bsz_balance`` order: by workload descending, every other one reversed to the front."""
    parts = sorted(parts, key=lambda p: (sum(work[i] for i in p), p[0] if p else 0), reverse=True)
    return parts[::2][::-1] + parts[1::2]


class VerlPolicy(Policy):
    """verl dynamic batching: static SP, KK balance over replicas, KK micro-batches under a token budget."""

    name = "verl"

    def __init__(self, world_size: int, view: CostView, **kw: Any):
        super().__init__(world_size, view, **kw)
        self.setting = self._setting()
        """``(sp, checkpointing, max_token_len_per_gpu)`` the plans use."""

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("sp", "checkpointing", "max_token_len_per_gpu", "tune_tokens")

    # -- tuning --------------------------------------------------------------------------
    def candidates(self, longest: int) -> list[tuple[int, bool, int]]:
        """Every ``(sp, checkpointing, max_token_len_per_gpu)`` the options allow that holds ``longest``."""
        L = self.view.num_layers
        sps = [self.options["sp"]] if self.options.get("sp") else self.view.ulysses_sizes  # verl: Ulysses SP
        ckpts = [bool(self.options["checkpointing"])] if "checkpointing" in self.options else [False, True]
        out = []
        for sp in sps:
            if sp not in self.view.ulysses_sizes:
                raise ValueError(f"verl: sp={sp} is not a usable SP size here; usable: {self.view.ulysses_sizes}")
            for ck in ckpts:
                cap = self.view.capacities(sp)[L if ck else 0]
                if cap < longest:
                    continue
                budgets = ([int(self.options["max_token_len_per_gpu"])] if self.options.get("max_token_len_per_gpu")
                           else sorted({cap // sp, max(cap // (2 * sp), math.ceil(longest / sp))}, reverse=True))
                for b in budgets:
                    if b * sp >= longest:  # verl asserts max_token_len >= the longest sequence
                        out.append((sp, ck, b))
        return out

    def _setting(self) -> tuple[int, bool, int] | None:
        longest = max(self.dataset_lengths) if self.dataset_lengths else None
        if longest is None:
            return None
        cands = self.candidates(longest)
        if not cands:
            raise ValueError(f"verl: no SP size and checkpointing setting holds the longest sequence ({longest} tokens)")
        if len(cands) == 1:
            return cands[0]
        tuner = Tuner.for_policy(self)
        return tuner.best(cands, lambda c: (lambda s, ls: self.plan_with(c, s, ls)))

    # -- planning ------------------------------------------------------------------------
    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        setting = self.setting
        if setting is None or self.view.capacities(setting[0])[self.view.num_layers] < max(lengths):
            cands = self.candidates(max(lengths))
            if not cands:
                longest = max(self.view.capacities(sp)[self.view.num_layers] for sp in self.view.ulysses_sizes)
                raise PlanningError(f"verl: no Ulysses SP size holds a sequence of {max(lengths)} tokens (verl's static "
                                    f"SP sizes {list(self.view.ulysses_sizes)} hold {longest} at most, every layer "
                                    "checkpointed); ring attention or a larger memory budget would be needed")
            setting = cands[0]  # the smallest SP size that holds this batch's longest sequence
        return self.plan_with(setting, samples, lengths)

    def plan_with(self, setting: tuple[int, bool, int], samples: Sequence[int], lengths: Sequence[int]) -> list[StepPlan]:
        sp, ckpt, per_gpu = setting
        count = self.world_size // sp
        starts = aligned_starts([sp] * count, self.world_size, self.view.topology)
        while starts is None:
            count -= 1
            starts = aligned_starts([sp] * count, self.world_size, self.view.topology)
        groups = [tuple(range(s, s + sp)) for s in starts]
        work = [workload(n) for n in lengths]
        G = len(groups)
        pad = (-len(lengths)) % G
        parts = karmarkar_karp(work + [0] * pad, G, equal_size=True)
        parts = [[i for i in p if i < len(lengths)] for p in parts]
        max_token_len = per_gpu * sp
        need = [min(len(p), math.ceil(sum(lengths[i] for i in p) / max_token_len)) for p in parts]
        num = max(need)  # same_micro_num_in_dp: every replica takes the largest count
        rec = self.view.num_layers if ckpt else 0
        per_group = []
        for g, p in zip(groups, parts):
            if not p:
                per_group.append([])
                continue
            k = min(num, len(p))
            sub = karmarkar_karp([work[i] for i in p], k)
            mbs = order_micro_batches([[p[j] for j in s] for s in sub if s], work)
            per_group.append([it for mb in mbs for it in self._items(g, mb, samples, lengths, rec, work)])
        return [StepPlan(tuple(interleave_items(per_group)), StepNotes(setting={
            "sp": sp, "checkpointing": ckpt, "max_token_len_per_gpu": per_gpu, "micro_batches": num}))]

    def _items(self, group: tuple[int, ...], mb: list[int], samples: Sequence[int], lengths: Sequence[int], rec: int,
               work: Sequence[float]) -> list[WorkItem]:
        """The micro-batch as items: at the setting's recompute, more where it would not fit, split where nothing fits."""
        sp = len(group)
        tokens = sum(lengths[i] for i in mb)
        r = self.view.min_recompute(tokens, sp)
        if r is None and len(mb) > 1:
            halves = karmarkar_karp([work[i] for i in mb], 2)
            return [it for h in halves if h for it in self._items(group, [mb[j] for j in h], samples, lengths, rec, work)]
        if r is None:
            raise ValueError(f"verl: a sequence of {tokens} tokens does not fit SP {sp}")
        return [WorkItem(group, tuple(samples[i] for i in mb), tuple(lengths[i] for i in mb), max(r, rec))]
