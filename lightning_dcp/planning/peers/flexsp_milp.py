"""FlexSP's per-micro-batch MILP: which SP groups to form and which sequences each runs.

Source: Wang et al., *FlexSP: Accelerating Large Language Model Training via Flexible Sequence
Parallelism* (ASPLOS '25), and its solver (PKU-DAIR Hetu-Galvatron, ``galvatron/flexsp_solver``:
``flexSPOptimizer.solve_flexSP_bucket_seqs``, ``bucketing_seqs``, ``chunk_globalbatch``). The
problem, as the solver states it for one micro-batch of sequences on ``N`` devices:

- candidate groups ``p``: for every SP size ``s``, ``N / s`` copies (fewer below the largest size any
  sequence needs: ``(N - s_max * count_max) / s``); ``m_p`` in {0, 1} whether group ``p`` is formed;
- sequences are grouped into buckets ``k`` (upper length ``b_k``, ``n_k`` sequences) by a dynamic
  program that minimizes the padding ``sum(b_k - l)``; ``A_kp >= 0`` integer: how many of bucket
  ``k``'s sequences group ``p`` runs;
- minimize ``M`` subject to: every bucket fully assigned (``sum_p A_kp = n_k``); no bucket on a group
  smaller than its minimum SP size; memory: ``sum_k b_k A_kp <= cap(s_p)`` (the tokens ``s_p`` devices
  hold); time: ``sum_k t(b_k, s_p) A_kp + c(s_p) m_p <= M`` (per-sequence time plus the group's
  per-micro-batch constant); ``A`` only on formed groups, a formed group runs something; every device
  in exactly one group: ``sum_p s_p m_p = N``.

Solved with HiGHS through ``scipy.optimize.milp`` (FlexSP uses SCIP) to a 1% relative gap, under a
time limit and a node limit (the node limit keeps the result deterministic on every rank; a solve
stopped by the time limit may not be). Copies of one SP size are interchangeable, so ``m`` is ordered within each size
(symmetry breaking; the optimum is unchanged). Like FlexSP's solver, which seeds SCIP with balanced
homogeneous solutions, :func:`solve` keeps the better of the MILP's solution and the best
homogeneous greedy one (:func:`greedy`), so it is never worse than that greedy.

Pure Python + numpy + scipy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["Bucket", "Solution", "bucketize", "sp_options", "greedy", "solve", "objective", "chunk_sorted"]


@dataclass(frozen=True)
class Bucket:
    """Sequences (indices) whose lengths are at most ``bound``."""

    bound: int
    members: tuple[int, ...]


@dataclass
class Solution:
    """Groups formed (SP sizes) and the sequence indices each runs; ``M`` its objective (seconds)."""

    sizes: list[int]
    groups: list[list[int]]
    M: float
    source: str
    """``"milp"`` or ``"greedy"``."""
    solve_s: float = 0.0
    status: str = ""


def bucketize(lengths: Sequence[int], count: int, max_runs: int = 512) -> list[Bucket]:
    """``bucketing_seqs``: at most ``count`` buckets of the sorted lengths minimizing the padding
    ``sum(bound - l)`` (a dynamic program over the sorted order; above ``max_runs`` distinct runs the
    sorted lengths are first cut into ``max_runs`` runs of equal count, which only coarsens the choice
    of bucket edges)."""
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    srt = np.array([lengths[i] for i in order], dtype=np.float64)
    if n <= max_runs:
        edges = np.arange(1, n + 1)
    else:
        edges = np.unique(np.round(np.linspace(0, n, max_runs + 1)[1:]).astype(np.int64))
    R = len(edges)
    count = max(1, min(count, R))
    pref = np.concatenate([[0.0], np.cumsum(srt)])
    top = srt[edges - 1]
    starts = np.concatenate([[0], edges[:-1]])
    # cost[j, i]: runs j..i in one bucket, bound = the largest length of run i
    ends = edges[None, :]
    cnt = ends - starts[:, None]
    cost = top[None, :] * cnt - (pref[ends] - pref[starts][:, None])
    cost[np.tril_indices(R, -1)] = np.inf
    dp = cost[0].copy()
    back = [np.zeros(R, dtype=np.int64)]
    for _ in range(1, count):
        cand = dp[:-1, None] + cost[1:, :]  # previous bucket ends at run j-1, this one is runs j..i
        cand = np.vstack([np.full((1, R), np.inf), cand])
        j = np.argmin(cand, axis=0)
        best = cand[j, np.arange(R)]
        take = best < dp
        back.append(np.where(take, j, -1))
        dp = np.where(take, best, dp)
    # walk back: the last bucket of the best chain ends at run R - 1
    out: list[Bucket] = []
    i, level = R - 1, count - 1
    while i >= 0:
        while level > 0 and back[level][i] < 0:
            level -= 1
        j = int(back[level][i]) if level > 0 else 0
        lo, hi = int(starts[j]), int(edges[i])
        out.append(Bucket(int(srt[hi - 1]), tuple(order[lo:hi])))
        i, level = j - 1, level - 1
    return out[::-1]


def sp_options(N: int, sizes: Sequence[int], need: Sequence[int]) -> list[int]:
    """FlexSP's candidate groups: ``N / s`` copies of every SP size ``s``, fewer below the largest needed size."""
    s_max = max(need)
    c_max = sum(1 for x in need if x == s_max)
    out = []
    for s in sorted(sizes):
        if s < s_max:
            cnt = max(N - s_max * c_max, 0) // s
        else:
            cnt = N // s
        out.extend([s] * cnt)
    return out


