"""Versus the field: dcp beside verl, Megatron-Core hybrid CP, Hydraulis and FlexSP on the same data and cost model.

For each world size (default 32 and 256 GPUs) and each of the six length distributions of
:mod:`lightning_dcp.planning.distributions`, the same run of samples (``--steps`` global batches of
:func:`~lightning_dcp.planning.planner.default_global_batch_tokens` tokens; ``--steps-large`` at 256
GPUs and more) is planned by every policy with the H100 analytic cost model of the Transformer-1D
(the peers are language-model systems) and simulated through :func:`lightning_dcp.commands.simulate.compare`,
the code ``lightning-dcp simulate`` runs. The peers are tuned on the dataset as their users would
(see each policy's docstring) on global batches of the run's size. Planning time is charged where a
step does not hide it (a step lasts ``max(its time, the next step's planning)``).

Reported per cell and policy: tokens/s relative to dcp, % of the step bound, imbalance, mean
simulated step (seconds), planning seconds per step (``time.perf_counter`` around each batch's
planning, this machine, Python), the share of the run spent waiting on the planner, and for flexsp
its MILP seconds per step.

Writes ``benchmarks/results/versus_field.md`` and ``.csv``.

    python benchmarks/versus_field.py                              # 32 and 256 GPUs, six datasets
    python benchmarks/versus_field.py --worlds 32 --dists long --steps 1
"""

from __future__ import annotations

import argparse
import csv
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
from lightning_dcp.planning.distributions import DISTRIBUTIONS, get_distribution
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.planner import default_global_batch_tokens

HERE = Path(__file__).resolve().parent
POLICIES = ("dcp", "verl", "megatron-hcp", "hydraulis", "flexsp")
GANTT = ("lightning-dcp simulate --world-size 32 --dataset long --num-steps 2 --policies "
         "dcp,verl,megatron-hcp,hydraulis,flexsp --plot benchmarks/results/versus_field_32_long.png")
"""The command that draws one cell's runs on one Gantt chart (``versus_field_32_long.png``)."""

LARGE = 256
"""World sizes from this one on run ``--steps-large`` global batches (planning the peers there is slow)."""


def cell_run(world: int, dist_name: str, steps: int, model: str, seed: int = 0,
             multiple: float = 1.0) -> tuple[AnalyticCostModel, list[int], list[int], int]:
    """One cell's cost model, dataset, run of samples and global batch tokens (``multiple`` x the default size)."""
    cm = AnalyticCostModel(get_model(model), get_hardware("h100"), world)
    dist = get_distribution(dist_name)
    dataset = dist.sample(DATASET_SIZE, seed)
    gbt = int(multiple * default_global_batch_tokens(world, dataset, cm))
    pool = dist.sample(int(steps * gbt / (sum(dataset) / len(dataset)) * 1.5) + 100, seed + 1)
    return cm, dataset, draw_run(pool, gbt, steps), gbt


def run_cell(world: int, dist_name: str, steps: int, model: str, seed: int = 0, multiple: float = 1.0) -> list[dict]:
    """Every policy on one (world, dataset) cell: the rows of :func:`compare` with the cell's keys added. The global
    batch is ``multiple`` times the default size (a larger batch gives static-SP planners more samples to balance).
    A policy whose rules fail on the run (verl: a batch its replica count does not divide) gets a row with ``error``."""
    cm, dataset, run, gbt = cell_run(world, dist_name, steps, model, seed, multiple)
    rows = []
    for name in POLICIES:
        try:
            rows += compare(world, cm, dataset, run, [name], global_batch_tokens=gbt, seed=seed)
        except PlanningError as err:
            rows.append({"policy": name, "error": str(err)})
    base = next(r for r in rows if r["policy"] == "dcp")["tokens_per_s"]
    out = []
    for r in rows:
        cell = {"gpus": world, "dataset": dist_name, "steps": steps, "batch_tokens": gbt, "samples": len(run),
                "policy": r["policy"], "error": r.get("error", "")}
        if not cell["error"]:
            cell.update({"vs_dcp": r["tokens_per_s"] / base, "tokens_per_s": r["tokens_per_s"],
                         "bound": r["fraction_of_bound"], "imbalance": r["imbalance"], "step_s": r["step_s"],
                         "planning_s": r["planner_ms_per_step"] / 1e3, "wait": r["planning_wait_s"] / r["total_time_s"],
                         "solver_s": r["solver_s_per_step"]})
        out.append(cell)
    return out


