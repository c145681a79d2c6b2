"""The cost-model interface every policy and the simulator use, and the delegating base of the views on a cost model.

Implementations: :class:`~lightning_dcp.planning.analytic.AnalyticCostModel` (model + hardware) and
:class:`~lightning_dcp.planning.profiled.ProfiledCostModel` (a dual-layer profile), both on one typed linear form
(:mod:`~lightning_dcp.planning.linear`); :class:`~lightning_dcp.planning.default_cost.DefaultCostModel`; the views
(:class:`DelegatingCostModel`): calibrated, lowered memory, padded (safe mode), hsdp's shard groups.

Units: seconds, bytes, tokens; "per device": per rank of the item's SP group. Pure Python: no torch.
"""

from __future__ import annotations

import abc
import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from lightning_dcp.planning.round_plan import FREE_RUNNING, RoundPlan

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from lightning_dcp.planning.prices import CollectivePrices

    Num = float | np.ndarray
    """A number, or a numpy array of them: the fast paths are vectorized."""

__all__ = ["CostModel", "DelegatingCostModel", "ItemCost", "keep_class", "shard_domain", "with_rounds"]


@dataclass(frozen=True)
class ItemCost:
    """Time of one micro-batch on its SP group (seconds), split the way the ICC metric needs it.

    ``total`` is what the simulator charges. ``ideal``: the samples' forward + backward compute at the model's best
    rates on one device (no communication, recomputation, per-micro-batch constant or all-reduce), divided by the SP
    size; additive over samples, so a packed micro-batch's ideal is the sum of its samples' ideals / sp.
    """

    compute: float
    """Forward + backward compute of all layers at the achieved efficiency."""
    recompute: float
    """Extra forward compute of the recomputed layers."""
    comm: float
    """Communication compute does not hide: Ulysses all-to-alls (forward, backward, recomputed forward), a ring's
    exposed key/value transfers."""
    overhead: float
    """Per-micro-batch constant: embedding, head, loss, launches, host work."""
    ideal: float
    """Best-rate compute of these samples / sp."""

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.comm + self.overhead