def objective(sizes: Sequence[int], groups: Sequence[Sequence[int]], bound_of: Sequence[int],
              t_seq: Callable[[int, int], float], const: Callable[[int], float]) -> float:
    """The MILP's ``M`` of an assignment: the slowest group's ``sum t(b, s) + c(s)``."""
    return max((sum(t_seq(bound_of[i], s) for i in g) + const(s) for s, g in zip(sizes, groups) if g), default=0.0)


def greedy(N: int, buckets: Sequence[Bucket], options: Sequence[int], need: Sequence[int], cap: Callable[[int], int],
           t_seq: Callable[[int, int], float], const: Callable[[int], float]) -> Solution | None:
    """The best homogeneous solution: for every SP size ``s`` that holds every bucket, ``N / s`` groups of
    ``s``, sequences longest first each to the least-loaded group with room (FlexSP's initial solutions)."""
    bound_of = {}
    for bk in buckets:
        for i in bk.members:
            bound_of[i] = bk.bound
    seqs = sorted(bound_of, key=lambda i: (-bound_of[i], i))
    best = None
    for s in sorted(set(options)):
        if s < max(need) or N // s == 0:
            continue
        G = N // s
        loads = [0.0] * G
        room = [cap(s)] * G
        groups: list[list[int]] = [[] for _ in range(G)]
        ok = True
        for i in seqs:
            b = bound_of[i]
            fit = [g for g in range(G) if room[g] >= b]
            if not fit:
                ok = False
                break
            g = min(fit, key=lambda x: (loads[x], x))
            groups[g].append(i)
            loads[g] += t_seq(b, s)
            room[g] -= b
        if not ok:
            continue
        M = objective([s] * G, groups, bound_of, t_seq, const)
        if best is None or M < best.M:
            best = Solution([s] * G, groups, M, "greedy")
    return best


