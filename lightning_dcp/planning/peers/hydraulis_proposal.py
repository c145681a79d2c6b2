"""Hydraulis' cost tables and its data-distribution-aware strategy proposal (Li et al., *Hydraulis*, §7, App. B).

- :class:`SchemeTable`: every ``<TP, PP>`` scheme a world allows, with ``MaxLen(P)`` (the longest
  micro-batch it holds, at each recompute count) and the latency model ``T(l, P)`` -- the stage time of
  a sequence of ``l`` tokens, vectorized over lengths (``a W(l) + b l + c`` per recompute count, exact
  for the analytic and profiled cost models, whose costs are linear in those sums), its micro-batch
  constant spread over a full micro-batch (the paper charges the constant once per micro-batch).
- :func:`propose`: the dynamic program of §7, eq. (4): ``t[n][l]``, the least latency of the dataset's
  sequences up to length ``l`` on ``n`` GPUs, each length interval given ``d`` pipelines of one scheme
  ``P`` (latency ``sum T(x, P) / d``, the slowest interval sets the step); the strategies ``S[N][l]``
  for every length class ``l`` are the candidates. The interval's latency also takes eq. (2)'s terms
  for its longest sequence ``l_max``: ``sum T / d + (PP - 1) T(l_max)`` and at least ``PP T(l_max)``
  (``sum T / d`` alone lets one sequence spread over ``d`` pipelines, so the DP never proposes the
  wide schemes a very long sequence needs). Simplifications: integer ``n`` and ``d`` (the
  paper relaxes them to steps of 0.1 and rounds), length classes at the dataset's quantiles by count and by
  latency (the paper steps ``l`` by 128 tokens), the sequence counts of one step of ``step_tokens`` tokens.

Pure Python + numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.parallel_costs import Scheme, scheme_capacities, scheme_cost, schemes_for

__all__ = ["SchemeTable", "Strategy", "propose"]

Strategy = tuple[tuple[Scheme, int], ...]
"""A heterogeneous strategy: ``(scheme, pipelines)`` pairs, largest ``MaxLen`` first."""


@dataclass
class _Coef:
    caps: np.ndarray      # caps[r]
    lin: np.ndarray       # (3, 2): [W, l, 1] coefficients at r = 0 and per recomputed layer
    const: np.ndarray     # (2,): micro-batch constant at r = 0 and per recomputed layer
    budget: int           # tokens of a full micro-batch without recompute (>= 1)


class SchemeTable:
    """The schemes of pipelines of ``sizes`` ranks and their ``MaxLen`` / ``T(l, P)`` (see the module docstring)."""

    def __init__(self, cost_model: CostModel, sizes: Sequence[int], work=None):
        self.cm = cost_model
        self.work = work or (lambda n: float(n) * n)
        self.schemes: list[Scheme] = [s for size in sizes for s in schemes_for(cost_model, size)]
        self._coef: dict[Scheme, _Coef] = {}
        for s in self.schemes:
            caps = np.asarray(scheme_capacities(cost_model, s), dtype=np.int64)
            if caps[-1] <= 0:
                continue
            self._coef[s] = self._fit(s, caps)
        self.schemes = [s for s in self.schemes if s in self._coef]

    def _fit(self, s: Scheme, caps: np.ndarray) -> _Coef:
        L = self.cm.num_layers
        pts = [1, 1024, 65536]
        X = np.array([[self.work(x), x, 1.0] for x in pts])
        lin = np.zeros((3, 2))
        const = np.zeros(2)
        for col, r in enumerate((0, L)):
            c0 = scheme_cost(self.cm, [], s, r).total
            y = np.array([scheme_cost(self.cm, [x], s, r).total - c0 for x in pts])
            lin[:, col] = np.linalg.solve(X, y)
            const[col] = c0
        lin[:, 1] = (lin[:, 1] - lin[:, 0]) / L  # per recomputed layer
        const[1] = (const[1] - const[0]) / L
        return _Coef(caps, lin, const, max(int(caps[0]), 1))

    def max_len(self, s: Scheme) -> int:
        """``MaxLen(P)``: the longest sequence the scheme holds (every layer recomputed)."""
        return int(self._coef[s].caps[-1])

    def budget(self, s: Scheme) -> int:
        """Tokens of a full micro-batch without recomputation."""
        return self._coef[s].budget

    def recompute(self, s: Scheme, tokens: np.ndarray) -> np.ndarray:
        """Fewest recomputed layers for micro-batches of ``tokens``; ``-1`` where none fits."""
        caps = self._coef[s].caps
        r = np.searchsorted(caps, tokens, side="left")
        return np.where(np.asarray(tokens) > caps[-1], -1, r)

    def stage_time(self, s: Scheme, tokens: float, work: float, n: int, r: int) -> float:
        """Stage time of a micro-batch from its sums (tokens, attention work, sequences) at ``r``."""
        c = self._coef[s]
        a = c.lin[:, 0] + r * c.lin[:, 1]
        return float(a[0] * work + a[1] * tokens + a[2] * n + c.const[0] + r * c.const[1])

    def seq_time(self, s: Scheme, lengths: np.ndarray) -> np.ndarray:
        """``T(l, P)`` of each length: its own stage time at the recompute it needs in a full micro-batch,
        plus its share of that micro-batch's constant; ``inf`` where the scheme cannot hold it."""
        c = self._coef[s]
        L = np.asarray(lengths, dtype=np.float64)
        r = self.recompute(s, np.maximum(L, c.budget).astype(np.int64))
        alone = r < 0
        if alone.any():
            r = np.where(alone, self.recompute(s, L.astype(np.int64)), r)
        W = np.array([self.work(int(x)) for x in L.tolist()]) if len(L) < 4096 else self._work_vec(L)
        rr = np.maximum(r, 0).astype(np.float64)
        a = c.lin[:, [0]] + rr[None, :] * c.lin[:, [1]]
        own = a[0] * W + a[1] * L + a[2]
        share = (c.const[0] + rr * c.const[1]) * L / np.maximum(L, c.budget)
        out = own + share
        out[r < 0] = np.inf
        return out

    def _work_vec(self, L: np.ndarray) -> np.ndarray:
        uniq, inv = np.unique(L.astype(np.int64), return_inverse=True)
        return np.array([self.work(int(x)) for x in uniq.tolist()])[inv]


