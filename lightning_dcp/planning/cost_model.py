"""The cost-model interface every planner policy and the simulator use.

Two implementations answer it: :class:`~lightning_dcp.planning.analytic.AnalyticCostModel`
(model + hardware description, no measurement) and
:class:`~lightning_dcp.planning.profiled.ProfiledCostModel` (fitted to a dual-layer profile).

Units: seconds, bytes, tokens. "Per device" means per rank of the SP group running the item.
Pure Python: no torch.
"""

from __future__ import annotations

import abc
import copy
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from lightning_dcp.planning.round_plan import FREE_RUNNING, RoundPlan

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.prices import CollectivePrices


@dataclass(frozen=True)
class ItemCost:
    """Time of one micro-batch on its SP group, split the way the ICC metric needs it.

    ``total`` is what the simulator charges; ``ideal`` is the same samples' compute at peak
    efficiency on one device, with no recomputation and no communication. Precisely: all of the
    samples' forward + backward compute at the model's best achievable rates (for the analytic
    model: GEMMs at maximum efficiency without the small-GEMM penalty, attention at maximum
    efficiency, the memory-bound element-wise passes, the head's per-token work; for a profiled
    model: the sp=1 fit's per-token and attention terms), with no communication, no
    recomputation, no per-micro-batch constant and no all-reduce, divided by the SP size. It is
    additive over samples (no constant term), so the ideal of a packed micro-batch is the sum of
    its samples' ideals / sp.
    """

    compute: float
    """Forward + backward compute of all layers at the achieved efficiency (seconds)."""
    recompute: float
    """Extra forward compute of the recomputed layers (seconds)."""
    comm: float
    """Communication not hidden by compute: Ulysses all-to-alls (forward + backward + recomputed forward)
    and, on a ring, the key/value transfers compute does not hide (seconds)."""
    overhead: float
    """Per-micro-batch constant: embedding, head, loss, launch latency (seconds)."""
    ideal: float
    """Compute of these samples at the best achievable rates, no comm/recompute/constants, divided by the SP size (seconds)."""

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.comm + self.overhead