class CostModel(abc.ABC):
    """Time and memory of any micro-batch for any SP size, ring degree and recompute count.

    Subclasses set ``num_layers``, ``memory_limit`` (usable bytes per device), ``num_heads`` (Ulysses sizes divide
    it), ``gpus_per_node`` and optionally ``memory_limit_source`` (printed by :meth:`describe_limit`).

    Every item method takes ``ring`` (default 1): the SP group's ring degree (``sp = ring x ulysses``,
    :class:`~lightning_dcp.planning.plan.WorkItem`'s ``ring``). :attr:`prices_ring` says whether ``item_cost`` and
    ``item_memory`` price ``ring > 1``; the planner offers ring sizes only then, and a plan's ring items on a model
    that does not (a peer's pure rings) get the generic estimate of :meth:`ring_cost` and :meth:`ring_memory`.
    :attr:`fast_paths` says whether :meth:`item_time_sum` and :meth:`item_memory_tokens` answer from a micro-batch's
    sums (numpy arrays too).

    Sharding (:mod:`~lightning_dcp.planning.sharding`): :attr:`sharding`, :attr:`state_bytes`,
    :attr:`memory_in_bytes`, :attr:`rounds`, :meth:`collective_prices`; a model with a ``with_sharding(states)``
    method is re-planned with the runtime's measured state bytes.
    """

    num_layers: int
    memory_limit: float
    num_heads: int
    gpus_per_node: int = 8
    memory_limit_source: str = ""
    """Where ``memory_limit`` came from (an argument, a default, the device), for messages; may be empty."""
    prices_ring: bool = False
    """Whether ``item_cost`` / ``item_memory`` price ``ring > 1`` (:mod:`~lightning_dcp.planning.ring`)."""
    fast_paths: bool = False
    """Whether :meth:`item_time_sum` / :meth:`item_memory_tokens` are implemented (and take numpy arrays)."""
    sharding: str | None = None
    """The ``DCPStrategy(sharding=...)`` mode whose model-state memory ``item_memory`` counts (``None``: not stated)."""
    state_bytes: float | None = None
    """Model-state bytes per rank that ``item_memory`` includes (``None``: not stated)."""
    memory_in_bytes: bool = True
    """Whether ``item_memory`` and ``memory_limit`` are bytes (the fallback and safe-mode models count tokens)."""
    rounds: RoundPlan = FREE_RUNNING
    """How a step's items run (:mod:`~lightning_dcp.planning.rounds`): free-running, or lockstep rounds of a shard group."""
    prices_tp: bool = False
    """Whether :meth:`tp_cost`, :meth:`tp_memory` and their fast paths price ``tp > 1`` (tensor parallelism inside
    an SP item, :mod:`~lightning_dcp.planning.tensor_parallel`); the planner offers TP splits only then, and only when
    asked (``Planner(max_tp_size=...)``)."""

    @abc.abstractmethod
    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        """Cost of one packed micro-batch of ``lengths`` on ``sp`` ranks (``ring`` x Ulysses) recomputing ``recompute`` layers."""

    @abc.abstractmethod
    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        """Peak bytes per device of that micro-batch, model states included."""

    @abc.abstractmethod
    def step_overhead(self, world_size: int) -> float:
        """Per-step constant: gradient reduction over ``world_size`` ranks + optimizer step (seconds)."""

    @abc.abstractmethod
    def signature(self) -> dict:
        """JSON-able description (model, hardware or profile key) for reports and caches."""

    def collective_prices(self) -> "CollectivePrices | None":
        """Bandwidths and latencies of collectives, from the hardware or a profile (``None``: unknown)."""
        return None

    def describe_limit(self) -> str:
        """The memory budget with its source, for messages: ``"5.25 MiB per device (...)"``."""
        from lightning_dcp.planning.units import limit_text

        return limit_text(self.memory_limit, self.memory_limit_source)

    # -- fast paths (fast_paths: True) ---------------------------------------------------------------
    def attention_work(self, length: int) -> float:
        """Attention work of one sample, the unit of ``sq_sum``: ``l^2`` unless the model says otherwise."""
        return float(length) * length

    def item_time_sum(self, tokens: Num, sq_sum: Num, n: Num, sp: int, recompute: Num, ring: int = 1,
                      ring_exposed: bool = True) -> Num:
        """:meth:`item_time` from the sums: ``tokens``, ``sq_sum`` (:meth:`attention_work` summed), ``n`` samples;
        ``ring_exposed=False``: a ring's transfers counted as hidden (a lower bound linear in the sums)."""
        raise NotImplementedError(f"{type(self).__name__} has no fast paths (fast_paths is False); use item_time(lengths, ...)")

    def item_memory_tokens(self, tokens: Num, sp: int, recompute: Num, ring: int = 1) -> Num:
        """:meth:`item_memory` of a micro-batch of ``tokens`` tokens (memory depends on nothing else)."""
        raise NotImplementedError(f"{type(self).__name__} has no fast paths (fast_paths is False); use item_memory(lengths, ...)")

    # -- derived answers; subclasses may override with closed forms -----------------------------------
    def item_time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.item_cost(lengths, sp, recompute, ring).total

    def item_time_lower(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        """A lower bound of :meth:`item_time` linear in the samples' sums (the step bound's per-sample GPU-seconds):
        :meth:`item_time` unless a ring's transfers can hide behind compute."""
        return self.item_time(lengths, sp, recompute, ring)

    def fits(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> bool:
        return self.item_memory(lengths, sp, recompute, ring) <= self.memory_limit

    def min_recompute(self, lengths: Sequence[int], sp: int, ring: int = 1) -> int | None:
        """Fewest recomputed layers that fit in memory (``None``: not even all). Memory falls in the recompute count
        (paper eq. 6): bisection here, closed forms in subclasses."""
        if not self.fits(lengths, sp, self.num_layers, ring):
            return None
        lo, hi = 0, self.num_layers
        while lo < hi:
            mid = (lo + hi) // 2
            if self.fits(lengths, sp, mid, ring):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def max_length(self, sp: int, recompute: int | None = None, ring: int = 1) -> int:
        """Longest single sequence ``sp`` ranks hold with ``recompute`` layers (default all); 0 if none."""
        r = self.num_layers if recompute is None else recompute
        if not self.fits([sp], sp, r, ring):
            return 0
        lo, hi = sp, sp
        while self.fits([hi * 2], sp, r, ring):
            hi *= 2
            if hi > 1 << 40:
                return hi
        hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits([mid], sp, r, ring):
                lo = mid
            else:
                hi = mid
        return lo

    def ideal_time(self, lengths: Sequence[int]) -> float:
        """Compute-only time of these samples on one device: the ideal bound's numerator."""
        return sum(self.item_cost([n], 1, 0).ideal for n in lengths)

    def sp_sizes(self, world_size: int) -> list[int]:
        """Ulysses SP sizes usable on ``world_size`` ranks: the divisors of the heads up to it."""
        from lightning_dcp.planning.sp_sizes import ulysses_sizes

        return list(ulysses_sizes(self.num_heads, world_size))

    def sp_splits(self, limit: int, *, ring: bool = True) -> dict[int, tuple[int, ...]]:
        """Every SP size the planner may use up to ``limit`` -> its candidate ring degrees
        (:func:`~lightning_dcp.planning.sp_sizes.sp_splits`), Ulysses sizes from :meth:`sp_sizes`, rings only when
        :attr:`prices_ring` and ``ring``."""
        from lightning_dcp.planning.sp_sizes import sp_splits

        domain = shard_domain(self)
        limit = min(int(limit), domain) if domain else int(limit)
        return sp_splits(self.num_heads, limit, self.gpus_per_node, ring=ring and self.prices_ring,
                         usable=set(self.sp_sizes(limit)))

    # -- tensor parallelism inside an item (prices_tp): tp == 1 is the item's ring (or Ulysses) answer -------------
    def tp_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1, tp: int = 1) -> ItemCost:
        """:meth:`ring_cost` of an item whose ``sp / ring`` subgroups run ``tp``-way tensor parallelism
        (``WorkItem.tp``); ``ValueError`` for ``tp > 1`` on a model that prices none (:attr:`prices_tp`)."""
        if tp <= 1:
            return self.ring_cost(lengths, sp, recompute, ring)
        raise ValueError(self._no_tp(tp))

    def tp_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1, tp: int = 1) -> float:
        """:meth:`ring_memory` of a ``tp``-way tensor-parallel item (see :meth:`tp_cost`)."""
        if tp <= 1:
            return self.ring_memory(lengths, sp, recompute, ring)
        raise ValueError(self._no_tp(tp))

    def tp_time_sum(self, tokens: Num, sq_sum: Num, n: Num, sp: int, recompute: Num, ring: int = 1, tp: int = 1,
                    ring_exposed: bool = True) -> Num:
        """:meth:`item_time_sum` of a ``tp``-way tensor-parallel item (fast paths)."""
        if tp <= 1:
            return self.item_time_sum(tokens, sq_sum, n, sp, recompute, ring, ring_exposed)
        raise ValueError(self._no_tp(tp))

    def tp_memory_tokens(self, tokens: Num, sp: int, recompute: Num, ring: int = 1, tp: int = 1) -> Num:
        """:meth:`item_memory_tokens` of a ``tp``-way tensor-parallel item (fast paths)."""
        if tp <= 1:
            return self.item_memory_tokens(tokens, sp, recompute, ring)
        raise ValueError(self._no_tp(tp))

    def _no_tp(self, tp: int) -> str:
        return (f"{type(self).__name__} prices no tensor parallelism (prices_tp is False), so an item with tp={tp} has "
                "no cost; plan with max_tp_size=1, or price TP with an AnalyticCostModel (or a ProfiledCostModel with "
                "hardware= and the profile's model.hidden_size)")

    # -- any ring degree: the model's own pricing, or the generic estimate for a model without it -----
    def ring_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int) -> ItemCost:
        """:meth:`item_cost` at any ring degree. On a model that prices no ring, a pure ring (``ring == sp``) is
        estimated from its Ulysses answers: each rank's ``1/sp`` share of the item's work at SP 1 (per-micro-batch
        constants not divided) plus the exposed transfers (:meth:`ring_transfer`)."""
        if ring <= 1 or self.prices_ring:
            return self.item_cost(lengths, sp, recompute, ring)
        p = int(sp)
        if p <= 1:
            return self.item_cost(lengths, p, recompute)
        if ring != p:
            raise ValueError(f"the ring estimate prices pure ring attention (ring == sp); got ring {ring} on {sp} ranks")
        one = self.item_cost(lengths, 1, recompute)
        try:
            c0 = self.item_cost([], 1, recompute)
        except (ValueError, ZeroDivisionError, IndexError):
            c0 = ItemCost(0.0, 0.0, 0.0, 0.0, 0.0)

        def share(a: float, b: float) -> float:
            return b + (a - b) / p

        return ItemCost(compute=share(one.compute, c0.compute), recompute=share(one.recompute, c0.recompute),
                        comm=self.ring_transfer(lengths, p, recompute), overhead=share(one.overhead, c0.overhead),
                        ideal=one.ideal / p)

    def ring_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int) -> float:
        """:meth:`item_memory` at any ring degree; on a model that prices no ring, a ring item's memory is the rank's
        ``1/sp`` share of the tokens on one device (the key/value ring buffers neglected)."""
        if ring <= 1 or self.prices_ring:
            return self.item_memory(lengths, sp, recompute, ring)
        share = max(1, math.ceil(sum(lengths) / sp))
        return self.item_memory_tokens(share, 1, recompute) if self.fast_paths else self.item_memory([share], 1, recompute)

    def ring_transfer(self, lengths: Sequence[int], p: int, recompute: int) -> float:
        """Ring transfer time of :meth:`ring_cost`'s estimate over ``p`` ranks, all layers, not overlapped: the item's
        Ulysses all-to-all time at the largest SP size the heads allow, scaled to the ring's bytes per rank (ring
        ``2 (p-1)/p T h``, Ulysses ``4 (q-1)/q (T/q) h``). The analytic model prices it from its hardware."""
        q = max([s for s in self.sp_sizes(p) if s <= p] or [1])
        if q <= 1:
            return 0.0
        return self.item_cost(lengths, q, recompute).comm * (2.0 * (p - 1) / p) / (4.0 * (q - 1) / q / q)