def solve(N: int, buckets: Sequence[Bucket], sizes: Sequence[int], cap: Callable[[int], int],
          t_seq: Callable[[int, int], float], const: Callable[[int], float], *, time_limit: float = 10.0,
          node_limit: int = 2000, gap: float = 0.01) -> Solution | None:
    """Solve one micro-batch's MILP (module docstring); the better of it and :func:`greedy`; None if neither is feasible."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    t0 = time.perf_counter()
    need = [min((s for s in sorted(sizes) if cap(s) >= bk.bound), default=10 ** 9) for bk in buckets]
    if max(need) > N:
        return None
    options = sp_options(N, [s for s in sizes if s <= N], need)
    base = greedy(N, buckets, options, need, cap, t_seq, const)
    A, lo, hi, ub = _milp_rows(N, buckets, options, need, cap, t_seq, const)
    K, P = len(buckets), len(options)
    nA, nv = K * P, K * P + P + 1
    iM = nv - 1
    c = np.zeros(nv)
    c[iM] = 1.0
    integrality = np.ones(nv)
    integrality[iM] = 0
    res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=integrality, bounds=Bounds(np.zeros(nv), ub),
               options={"time_limit": max(float(time_limit), 0.05), "node_limit": int(node_limit), "disp": False,
                        "mip_rel_gap": float(gap)})
    solve_s = time.perf_counter() - t0
    best = base
    if res.x is not None:
        x = np.round(res.x).astype(np.int64)
        sizes_out, groups = [], []
        for p, s in enumerate(options):
            if x[nA + p] <= 0:
                continue
            members: list[int] = []
            for k, bk in enumerate(buckets):
                members.extend([-1 - k] * int(x[k * P + p]))  # bucket slots, filled below
            sizes_out.append(s)
            groups.append(members)
        groups = _fill(groups, buckets)
        bound_of = {i: bk.bound for bk in buckets for i in bk.members}
        M = objective(sizes_out, groups, bound_of, t_seq, const)
        if sum(sizes_out) == N and (best is None or M <= best.M):
            best = Solution(sizes_out, groups, M, "milp")
    if best is not None:
        best.solve_s = solve_s
        best.status = str(res.message)
    return best


def _milp_rows(N: int, buckets: Sequence[Bucket], options: Sequence[int], need: Sequence[int], cap: Callable[[int], int],
               t_seq: Callable[[int, int], float], const: Callable[[int], float]) -> tuple[Any, list, list, Any]:
    """The MILP's constraint matrix, its row bounds and the variables' upper bounds (module docstring):
    variables ``A`` (bucket x option counts, k-major), ``m`` (option used) and ``M`` (the makespan)."""
    from scipy.sparse import coo_array

    K, P = len(buckets), len(options)
    nA = K * P
    nv = nA + P + 1  # A (k-major), m, M
    iM = nv - 1
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []
    r = 0

    def row(entries: list[tuple[int, float]], low: float, high: float) -> None:
        nonlocal r
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        lo.append(low)
        hi.append(high)
        r += 1

    total = sum(len(bk.members) for bk in buckets)
    for k, bk in enumerate(buckets):
        row([(k * P + p, 1.0) for p in range(P)], len(bk.members), len(bk.members))
    for p, s in enumerate(options):
        row([(k * P + p, float(bk.bound)) for k, bk in enumerate(buckets)] + [(nA + p, -float(cap(s)))], -np.inf, 0.0)
        row([(k * P + p, t_seq(bk.bound, s)) for k, bk in enumerate(buckets)] + [(nA + p, const(s)), (iM, -1.0)],
            -np.inf, 0.0)
        row([(k * P + p, 1.0) for k in range(K)] + [(nA + p, -float(total))], -np.inf, 0.0)
        row([(k * P + p, 1.0) for k in range(K)] + [(nA + p, -1.0)], 0.0, np.inf)
        if p + 1 < P and options[p + 1] == s:  # symmetry: copies of one size are formed in order
            row([(nA + p, 1.0), (nA + p + 1, -1.0)], 0.0, np.inf)
    row([(nA + p, float(s)) for p, s in enumerate(options)], N, N)
    ub = np.full(nv, np.inf)
    for k, bk in enumerate(buckets):
        for p, s in enumerate(options):
            ub[k * P + p] = 0.0 if s < need[k] else len(bk.members)
    ub[nA:nA + P] = 1.0
    return coo_array((vals, (rows, cols)), shape=(r, nv)).tocsr(), lo, hi, ub


def _fill(groups: list[list[int]], buckets: Sequence[Bucket]) -> list[list[int]]:
    """Replace bucket slots (``-1 - k``) by bucket ``k``'s sequences, longest first, in group order."""
    queues = [list(bk.members) for bk in buckets]
    out = []
    for g in groups:
        out.append([queues[-1 - v].pop(0) if v < 0 else v for v in g])
    return out


def chunk_sorted(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """``chunk_globalbatch`` (``sort_consec``): indices sorted longest first, cut into ``parts`` consecutive
    chunks minimizing the largest chunk's tokens (binary search on that maximum, greedy cuts)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    vals = [lengths[i] for i in order]
    parts = max(1, min(parts, len(vals)))
    lo, hi = max(vals), sum(vals)

    def cuts(limit: int) -> list[int] | None:
        out, acc = [], 0
        for j, v in enumerate(vals):
            if acc + v > limit:
                out.append(j)
                acc = 0
            acc += v
        return out if len(out) < parts else None

    while lo < hi:
        mid = (lo + hi) // 2
        if cuts(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = [0] + (cuts(lo) or []) + [len(vals)]
    chunks = [order[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    while len(chunks) < parts:  # split the largest chunk so there are exactly `parts` (empty ones are not micro-batches)
        big = max(range(len(chunks)), key=lambda i: (len(chunks[i]) > 1, sum(lengths[x] for x in chunks[i])))
        if len(chunks[big]) <= 1:
            break
        c = chunks.pop(big)
        chunks[big:big] = [c[: len(c) // 2], c[len(c) // 2:]]
    return chunks
