"""Planner speed per step (issue #10 item 4): dcp ``plan_batch`` wall time, min and median over batches.

Settings (Transformer-1D unless ``--model``, H100 analytic cost model, every distribution):

- 32, 256 and 1024 GPUs, the default global batch (:func:`default_global_batch_tokens`, as
  ``benchmarks/simulate_scaling.py`` and ``lightning-dcp simulate`` use it: ~100-3,000 samples per
  step at 32 GPUs, up to ~40,000 at 1024);
- 1024 GPUs, 3.2 M tokens per step (about one sample per rank).

Targets (one core, ``taskset -c 0``): <= 100 ms per step at 32 GPUs on the default batch, <= 50 ms
at 1024 GPUs / 3.2 M tokens, and at 256 and 1024 GPUs on the default batch <= 1 s and less than the
simulated step (the planner runs one step ahead: a slower plan is waited for). Not a test: timings
depend on the machine. The planner is built
once per setting with the dataset's lengths (as in training), then ``--batches`` different
global batches are planned one by one, each timed with ``time.perf_counter``; the first batch
is planned once more untimed beforehand (caches warm, as in a running job). Wall time
(``time.perf_counter``) and the planning thread's CPU time (``time.thread_time``: what the
planner itself used, robust to other jobs on a shared core) are both reported. Also prints the
simulated % of step bound, so a faster planner can be checked for making the same plans.

    taskset -c 0 python benchmarks/planner_speed.py [--batches 5] [--dists short,...] [--policy dcp]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from lightning_dcp.commands.simulate import DATASET_SIZE, draw_run  # as lightning-dcp simulate
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.distributions import get_distribution
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.planner import Planner, default_global_batch_tokens
from lightning_dcp.planning.simulator import simulate

SETTINGS = ((32, None), (256, None), (1024, None), (1024, 3_200_000))
"""``(GPUs, tokens per step)``; None: the default global batch."""


def measure(world: int, gbt: int | None, dist_name: str, model: str, batches: int, policy: str, seed: int = 0) -> dict:
    cm = AnalyticCostModel(get_model(model), get_hardware("h100"), world)
    dist = get_distribution(dist_name)
    dataset = dist.sample(DATASET_SIZE, seed)
    tokens = gbt or default_global_batch_tokens(world, dataset, cm)
    mean = sum(dataset) / len(dataset)
    run = draw_run(dist.sample(int(batches * tokens / mean * 1.5) + 100, seed + 1), tokens, batches)
    planner = Planner(world, cm, policy, seed=seed, dataset_lengths=dataset)
    idx = planner.batches(run, global_batch_tokens=tokens)[:batches]
    planner.plan_batch(idx[0], [run[i] for i in idx[0]], step=0)  # warm caches, untimed
    times, cpu, fracs, samples, steps = [], [], [], [], []
    for k, b in enumerate(idx):
        lens = [run[i] for i in b]
        c0, t0 = time.thread_time(), time.perf_counter()
        plan = planner.plan_batch(b, lens, step=k)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        sim = simulate(plan, cm, timeline=False)
        fracs.append(sim.mean_step_bound_fraction)
        steps.append(sum(sim.step_times))
        samples.append(len(b))
    return {"world": world, "dist": dist_name, "tokens": tokens, "samples": statistics.mean(samples),
            "min_ms": 1e3 * min(times), "median_ms": 1e3 * statistics.median(times),
            "cpu_median_ms": 1e3 * statistics.median(cpu), "cpu_max_ms": 1e3 * max(cpu),
            "bound": statistics.mean(fracs), "step_s": statistics.mean(steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--dists", default="short,balanced,long,video,code")
    ap.add_argument("--model", default="transformer-1d")
    ap.add_argument("--policy", default="dcp")
    ap.add_argument("--worlds", default="32,256,1024", help="which settings to run, by GPUs (1024: both of its rows)")
    args = ap.parse_args(argv)
    worlds = {int(w) for w in args.worlds.split(",")}
    print(f"# planner speed, policy {args.policy}, {args.model}, H100 analytic; {platform.node()}, "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print("| GPUs | dataset | tokens/step | samples/step | wall min ms | wall median ms | CPU median ms | CPU max ms | "
          "simulated step s | % of step bound |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world, gbt in SETTINGS:
        if world not in worlds:
            continue
        for d in args.dists.split(","):
            r = measure(world, gbt, d, args.model, args.batches, args.policy)
            print(f"| {world} | {d} | {r['tokens']:,} | {r['samples']:,.0f} | {r['min_ms']:.1f} | {r['median_ms']:.1f} | "
                  f"{r['cpu_median_ms']:.1f} | {r['cpu_max_ms']:.1f} | {r['step_s']:.2f} | "
                  f"{100 * r['bound']:.1f}% |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
