"""One typed linear cost form: :class:`LinearCost`, and :class:`LinearCostModel`, the cost model built on it.

The analytic and the profiled models both price a micro-batch on ``sp`` ranks (Ulysses) linearly in its sums:
attention work ``W`` (``sum l^2`` for 1d), tokens ``T``, samples ``n`` and a constant, and linearly in the
recomputed layers ``r``::

    time   = time.at(W, T, n) + r * time_per_layer.at(W, T, n)
    memory = memory - r * memory_per_layer + T * (memory_per_token - r * memory_per_layer_token)

(a :class:`Terms` at ``(W, T, n)`` is ``work * W + tokens * T + const + samples * n``). Each model fills one :class:`LinearCost`
per SP size; :class:`LinearCostModel` answers the whole :class:`~lightning_dcp.planning.cost_model.CostModel`
interface from it, rings included (:mod:`~lightning_dcp.planning.ring`), and tensor parallelism inside an item when the
model says what its collectives move (:mod:`~lightning_dcp.planning.tensor_parallel`). The evaluators take numpy
arrays as well (the planner's vectorized fast path). Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

from lightning_dcp.planning.cost_model import CostModel, ItemCost
from lightning_dcp.planning.ring import RingTerms, hardware_ring_terms, ring_buffer_bytes, ring_exposed, ring_steps, \
    ring_steps_compute
from lightning_dcp.planning.tensor_parallel import TPTerms, a2a_share, tp_buffer_bytes, tp_collective_time

__all__ = ["LinearCost", "LinearCostModel", "Terms"]

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.cost_model import Num
    from lightning_dcp.planning.hardware import HardwareSpec


@dataclass(frozen=True)
class Terms:
    """``work * W + tokens * T + const + samples * n`` (seconds, per rank)."""

    work: float = 0.0
    tokens: float = 0.0
    const: float = 0.0
    samples: float = 0.0


@dataclass(frozen=True)
class LinearCost:
    """A micro-batch's time and memory on one SP size, linear in its sums and in the recomputed layers ``r``.

    ``time`` (no layer recomputed) and ``time_per_layer`` (added per recomputed layer) are the totals the planner's
    fast path evaluates; ``compute`` (all layers' forward + backward), ``recompute`` (per recomputed layer),
    ``comm`` + ``r * comm_per_layer`` (unhidden communication), ``overhead`` (per-micro-batch constant parts) and
    ``ideal`` (best-rate compute / sp) split them as :class:`~lightning_dcp.planning.cost_model.ItemCost` does
    (their sum is the total up to rounding). Memory (bytes per device): ``memory`` (an empty micro-batch: states,
    workspace) and ``memory_per_token``, each recomputed layer freeing ``memory_per_layer`` and
    ``memory_per_layer_token`` per token. For rings: ``attn_fwd`` / ``attn_bwd``, one layer's attention seconds per
    unit of work on one rank (a ring step's compute), and ``whole_tokens``, the seconds per token every rank spends
    on the whole micro-batch (host work: a ring does not split it).
    """

    time: Terms
    time_per_layer: Terms
    compute: Terms
    recompute: Terms
    comm: Terms
    comm_per_layer: Terms
    overhead: Terms
    ideal: Terms
    memory: float
    memory_per_token: float
    memory_per_layer: float = 0.0
    memory_per_layer_token: float = 0.0
    attn_fwd: float = 0.0
    attn_bwd: float = 0.0
    whole_tokens: float = 0.0
    _time: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _memory: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _parts: tuple[tuple[float, float, float, float], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:  # the coefficients as the planner's inner loop reads them: tuples
        t, p = self.time, self.time_per_layer
        object.__setattr__(self, "_time", (t.work, p.work, t.tokens, p.tokens, t.const, p.const, t.samples, p.samples))
        object.__setattr__(self, "_memory", (self.memory, self.memory_per_layer, self.memory_per_token,
                                             self.memory_per_layer_token))
        object.__setattr__(self, "_parts", tuple((x.work, x.tokens, x.const, x.samples) for x in (
            self.compute, self.recompute, self.comm, self.comm_per_layer, self.overhead, self.ideal)))

    def item_time(self, T: Num, W: Num, n: Num, r: Num) -> Num:
        tw, pw, tt, pt, tc, pc, ts, ps = self._time
        return (tw + r * pw) * W + (tt + r * pt) * T + tc + r * pc + (ts + r * ps) * n

    def item_memory(self, T: Num, r: Num) -> Num:
        m0, m1, t0, t1 = self._memory
        return m0 - r * m1 + T * (t0 - r * t1)

    def item_cost(self, T: float, W: float, n: int, r: int) -> ItemCost:
        compute, rec, comm, comm_r, overhead, ideal = [w * W + t * T + c + s * n for w, t, c, s in self._parts]
        return ItemCost(compute, r * rec, comm + r * comm_r, overhead, ideal)

    def min_recompute(self, T: float, limit: float, layers: int) -> int | None:
        """Fewest recomputed layers (of ``layers``) that hold ``T`` tokens under ``limit``; None if all do not."""
        mem = self.item_memory
        if mem(T, layers) > limit:
            return None
        per_layer = self.memory_per_layer + T * self.memory_per_layer_token
        if per_layer <= 0:
            return 0
        r = min(max(math.ceil((mem(T, 0) - limit) / per_layer), 0), layers)
        while r > 0 and mem(T, r - 1) <= limit:  # rounding at the boundary: the answer is the bisection's
            r -= 1
        while r < layers and mem(T, r) > limit:
            r += 1
        return r

    def max_length(self, limit: float, r: int, sp: int) -> int:
        """Most tokens one micro-batch holds under ``limit`` with ``r`` recomputed layers; 0 below ``sp``."""
        base = self.memory - r * self.memory_per_layer
        per_token = self.memory_per_token - r * self.memory_per_layer_token
        if base + sp * per_token > limit:
            return 0
        if per_token <= 0:
            return 1 << 40  # memory does not grow with length: the generic search's cap
        n = int((limit - base) / per_token)
        while n > 0 and self.item_memory(n, r) > limit:
            n -= 1
        while self.item_memory(n + 1, r) <= limit:
            n += 1
        return n if n >= sp else 0


class LinearCostModel(CostModel):
    """A cost model whose Ulysses answers are one :class:`LinearCost` per SP size (:meth:`linear_cost`, cached by
    :meth:`linear`), and whose rings (``sp = ring x u``, when :attr:`prices_ring`) are the ``u``-rank item on ``T /
    ring`` tokens plus the ring's steps and buffers (:mod:`~lightning_dcp.planning.ring`, needs ``hardware`` and
    :meth:`kv_bytes_per_token`), and whose tensor-parallel items (``tp > 1``, when :attr:`prices_tp`) are the same
    item on Ulysses ``sp / ring`` with its all-to-all scaled and the TP collectives added
    (:mod:`~lightning_dcp.planning.tensor_parallel`, needs :meth:`tp_terms`)."""

    fast_paths = True
    hardware: HardwareSpec | None = None
    no_ring_reason = "this cost model prices no ring attention; plan with ring=1"
    """The error for a ring on a model that prices none."""

    def linear_cost(self, sp: int) -> LinearCost:  # pragma: no cover - provided by the model
        """The :class:`LinearCost` of SP size ``sp`` (``ValueError`` naming the usable sizes otherwise)."""
        raise NotImplementedError

    def kv_bytes_per_token(self, u: int) -> float:  # pragma: no cover - provided by a model that prices rings
        """Key and value bytes one rank of a ``u``-rank Ulysses group holds per token after its all-to-all."""
        raise NotImplementedError

    def tp_terms(self) -> TPTerms:  # pragma: no cover - provided by a model that prices TP
        """What the model's TP collectives move and at what prices (:class:`~lightning_dcp.planning.tensor_parallel.TPTerms`)."""
        raise NotImplementedError

    def __init__(self) -> None:
        self._linear: dict[int, LinearCost] = {}
        self._ring_terms: dict[tuple[int, int], RingTerms] = {}
        self._tp_terms: TPTerms | None = None

    def linear(self, sp: int) -> LinearCost:
        """:meth:`linear_cost`, cached."""
        got = self._linear.get(sp)
        if got is None:
            got = self._linear[sp] = self.linear_cost(sp)
        return got

    def _sums(self, lengths: Sequence[int]) -> tuple[int, float]:
        tokens, work = 0, 0.0
        for n in lengths:
            tokens += n
            work += n * n
        return tokens, work

    # -- the fast paths -----------------------------------------------------------------------------
    def item_time_sum(self, tokens: Num, sq_sum: Num, n: Num, sp: int, recompute: Num, ring: int = 1,
                      ring_exposed: bool = True) -> Num:
        if ring != 1:
            return self._ring_time(tokens, sq_sum, n, sp, recompute, ring, ring_exposed)
        return (self._linear.get(sp) or self.linear(sp)).item_time(tokens, sq_sum, n, recompute)

    def item_memory_tokens(self, tokens: Num, sp: int, recompute: Num, ring: int = 1) -> Num:
        if ring != 1:
            u = self._ulysses(sp, ring)
            return self.linear(u).item_memory(tokens / ring, recompute) + ring_buffer_bytes(self._terms(sp, ring), tokens, ring)
        return (self._linear.get(sp) or self.linear(sp)).item_memory(tokens, recompute)

    # -- the interface -----------------------------------------------------------------------------
    def item_time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        tokens, work = self._sums(lengths)
        return self.item_time_sum(tokens, work, len(lengths), sp, recompute, ring)

    def item_time_lower(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        """On a ring, the time with its transfers hidden behind compute."""
        tokens, work = self._sums(lengths)
        return self.item_time_sum(tokens, work, len(lengths), sp, recompute, ring, ring_exposed=False)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.item_memory_tokens(sum(lengths), sp, recompute, ring)

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        if not 0 <= recompute <= self.num_layers:
            raise ValueError(f"recompute must be in [0, {self.num_layers}] (the model's layers), got {recompute!r}")
        T, W = self._sums(lengths)
        if ring == 1:
            return (self._linear.get(sp) or self.linear(sp)).item_cost(T, W, len(lengths), recompute)
        u = self._ulysses(sp, ring)
        c, terms = self.linear(u), self._terms(sp, ring)
        base = c.item_cost(T / ring, W / (ring * ring), len(lengths), recompute)
        fwd_bwd = ring_steps_compute(terms, T, W, ring, 0)
        return ItemCost(  # the later ring steps' compute in compute / recompute, their exposed transfers in comm
            compute=base.compute + fwd_bwd,
            recompute=base.recompute + ring_steps_compute(terms, T, W, ring, recompute) - fwd_bwd,
            comm=base.comm + ring_exposed(terms, T, W, ring, recompute),
            overhead=base.overhead + c.whole_tokens * T * (1.0 - 1.0 / ring),
            ideal=c.item_cost(T, W, len(lengths), 0).ideal * u / sp,  # the ideal does not depend on the split
        )

    def min_recompute(self, lengths: Sequence[int], sp: int, ring: int = 1) -> int | None:
        """Fewest recomputed layers that fit (closed form of eq. 6 on Ulysses), ``None`` if all do not."""
        if ring != 1:
            return CostModel.min_recompute(self, lengths, sp, ring)
        return self.linear(sp).min_recompute(sum(lengths), self.memory_limit, self.num_layers)

    def max_length(self, sp: int, recompute: int | None = None, ring: int = 1) -> int:
        """Longest single sequence on ``sp`` ranks with ``recompute`` layers (default all); 0 if none."""
        if ring != 1:
            return CostModel.max_length(self, sp, recompute, ring)
        return self.linear(sp).max_length(self.memory_limit, self.num_layers if recompute is None else recompute, sp)

    # -- tensor parallelism inside an item ----------------------------------------------------------
    def tp_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1, tp: int = 1) -> ItemCost:
        cost = self.item_cost(lengths, sp, recompute, ring)
        if tp <= 1:
            return cost
        return replace(cost, comm=cost.comm + self._tp_extra(float(sum(lengths)), sp, recompute, ring, tp))

    def tp_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1, tp: int = 1) -> float:
        return self.tp_memory_tokens(sum(lengths), sp, recompute, ring, tp)

    def tp_time_sum(self, tokens: Num, sq_sum: Num, n: Num, sp: int, recompute: Num, ring: int = 1, tp: int = 1,
                    ring_exposed: bool = True) -> Num:
        time = self.item_time_sum(tokens, sq_sum, n, sp, recompute, ring, ring_exposed)
        return time if tp <= 1 else time + self._tp_extra(tokens, sp, recompute, ring, tp)

    def tp_memory_tokens(self, tokens: Num, sp: int, recompute: Num, ring: int = 1, tp: int = 1) -> Num:
        mem = self.item_memory_tokens(tokens, sp, recompute, ring)
        if tp <= 1:
            return mem
        return mem + tp_buffer_bytes(self._tp(tp), tokens, ring, self._ulysses(sp, ring), tp)

    def _tp(self, tp: int) -> TPTerms:
        """:meth:`tp_terms`, cached; ``ValueError`` naming the fix on a model that prices no TP."""
        if not self.prices_tp:
            raise ValueError(self._no_tp(tp))
        if self._tp_terms is None:
            self._tp_terms = self.tp_terms()
        return self._tp_terms

    def _tp_extra(self, tokens: Num, sp: int, recompute: Num, ring: int, tp: int) -> Num:
        """What ``tp``-way TP adds to the item on Ulysses ``q = sp / ring``: its all-to-all scaled by
        :func:`~lightning_dcp.planning.tensor_parallel.a2a_share` (no latency left at ``u = 1``) and the TP
        collectives."""
        terms = self._tp(tp)
        q = self._ulysses(sp, ring)
        c = self.linear(q)
        a2a = (c.comm.tokens + recompute * c.comm_per_layer.tokens) * (tokens / ring)
        latency = c.comm.const + recompute * c.comm_per_layer.const
        extra = (a2a_share(q, tp) - 1.0) * a2a - (latency if tp == q else 0.0)
        return extra + tp_collective_time(terms, tokens, ring, q, tp, recompute)

    # -- rings ------------------------------------------------------------------------------------
    def ring_terms(self, sp: int, ring: int) -> RingTerms:
        """The ring's per-step terms at Ulysses size ``sp / ring`` (:mod:`~lightning_dcp.planning.ring`)."""
        if not self.prices_ring:
            raise ValueError(self.no_ring_reason)
        u = sp // ring
        c = self.linear(u)
        return hardware_ring_terms(self.hardware, sp, c.attn_fwd, c.attn_bwd, self.kv_bytes_per_token(u), self.num_layers)

    def _ulysses(self, sp: int, ring: int) -> int:
        """``sp / ring``; ``ValueError`` naming the fix when ``ring`` does not divide ``sp``."""
        sp, ring = int(sp), int(ring)
        if ring < 1 or sp % ring:
            raise ValueError(f"ring degree {ring} must be >= 1 and divide the SP size {sp}")
        return sp // ring

    def _terms(self, sp: int, ring: int) -> RingTerms:
        got = self._ring_terms.get((sp, ring))
        if got is None:
            got = self._ring_terms[(sp, ring)] = self.ring_terms(sp, ring)
        return got

    def _ring_time(self, tokens: Num, sq_sum: Num, n: Num, sp: int, recompute: Num, ring: int, exposed: bool) -> Num:
        """Item time on ``ring x (sp / ring)`` ranks: the subgroup's on ``1/ring`` of the tokens, the later ring steps
        (``exposed=False``: their transfers hidden), the whole micro-batch's host work."""
        u = self._ulysses(sp, ring)
        c = self.linear(u)
        base = c.item_time(tokens / ring, sq_sum / (ring * ring), n, recompute)
        time = base + (ring_steps if exposed else ring_steps_compute)(self._terms(sp, ring), tokens, sq_sum, ring, recompute)
        return time + c.whole_tokens * tokens * (1.0 - 1.0 / ring) if c.whole_tokens else time
