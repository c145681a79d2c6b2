"""Planner-side view of a cost model: cached capacities and fast item times.

Every policy asks the same three questions many times per step: how many tokens fit on an SP
group of size ``sp`` with ``r`` recomputed layers, the fewest recomputed layers that fit a
micro-batch, and the time of a packed micro-batch. :class:`CostView` answers them from tables
built once per (cost model, world size), and uses the cost model's fast paths when it has them
(``cost_model.fast_paths``):

- ``item_time_sum(tokens, sq_sum, n, sp, recompute, ring)`` — time from the token sum, the sum of
  squared lengths and the sample count (else ``item_time(lengths, ...)``);
- ``item_memory_tokens(tokens, sp, recompute, ring)`` — memory from the token count alone (else
  ``max_length``, i.e. a packed micro-batch is charged like one sequence of the same tokens,
  and the planner verifies every item with ``item_memory`` at the end).

Pure Python + numpy.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import numpy as np

from lightning_dcp.planning.cost_model import CostModel, shard_domain
from lightning_dcp.planning.plan import WorkItem
from lightning_dcp.planning.speeds import group_speed, uniform
from lightning_dcp.planning.topology import Topology


class CostView:
    """Cached capacities and times of ``cost_model`` for the SP sizes a world allows.

    Args:
        cost_model: any :class:`CostModel`.
        max_sp: the largest SP group allowed (the world, ``max_sp_size``, the shard group).
        rank_speeds: per-rank speeds the speed-aware policies plan with (:mod:`~lightning_dcp.planning.speeds`;
            None or all 1.0: the cost model as is).
        world_size: ranks of the world, for :attr:`topology` (default ``max_sp``).
        ring: offer ring sizes when the cost model prices them (:meth:`CostModel.sp_splits`).
    """

    def __init__(self, cost_model: CostModel, max_sp: int, rank_speeds: Sequence[float] | None = None, *,
                 world_size: int | None = None, ring: bool = True):
        self.cm = cost_model
        self.max_sp = int(max_sp)
        """The largest group the world, ``max_sp_size`` and the shard group allow (the heads may allow fewer: :attr:`sp_sizes`)."""
        self.speeds: tuple[float, ...] | None = None if uniform(rank_speeds) else tuple(float(s) for s in rank_speeds)
        """Per-rank speeds, or None when every rank runs at the cost model's pace."""
        self.num_layers = int(cost_model.num_layers)
        splits = {p: c for p, c in cost_model.sp_splits(max_sp, ring=ring).items() if p <= max_sp} or {1: (1,)}
        self.sp_sizes = sorted(splits)
        """Usable SP sizes, ascending (Ulysses sizes, and ring sizes where the cost model prices them)."""
        self.ring: dict[int, int] = {p: c[0] for p, c in splits.items()}
        """Ring degree of every SP size (1: Ulysses only); :meth:`_choose_rings` picks among candidates."""
        fast = cost_model.fast_paths
        self._time_base = cost_model.item_time_sum if fast else None
        self._mem_base = cost_model.item_memory_tokens if fast else None
        self.work = cost_model.attention_work
        """Attention work of one sample (``l**2`` for 1d; the model's own measure for 2d)."""
        self.exact_memory = callable(self._mem_base)
        self._cap: dict[int, list[int]] = {}
        self._est: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._vector_ok: bool | None = None
        self._bind()
        self._choose_rings({p: c for p, c in splits.items() if len(c) > 1})
        g = int(cost_model.gpus_per_node or 0) or None
        self.topology = Topology(int(world_size or max_sp), g, shard_domain(cost_model),
                                 {p: p // r for p, r in self.ring.items() if r > 1})
        """Where SP groups may go (:mod:`~lightning_dcp.planning.topology`)."""
        self._contains: dict[tuple, object] = {}

    def _bind(self) -> None:
        """The fast paths with every size's ring degree filled in (the bare methods when every ring is 1)."""
        rings = self.ring
        t, m = self._time_base, self._mem_base
        if all(r == 1 for r in rings.values()):
            self._time_fast, self._mem_fast = t, m
            return

        def time_fast(tokens, sq, n, sp, recompute, _t=t, _r=rings):
            return _t(tokens, sq, n, sp, recompute, _r.get(sp, 1))

        def mem_fast(tokens, sp, recompute, _m=m, _r=rings):
            return _m(tokens, sp, recompute, _r.get(sp, 1))

        self._time_fast = time_fast if callable(t) else None
        self._mem_fast = mem_fast if callable(m) else None

    def _choose_rings(self, choices: dict[int, tuple[int, ...]]) -> None:
        """For sizes with two splits (Ulysses, or Ulysses x ring across nodes), keep the faster one for the
        longest sample both hold at full recompute (what a group that large is for); ties: the first."""
        for p, cands in sorted(choices.items()):
            caps = [self._cap_with(p, r) for r in cands]
            fitting = [c for c in caps if c > 0]
            if not fitting:
                self.ring[p] = cands[0]
                continue
            ell = min(fitting)
            times = []
            for r, cap in zip(cands, caps):
                self._cap_with(p, r)
                rec = self.min_recompute(ell, p) if cap >= ell else None
                times.append(math.inf if rec is None else self.time([ell], p, rec))
            self.ring[p] = cands[times.index(min(times))]
        self._cap.clear()
        self._bind()

    def _cap_with(self, p: int, r: int) -> int:
        """Full-recompute capacity of size ``p`` at ring degree ``r`` (leaves that ring bound)."""
        self.ring[p] = r
        self._bind()
        self._cap.pop(p, None)
        return self.max_len(p)

    @property
    def fast_time(self):
        """The cost model's ``item_time_sum(tokens, work_sum, count, sp, recompute)`` at each size's ring degree, or
        None when it has no such fast path."""
        return self._time_fast

    @property
    def ulysses_sizes(self) -> list[int]:
        """The usable SP sizes the planner runs as plain Ulysses groups (ring degree 1), ascending."""
        return [p for p in self.sp_sizes if self.ring.get(p, 1) == 1]

    def ring_of(self, sp: int) -> int:
        """The ring degree the planner gives a group of ``sp`` ranks."""
        return self.ring.get(sp, 1)

    def fill_ok(self, count: int) -> np.ndarray:
        """``ok[k, c]`` for the first ``count`` SP sizes: :meth:`contains` of size ``k`` and size ``c``."""
        got = self._contains.get(("matrix", count))
        if got is None:
            cl = self.sp_sizes[:count]
            got = self._contains[("matrix", count)] = np.array([[self.contains(p, c) for c in cl] for p in cl], dtype=bool)
        return got  # type: ignore[return-value]

    def contains(self, outer: int, inner: int) -> bool:
        """Whether every group of ``outer`` ranks holds a group of ``inner`` ranks wherever it is placed (so a
        group of ``outer`` may run a sample planned for ``inner`` ranks as a fill on a sub-group)."""
        key = (outer, inner)
        got = self._contains.get(key)
        if got is None:
            got = self._contains[key] = self.topology.always_contains(outer, inner)
        return bool(got)

    # -- capacity ------------------------------------------------------------------------
    def capacities(self, sp: int, ring: int | None = None) -> list[int]:
        """``caps[r]``: most tokens one micro-batch on ``sp`` ranks holds with ``r`` recomputed layers (at ring degree
        ``ring``; default the view's ring degree of ``sp``)."""
        if ring is not None and ring != self.ring_of(sp):
            key = (sp, int(ring))
            caps = self._cap.get(key)  # type: ignore[call-overload]
            if caps is None:
                caps = self._cap[key] = self._monotone(  # type: ignore[index]
                    [int(self.cm.max_length(sp, r, int(ring))) for r in range(self.num_layers + 1)])
            return caps
        caps = self._cap.get(sp)
        if caps is None:
            caps = self._cap[sp] = self._monotone([self._max_tokens(sp, r) for r in range(self.num_layers + 1)])
        return caps

    @staticmethod
    def _monotone(caps: list[int]) -> list[int]:
        for r in range(1, len(caps)):  # more recompute never holds less
            caps[r] = max(caps[r], caps[r - 1])
        return caps

    def _max_tokens(self, sp: int, r: int) -> int:
        if not callable(self._mem_fast):
            return int(self.cm.max_length(sp, r, self.ring_of(sp)))
        limit = self.cm.memory_limit
        mem = self._mem_fast
        if mem(sp, sp, r) > limit:
            return 0
        lo, hi = sp, sp * 2
        while mem(hi, sp, r) <= limit:
            lo, hi = hi, hi * 2
            if hi > 1 << 42:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if mem(mid, sp, r) <= limit:
                lo = mid
            else:
                hi = mid
        return lo

    def max_len(self, sp: int, ring: int | None = None) -> int:
        """Longest micro-batch (tokens) ``sp`` ranks hold at full recompute."""
        return self.capacities(sp, ring)[-1]

    def min_recompute(self, tokens: int, sp: int, ring: int | None = None) -> int | None:
        """Fewest recomputed layers for a micro-batch of ``tokens`` on ``sp`` ranks; None if none fits."""
        caps = self.capacities(sp, ring)
        if tokens > caps[-1]:
            return None
        return bisect.bisect_left(caps, tokens)

    def min_sp(self, length: int) -> int | None:
        """Smallest usable SP size that holds a sample of ``length`` tokens, or None."""
        for p in self.sp_sizes:
            if self.max_len(p) >= length:
                return p
        return None

    def longest_fitting(self) -> int:
        return self.max_len(self.sp_sizes[-1])

    # -- time ----------------------------------------------------------------------------
    def speed(self, ranks: Sequence[int]) -> float:
        """Pace of an item on ``ranks``: its slowest member's speed (1.0 without speeds)."""
        return group_speed(self.speeds, ranks)

    def item_time(self, item: WorkItem) -> float:
        """Time of a plan item at its slowest member's pace."""
        return self.time(item.lengths, item.sp_size, item.recompute, item.ring) / self.speed(item.ranks)

    def time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int | None = None) -> float:
        """Time of one packed micro-batch (on ``ring`` x Ulysses; default the ring degree of ``sp``)."""
        if ring is None or ring == self.ring_of(sp):
            if self._time_fast is not None:
                w = self.work
                return self._time_fast(sum(lengths), float(sum(w(n) for n in lengths)), len(lengths), sp, recompute)
            ring = self.ring_of(sp)
        return self.cm.item_time(lengths, sp, recompute, ring)

    def time_many(self, tokens: np.ndarray, sq: np.ndarray, n: np.ndarray, sp: int, recompute: np.ndarray,
                  lower: bool = False) -> np.ndarray:
        """Times of many packed micro-batches on ``sp`` ranks from their sums (arrays, one entry each).

        ``tokens``: token sums, ``sq``: attention-work sums (:attr:`work`), ``n``: sample counts,
        ``recompute``: recomputed layers. One vectorized call of the cost model's
        ``item_time_sum`` when it accepts arrays (the analytic and profiled models do), else a loop.
        ``lower``: on a ring size, a lower bound linear in the sums (the ring's transfers hidden), for the
        step bound.
        """
        tokens = np.asarray(tokens, dtype=np.float64)
        fast = self._time_fast
        r = self.ring_of(sp)
        if lower and r > 1 and fast is not None:
            base = self._time_base
            fast = lambda t, q, k, p, rc: base(t, q, k, p, rc, r, False)  # noqa: E731
        if fast is not None and self._vector_ok is not False:
            try:
                out = np.asarray(fast(tokens, np.asarray(sq, dtype=np.float64), np.asarray(n),
                                      sp, np.asarray(recompute, dtype=np.float64)), dtype=np.float64)
                if out.shape == tokens.shape:
                    self._vector_ok = True
                    return out
            except (TypeError, ValueError):
                pass
            self._vector_ok = False
        if fast is not None:
            return np.array([fast(float(t), float(q), int(k), sp, int(rc))
                             for t, q, k, rc in zip(tokens.tolist(), np.asarray(sq).tolist(), np.asarray(n).tolist(),
                                                    np.asarray(recompute).tolist())], dtype=np.float64)
        raise TypeError("time_many needs a cost model with item_time_sum; use time() per micro-batch")

    def min_recompute_many(self, tokens: np.ndarray, sp: int) -> np.ndarray:
        """:meth:`min_recompute` of many micro-batches; ``-1`` where none fits."""
        caps = np.asarray(self.capacities(sp), dtype=np.int64)
        tokens = np.asarray(tokens, dtype=np.int64)
        r = np.searchsorted(caps, tokens, side="left")
        r[tokens > caps[-1]] = -1
        return r

    def time_uniform(self, length: float, count: float, sp: int, recompute: int) -> float:
        """Time of a micro-batch of ``count`` samples of ``length`` tokens (count may be fractional)."""
        if self._time_fast is not None:
            return self._time_fast(length * count, self.work(length) * count, count, sp, recompute)
        k = max(1, int(round(count)))
        return self.cm.item_time([int(length)] * k, sp, recompute, self.ring_of(sp)) * (count / k)

    def constant(self, sp: int, recompute: int) -> float:
        """Per-micro-batch constant on ``sp`` ranks: what a micro-batch costs beyond its samples' own terms.

        With a fast path, the time of an empty micro-batch; otherwise ``2 t([1]) - t([1, 1])``
        (exact for costs linear in the samples, never negative).
        """
        if self._time_fast is not None:
            return float(self._time_fast(0, 0.0, 0, sp, recompute))
        ring = self.ring_of(sp)
        return max(0.0, 2.0 * self.cm.item_time([1], sp, recompute, ring) - self.cm.item_time([1, 1], sp, recompute, ring))

    def split_costs(self, lengths: np.ndarray, sp: int, work: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(own, const)`` per sample on ``sp`` ranks: its own time in a well-packed micro-batch, and the
        per-micro-batch constant it pays when it opens one.

        The recompute is the one a micro-batch of ``max(l, pack_target(sp))`` tokens needs (of
        ``l`` tokens alone if that does not fit), as in :meth:`estimator`; ``own = t([l]) -
        const`` at that recompute. ``inf`` own time where the sample does not fit ``sp`` ranks.
        ``work``: the samples' :attr:`work` when the caller has it (the same values, not computed again).
        """
        L = np.asarray(lengths, dtype=np.int64)
        P = np.maximum(L, self.pack_target(sp))
        r = self.min_recompute_many(P, sp)
        alone = r < 0
        if alone.any():
            r[alone] = self.min_recompute_many(L[alone], sp)
        ok = r >= 0
        own = np.full(len(L), np.inf)
        const = np.zeros(len(L))
        if not ok.any():
            return own, const
        consts = {int(x): self.constant(sp, int(x)) for x in np.unique(r[ok]).tolist()}
        const[ok] = [consts[x] for x in r[ok].tolist()]
        if self._time_fast is not None:
            if work is None:
                w = np.array([self.work(int(n)) for n in L[ok].tolist()], dtype=np.float64)
            else:
                w = np.asarray(work, dtype=np.float64)[ok]
            t = self.time_many(L[ok], w, np.ones(int(ok.sum())), sp, r[ok])
        else:
            t = np.array([self.time([int(n)], sp, int(x)) for n, x in zip(L[ok].tolist(), r[ok].tolist())])
        own[ok] = np.maximum(t - const[ok], 0.0)
        return own, const

    # -- amortized per-sample estimates used for dispatch ---------------------------------
    def pack_target(self, sp: int, recompute_free: bool = False) -> int:
        """Token budget of a well-packed micro-batch on ``sp`` ranks.

        The budget with the lowest time per token among the recompute thresholds
        ``caps[r]`` (reference samples of 2048 tokens or the budget, whichever is smaller);
        ``recompute_free`` forces ``r = 0``.
        """
        key = ("target", sp, recompute_free)
        got = self._est.get(key)
        if got is not None:
            return got  # type: ignore[return-value]
        caps = self.capacities(sp)
        best, best_t = caps[0], math.inf
        options = range(0, 1) if recompute_free else range(len(caps))
        for r in options:
            T = caps[r]
            if T <= 0 or (r > 0 and T == caps[r - 1]):
                continue
            ell = min(T, 2048)
            per_tok = self.time_uniform(ell, T / ell, sp, r) / T
            if per_tok < best_t * (1 - 1e-9):
                best, best_t = T, per_tok
        best = max(best, 1)
        self._est[key] = best  # type: ignore[assignment]
        return best

    def estimator(self, sp: int, full_recompute: bool = False):
        """Per-sample amortized time on ``sp`` ranks as a vectorized function of the lengths.

        A sample of length ``l`` is charged its share ``l / P`` of a micro-batch of ``P =
        max(l, pack_target)`` tokens made of length-``l`` samples, with the recompute that
        micro-batch needs (all layers when ``full_recompute``). Tabulated on a log grid once,
        then ``np.interp``; lengths over the SP group's capacity get ``inf``.
        """
        key = ("est", sp, full_recompute)
        table = self._est.get(key)
        if table is None:
            cap = self.max_len(sp)
            target = self.pack_target(sp)
            grid = np.unique(np.round(np.geomspace(1, max(cap, 2), 96)).astype(np.int64))
            grid = grid[grid <= cap] if cap >= 1 else grid[:0]
            vals = []
            for ell in grid.tolist():
                P = max(ell, target)
                r = self.num_layers if full_recompute else self.min_recompute(P, sp)
                if r is None:
                    P, r = ell, self.min_recompute(ell, sp)
                vals.append(self.time_uniform(ell, P / ell, sp, r) * ell / P)
            table = (np.log(grid.astype(np.float64)) if len(grid) else np.zeros(0), np.array(vals, dtype=np.float64), cap)
            self._est[key] = table  # type: ignore[assignment]
        logx, vals, cap = table  # type: ignore[misc]

        def est(lengths: np.ndarray) -> np.ndarray:
            if len(logx) == 0:
                return np.full(len(lengths), np.inf)
            out = np.interp(np.log(np.maximum(lengths, 1).astype(np.float64)), logx, vals)
            out[lengths > cap] = np.inf
            return out

        return est
