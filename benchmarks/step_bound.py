"""Planner quality at fixed global batches (issue #10 item 5): % of the step bound per cell.

Grid: the five length distributions x {32 GPUs with 256K, 1M and 4M tokens per step, 1024 GPUs
with 3.2M tokens per step} x both paper models (transformer-1d, transformer-2d), H100 analytic
cost model, ``--steps`` global batches per cell (the same samples for every policy). Per cell
and policy: the mean over steps of ``step_bound / simulated step time``
(:attr:`SimulationResult.mean_step_bound_fraction`; for bucket, whose steps are not the global
batches, the global batches' bounds over its total time), and dcp's step-bound parts (which
term limits the step). Target: dcp >= 92% everywhere.

Writes ``benchmarks/results/step_bound.md``.

    taskset -c 0 python benchmarks/step_bound.py [--steps 4] [--policies dcp,dcp-intra,dcp-inter,bucket]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from lightning_dcp.commands.simulate import DATASET_SIZE, draw_run
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.bound import StepBounder
from lightning_dcp.planning.distributions import get_distribution
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.planner import Planner
from lightning_dcp.planning.simulator import simulate

OUT = Path(__file__).parent / "results" / "step_bound.md"
CELLS = ((32, 262_144), (32, 1_048_576), (32, 4_194_304), (1024, 3_200_000))
TARGET = 0.92


def cell(model: str, world: int, gbt: int, dist_name: str, policies: list[str], steps: int, seed: int = 0) -> dict:
    cm = AnalyticCostModel(get_model(model), get_hardware("h100"), world)
    dist = get_distribution(dist_name)
    dataset = dist.sample(DATASET_SIZE, seed)
    mean = sum(dataset) / len(dataset)
    run = draw_run(dist.sample(int(steps * gbt / mean * 1.5) + 100, seed + 1), steps * gbt)
    bounder = StepBounder(cm, world)
    out: dict = {"samples": len(run)}
    for name in policies:
        planner = Planner(world, cm, name, seed=seed, dataset_lengths=dataset)
        batches = planner.batches(run, global_batch_tokens=gbt)[:steps]
        if name == "dcp":
            parts = [bounder.parts([run[i] for i in b]) for b in batches]
            out["limited"] = sum(p.limited_by == "heaviest" for p in parts)
            out["steps"] = len(batches)
        t0 = time.perf_counter()
        plan = planner.plan([run[i] for b in batches for i in b], global_batch_tokens=gbt)
        out[name + "_ms"] = 1e3 * (time.perf_counter() - t0) / max(len(plan.steps), 1)
        sim = simulate(plan, cm, timeline=False)
        if planner.one_step_per_batch:
            out[name] = sim.mean_step_bound_fraction
        else:
            out[name] = sum(bounder.seconds([run[i] for i in b]) for b in batches) / sim.total_time
        if name == "dcp":
            out["dcp_imb"] = sim.imbalance
            out["dcp_ideal"] = sim.fraction_of_ideal
            out["dcp_min"] = min(b / t for b, t in zip(sim.step_bounds, sim.step_times))
            busy = sum(sum(r) for r in sim.busy)
            out["busy_over_work"] = busy / (world * sum(p.work_s for p in parts))
            out["overhead"] = sum(p.overhead_s for p in parts) / sim.total_time
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--models", default="transformer-1d,transformer-2d")
    ap.add_argument("--dists", default="short,balanced,long,video,code")
    ap.add_argument("--policies", default="dcp,dcp-intra,dcp-inter,bucket")
    ap.add_argument("--cells", default=None, help="e.g. 32:262144,1024:3200000 (default: the issue's four)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    cells = CELLS if not args.cells else tuple(tuple(int(x) for x in c.split(":")) for c in args.cells.split(","))
    cmd = "python benchmarks/step_bound.py " + " ".join(argv if argv is not None else sys.argv[1:])
    head = ["model", "GPUs", "tokens/step", "dataset", "samples/step"] + [f"{p} % of bound" for p in policies] + \
        ["dcp worst step", "dcp % of ideal", "dcp imbalance", "dcp busy / best-rate work", "all-reduce share",
         "steps limited by heaviest", "dcp ms/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    below = []
    for model in args.models.split(","):
        for world, gbt in cells:
            for d in args.dists.split(","):
                r = cell(model, world, gbt, d, policies, args.steps)
                row = [model, str(world), f"{gbt:,}", d, f"{r['samples'] / args.steps:,.0f}"] + \
                    [f"{100 * r[p]:.1f}%" for p in policies] + \
                    [f"{100 * r['dcp_min']:.1f}%", f"{100 * r['dcp_ideal']:.1f}%", f"{100 * r['dcp_imb']:.1f}%",
                     f"{r['busy_over_work']:.3f}", f"{100 * r['overhead']:.0f}%", f"{r['limited']}/{r['steps']}", f"{r['dcp_ms']:.1f}"]
                lines.append("| " + " | ".join(row) + " |")
                print(lines[-1], flush=True)
                if r["dcp"] < TARGET:
                    below.append(f"{model} {world} GPUs {gbt:,} tokens {d}: {100 * r['dcp']:.1f}%")
    text = [f"# dcp % of the step bound at fixed global batches (issue #10)", "",
            f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} CPUs shared with "
            f"other engineers' jobs, Python {platform.python_version()}; ms/step indicative only).", "",
            "Step bound: `lightning_dcp.planning.step_bound` = max(best-rate work / W, heaviest sample's best time) "
            "+ all-reduce. Cells: mean over steps of bound / simulated step time (bucket: the global batches' "
            "bounds over its total time). H100 analytic cost model.", "", *lines, "",
            f"Target dcp >= {100 * TARGET:.0f}%: " + ("met in every cell." if not below else
                                                     f"{len(below)} cell(s) below: " + "; ".join(below))]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(text) + "\n")
    print(text[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