def propose(table: SchemeTable, lengths: Sequence[int], world_size: int, step_tokens: int,
            classes: int = 12) -> list[Strategy]:
    """Hydraulis §7: candidate strategies ``S[N][l]`` for every length class ``l`` (see the module docstring)."""
    L = np.sort(np.asarray(list(lengths), dtype=np.int64))
    if not len(L) or not table.schemes:
        return []
    scale = step_tokens / max(int(L.sum()), 1)
    q = np.linspace(0, 1, classes + 1)[1:]
    by_count = np.quantile(L, q, method="higher")
    cum = np.cumsum(table.seq_time(table.schemes[-1], L).clip(max=1e30))
    by_work = L[np.minimum(np.searchsorted(cum, q * cum[-1]), len(L) - 1)]
    edges = np.concatenate([[0], np.unique(np.concatenate([by_count, by_work]).astype(np.int64))])
    G = len(edges) - 1
    N = world_size
    times = [table.seq_time(s, L) for s in table.schemes]
    pref = [np.concatenate([[0.0], np.cumsum(np.where(np.isfinite(t), t, 0.0))]) for t in times]
    idx = np.searchsorted(L, edges, side="right")  # sequences with length <= edges[i]: L[:idx[i]]
    INF = math.inf
    t = np.full((N + 1, G + 1), INF)
    t[:, 0] = 0.0
    choice: dict[tuple[int, int], tuple[int, int, int, int]] = {}
    ns = np.arange(N + 1)
    for i in range(1, G + 1):
        best = np.full(N + 1, INF)
        arg = np.full((N + 1, 3), -1, dtype=np.int64)
        for k, s in enumerate(table.schemes):
            if table.max_len(s) < edges[i]:
                continue
            size = s.size
            ds = np.arange(1, N // size + 1)
            if not len(ds):
                continue
            src = ns[None, :] - (ds * size)[:, None]  # GPUs left for the shorter classes
            ok = src >= 0
            t_top = float(times[k][idx[i] - 1])  # T(l_max, P) of the class's longest sequence
            for j in range(i):
                work = (pref[k][idx[i]] - pref[k][idx[j]]) * scale
                prev = np.where(ok, t[np.clip(src, 0, N), j], INF)
                lat = np.maximum(work / ds + (s.pp - 1) * t_top, s.pp * t_top)
                cand = np.maximum(prev, lat[:, None])
                d_best = np.argmin(cand, axis=0)
                val = cand[d_best, ns]
                better = val < best
                if better.any():
                    best = np.where(better, val, best)
                    arg[better] = np.stack([np.full(int(better.sum()), k), ds[d_best[better]],
                                            np.full(int(better.sum()), j)], axis=1)
        col = np.minimum.accumulate(best)  # t[n][i] = min(t[n-1][i], ...)
        src_n = np.maximum.accumulate(np.where(best <= col, ns, 0))
        t[:, i] = col
        for n in range(N + 1):
            if np.isfinite(col[n]):
                k, d, j = (int(x) for x in arg[src_n[n]])
                choice[(n, i)] = (k, d, j, int(src_n[n]))
    out: list[Strategy] = []
    for i in range(1, G + 1):
        if not np.isfinite(t[N, i]):
            continue
        strat: dict[Scheme, int] = {}
        n, ii = N, i
        while ii > 0:
            k, d, j, n_at = choice[(n, ii)]
            s = table.schemes[k]
            strat[s] = strat.get(s, 0) + d
            n, ii = n_at - d * s.size, j
        key = tuple(sorted(strat.items(), key=lambda kv: (-table.max_len(kv[0]), -kv[0].size, -kv[0].tp)))
        if key not in out:
            out.append(key)
    return out