class CostModel(abc.ABC):
    """Time and memory of any micro-batch for any SP size and recompute count.

    Subclasses set ``num_layers``, ``memory_limit`` (usable bytes per device), ``num_heads``
    (Ulysses sizes must divide it) and ``gpus_per_node``; optionally ``memory_limit_source`` (where the
    limit came from, printed in errors by :meth:`describe_limit`).

    Ring attention: every item method takes ``ring`` (keyword, default 1), the ring degree of the
    SP group (:class:`~lightning_dcp.planning.plan.WorkItem`'s ``ring``: ``sp = ring x ulysses``). A
    cost model prices rings when :func:`prices_ring_of` says so (its :attr:`prices_ring`, or by default
    whether its ``item_cost`` takes ``ring``); callers pass ``ring`` only when it is above 1, so a
    subclass written without the keyword keeps working (and is never offered rings).

    What a cost model states about sharding (:mod:`lightning_dcp.planning.sharding`), so that every mode
    can plan with it or refuse it by name (each mode's ``plan_with``):
    :attr:`sharding`, :attr:`state_bytes`, :attr:`memory_in_bytes`, :attr:`rounds` and
    :meth:`collective_prices`. A cost model with a ``with_sharding(states)`` method is re-planned with the
    runtime's measured state bytes.
    """

    num_layers: int
    memory_limit: float
    num_heads: int
    gpus_per_node: int = 8
    memory_limit_source: str = ""
    """Where ``memory_limit`` came from (an argument, a default, the device), for messages; may be empty."""
    prices_ring: bool | None = None
    """Whether :meth:`item_cost` / :meth:`item_memory` price ``ring > 1`` (ring attention, see
    :mod:`~lightning_dcp.planning.ring`); the planner offers ring sizes only then. None (default): whether
    ``item_cost`` takes ``ring`` (:func:`prices_ring_of`)."""

    sharding: str | None = None
    """The ``DCPStrategy(sharding=...)`` mode whose model-state memory ``item_memory`` counts (``None``: not stated)."""
    state_bytes: float | None = None
    """Model-state bytes per rank that ``item_memory`` includes (``None``: not stated)."""
    memory_in_bytes: bool = True
    """Whether ``item_memory`` and ``memory_limit`` are bytes (the fallback and safe-mode models count tokens)."""
    rounds: RoundPlan = FREE_RUNNING
    """How a step's items run (:mod:`~lightning_dcp.planning.rounds`): free-running per rank, or lockstep
    rounds of a shard group (``sharding="hsdp"``)."""

    def collective_prices(self) -> "CollectivePrices | None":
        """Bandwidths and latencies of collectives, from the hardware or a profile (``None``: unknown)."""
        return None

    def describe_limit(self) -> str:
        """The memory budget with its source, for messages: ``"5.25 MiB per device (...)"``."""
        from lightning_dcp.planning.units import limit_text

        return limit_text(self.memory_limit, self.memory_limit_source)

    @abc.abstractmethod
    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        """Cost of one packed micro-batch of ``lengths`` on an SP group of size ``sp`` (``ring`` x Ulysses)."""

    @abc.abstractmethod
    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        """Peak bytes per device of that micro-batch, model states included."""

    @abc.abstractmethod
    def step_overhead(self, world_size: int) -> float:
        """Per-step constant: gradient all-reduce over ``world_size`` ranks + optimizer step (seconds)."""

    @abc.abstractmethod
    def signature(self) -> dict:
        """JSON-able description (model, hardware or profile key) for reports and caches."""

    # Derived answers; subclasses may override with closed forms.

    def item_time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return (self.item_cost(lengths, sp, recompute) if ring == 1
                else self.item_cost(lengths, sp, recompute, ring=ring)).total

    def item_time_lower(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        """A lower bound of :meth:`item_time` linear in the samples' sums (tokens, attention work, count): the
        step bound's per-sample GPU-seconds use it. :meth:`item_time` itself for ``ring == 1``; on a ring, the
        time with its key/value transfers hidden behind compute (:mod:`~lightning_dcp.planning.ring`)."""
        return self.item_time(lengths, sp, recompute) if ring == 1 else self.item_time(lengths, sp, recompute, ring=ring)

    def sp_sizes(self, world_size: int) -> list[int]:
        """Ulysses SP sizes usable on ``world_size`` ranks: every divisor of the heads up to it
        (:func:`~lightning_dcp.planning.sp_sizes.ulysses_sizes`)."""
        from lightning_dcp.planning.sp_sizes import ulysses_sizes

        return list(ulysses_sizes(self.num_heads, world_size))

    def sp_splits(self, limit: int, *, ring: bool = True) -> dict[int, tuple[int, ...]]:
        """Every SP size the planner may use up to ``limit`` -> its candidate ring degrees
        (:func:`~lightning_dcp.planning.sp_sizes.sp_splits`), keeping the splits whose Ulysses size is in
        :meth:`sp_sizes` (a profiled model: the measured ones); ring degrees above 1 only when
        :attr:`prices_ring` and ``ring``."""
        from lightning_dcp.planning.sp_sizes import sp_splits

        domain = shard_domain(self)
        limit = min(int(limit), domain) if domain else int(limit)
        usable = set(self.sp_sizes(limit))
        return sp_splits(self.num_heads, limit, getattr(self, "gpus_per_node", 8), ring=ring and prices_ring_of(self),
                         usable=usable)

    def fits(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> bool:
        need = self.item_memory(lengths, sp, recompute) if ring == 1 else self.item_memory(lengths, sp, recompute, ring=ring)
        return need <= self.memory_limit

    def _fits(self, lengths: Sequence[int], sp: int, recompute: int, ring: int) -> bool:
        """:meth:`fits`, passing ``ring`` only above 1 (a subclass's override may predate it)."""
        return self.fits(lengths, sp, recompute) if ring == 1 else self.fits(lengths, sp, recompute, ring=ring)

    def min_recompute(self, lengths: Sequence[int], sp: int, ring: int = 1) -> int | None:
        """Fewest recomputed layers that fit in memory, or ``None`` if even full recompute does not.

        Memory falls linearly in the recompute count (paper eq. 6), so this is a closed form
        in subclasses; the default bisects.
        """
        if not self._fits(lengths, sp, self.num_layers, ring):
            return None
        lo, hi = 0, self.num_layers
        while lo < hi:
            mid = (lo + hi) // 2
            if self._fits(lengths, sp, mid, ring):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def max_length(self, sp: int, recompute: int | None = None, ring: int = 1) -> int:
        """Longest single sequence an SP group of ``sp`` holds with ``recompute`` layers (default all)."""
        r = self.num_layers if recompute is None else recompute
        if not self._fits([sp], sp, r, ring):
            return 0
        lo, hi = sp, sp
        while self._fits([hi * 2], sp, r, ring):
            hi *= 2
            if hi > 1 << 40:
                return hi
        hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._fits([mid], sp, r, ring):
                lo = mid
            else:
                hi = mid
        return lo

    def ideal_time(self, lengths: Sequence[int]) -> float:
        """Compute-only time of these samples on one device: the ideal bound's numerator."""
        return sum(self.item_cost([n], 1, 0).ideal for n in lengths)


def prices_ring_of(cost_model: object) -> bool:
    """Whether ``cost_model`` prices ring attention: its ``prices_ring`` when set, else whether its
    ``item_cost`` takes the ``ring`` keyword."""
    flag = getattr(cost_model, "prices_ring", None)
    if flag is not None:
        return bool(flag)
    try:
        return "ring" in inspect.signature(cost_model.item_cost).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False


def shard_domain(cost_model: CostModel) -> int | None:
    """Ranks of the shard group no SP group may cross (a mode with lockstep rounds: its shard group), else None:
    the cost model's :attr:`~CostModel.rounds` say."""
    return cost_model.rounds.domain


def ring_kwargs(ring: int) -> dict:
    """``{"ring": ring}`` above 1, else ``{}``: how a wrapper passes ``ring`` on to a cost model that may
    predate the keyword."""
    return {} if ring == 1 else {"ring": ring}


def keep_class(original: CostModel, rebuilt: CostModel) -> CostModel:
    """``rebuilt`` (built by a base class, e.g. for another sharding mode) as an instance of ``original``'s
    class: a user's subclass keeps its overridden methods and its own attributes; the rebuilt state wins."""
    if type(original) is type(rebuilt):
        return rebuilt
    new = copy.copy(original)
    new.__dict__.update(rebuilt.__dict__)
    return new
