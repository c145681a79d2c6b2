"""Issue #2 targets: simulated throughput, balance and planner speed (not a timed test).

Grid: the five length distributions x 8 / 32 / 256 / 1024 GPUs, Transformer-1D, H100 analytic
cost model, default global batch (:func:`default_global_batch_tokens`: at least 65,536 tokens per
GPU and enough that a step's mean per-GPU work covers the best-case time of the dataset's longest
sample), ``--steps`` global batches (``--steps-large`` at 256+ GPUs; the same samples for bucket
and dcp). Targets:

- dcp over bucket >= 2.9x on ``short`` and >= 1.3x on ``long`` at 32 GPUs;
- dcp >= 85% of the ideal bound and imbalance <= 3% everywhere;
- planner time per step on one core: <= 10 ms at 32 GPUs (default batch), <= 50 ms at 1024
  GPUs with 3.2 M tokens per step.

Prints a markdown table and writes ``benchmarks/results/simulate_targets.md``.

    python benchmarks/simulate_targets.py [--worlds 8,32,256,1024] [--dists short,...] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from lightning_dcp.commands.simulate import DATASET_SIZE, compare, draw_run
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.distributions import get_distribution
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.planner import Planner, default_global_batch_tokens

OUT = Path(__file__).parent / "results" / "simulate_targets.md"


def grid(worlds, dists, steps, policies, seed=0, steps_large=None, tokens_per_gpu=None):
    rows = []
    for W in worlds:
        cm = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), W)
        n_steps = steps if (W < 256 or not steps_large) else steps_large
        for name in dists:
            dist = get_distribution(name)
            dataset = dist.sample(DATASET_SIZE, seed)
            gbt = W * tokens_per_gpu if tokens_per_gpu else default_global_batch_tokens(W, dataset, cm)
            steps = n_steps
            mean = sum(dataset) / len(dataset)
            pool = dist.sample(int(steps * gbt / mean * 1.5) + 100, seed + 1)
            run = draw_run(pool, gbt, steps)
            res = {r["policy"]: r for r in compare(W, cm, dataset, run, policies, global_batch_tokens=gbt, seed=seed)}
            d, b = res["dcp"], res["bucket"]
            row = {"gpus": W, "dist": name, "samples": len(run), "gbt": gbt,
                   "speedup": d["tokens_per_s"] / b["tokens_per_s"], "dcp_ideal": d["fraction_of_ideal"],
                   "dcp_imb": d["imbalance"], "bucket_ideal": b["fraction_of_ideal"], "bucket_imb": b["imbalance"],
                   "dcp_ms": d["planner_ms_per_step"], "dcp_eff": d["icc_compute_efficiency"],
                   "dcp_comm": d["icc_comm_fraction"], "dcp_ar": d["icc_allreduce_fraction"],
                   "others": {k: v["tokens_per_s"] / b["tokens_per_s"] for k, v in res.items()}}
            rows.append(row)
            print(f"  {W:5d} {name:9s} dcp/bucket {row['speedup']:.2f}x  dcp ideal {100 * row['dcp_ideal']:.1f}%  "
                  f"imb {100 * row['dcp_imb']:.1f}%  ({time.strftime('%X')})", flush=True)
    return rows


def planner_time(W, tokens, dist_name="short", batches=5, seed=0):
    """Min-of-5 ms of ``Planner.plan_batch`` (dcp) per global batch of ``tokens`` tokens."""
    cm = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), W)
    dist = get_distribution(dist_name)
    dataset = dist.sample(DATASET_SIZE, seed)
    planner = Planner(W, cm, "dcp", seed=seed, dataset_lengths=dataset)
    pool = dist.sample(int(batches * tokens / (sum(dataset) / len(dataset)) * 1.5) + 100, seed + 1)
    times = []
    for k, idx in enumerate(planner.batches(pool, global_batch_tokens=tokens)[:batches]):
        t0 = time.perf_counter()
        planner.plan_batch(idx, [pool[i] for i in idx], step=k)
        times.append(1e3 * (time.perf_counter() - t0))
    return min(times), len(idx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="8,32,256,1024")
    ap.add_argument("--dists", default="short,balanced,long,video,code")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--steps-large", type=int, default=2, help="global batches at 256+ GPUs (default 2)")
    ap.add_argument("--tokens-per-gpu", type=int, default=None, help="fixed batch: this many tokens per GPU per step")
    ap.add_argument("--policies", default="bucket,dcp")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    dists = args.dists.split(",")
    policies = args.policies.split(",")
    if "bucket" not in policies or "dcp" not in policies:
        ap.error("--policies must include bucket and dcp")
    print("grid:", flush=True)
    rows = grid(worlds, dists, args.steps, policies, steps_large=args.steps_large, tokens_per_gpu=args.tokens_per_gpu)
    lines = ["| GPUs | dataset | samples | tokens/step | dcp / bucket | dcp % of ideal | dcp imbalance | bucket % of ideal | bucket imbalance | dcp compute eff. | dcp a2a | dcp all-reduce | planner ms/step |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['gpus']} | {r['dist']} | {r['samples']} | {r['gbt']:,} | {r['speedup']:.2f}x | {100 * r['dcp_ideal']:.1f}% | "
                     f"{100 * r['dcp_imb']:.1f}% | {100 * r['bucket_ideal']:.1f}% | {100 * r['bucket_imb']:.1f}% | "
                     f"{100 * r['dcp_eff']:.1f}% | {100 * r['dcp_comm']:.1f}% | {100 * r['dcp_ar']:.1f}% | {r['dcp_ms']:.1f} |")
    others = [r for r in rows if len(r["others"]) > 2]
    if others:
        lines += ["", "Speedup over bucket, every policy:", "",
                  "| GPUs | dataset | " + " | ".join(others[0]["others"]) + " |",
                  "|---:|---|" + "---:|" * len(others[0]["others"])]
        for r in others:
            lines.append(f"| {r['gpus']} | {r['dist']} | " + " | ".join(f"{v:.2f}x" for v in r["others"].values()) + " |")
    print("planner timing:", flush=True)
    cm32 = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), 32)
    d32 = default_global_batch_tokens(32, get_distribution("short").sample(DATASET_SIZE, 0), cm32)
    t32, n32 = planner_time(32, d32)
    t32s, n32s = planner_time(32, 32 * 65536)
    t1k, n1k = planner_time(1024, 3_200_000)
    lines += ["", "Planner (dcp) time per step, min of 5 global batches (short), wall clock in this process "
              "(run under `taskset -c 0` for one core):", "",
              f"- 32 GPUs, default batch ({d32:,} tokens, {n32} samples): {t32:.1f} ms",
              f"- 32 GPUs, 65,536 tokens per GPU ({32 * 65536:,} tokens, {n32s} samples): {t32s:.1f} ms (target <= 10 ms)",
              f"- 1024 GPUs, 3.2 M tokens ({n1k} samples): {t1k:.1f} ms (target <= 50 ms)"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("Command: `python benchmarks/simulate_targets.py " + " ".join(
        f"--{k} {v}" for k, v in (("worlds", args.worlds), ("dists", args.dists), ("steps", args.steps),
                                   ("steps-large", args.steps_large), ("policies", args.policies),
                                   ("tokens-per-gpu", args.tokens_per_gpu)) if v is not None)
        + f"` ({time.strftime('%Y-%m-%d')}, {platform.node() or 'host'}, {os.cpu_count()} CPUs, Python {platform.python_version()})\n\n" + text)


if __name__ == "__main__":
    main()
