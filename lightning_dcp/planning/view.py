"""The planner's view of a cost model: cached capacities, fast item times, and the split of every item.

Policies ask the same questions many times a step: how many tokens a micro-batch on ``sp`` ranks holds with ``r``
recomputed layers, the fewest recomputed layers that fit it, its time. :class:`CostView` answers them from tables
built once per (cost model, world), through the model's fast paths (``item_time_sum`` / ``item_memory_tokens``) when
it has them (else every item is checked with ``item_memory`` at the end, :class:`~lightning_dcp.planning.planner.Planner`).

**Splits.** An SP group of ``sp`` ranks runs an item as ``ring x ulysses``. Each size has a *default* split
(:meth:`ring_of`: the faster of its candidates for the longest sample both hold), what the baselines and Algorithm 1
run. dcp chooses the split per item (:meth:`setting`) among :attr:`item_splits`: every Ulysses size the model prices
(dividing the heads) times any ring degree (:attr:`item_rings`), pure rings included, when the model prices rings; a
group larger than a node only takes splits whose Ulysses subgroups its placement keeps inside nodes. With ``max_tp >
1`` (and a cost model that prices it) a split may also run ``tp``-way tensor parallelism inside each subgroup
(:mod:`~lightning_dcp.planning.tensor_parallel`): ``tp`` divides a node's GPUs and the subgroup, and a group larger
than a node starts at a multiple of every ``tp`` it may take (its TP groups stay inside nodes).

Pure Python + numpy.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, NamedTuple, Sequence

import numpy as np

from lightning_dcp.planning.cost_model import CostModel, shard_domain, with_rounds
from lightning_dcp.planning.plan import WorkItem
from lightning_dcp.planning.sp_sizes import item_rings, item_splits, ring_candidates, tp_degrees
from lightning_dcp.planning.speeds import group_speed, uniform
from lightning_dcp.planning.topology import Topology

__all__ = ["CostView", "Setting", "Split"]

Split = tuple[int, int]
"""An item's split of its SP group: ``(ring degree, tensor-parallel degree)``."""


class Setting(NamedTuple):
    """An item's split and recompute, with its time at the cost model's pace."""

    ring: int
    recompute: int
    time: float
    tp: int = 1

Estimator = Callable[[np.ndarray], np.ndarray]


