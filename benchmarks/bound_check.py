"""An independent check of the step bound, tighter bounds, and where each step's time goes.

``lightning_dcp.planning.bound.StepBounder`` computes ``max(work / W, heaviest) + all-reduce``
from :class:`~lightning_dcp.planning.view.CostView` tables and the cost model's fast
path. :class:`FirstPrinciplesBounder` recomputes it with nothing but the
:class:`~lightning_dcp.planning.cost_model.CostModel` interface on real lists of lengths:

- capacity of a micro-batch on ``p`` ranks with ``r`` recomputed layers: the most tokens ``T``
  with ``cm.fits([T], p, r)`` (bisection), for the planner's SP sizes and their ring degrees;
- a sample's best GPU-seconds: ``min over (p, r)`` of ``p`` x its share of a full micro-batch
  of ``cap[p][r]`` tokens. ``cm.item_time_lower`` is linear in (attention work, tokens, 1) (the
  cost-model contract: the item time itself, a ring's transfers counted as hidden), so a sample of
  ``l`` tokens has the share
  ``t([l]) - t([]) + t([]) * l / cap``: its own terms, plus the micro-batch constant ``t([])``
  (an empty micro-batch's time) spread over the fullest micro-batch;
- the heaviest sample's best time alone: ``min over p`` of ``cm.item_time([l], p, cm.min_recompute([l], p))``;
- the all-reduce: ``cm.step_overhead(W)``.

It also computes *tighter* lower bounds on the compute span ``S`` of any plan, valid for cost
models linear in (attention work, tokens, 1) with coefficients that never fall as the
recompute count grows (the analytic and profiled models). They are diagnostics only -- how
much of a gap below the step bound no plan can close; the step bound itself is unchanged:

- **moldable**: a sample on ``p`` ranks lasts at least its time alone there, so each sample
  can only use SP sizes on which it finishes within ``S``, at their GPU-seconds:
  ``sum_i min{g_i(p) : alone_i(p) <= S} <= W S``.
- **per-rank constant**: every rank that works runs at least one micro-batch and pays its
  per-rank constant, so ``S >= V / W + c_min`` with ``V`` the samples' GPU-seconds without
  micro-batch constants and ``c_min`` the smallest constant; with the moldable restriction,
  ``sum_i min{v_i(p) : alone_i(p) <= S} <= W (S - c_min)``.
- **stacking**: a sample that lasts more than ``h_p = (S + C_p) / 2`` alone on ``p`` ranks
  (``C_p``: the largest per-micro-batch constant there) shares neither a rank with another
  such sample (together more than ``S``) nor a micro-batch (the two would last more than
  ``S``), so those samples' SP sizes sum to at most ``W``. Relaxed with a multiplier
  ``lambda >= 0`` on that constraint (any ``lambda`` gives a valid bound; the best of a
  ternary search is used), both bounds above become
  ``max_lambda sum_i min_p (g_i(p) + lambda p [alone_i(p) > h_p]) - lambda W <= W S``.
  This is what a step of several long samples that each need a large group for more than
  half the step runs into: they cannot all run side by side, and cannot run one after another.
  In the per-rank-constant form, a long sample's ``p`` ranks also pay at least the smallest
  constant of SP size ``p`` (larger than ``c_min`` when ``p > 1``: all-to-all latencies).

:func:`gap_parts` splits a simulated step's compute span exactly into the best-rate work plus
idle time, SP-size excess, recompute excess and partial micro-batches.

    python benchmarks/bound_check.py --model transformer-1d --dist video --tokens 524288 --seeds 4 --steps 8
    python benchmarks/bound_check.py --model transformer-1d,transformer-2d --dist video,long \
        --tokens 524288,786432,1048576 --seeds 4 --steps 8        # one table row per cell

Prints one line per step and a summary (one cell), or a markdown table (several); writes nothing.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from lightning_dcp.planning.cost_model import CostModel


@dataclass(frozen=True)
class SampleCosts:
    """One length's costs per usable SP size (only the sizes that hold it)."""

    gpu_s: dict[int, float]
    """Best GPU-seconds: ``p`` x its share of a full micro-batch, best recompute."""
    bare: dict[int, float]
    """The same without the micro-batch constant's share."""
    alone: dict[int, float]
    """Time alone with the fewest recomputed layers that fit."""