def fail_note(error: str) -> str:
    """The rule a failed peer broke, short, for a table cell."""
    if "do not split evenly" in error or "multiple of" in error:
        return "equal-count DP split"
    if "holds the longest" in error or "no Ulysses SP size holds" in error:
        return "longest sample"
    return error.split("; ", 1)[0][:80].replace("|", "/")


def markdown(rows: Sequence[dict], command: str, elapsed: float, multiple: float = 1.0) -> str:
    lines = ["# Versus the field", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- machine: {platform.platform()}, {os.cpu_count()} CPUs shared with other jobs (simulation only; "
             f"{elapsed:.0f} s); planning times are Python on this machine, noisy",
             f"- command: `{command}`",
             "- model: transformer-1d, H100 analytic cost model; every policy plans the same samples",
             f"- cells: `steps` global batches of {multiple:g} x the default size (`default_global_batch_tokens`; "
             "tokens per batch in the tables)",
             "- planning charged: a step lasts max(its simulated time, the next step's planning time)",
             f"- one cell on one Gantt chart: `{GANTT}`", ""]
    for world in dict.fromkeys(r["gpus"] for r in rows):
        cell = [r for r in rows if r["gpus"] == world]
        steps = sorted({r["steps"] for r in cell})
        lines += [f"## {world} GPUs ({', '.join(map(str, steps))} global batch{'es' if steps != [1] else ''} per cell)", "",
                  "tokens/s relative to dcp / % of the step bound / imbalance %:", "",
                  "| dataset | batch tokens | " + " | ".join(POLICIES) + " |", "|---|---:|" + "---:|" * len(POLICIES)]
        for ds in dict.fromkeys(r["dataset"] for r in cell):
            by = {r["policy"]: r for r in cell if r["dataset"] == ds}
            lines.append(f"| {ds} | {by['dcp']['batch_tokens']:,} | " + " | ".join(
                f"fails: {fail_note(by[p]['error'])}" if by[p]["error"] else
                f"{by[p]['vs_dcp']:.2f}x / {100 * by[p]['bound']:.0f}% / {100 * by[p]['imbalance']:.1f}"
                for p in POLICIES) + " |")
        lines += ["", "mean simulated step s / planning s per step (waiting on the planner, % of the run):", "",
                  "| dataset | " + " | ".join(POLICIES) + " | flexsp MILP s/step |", "|---|" + "---:|" * (len(POLICIES) + 1)]
        for ds in dict.fromkeys(r["dataset"] for r in cell):
            by = {r["policy"]: r for r in cell if r["dataset"] == ds}
            lines.append(f"| {ds} | " + " | ".join(
                "-" if by[p]["error"] else
                f"{by[p]['step_s']:.3g} / {by[p]['planning_s']:.3g} ({100 * by[p]['wait']:.0f}%)" for p in POLICIES)
                + (" | - |" if by["flexsp"]["error"] else f" | {by['flexsp']['solver_s']:.2f} |"))
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="32,256")
    ap.add_argument("--dists", default=",".join(DISTRIBUTIONS))
    ap.add_argument("--steps", type=int, default=2, help="global batches per cell below 256 GPUs")
    ap.add_argument("--steps-large", type=int, default=1, help="global batches per cell at 256 GPUs and more")
    ap.add_argument("--model", default="transformer-1d")
    ap.add_argument("--batch-multiple", type=float, default=1.0,
                    help="global batch = this many times the default size (default 1)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "versus_field.md")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        for ds in args.dists.split(","):
            t = time.perf_counter()
            steps = args.steps_large if world >= LARGE else args.steps
            cell = run_cell(world, ds, steps, args.model, multiple=args.batch_multiple)
            rows += cell
            print(f"{world:5d} {ds:9s} " + "  ".join(f"{r['policy']} " + ("fails" if r["error"] else f"{r['vs_dcp']:.2f}x")
                                                    for r in cell)
                  + f"  [{time.perf_counter() - t:.0f} s]", flush=True)
    command = "python benchmarks/versus_field.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(rows, command.strip(), time.perf_counter() - t0, args.batch_multiple))
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