def shard_domain(cost_model: CostModel) -> int | None:
    """Ranks of the shard group no SP group may cross (lockstep rounds' shard group), else None."""
    return cost_model.rounds.domain


def with_rounds(cost_model: CostModel, rounds: RoundPlan) -> CostModel:
    """``cost_model`` with other ``rounds`` (e.g. lockstep rounds whose SP groups may span more shard groups), a shallow
    copy: the same times and memory."""
    new = copy.copy(cost_model)
    new.rounds = rounds
    return new


def keep_class(original: CostModel, rebuilt: CostModel) -> CostModel:
    """``rebuilt`` (built by a base class, e.g. for another sharding mode) as an instance of ``original``'s class: a
    user's subclass keeps its overrides and its own attributes; the rebuilt state wins."""
    if type(original) is type(rebuilt):
        return rebuilt
    new = copy.copy(original)
    new.__dict__.update(rebuilt.__dict__)
    return new


class _FromBase:
    """An interface attribute of a :class:`DelegatingCostModel`: its base's, unless the view sets its own."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: "DelegatingCostModel | None", owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.base, self.name)


class DelegatingCostModel(CostModel):
    """A view of ``base``: every interface attribute and every primitive answer (the abstract methods, the fast paths,
    :meth:`sp_sizes`, :meth:`collective_prices`, :meth:`describe_limit`, :meth:`ring_transfer`, the ``tp > 1`` answers of
    :meth:`tp_cost` and its kin) is the base's; the derived answers (:meth:`item_time`, :meth:`fits`,
    :meth:`min_recompute`, :meth:`max_length`, ...) follow from them. A subclass overrides what it changes (the
    attribute, the primitive: a view that changes times or memory changes its TP answers too, or sets ``prices_tp``
    False); a closed form of its own is an option."""

    num_layers = _FromBase()  # type: ignore[assignment]
    memory_limit = _FromBase()  # type: ignore[assignment]
    num_heads = _FromBase()  # type: ignore[assignment]
    gpus_per_node = _FromBase()  # type: ignore[assignment]
    memory_limit_source = _FromBase()  # type: ignore[assignment]
    prices_ring = _FromBase()  # type: ignore[assignment]
    fast_paths = _FromBase()  # type: ignore[assignment]
    sharding = _FromBase()  # type: ignore[assignment]
    state_bytes = _FromBase()  # type: ignore[assignment]
    memory_in_bytes = _FromBase()  # type: ignore[assignment]
    rounds = _FromBase()  # type: ignore[assignment]
    prices_tp = _FromBase()  # type: ignore[assignment]

    def __init__(self, base: CostModel) -> None:
        self.base = base

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        return self.base.item_cost(lengths, sp, recompute, ring)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.base.item_memory(lengths, sp, recompute, ring)

    def step_overhead(self, world_size: int) -> float:
        return self.base.step_overhead(world_size)

    def signature(self) -> dict:
        return self.base.signature()

    def collective_prices(self) -> "CollectivePrices | None":
        return self.base.collective_prices()

    def describe_limit(self) -> str:
        return self.base.describe_limit()

    def attention_work(self, length: int) -> float:
        return self.base.attention_work(length)

    def item_time_sum(self, tokens: Num, sq_sum: Num, n: Num, sp: int, recompute: Num, ring: int = 1,
                      ring_exposed: bool = True) -> Num:
        return self.base.item_time_sum(tokens, sq_sum, n, sp, recompute, ring, ring_exposed)

    def item_memory_tokens(self, tokens: Num, sp: int, recompute: Num, ring: int = 1) -> Num:
        return self.base.item_memory_tokens(tokens, sp, recompute, ring)

    def sp_sizes(self, world_size: int) -> list[int]:
        return self.base.sp_sizes(world_size)

    def ring_transfer(self, lengths: Sequence[int], p: int, recompute: int) -> float:
        return self.base.ring_transfer(lengths, p, recompute)

    def tp_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1, tp: int = 1) -> ItemCost:
        return self.base.tp_cost(lengths, sp, recompute, ring, tp) if tp > 1 else \
            CostModel.tp_cost(self, lengths, sp, recompute, ring, tp)

    def tp_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1, tp: int = 1) -> float:
        return self.base.tp_memory(lengths, sp, recompute, ring, tp) if tp > 1 else \
            CostModel.tp_memory(self, lengths, sp, recompute, ring, tp)

    def tp_time_sum(self, tokens: Num, sq_sum: Num, n: Num, sp: int, recompute: Num, ring: int = 1, tp: int = 1,
                    ring_exposed: bool = True) -> Num:
        return self.base.tp_time_sum(tokens, sq_sum, n, sp, recompute, ring, tp, ring_exposed) if tp > 1 else \
            self.item_time_sum(tokens, sq_sum, n, sp, recompute, ring, ring_exposed)

    def tp_memory_tokens(self, tokens: Num, sp: int, recompute: Num, ring: int = 1, tp: int = 1) -> Num:
        return self.base.tp_memory_tokens(tokens, sp, recompute, ring, tp) if tp > 1 else \
            self.item_memory_tokens(tokens, sp, recompute, ring)