@dataclass(frozen=True)
class CheckedBound:
    """One step's bounds: compute-span seconds, plus the all-reduce ``overhead``."""

    work: float
    heaviest: float
    overhead: float
    moldable: float
    per_rank_constant: float
    stacking: float

    @property
    def step_bound_s(self) -> float:
        """The step bound as StepBounder defines it, all-reduce included."""
        return max(self.work, self.heaviest) + self.overhead

    @property
    def tight_s(self) -> float:
        """The tightest bound here, all-reduce included (never below ``step_bound_s``)."""
        return max(self.work, self.heaviest, self.moldable, self.per_rank_constant, self.stacking) + self.overhead


def _smallest(ok: Callable[[float], bool], lo: float) -> float:
    """The smallest ``S >= lo`` with ``ok(S)`` for a monotone ``ok``, from below (bisection to 1e-7 relative)."""
    if ok(lo):
        return lo
    hi = lo * 1.5 + 1e-12
    while not ok(hi):
        lo, hi = hi, hi * 1.5
    while hi - lo > 1e-7 * hi:
        mid = 0.5 * (lo + hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return lo  # ok(lo) is false: every feasible S is above it (a lower bound, within 1e-7 of the smallest)


class FirstPrinciplesBounder:
    """Step bounds of one (cost model, world size), from the CostModel interface alone (see module doc)."""

    def __init__(self, cm: CostModel, world_size: int, max_sp: int | None = None):
        from lightning_dcp.planning.view import CostView

        self.cm = cm
        self.W = int(world_size)
        top = self.W if max_sp is None else min(self.W, max_sp)
        # the planner's SP sizes and the splits an item may take: an input here (what is checked is the arithmetic)
        self.rings = dict(CostView(cm, top, world_size=self.W).item_rings)
        self.sps = sorted(self.rings)
        self.caps = {(p, g): [self._cap(p, r, g) for r in range(cm.num_layers + 1)] for p in self.sps
                     for g in self.rings[p]}
        usable = [(p, g, r) for (p, g), caps in self.caps.items() for r, c in enumerate(caps) if c > 0]
        self.c_min = min(self._t([], p, r, g) for p, g, r in usable)
        self.c_max = {p: max(self._t([], q, r, g) for q, g, r in usable if q == p) for p in self.sps
                      if any(q == p for q, _, _ in usable)}
        self.c_low = {p: min(self._t([], q, r, g) for q, g, r in usable if q == p) for p in self.c_max}
        self._per_len: dict[int, SampleCosts] = {}

    def _t(self, lengths: Sequence[int], p: int, r: int, ring: int) -> float:
        """``item_time_lower``: linear in the samples' sums (a ring's transfers hidden), as the bound needs."""
        return self.cm.item_time_lower(lengths, p, r, ring)

    def _cap(self, p: int, r: int, ring: int) -> int:
        cm = self.cm
        if not cm.fits([1], p, r, ring):
            return 0
        lo, hi = 1, 2
        while cm.fits([hi], p, r, ring):
            lo, hi = hi, hi * 2
            if hi > 1 << 40:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if cm.fits([mid], p, r, ring):
                lo = mid
            else:
                hi = mid
        return lo

    def sample(self, n: int) -> SampleCosts:
        """The costs of a sample of ``n`` tokens (cached per length)."""
        got = self._per_len.get(n)
        if got is not None:
            return got
        cm = self.cm
        g: dict[int, float] = {}
        bare: dict[int, float] = {}
        alone: dict[int, float] = {}
        for p in self.sps:
            best = low = lone = math.inf
            for ring in self.rings[p]:
                caps = self.caps[(p, ring)]
                for r, cap in enumerate(caps):
                    if cap < n or (r > 0 and cap == caps[r - 1]):  # more recompute, same capacity: never better
                        continue
                    const = self._t([], p, r, ring)
                    own = self._t([n], p, r, ring) - const
                    best = min(best, p * (own + const * n / cap))
                    low = min(low, p * own)
                rec = cm.min_recompute([n], p, ring)
                if rec is not None:
                    lone = min(lone, cm.item_time([n], p, rec, ring))
            if math.isfinite(best):
                g[p], bare[p], alone[p] = best, low, lone
        self._per_len[n] = got = SampleCosts(g, bare, alone)
        return got

    def _arrays(self, lengths: Sequence[int]):
        """Per distinct length (rows) and usable SP size (columns): GPU-seconds, bare GPU-seconds, time
        alone (``inf`` where the size does not hold it), and each length's count."""
        counts: dict[int, int] = {}
        for n in lengths:
            counts[int(n)] = counts.get(int(n), 0) + 1
        rows = [self.sample(n) for n in counts]
        inf = math.inf
        G = np.array([[sc.gpu_s.get(p, inf) for p in self.sps] for sc in rows])
        B = np.array([[sc.bare.get(p, inf) for p in self.sps] for sc in rows])
        A = np.array([[sc.alone.get(p, inf) for p in self.sps] for sc in rows])
        return G, B, A, np.array(list(counts.values()), dtype=np.float64)

    def _relaxed(self, G, A, mult, S: float, extra: np.ndarray | None) -> float:
        """Lower bound on the GPU-seconds of any plan with compute span ``S`` (inf: none exists).

        ``max over lambda`` of the Lagrangian of the stacking constraint (module docstring) with
        per-sample costs ``G``; ``lambda = 0`` is the moldable bound. ``extra`` (per SP size): what
        a long sample's ranks pay beyond the caller's per-rank charge (their smallest constant
        minus ``c_min`` in the bare form; its micro-batch is its ranks' own).
        """
        ok = A <= S * (1 + 1e-12)
        if not ok.any(axis=1).all():
            return math.inf
        sp = np.array(self.sps, dtype=np.float64)
        cmax = np.array([self.c_max.get(p, math.inf) for p in self.sps])
        long = A > 0.5 * (S + cmax)
        base = np.where(ok, G + (extra * long if extra is not None else 0.0), np.inf)
        width = sp * long

        def f(lam: float) -> float:
            return float(mult @ np.min(base + lam * width, axis=1)) - lam * self.W

        hi = float(np.max(np.where(ok, G, 0.0))) + 1e-12  # past it no long option pays
        lo = 0.0
        best = f(0.0)
        for _ in range(40):  # f is concave: ternary search
            a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            fa, fb = f(a), f(b)
            best = max(best, fa, fb)
            if fa < fb:
                lo = a
            else:
                hi = b
        return best

    def check(self, lengths: Sequence[int]) -> CheckedBound:
        """All bounds of one step that runs ``lengths``."""
        W, cmin = self.W, self.c_min
        G, B, A, mult = self._arrays(lengths)
        work = float(mult @ G.min(axis=1)) / W
        heaviest = float(A.min(axis=1).max())
        floor = max(work, heaviest)

        def need(C: np.ndarray, S: float) -> float:
            return float(mult @ np.where(A <= S * (1 + 1e-12), C, np.inf).min(axis=1))

        moldable = _smallest(lambda S: need(G, S) <= W * S, floor)
        prc = _smallest(lambda S: need(B, S) <= W * (S - cmin), max(floor, float(mult @ B.min(axis=1)) / W + cmin))
        extra = np.array([self.sps[k] * (self.c_low.get(p, cmin) - cmin) for k, p in enumerate(self.sps)])
        stacking = _smallest(lambda S: self._relaxed(G, A, mult, S, None) <= W * S
                             and self._relaxed(B, A, mult, S, extra) <= W * (S - cmin), max(moldable, prc))
        return CheckedBound(work, heaviest, float(self.cm.step_overhead(W)), moldable, prc, stacking)


def gap_parts(step, cm: CostModel, fp: FirstPrinciplesBounder) -> dict[str, float]:
    """Where a simulated step's compute span goes beyond the best-rate work (seconds: rank-seconds / W).

    ``span = work + idle + sp + recompute + partial`` exactly, with ``work`` the samples' best
    GPU-seconds / W and, summed over the step's micro-batches (SP ``p``, recompute ``r``,
    ``T`` tokens, constant ``C = t([])``, capacity ``cap``):

    - ``idle``: rank-time waiting (imbalance);
    - ``sp``: each sample's best GPU-seconds on the SP size it ran on minus its best on any
      (the price of a larger SP group: all-to-all, smaller per-rank GEMMs -- long samples
      split to finish in time, group sizes rounded to powers of two);
    - ``recompute``: each sample's share at the micro-batch's recompute minus its best share
      at that SP size;
    - ``partial``: ``p C (1 - T / cap)``, the micro-batch constant a micro-batch pays beyond a
      full one's share (few samples per rank, small micro-batches);
    - ``ring``: a ring item's key/value transfers that compute does not hide (``item_time`` minus
      ``item_time_lower``; 0 without rings).
    """
    W = fp.W
    free = [0.0] * W
    busy = sp = rec = partial = work = ring = 0.0
    for item in step.items:
        p, r = item.sp_size, item.recompute
        split = item.ring
        t = cm.item_time(item.lengths, p, r, split)
        start = max(free[x] for x in item.ranks)
        for x in item.ranks:
            free[x] = start + t
        busy += t * p
        ring += p * (t - cm.item_time_lower(item.lengths, p, r, split))
        const = cm.item_time_lower([], p, r, split)
        cap = fp.caps[(p, split)][r]
        partial += p * const * (1 - sum(item.lengths) / cap)
        for n in item.lengths:
            g = fp.sample(n).gpu_s
            rec += p * (cm.item_time_lower([n], p, r, split) - const + const * n / cap) - g[p]
            sp += g[p] - min(g.values())
            work += min(g.values())
    span = max(free)
    return {"span": span, "work": work / W, "idle": (W * span - busy) / W, "sp": sp / W, "recompute": rec / W,
            "partial": partial / W, "ring": ring / W}


def full_run(dist, seed: int, steps: int, tokens: int, mean: float) -> list[int]:
    """Sample lengths (drawn with ``seed``) of ``steps`` *full* global batches of up to ``tokens`` each, cut as
    training cuts them (:func:`~lightning_dcp.planning.batches.cut_batches`): each closed by a sample that does not
    fit, where ``lightning-dcp simulate``'s last batch may be its pool's short tail. ``mean``: the distribution's
    mean length.
    """
    from lightning_dcp.planning.batches import cut_batches

    extra = 1
    while True:
        pool = dist.sample(int((steps + extra) * tokens / mean * 1.5) + 100, seed)
        batches = cut_batches(pool, global_batch_tokens=tokens)
        if len(batches) > steps:
            return [pool[i] for b in batches[:steps] for i in b]
        extra *= 2


def check_cell(model: str, dist_name: str, tokens: int, *, world: int = 32, seeds: int = 1, steps: int = 4,
               policy: str = "dcp", out: Callable[[str], None] | None = None) -> dict[str, float]:
    """Plan and simulate ``seeds x steps`` full global batches as benchmarks/step_bound.py does (seed ``s``
    draws the dataset with seed ``s`` and the run with ``s + 1``); check every step. Returns the cell's mean
    figures (fractions): of the step bound, of the tight bound, the ceiling, the compute-only fraction (all-reduce
    left out of both sides), the fraction of the ideal, the worst step of each, and per part of :func:`gap_parts`
    its share of the step time."""
    from lightning_dcp.commands.simulate import DATASET_SIZE
    from lightning_dcp.planning.analytic import AnalyticCostModel
    from lightning_dcp.planning.bound import StepBounder
    from lightning_dcp.planning.distributions import get_distribution
    from lightning_dcp.planning.hardware import get_hardware
    from lightning_dcp.planning.models import get_model
    from lightning_dcp.planning.planner import Planner
    from lightning_dcp.planning.simulator import simulate

    cm = AnalyticCostModel(get_model(model), get_hardware("h100"), world)
    fp = FirstPrinciplesBounder(cm, world)
    sb = StepBounder(cm, world)
    dist = get_distribution(dist_name)
    rows: list[dict[str, float]] = []
    for seed in range(seeds):
        dataset = dist.sample(DATASET_SIZE, seed)
        mean = sum(dataset) / len(dataset)
        run = full_run(dist, seed + 1, steps, tokens, mean)
        planner = Planner(world, cm, policy, seed=seed, dataset_lengths=dataset)
        batches = planner.batches(run, global_batch_tokens=tokens)[:steps]
        plan = planner.plan([run[i] for b in batches for i in b], global_batch_tokens=tokens)
        sim = simulate(plan, cm, timeline=False)
        for k, (step, t) in enumerate(zip(plan.steps, sim.step_times)):
            lengths = [n for it in step.items for n in it.lengths]
            c = fp.check(lengths)
            ours = sb.seconds(lengths)
            g = gap_parts(step, cm, fp)
            rows.append({"fraction": c.step_bound_s / t, "tight": c.tight_s / t, "ceiling": c.step_bound_s / c.tight_s,
                         "compute_only": (c.step_bound_s - c.overhead) / (t - c.overhead),
                         "ideal": sum(cm.ideal_time([n]) for n in lengths) / world / t,
                         "diff": abs(c.step_bound_s - ours) / ours, "limited": float(c.heaviest > c.work),
                         **{key: g[key] / t for key in ("idle", "sp", "recompute", "partial", "ring")},
                         "allreduce": c.overhead / t})
            if out is not None:
                out(f"seed {seed} step {k}: {len(lengths)} samples, longest {max(lengths):,}; bound "
                    f"{c.step_bound_s:.3f}s (StepBounder {ours:.3f}s: work {c.work:.3f} heaviest {c.heaviest:.3f} "
                    f"all-reduce {c.overhead:.3f}); tight {c.tight_s:.3f}s (moldable {c.moldable:.3f} per-rank "
                    f"constant {c.per_rank_constant:.3f} stacking {c.stacking:.3f}); step {t:.3f}s = "
                    f"{100 * c.step_bound_s / t:.1f}% of the bound, {100 * c.tight_s / t:.1f}% of the tight bound; "
                    f"span {g['span']:.3f}s = best-rate work {g['work']:.3f} + idle {g['idle']:.3f} + SP size "
                    f"{g['sp']:.3f} + recompute {g['recompute']:.3f} + partial micro-batches {g['partial']:.3f} + exposed "
                    f"ring transfers {g['ring']:.3f}")
    keys = rows[0].keys()
    cell = {k: statistics.mean(r[k] for r in rows) for k in keys}
    for k in ("fraction", "tight", "compute_only", "ideal"):
        cell["worst_" + k] = min(r[k] for r in rows)
    cell["worst"] = cell["worst_fraction"]
    cell["diff"] = max(r["diff"] for r in rows)
    cell["steps"] = len(rows)
    return cell


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="transformer-1d", help="comma-separated: one table row per combination")
    ap.add_argument("--dist", default="video", help="comma-separated")
    ap.add_argument("--world", type=int, default=32)
    ap.add_argument("--tokens", default="524288", help="comma-separated tokens per step")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--policy", default="dcp")
    ap.add_argument("--quiet", action="store_true", help="summary only (always, with several cells)")
    args = ap.parse_args(argv)
    combos = [(m, d, int(t)) for m in args.model.split(",") for t in args.tokens.split(",") for d in args.dist.split(",")]
    if len(combos) > 1:
        print(f"| model | tokens/step | dataset | steps | % of step bound: mean | worst step | compute only (no all-reduce): "
              f"mean | worst | % of ideal: mean | worst | ceiling | idle | SP size | partial micro-batches | all-reduce |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model, dist, tokens in combos:
        c = check_cell(model, dist, tokens, world=args.world, seeds=args.seeds, steps=args.steps, policy=args.policy,
                       out=None if args.quiet or len(combos) > 1 else print)
        if len(combos) > 1:
            cols = [c["fraction"], c["worst"], c["compute_only"], c["worst_compute_only"], c["ideal"], c["worst_ideal"],
                    c["ceiling"], c["idle"], c["sp"], c["partial"], c["allreduce"]]
            print(f"| {model} | {tokens:,} | {dist} | {c['steps']} | " + " | ".join(f"{100 * x:.1f}%" for x in cols) + " |",
                  flush=True)
            continue
        print(f"{model} {args.world} GPUs {tokens:,} tokens {dist} ({args.policy}, {c['steps']} steps): "
              f"% of step bound mean {100 * c['fraction']:.1f} worst {100 * c['worst']:.1f}; compute only (no all-reduce) "
              f"mean {100 * c['compute_only']:.1f} worst {100 * c['worst_compute_only']:.1f}; % of tight bound mean "
              f"{100 * c['tight']:.1f}; ceiling (step bound / tight bound) {100 * c['ceiling']:.1f}; % of ideal mean "
              f"{100 * c['ideal']:.1f} worst {100 * c['worst_ideal']:.1f}; step time shares: "
              f"idle {100 * c['idle']:.1f}%, SP size {100 * c['sp']:.1f}%, recompute {100 * c['recompute']:.1f}%, partial "
              f"micro-batches {100 * c['partial']:.1f}%, all-reduce {100 * c['allreduce']:.1f}%; first-principles vs "
              f"StepBounder: max rel. diff {c['diff']:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
