"""An independent check of the step bound, tighter bounds, and where each step's time goes.

``lightning_dcp.planning.bound.StepBounder`` computes ``max(work / W, heaviest) + all-reduce``
from :class:`~lightning_dcp.planning.policies.costs.CostView` tables and the cost model's fast
path. :class:`FirstPrinciplesBounder` recomputes it with nothing but the
:class:`~lightning_dcp.planning.cost_model.CostModel` interface on real lists of lengths:

- capacity of a micro-batch on ``p`` ranks with ``r`` recomputed layers: the most tokens ``T``
  with ``cm.fits([T], p, r)`` (bisection);
- a sample's best GPU-seconds: ``min over (p, r)`` of ``p`` x its share of a full micro-batch
  of ``cap[p][r]`` tokens. Micro-batch time is linear in (attention work, tokens, 1) (the
  cost-model contract), so a sample of ``l`` tokens has the share
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

Prints one line per step and a summary per cell; writes nothing.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

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
        self.cm = cm
        self.W = int(world_size)
        top = 1
        while top * 2 <= self.W:
            top *= 2
        if max_sp is not None:
            top = min(top, max_sp)
        self.sps = list(cm.sp_sizes(top))
        self.caps = {p: [self._cap(p, r) for r in range(cm.num_layers + 1)] for p in self.sps}
        usable = [(p, r) for p in self.sps for r, c in enumerate(self.caps[p]) if c > 0]
        self.c_min = min(cm.item_time([], p, r) for p, r in usable)
        self.c_max = {p: max(cm.item_time([], q, r) for q, r in usable if q == p) for p in self.sps
                      if any(q == p for q, _ in usable)}
        self.c_low = {p: min(cm.item_time([], q, r) for q, r in usable if q == p) for p in self.c_max}
        self._per_len: dict[int, SampleCosts] = {}

    def _cap(self, p: int, r: int) -> int:
        cm = self.cm
        if not cm.fits([1], p, r):
            return 0
        lo, hi = 1, 2
        while cm.fits([hi], p, r):
            lo, hi = hi, hi * 2
            if hi > 1 << 40:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if cm.fits([mid], p, r):
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
            caps = self.caps[p]
            best = low = math.inf
            for r, cap in enumerate(caps):
                if cap < n or (r > 0 and cap == caps[r - 1]):  # more recompute, same capacity: never better
                    continue
                const = cm.item_time([], p, r)
                own = cm.item_time([n], p, r) - const
                best = min(best, p * (own + const * n / cap))
                low = min(low, p * own)
            if math.isfinite(best):
                g[p], bare[p] = best, low
                alone[p] = cm.item_time([n], p, cm.min_recompute([n], p))
        self._per_len[n] = got = SampleCosts(g, bare, alone)
        return got

    def _relaxed(self, per: list[SampleCosts], S: float, bare: bool) -> float:
        """Lower bound on the GPU-seconds of any plan with compute span ``S`` (inf: none exists).

        ``max over lambda`` of the Lagrangian of the stacking constraint (module docstring);
        ``lambda = 0`` is the moldable bound. ``bare``: GPU-seconds without micro-batch constants,
        except that a long sample's ranks pay their SP size's smallest constant beyond ``c_min``
        (its micro-batch is its ranks' own; the caller charges every rank ``c_min``).
        """
        opts = []
        for sc in per:
            cost = sc.bare if bare else sc.gpu_s
            o = []
            for p in sc.gpu_s:
                if sc.alone[p] > S * (1 + 1e-12):
                    continue
                if sc.alone[p] > 0.5 * (S + self.c_max[p]):  # long: its own ranks, their constants
                    o.append((cost[p] + (p * (self.c_low[p] - self.c_min) if bare else 0.0), p))
                else:
                    o.append((cost[p], 0))
            if not o:
                return math.inf
            opts.append(o)

        def f(lam: float) -> float:
            return math.fsum(min(c + lam * w for c, w in o) for o in opts) - lam * self.W

        top = max((c for o in opts for c, _ in o), default=0.0) / 1.0 + 1e-12  # past it no long option pays
        lo, hi = 0.0, top
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
        W = self.W
        per = [self.sample(int(n)) for n in lengths]
        work = math.fsum(min(sc.gpu_s.values()) for sc in per) / W
        heaviest = max(min(sc.alone.values()) for sc in per)
        floor = max(work, heaviest)

        def need(S: float, bare: bool) -> float:
            return math.fsum(min(c for p, c in (sc.bare if bare else sc.gpu_s).items()
                                 if sc.alone[p] <= S * (1 + 1e-12)) for sc in per)

        moldable = _smallest(lambda S: need(S, False) <= W * S, floor)
        prc = math.fsum(min(sc.bare.values()) for sc in per) / W + self.c_min
        prc = _smallest(lambda S: need(S, True) <= W * (S - self.c_min), max(floor, prc))
        stacking = _smallest(lambda S: self._relaxed(per, S, False) <= W * S
                             and self._relaxed(per, S, True) <= W * (S - self.c_min), max(moldable, prc))
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
      full one's share (few samples per rank, small micro-batches).
    """
    W = fp.W
    free = [0.0] * W
    busy = sp = rec = partial = work = 0.0
    for item in step.items:
        p, r = item.sp_size, item.recompute
        t = cm.item_time(item.lengths, p, r)
        start = max(free[x] for x in item.ranks)
        for x in item.ranks:
            free[x] = start + t
        busy += t * p
        const = cm.item_time([], p, r)
        cap = fp.caps[p][r]
        partial += p * const * (1 - sum(item.lengths) / cap)
        for n in item.lengths:
            g = fp.sample(n).gpu_s
            rec += p * (cm.item_time([n], p, r) - const + const * n / cap) - g[p]
            sp += g[p] - min(g.values())
            work += min(g.values())
    span = max(free)
    return {"span": span, "work": work / W, "idle": (W * span - busy) / W, "sp": sp / W, "recompute": rec / W,
            "partial": partial / W}


def check_cell(model: str, dist_name: str, tokens: int, *, world: int = 32, seeds: int = 1, steps: int = 4,
               policy: str = "dcp", out: Callable[[str], None] | None = None) -> dict[str, float]:
    """Plan and simulate ``seeds x steps`` global batches as benchmarks/step_bound.py does (seed ``s`` draws
    the dataset with seed ``s`` and the run with ``s + 1``); check every step. Returns the cell's figures
    (percentages) and, per part of :func:`gap_parts`, its mean share of the step time."""
    from lightning_dcp.commands.simulate import DATASET_SIZE, draw_run
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
        run = draw_run(dist.sample(int(steps * tokens / mean * 1.5) + 100, seed + 1), steps * tokens)
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
                         "diff": abs(c.step_bound_s - ours) / ours, "limited": float(c.heaviest > c.work),
                         **{key: g[key] / t for key in ("idle", "sp", "recompute", "partial")},
                         "floor_gap": (g["work"] - max(c.work, c.heaviest)) / t, "allreduce": c.overhead / t})
            if out is not None:
                out(f"seed {seed} step {k}: {len(lengths)} samples, longest {max(lengths):,}; bound "
                    f"{c.step_bound_s:.3f}s (StepBounder {ours:.3f}s: work {c.work:.3f} heaviest {c.heaviest:.3f} "
                    f"all-reduce {c.overhead:.3f}); tight {c.tight_s:.3f}s (moldable {c.moldable:.3f} per-rank "
                    f"constant {c.per_rank_constant:.3f} stacking {c.stacking:.3f}); step {t:.3f}s = "
                    f"{100 * c.step_bound_s / t:.1f}% of the bound, {100 * c.tight_s / t:.1f}% of the tight bound; "
                    f"span {g['span']:.3f}s = best-rate work {g['work']:.3f} + idle {g['idle']:.3f} + SP size "
                    f"{g['sp']:.3f} + recompute {g['recompute']:.3f} + partial micro-batches {g['partial']:.3f}")
    keys = rows[0].keys()
    cell = {k: statistics.mean(r[k] for r in rows) for k in keys}
    cell["worst"] = min(r["fraction"] for r in rows)
    cell["diff"] = max(r["diff"] for r in rows)
    cell["steps"] = len(rows)
    return cell


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="transformer-1d")
    ap.add_argument("--dist", default="video")
    ap.add_argument("--world", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=524288)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--policy", default="dcp")
    ap.add_argument("--quiet", action="store_true", help="summary only")
    args = ap.parse_args(argv)
    c = check_cell(args.model, args.dist, args.tokens, world=args.world, seeds=args.seeds, steps=args.steps,
                   policy=args.policy, out=None if args.quiet else print)
    print(f"{args.model} {args.world} GPUs {args.tokens:,} tokens {args.dist} ({args.policy}, {c['steps']} steps): "
          f"% of step bound mean {100 * c['fraction']:.1f} worst {100 * c['worst']:.1f}; % of tight bound mean "
          f"{100 * c['tight']:.1f}; ceiling (step bound / tight bound) {100 * c['ceiling']:.1f}; step time shares: "
          f"idle {100 * c['idle']:.1f}%, SP size {100 * c['sp']:.1f}%, recompute {100 * c['recompute']:.1f}%, partial "
          f"micro-batches {100 * c['partial']:.1f}%, all-reduce {100 * c['allreduce']:.1f}%; first-principles vs "
          f"StepBounder: max rel. diff {c['diff']:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
