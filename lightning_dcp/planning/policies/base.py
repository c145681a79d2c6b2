"""What every planning policy is: a deterministic function from one global batch to step plans.

A policy is built once per (world size, cost model, seed, dataset lengths, options) and then
asked :meth:`Policy.plan_batch` for each global batch. It returns one :class:`StepPlan` per
optimizer step the batch needs (one for every policy but ``bucket``). Inputs are already
checked by :class:`~lightning_dcp.planning.planner.Planner` (positive lengths that fit some
setting), so policies only plan.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Sequence

import numpy as np

from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.planning.view import CostView
from lightning_dcp.planning.step_time import run_step


class Policy(abc.ABC):
    """Base of the policies; subclasses set ``name`` and implement :meth:`plan_batch`."""

    name: str = ""
    one_step_per_batch: bool = True
    plans_rounds: bool = False
    """Whether the policy plans its steps' lockstep rounds itself under a mode with them (``sharding="hsdp"``:
    :meth:`~lightning_dcp.planning.round_plan.RoundPlan.plan_step` with its cost view, re-packing its micro-batches
    for the rounds, as dcp does). Otherwise the planner plans the rounds of the policy's items as they are: a
    baseline keeps its own packing."""
    runtime_refusal: str | None = None
    """Why DCPStrategy cannot train with this policy (plan and simulate only), or ``None``: ``hydraulis`` plans
    TP/PP pipelines, ``flexsp``'s MILP stops at a time limit (ranks could get different plans)."""

    def __init__(self, world_size: int, view: CostView, *, seed: int = 0,
                 dataset_lengths: Sequence[int] | None = None, **options: Any):
        unknown = set(options) - set(self.option_names())
        if unknown:
            raise TypeError(f"policy {self.name!r} has no option(s) {sorted(unknown)}; "
                            f"its options are {sorted(self.option_names()) or 'none'}")
        self.world_size = world_size
        self.view = view
        self.seed = int(seed)
        self.dataset_lengths = None if dataset_lengths is None else [int(n) for n in dataset_lengths]
        self.options = options

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ()

    def rng(self, step: int, salt: int = 0) -> np.random.Generator:
        """Generator seeded by (seed, step, salt): identical input and seed give identical plans."""
        return np.random.default_rng([self.seed & 0xFFFFFFFF, step & 0xFFFFFFFF, salt, 0x5EED])

    def prepare(self, batches: Sequence[Sequence[int]]) -> None:
        """Called with the lengths of an epoch's global batches before any of them is planned, once per epoch (a
        tuned policy tunes on them, as its users tune on their own data); the default does nothing."""

    @abc.abstractmethod
    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        """Step plans covering ``samples`` (dataset indices) with ``lengths``, each exactly once."""


class FixedSPPolicy(Policy):
    """Baselines with one SP size and one recompute count for the whole run.

    The SP size is the smallest usable one that holds the longest sample (of the dataset when
    given, else of the batch) at full recompute and whose groups fill the world (a static user
    does not leave GPUs idle: on 32 GPUs SP 16 rather than 12; the smallest holding one when none
    does) — what a user of a static system must pick.
    The recompute count is the fewest layers that fit that longest sample (a careful user does
    not checkpoint more than needed), overridable with ``sp=`` / ``recompute=``.
    """

    def __init__(self, world_size: int, view: CostView, **kw: Any):
        super().__init__(world_size, view, **kw)
        self._fixed: tuple[int, int] | None = None
        if self.dataset_lengths or "sp" in self.options:
            self._fixed = self._choose(self.dataset_lengths or [1])

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("sp", "recompute")

    def _choose(self, lengths: Sequence[int]) -> tuple[int, int]:
        longest = max(lengths)
        sp = self.options.get("sp") or self._static_sp(longest)
        if sp is None or sp not in self.view.sp_sizes:
            raise ValueError(f"no usable SP size for length {longest}; usable: {self.view.sp_sizes}")
        rec = self.options.get("recompute")
        if rec is None:
            rec = self.view.min_recompute(longest, sp)
            if rec is None:
                raise ValueError(f"SP {sp} cannot hold length {longest}")
        return int(sp), int(rec)

    def _static_sp(self, longest: int) -> int | None:
        """The smallest SP size holding ``longest`` whose groups fill the world (else the smallest holding it)."""
        holding = [p for p in self.view.sp_sizes if self.view.max_len(p) >= longest]
        full = [p for p in holding if len(self.groups(p)) * p == self.world_size]
        return (full or holding or [None])[0]

    def fixed(self, lengths: Sequence[int]) -> tuple[int, int]:
        """(sp, recompute) for a batch: the fixed setting, widened if this batch has a longer sample."""
        if self._fixed is None:
            return self._choose(lengths)
        sp, rec = self._fixed
        longest = max(lengths)
        if self.view.capacities(sp)[rec] < longest:
            need = self.view.min_recompute(longest, sp)
            if need is not None:
                return sp, need
            return self._choose(lengths)
        return sp, rec

    def groups(self, sp: int) -> list[tuple[int, ...]]:
        """All SP groups of size ``sp`` the world holds side by side (data-parallel replicas), first fit."""
        got = getattr(self, "_groups", None)
        if got is None:
            got = self._groups = {}
        if sp not in got:
            topo = self.view.topology
            got[sp] = topo.take(topo.free_runs(), sp, self.world_size)
        return list(got[sp])


def step_span(step: StepPlan, view: CostView) -> float:
    """Compute span of ``step`` (:func:`~lightning_dcp.planning.step_time.run_step`) with the view's item times and
    rank speeds (no step-end overhead)."""
    return run_step(step, [view.item_time(it) for it in step.items], view.topology.world_size, view.cm.rounds).span


def log_buckets(lengths: Sequence[int], per_octave: int = 2) -> dict[int, list[int]]:
    """Indices grouped into length buckets with ``per_octave`` buckets per doubling."""
    out: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        key = int(math.floor(math.log2(max(n, 1)) * per_octave + 1e-9))
        out.setdefault(key, []).append(i)
    return out