class CostView:
    """Cached capacities and times of ``cost_model`` for the SP sizes a world allows.

    Args:
        cost_model: any :class:`CostModel`.
        max_sp: the largest SP group allowed (the world, ``max_sp_size``, the shard group).
        rank_speeds: per-rank speeds the speed-aware policies plan with (None or all 1.0: the cost model's pace).
        world_size: ranks of the world, for :attr:`topology` (default ``max_sp``).
        ring: offer ring splits when the cost model prices them.
        max_tp: the largest tensor-parallel degree a split may take (1: none; more only where the cost model
            prices TP with fast paths).
    """

    def __init__(self, cost_model: CostModel, max_sp: int, rank_speeds: Sequence[float] | None = None, *,
                 world_size: int | None = None, ring: bool = True, max_tp: int = 1):
        self.cm = cost_model
        self._args = (max_sp, rank_speeds, world_size, ring)
        self._plain: CostView | None = None
        max_sp = min(int(max_sp), shard_domain(cost_model) or int(max_sp))  # no SP group crosses a shard group
        self.max_sp = max_sp
        """The largest group the world, ``max_sp_size`` and the shard group allow (the heads may allow fewer)."""
        self.speeds: tuple[float, ...] | None = None if uniform(rank_speeds) else tuple(float(s) for s in rank_speeds)
        """Per-rank speeds, or None when every rank runs at the cost model's pace."""
        self.num_layers = int(cost_model.num_layers)
        splits = {p: c for p, c in cost_model.sp_splits(max_sp, ring=ring).items() if p <= max_sp} or {1: (1,)}
        self.sp_sizes = sorted(splits)
        """Usable SP sizes, ascending (Ulysses sizes, and ring sizes where the cost model prices them)."""
        self.ring: dict[int, int] = {p: c[0] for p, c in splits.items()}
        """The default ring degree of every size (1: Ulysses)."""
        self.fast_paths = bool(cost_model.fast_paths)
        """Whether the cost model answers from a micro-batch's sums (``item_time_sum``, ``item_memory_tokens``)."""
        self.work = cost_model.attention_work
        """Attention work of one sample (``l**2`` for 1d; the model's own measure for 2d)."""
        self.exact_memory = self.fast_paths
        self._cap: dict[tuple[int, int], list[int]] = {}
        self._est: dict[tuple, object] = {}
        self._vector_ok: bool | None = None
        for p, cands in sorted(splits.items()):
            if len(cands) > 1:
                self.ring[p] = self._faster_split(p, cands)
        g = int(cost_model.gpus_per_node or 0) or None
        self.max_tp = int(max_tp) if cost_model.prices_tp and self.fast_paths and g else 1
        """The largest tensor-parallel degree a split may take (1: none)."""
        priced = ring and cost_model.prices_ring
        cands = {p: ring_candidates(p, self.ring[p], set(cost_model.sp_sizes(p)) if priced else None)
                 for p in self.sp_sizes}
        tps = tp_degrees(cands, g, self.max_tp) if self.max_tp > 1 and g else {}
        align = {p: p // r for p, r in self.ring.items() if r > 1}
        for p, ts in tps.items():  # a group larger than a node keeps its TP groups inside nodes
            if g and p > g and ts:
                align[p] = math.lcm(align.get(p, 1), *ts)
        self.topology = Topology(int(world_size or max_sp), g, shard_domain(cost_model), align)
        """Where SP groups may go (:mod:`~lightning_dcp.planning.topology`)."""
        node, al = self.topology.node_size, self.topology.align
        self.item_rings: dict[int, tuple[int, ...]] = {p: item_rings(p, cands[p], node, al.get(p, 1))
                                                        for p in self.sp_sizes}
        """Every ring degree an item on ``p`` ranks may take without TP, the default first."""
        self.item_splits: dict[int, tuple[Split, ...]] = {
            p: item_splits(p, self.item_rings[p], tps.get(p, ()), node, al.get(p, 1)) for p in self.sp_sizes}
        """Every ``(ring, tp)`` split an item on ``p`` ranks may take (dcp's per-item split), the default first: the
        rings of :attr:`item_rings` without TP, then the TP splits."""
        self._contains: dict[tuple, object] = {}

    def _faster_split(self, p: int, cands: Sequence[int]) -> int:
        """The faster of ``cands`` for the longest sample they all hold at full recompute; ties: the first."""
        caps = [self.max_len(p, r) for r in cands]
        fitting = [c for c in caps if c > 0]
        if not fitting:
            return cands[0]
        ell = min(fitting)
        times = [self._time([ell], p, self.min_recompute(ell, p, r), r) if cap >= ell else math.inf
                 for r, cap in zip(cands, caps)]
        return cands[times.index(min(times))]

    def ring_of(self, sp: int) -> int:
        """The default ring degree of a group of ``sp`` ranks."""
        return self.ring.get(sp, 1)

    @property
    def has_tp(self) -> bool:
        """Whether some split of some size runs tensor parallelism."""
        return any(t > 1 for splits in self.item_splits.values() for _, t in splits)

    def without_tp(self) -> "CostView":
        """This view without TP splits (itself when it has none): the same model, sizes, speeds and rings."""
        if not self.has_tp:
            return self
        if self._plain is None:
            max_sp, speeds, world, ring = self._args
            self._plain = CostView(self.cm, max_sp, speeds, world_size=world, ring=ring)
        return self._plain

    def with_domain(self, domain: int) -> "CostView":
        """This view with SP groups inside blocks of ``domain`` ranks (lockstep rounds: a multiple of the shard group),
        the same model otherwise (:func:`~lightning_dcp.planning.cost_model.with_rounds`)."""
        max_sp, speeds, world, ring = self._args
        cm = with_rounds(self.cm, self.cm.rounds.with_domain(domain))
        return CostView(cm, min(int(max_sp), int(domain)), speeds, world_size=world, ring=ring, max_tp=self.max_tp)

    def splits_of(self, sp: int) -> tuple[Split, ...]:
        """:attr:`item_splits` of ``sp`` (the default split alone for a size the view does not list)."""
        got = self.item_splits.get(sp)
        return got if got is not None else ((self.ring_of(sp), 1),)

    def fill_ok(self, count: int) -> np.ndarray:
        """``ok[k, c]`` for the first ``count`` SP sizes: :meth:`contains` of size ``k`` and size ``c``."""
        got = self._contains.get(("matrix", count))
        if got is None:
            cl = self.sp_sizes[:count]
            got = self._contains[("matrix", count)] = np.array([[self.contains(p, c) for c in cl] for p in cl], dtype=bool)
        return got  # type: ignore[return-value]

    def contains(self, outer: int, inner: int) -> bool:
        """Whether every group of ``outer`` ranks holds a group of ``inner`` ranks wherever it is placed (a group of
        ``outer`` may then run a sample planned for ``inner`` ranks as a fill on a sub-group)."""
        key = (outer, inner)
        got = self._contains.get(key)
        if got is None:
            got = self._contains[key] = self.topology.always_contains(outer, inner)
        return bool(got)

    # -- capacity ------------------------------------------------------------------------
    def capacities(self, sp: int, ring: int | None = None, tp: int = 1) -> list[int]:
        """``caps[r]``: most tokens one micro-batch on ``sp`` ranks holds with ``r`` recomputed layers, at ring degree
        ``ring`` (default: the size's default split) and tensor-parallel degree ``tp``."""
        key = (sp, self.ring_of(sp) if ring is None else int(ring), int(tp))
        caps = self._cap.get(key)
        if caps is None:
            caps = [self._max_tokens(sp, r, key[1], key[2]) for r in range(self.num_layers + 1)]
            for r in range(1, len(caps)):  # more recompute never holds less
                caps[r] = max(caps[r], caps[r - 1])
            self._cap[key] = caps
        return caps

    def item_capacities(self, sp: int) -> list[int]:
        """:meth:`capacities` over every split an item on ``sp`` ranks may take: the most any of them holds."""
        key = ("any", sp)
        got = self._est.get(key)
        if got is None:
            got = self._est[key] = [max(c) for c in zip(*(self.capacities(sp, r, t) for r, t in self.splits_of(sp)))]
        return got  # type: ignore[return-value]

    def _max_tokens(self, sp: int, r: int, ring: int, tp: int = 1) -> int:
        if not self.fast_paths:
            return int(self.cm.max_length(sp, r, ring))
        limit, mem = self.cm.memory_limit, self._memory_sum(tp)
        if mem(sp, sp, r, ring) > limit:
            return 0
        lo, hi = sp, sp * 2
        while mem(hi, sp, r, ring) <= limit:
            lo, hi = hi, hi * 2
            if hi > 1 << 42:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if mem(mid, sp, r, ring) <= limit:
                lo = mid
            else:
                hi = mid
        return lo

    def max_len(self, sp: int, ring: int | None = None, tp: int = 1) -> int:
        """Longest micro-batch (tokens) ``sp`` ranks hold at full recompute."""
        return self.capacities(sp, ring, tp)[-1]

    def min_recompute(self, tokens: int, sp: int, ring: int | None = None, tp: int = 1) -> int | None:
        """Fewest recomputed layers for a micro-batch of ``tokens`` on ``sp`` ranks; None if none fits."""
        caps = self.capacities(sp, ring, tp)
        if tokens > caps[-1]:
            return None
        return bisect.bisect_left(caps, tokens)

    def longest_fitting(self) -> int:
        """The longest sample any size and split holds."""
        return max(self.item_capacities(p)[-1] for p in self.sp_sizes)

    # -- time ----------------------------------------------------------------------------
    def speed(self, ranks: Sequence[int]) -> float:
        """Pace of an item on ``ranks``: its slowest member's speed (1.0 without speeds)."""
        return group_speed(self.speeds, ranks)

    def item_time(self, item: WorkItem) -> float:
        """Time of a plan item at its slowest member's pace."""
        return self.time(item.lengths, item.sp_size, item.recompute, item.ring, item.tp) / self.speed(item.ranks)

    def time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int | None = None, tp: int = 1) -> float:
        """Time of one packed micro-batch (on ``ring`` x Ulysses, default the size's default split; ``tp``-way tensor
        parallel inside)."""
        return self._time(lengths, sp, recompute, self.ring_of(sp) if ring is None else ring, tp=tp)

    def _time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int, work: float | None = None,
              tp: int = 1) -> float:
        if self.fast_paths:
            w = float(sum(self.work(n) for n in lengths)) if work is None else work
            return self._time_sum(tp)(sum(lengths), w, len(lengths), sp, recompute, ring)
        return self.cm.item_time(lengths, sp, recompute, ring)

    def _time_sum(self, tp: int) -> Callable:
        """The fast path ``(tokens, work, n, sp, recompute, ring, ring_exposed=True)`` at ``tp``: ``item_time_sum``,
        or ``tp_time_sum`` with ``tp`` bound."""
        if tp == 1:
            return self.cm.item_time_sum
        return lambda a, q, k, p, rc, rg, exposed=True: self.cm.tp_time_sum(a, q, k, p, rc, rg, tp, exposed)

    def _memory_sum(self, tp: int) -> Callable:
        """``(tokens, sp, recompute, ring)`` at ``tp``: ``item_memory_tokens``, or ``tp_memory_tokens`` with ``tp``
        bound."""
        if tp == 1:
            return self.cm.item_memory_tokens
        return lambda tokens, p, rec, rg: self.cm.tp_memory_tokens(tokens, p, rec, rg, tp)

    def setting(self, lengths: Sequence[int], sp: int, work: float | None = None) -> Setting | None:
        """The fastest split (:attr:`item_splits`) and its fewest recomputed layers for a micro-batch of ``lengths``
        on ``sp`` ranks, with its time (``work``: its attention work, when the caller has it); None if none holds it.
        A ring split without TP is tried only where its attention per token is high enough that it can win
        (:meth:`_ring_threshold`); ties keep the earlier split (the default first)."""
        splits = self.splits_of(sp)
        tokens = sum(lengths)
        if work is None and (self.fast_paths or len(splits) > 1):
            work = float(sum(self.work(n) for n in lengths))
        best = None
        for ring, tp in splits:
            if best is not None and tp == 1 and work < self._ring_threshold(sp, ring) * tokens:
                continue
            caps = self.capacities(sp, ring, tp)
            if tokens > caps[-1]:
                continue
            rec = bisect.bisect_left(caps, tokens)
            t = self._time(lengths, sp, rec, ring, work, tp)
            if best is None or t < best.time * (1 - 1e-12):
                best = Setting(ring, rec, t, tp)
        return best

    def _ring_threshold(self, sp: int, ring: int) -> float:
        """Attention work per token (a sample's length, for 1d models) below which a micro-batch on split ``ring``
        is never faster than on the default split: the shortest sample it beats alone, over a log grid, with half of
        it as a margin (inf: it never wins)."""
        key = ("threshold", sp, ring)
        got = self._est.get(key)
        if got is None:
            default = self.ring_of(sp)
            cap = min(self.max_len(sp, ring), self.max_len(sp, default))
            got = math.inf
            for ell in np.unique(np.round(np.geomspace(max(sp, 2), max(cap, 3), 48)).astype(np.int64)).tolist():
                r1, r0 = self.min_recompute(ell, sp, ring), self.min_recompute(ell, sp, default)
                if r1 is not None and r0 is not None and \
                        self._time([ell], sp, r1, ring) < self._time([ell], sp, r0, default):
                    got = 0.5 * self.work(ell) / ell
                    break
            self._est[key] = got
        return got  # type: ignore[return-value]

    def time_many(self, tokens: np.ndarray, sq: np.ndarray, n: np.ndarray, sp: int, recompute: np.ndarray,
                  lower: bool = False, ring: int | None = None, tp: int = 1) -> np.ndarray:
        """Times of many micro-batches on ``sp`` ranks from their sums (token sums ``tokens``, attention-work sums
        ``sq``, sample counts ``n``, recomputed layers), one vectorized ``item_time_sum`` call where the model takes
        arrays. ``lower``: on a ring, the lower bound with its transfers hidden (the step bound's)."""
        if not self.fast_paths:
            raise TypeError("time_many needs a cost model with fast paths (item_time_sum); use time() per micro-batch")
        r = self.ring_of(sp) if ring is None else ring
        t = self._time_sum(tp)
        tokens = np.asarray(tokens, dtype=np.float64)
        if self._vector_ok is not False:
            try:
                out = np.asarray(t(tokens, np.asarray(sq, dtype=np.float64), np.asarray(n), sp,
                                   np.asarray(recompute, dtype=np.float64), r, not lower), dtype=np.float64)
                if out.shape == tokens.shape:
                    self._vector_ok = True
                    return out
            except (TypeError, ValueError):
                pass
            self._vector_ok = False
        return np.array([t(float(a), float(q), int(k), sp, int(rc), r, not lower)
                         for a, q, k, rc in zip(tokens.tolist(), np.asarray(sq).tolist(), np.asarray(n).tolist(),
                                                np.asarray(recompute).tolist())], dtype=np.float64)

    def min_recompute_many(self, tokens: np.ndarray, sp: int, ring: int | None = None, tp: int = 1) -> np.ndarray:
        """:meth:`min_recompute` of many micro-batches; ``-1`` where none fits."""
        caps = np.asarray(self.capacities(sp, ring, tp), dtype=np.int64)
        tokens = np.asarray(tokens, dtype=np.int64)
        r = np.searchsorted(caps, tokens, side="left")
        r[tokens > caps[-1]] = -1
        return r

    def time_uniform(self, length: float, count: float, sp: int, recompute: int, ring: int | None = None,
                     tp: int = 1) -> float:
        """Time of a micro-batch of ``count`` samples of ``length`` tokens (count may be fractional)."""
        ring = self.ring_of(sp) if ring is None else ring
        if self.fast_paths:
            return self._time_sum(tp)(length * count, self.work(length) * count, count, sp, recompute, ring)
        k = max(1, int(round(count)))
        return self.cm.item_time([int(length)] * k, sp, recompute, ring) * (count / k)

    def constant(self, sp: int, recompute: int, ring: int | None = None, tp: int = 1) -> float:
        """Per-micro-batch constant on ``sp`` ranks: the time of an empty micro-batch (fast path), else ``2 t([1]) -
        t([1, 1])`` (exact for costs linear in the samples, never negative)."""
        ring = self.ring_of(sp) if ring is None else ring
        if self.fast_paths:
            return float(self._time_sum(tp)(0, 0.0, 0, sp, recompute, ring))
        t = self.cm.item_time
        return max(0.0, 2.0 * t([1], sp, recompute, ring) - t([1, 1], sp, recompute, ring))

    def split_costs(self, lengths: np.ndarray, sp: int, work: np.ndarray | None = None,
                    ring: int | None = None, tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """``(own, const)`` per sample on ``sp`` ranks: its own time in a well-packed micro-batch and the
        per-micro-batch constant it pays when it opens one (the recompute of a micro-batch of ``max(l,
        pack_target)`` tokens, or of ``l`` alone when that does not fit); ``inf`` own time where it does not fit.
        ``ring=None``: over every split an item may take, the one of least own + constant."""
        if ring is None and len(self.splits_of(sp)) > 1:
            best = None
            for r, t in self.splits_of(sp):
                own, const = self.split_costs(lengths, sp, work, r, t)
                if best is None:
                    best = (own, const)
                    continue
                take = own + const < best[0] + best[1]
                best = (np.where(take, own, best[0]), np.where(take, const, best[1]))
            return best  # type: ignore[return-value]
        ring = self.ring_of(sp) if ring is None else ring
        L = np.asarray(lengths, dtype=np.int64)
        r = self.min_recompute_many(np.maximum(L, self.pack_target(sp, ring=ring, tp=tp)), sp, ring, tp)
        alone = r < 0
        if alone.any():
            r[alone] = self.min_recompute_many(L[alone], sp, ring, tp)
        ok = r >= 0
        own, const = np.full(len(L), np.inf), np.zeros(len(L))
        if not ok.any():
            return own, const
        consts = {int(x): self.constant(sp, int(x), ring, tp) for x in np.unique(r[ok]).tolist()}
        const[ok] = [consts[x] for x in r[ok].tolist()]
        if self.fast_paths:
            w = (np.array([self.work(int(n)) for n in L[ok].tolist()], dtype=np.float64) if work is None
                 else np.asarray(work, dtype=np.float64)[ok])
            t = self.time_many(L[ok], w, np.ones(int(ok.sum())), sp, r[ok], ring=ring, tp=tp)
        else:
            t = np.array([self._time([int(n)], sp, int(x), ring) for n, x in zip(L[ok].tolist(), r[ok].tolist())])
        own[ok] = np.maximum(t - const[ok], 0.0)
        return own, const

    # -- amortized per-sample estimates used for dispatch ---------------------------------
    def pack_target(self, sp: int, recompute_free: bool = False, ring: int | None = None, tp: int = 1) -> int:
        """Token budget of a well-packed micro-batch on ``sp`` ranks: the recompute threshold ``caps[r]`` of lowest
        time per token (reference samples of 2,048 tokens or the budget); ``recompute_free``: ``r = 0``."""
        ring = self.ring_of(sp) if ring is None else ring
        key = ("target", sp, recompute_free, ring) if tp == 1 else ("target", sp, recompute_free, ring, tp)
        got = self._est.get(key)
        if got is None:
            caps = self.capacities(sp, ring, tp)
            best, best_t = caps[0], math.inf
            for r in range(1 if recompute_free else len(caps)):
                T = caps[r]
                if T <= 0 or (r > 0 and T == caps[r - 1]):
                    continue
                ell = min(T, 2048)
                per_tok = self.time_uniform(ell, T / ell, sp, r, ring, tp) / T
                if per_tok < best_t * (1 - 1e-9):
                    best, best_t = T, per_tok
            got = self._est[key] = max(best, 1)
        return got  # type: ignore[return-value]

    def estimator(self, sp: int, full_recompute: bool = False, ring: int | None = None, tp: int = 1) -> Estimator:
        """Per-sample amortized time on ``sp`` ranks, vectorized over lengths: a sample of length ``l`` is charged its
        share ``l / P`` of a micro-batch of ``P = max(l, pack_target)`` tokens of length-``l`` samples, with the
        recompute that needs (all layers when ``full_recompute``); tabulated on a log grid once, then interpolated;
        ``inf`` over the capacity."""
        ring = self.ring_of(sp) if ring is None else ring
        key = ("est", sp, full_recompute, ring) if tp == 1 else ("est", sp, full_recompute, ring, tp)
        table = self._est.get(key)
        if table is None:
            cap, target = self.max_len(sp, ring, tp), self.pack_target(sp, ring=ring, tp=tp)
            grid = np.unique(np.round(np.geomspace(1, max(cap, 2), 96)).astype(np.int64))
            grid = grid[grid <= cap] if cap >= 1 else grid[:0]
            vals = []
            for ell in grid.tolist():
                P = max(ell, target)
                r = self.num_layers if full_recompute else self.min_recompute(P, sp, ring, tp)
                if r is None:
                    P, r = ell, self.min_recompute(ell, sp, ring, tp)
                vals.append(self.time_uniform(ell, P / ell, sp, r, ring, tp) * ell / P)
            table = self._est[key] = (np.log(grid.astype(np.float64)) if len(grid) else np.zeros(0),
                                      np.array(vals, dtype=np.float64), cap)
        logx, vals, cap = table  # type: ignore[misc]

        def est(lengths: np.ndarray) -> np.ndarray:
            if len(logx) == 0:
                return np.full(len(lengths), np.inf)
            out = np.interp(np.log(np.maximum(lengths, 1).astype(np.float64)), logx, vals)
            out[lengths > cap] = np.inf
            return out

        return est

    def item_estimator(self, sp: int) -> Estimator:
        """:meth:`estimator` over every split an item on ``sp`` ranks may take: the least of them."""
        parts = [self.estimator(sp, ring=r, tp=t) for r, t in self.splits_of(sp)]
        if len(parts) == 1:
            return parts[0]
        return lambda lengths: np.minimum.reduce([e(lengths) for e in parts])
