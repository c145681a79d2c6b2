"""Simulated slow node: speed-aware dcp vs speed-blind dcp vs bucket when one 8-GPU node runs at 0.7x.

For each world size (default 32 and 256 GPUs, 8 per node) and distribution (``short``, ``balanced``,
``long``, ``video``, ``code``): the same run of samples (``--steps`` global batches of
:func:`~lightning_dcp.planning.planner.default_global_batch_tokens` tokens, as
``benchmarks/simulate_scaling.py`` draws them) is planned with the H100 analytic cost model and
simulated with the first node's ranks (``--slow``, default ``0-7:0.7``, the ``--rank-speed`` syntax of
``lightning-dcp simulate``) at 0.7x their predicted pace: an item runs at its slowest member's pace.

- ``bucket``: Open-Sora's bucket sampler (it never sees speeds);
- ``dcp blind``: dcp planned as if every rank ran at the cost model's pace (a run without calibration);
- ``dcp aware``: dcp planned with the true speeds (what calibration's per-rank speeds give the planner);
- ``dcp healthy``: the blind plan on a cluster without the slow node (what the slow node costs).

Reported: tokens/s, aware over blind, aware over bucket, and the fraction of the (speed-aware) step
bound. Writes ``benchmarks/results/simulate_slow_rank.md``.

    python benchmarks/simulate_slow_rank.py                         # 32 and 256 GPUs, five distributions
    python benchmarks/simulate_slow_rank.py --worlds 16 --dists balanced --steps 1
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_dcp.commands.simulate import DATASET_SIZE, compare, draw_run
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.distributions import get_distribution
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.planner import default_global_batch_tokens
from lightning_dcp.planning.simulator import simulate
from lightning_dcp.planning.speeds import parse_rank_speeds

HERE = Path(__file__).resolve().parent


def run_cell(model: str, world: int, dist_name: str, slow: str, steps: int, hardware: str, seed: int) -> dict:
    """One (model, world, distribution): the four figures of the module docstring."""
    cm = AnalyticCostModel(get_model(model), get_hardware(hardware), world)
    speeds = parse_rank_speeds(slow, world)
    dist = get_distribution(dist_name)
    dataset = dist.sample(DATASET_SIZE, seed)
    gbt = default_global_batch_tokens(world, dataset, cm)
    mean = sum(dataset) / len(dataset)
    run = draw_run(dist.sample(int(steps * gbt / mean * 1.5) + 100, seed + 1), gbt, steps)
    blind = {r["policy"]: r for r in compare(world, cm, dataset, run, ["bucket", "dcp"], global_batch_tokens=gbt,
                                              seed=seed, rank_speeds=speeds, speed_aware=False)}
    (aware,) = compare(world, cm, dataset, run, ["dcp"], global_batch_tokens=gbt, seed=seed, rank_speeds=speeds,
                       speed_aware=True)
    healthy = simulate(blind["dcp"]["_plan"], cm, timeline=False)
    return {"model": model, "gpus": world, "dist": dist_name, "samples": len(run), "tokens_per_step": gbt,
            "bucket": blind["bucket"]["tokens_per_s"], "blind": blind["dcp"]["tokens_per_s"],
            "aware": aware["tokens_per_s"], "healthy": healthy.tokens_per_s,
            "blind_bound": blind["dcp"]["fraction_of_bound"], "aware_bound": aware["fraction_of_bound"],
            "aware_planner_ms": aware["planner_ms_per_step"], "blind_planner_ms": blind["dcp"]["planner_ms_per_step"]}


def markdown(rows: Sequence[dict]) -> str:
    lines = ["| model | GPUs | dataset | bucket tokens/s | dcp blind | dcp aware | aware / blind | aware / bucket | "
             "blind % bound | aware % bound | dcp healthy | planner ms/step blind / aware |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['gpus']} | {r['dist']} | {r['bucket']:,.0f} | {r['blind']:,.0f} | "
                     f"{r['aware']:,.0f} | {r['aware'] / r['blind']:.2f}x | {r['aware'] / r['bucket']:.2f}x | "
                     f"{100 * r['blind_bound']:.1f} | {100 * r['aware_bound']:.1f} | {r['healthy']:,.0f} | "
                     f"{r['blind_planner_ms']:.0f} / {r['aware_planner_ms']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="transformer-1d")
    ap.add_argument("--worlds", default="32,256")
    ap.add_argument("--dists", default="short,balanced,long,video,code")
    ap.add_argument("--slow", default="0-7:0.7", help="rank speeds (the --rank-speed syntax of lightning-dcp simulate)")
    ap.add_argument("--steps", type=int, default=2, help="global batches per run (the same samples for every plan)")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "simulate_slow_rank.md")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for model in args.models.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            for dist in args.dists.split(","):
                t1 = time.perf_counter()
                r = run_cell(model, world, dist, args.slow, args.steps, args.hardware, args.seed)
                rows.append(r)
                print(f"  {model} {world:5d} {dist:9s}: bucket {r['bucket']:,.0f}  blind {r['blind']:,.0f}  aware "
                      f"{r['aware']:,.0f} ({r['aware'] / r['blind']:.2f}x)  healthy {r['healthy']:,.0f}  "
                      f"[{time.perf_counter() - t1:.1f} s]", flush=True)
    elapsed = time.perf_counter() - t0
    command = ("python benchmarks/simulate_slow_rank.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    text = (f"# Simulated slow node\n\n- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
            f"- machine: {platform.platform()}, {os.cpu_count()} CPUs (simulation only; {elapsed:.0f} s)\n"
            f"- command: `{command}`\n- cost model: {args.hardware} analytic; rank speeds `{args.slow}` "
            "(simulated: an item runs at its slowest member's pace)\n"
            f"- each row: {args.steps} global batches of the default size, the same samples for every plan; "
            "tokens/s on the cluster with the slow ranks, except *dcp healthy* (the blind plan without them)\n\n"
            + markdown(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
