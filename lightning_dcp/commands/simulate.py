"""``lightning-dcp simulate``: compare the planning policies on a simulated cluster.

Example::

    lightning-dcp simulate --world-size 32 --dataset short --model transformer-1d --hardware h100

Draws a dataset from the named length distribution (``--dataset``; or a JSON list with
``--lengths``), takes ``--num-steps`` global batches of ``--global-batch-tokens`` tokens from it
(the same samples for every policy), plans them with each policy (every planner is given the
dataset's lengths once, for candidate layouts and bucket tuning) and simulates the plans on the
cost model. One row per policy: tokens/s, speedup over bucket, imbalance %, % of the ideal
bound, % of the step bound (the sum over the global batches of
:func:`~lightning_dcp.planning.bound.step_bound` -- best-rate work spread over every rank, or the
heaviest sample's best time, plus the all-reduce -- divided by the policy's simulated time: the
same numerator for every policy, so bucket's extra steps count against it), planner milliseconds per step (``time.perf_counter`` around ``Planner.plan``, divided by
the plan's steps). ``--plot out.png`` draws every policy's whole run (the same samples) as
per-rank Gantt charts on one shared time axis -- colour SP size, hatched recompute, dark grey
all-reduce, pale idle -- above a panel of tokens/s and % of step bound per policy;
``--json`` / ``--csv`` write the rows.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import time
from pathlib import Path
from typing import Any

from lightning_dcp.cli import CLIError
from lightning_dcp.commands.plan import add_cost_model_arguments, build_cost_model, check_policy, read_lengths, write_atomic

HELP = "simulate every planning policy on a length distribution and compare throughput and balance"

DATASET_SIZE = 50000
"""Samples drawn to stand for the whole dataset (candidate layouts, bucket tuning)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="length distribution: short, balanced, long, video or code")
    src.add_argument("--lengths", type=Path, help="JSON list of sample lengths to use as the dataset instead")
    add_cost_model_arguments(parser)
    parser.add_argument("--num-steps", type=int, default=4, help="global batches to simulate (default 4; more for steadier figures)")
    parser.add_argument("--policies", default="bucket,packed,static,dcp-inter,dcp-intra,dcp",
                        help="comma-separated policies (default: all; bucket first is the speedup baseline)")
    parser.add_argument("--plot", type=Path, default=None, help="write a chart of every policy's whole run on one time axis + tokens/s and %% of step bound (PNG)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument("--csv", type=Path, default=None, help="write the rows as CSV")


def draw_run(lengths_pool: list[int], target_tokens: int) -> list[int]:
    """The prefix of ``lengths_pool`` holding ``target_tokens`` tokens (the whole pool if fewer)."""
    acc = 0
    for i, n in enumerate(lengths_pool):
        acc += n
        if acc >= target_tokens:
            return lengths_pool[: i + 1]
    return list(lengths_pool)


def cut_batches(lengths: list[int], global_batch_tokens: int) -> list[list[int]]:
    """``lengths`` cut in order into global batches that close at ``global_batch_tokens`` (as :meth:`Planner.batches`)."""
    from lightning_dcp.planning.planner import cut_by_tokens

    return [[lengths[i] for i in batch] for batch in cut_by_tokens(lengths, global_batch_tokens)]


def compare(world_size: int, cost_model: Any, dataset: list[int], run_lengths: list[int], policies: list[str], *,
            global_batch_tokens: int, seed: int = 0, timeline: bool = False) -> list[dict[str, Any]]:
    """Plan and simulate ``run_lengths`` with each policy; one dict per policy (plus its plan and result)."""
    from lightning_dcp.planning.planner import Planner
    from lightning_dcp.planning.simulator import simulate

    from lightning_dcp.planning.bound import StepBounder

    bounder = StepBounder(cost_model, world_size)
    bound_time = sum(bounder.seconds(b) for b in cut_batches(run_lengths, global_batch_tokens))
    rows = []
    for name in policies:
        planner = Planner(world_size, cost_model, name, seed=seed, dataset_lengths=dataset)
        t0 = time.perf_counter()
        plan = planner.plan(run_lengths, global_batch_tokens=global_batch_tokens)
        elapsed = time.perf_counter() - t0
        sim = simulate(plan, cost_model, timeline=timeline)
        rows.append({
            "policy": name, "steps": len(plan.steps), "tokens": sim.tokens, "total_time_s": sim.total_time,
            "tokens_per_s": sim.tokens_per_s, "imbalance": sim.imbalance, "fraction_of_ideal": sim.fraction_of_ideal,
            "fraction_of_bound": bound_time / sim.total_time if sim.total_time > 0 else 0.0,
            "mean_step_bound_fraction": sim.mean_step_bound_fraction,
            "planner_ms_per_step": 1e3 * elapsed / max(len(plan.steps), 1), **{f"icc_{k}": v for k, v in sim.icc.items()},
            "_plan": plan, "_sim": sim,
        })
    base = next((r["tokens_per_s"] for r in rows if r["policy"] == "bucket"), rows[0]["tokens_per_s"] if rows else 1.0)
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base if base > 0 else math.nan
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ["policy", "steps", "tokens/s", "speedup", "imbalance %", "% of ideal", "% of step bound", "planner ms/step"]
    body = [[r["policy"], str(r["steps"]), f"{r['tokens_per_s']:,.0f}", f"{r['speedup']:.2f}x", f"{100 * r['imbalance']:.1f}",
             f"{100 * r['fraction_of_ideal']:.1f}", f"{100 * r['fraction_of_bound']:.1f}",
             f"{r['planner_ms_per_step']:.2f}"] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)


def public(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


SP_COLOURS = {1: "#4c72b0", 2: "#55a868", 4: "#dd8452", 8: "#c44e52", 16: "#8172b3", 32: "#937860", 64: "#da8bc3"}
"""Colour of each SP size in the chart (larger sizes cycle through these)."""


def _run_bars(plan: Any, sim: Any) -> tuple[dict, list[tuple[float, float]], list[float]]:
    """Bars of a whole run on one time axis: ``{(rank, sp, recomputes): [(start, width)]}``, all-reduce bars, step ends."""
    bars: dict[tuple[int, int, bool], list[tuple[float, float]]] = {}
    allreduce: list[tuple[float, float]] = []
    ends, t0 = [], 0.0
    for step, line, t in zip(plan.steps, sim.timeline, sim.step_times):
        for rank, start, end, idx, kind in line:
            if kind == "allreduce":
                if rank == 0:
                    allreduce.append((t0 + start, end - start))
                continue
            item = step.items[idx]
            bars.setdefault((rank, item.sp_size, item.recompute > 0), []).append((t0 + start, end - start))
        t0 += t
        ends.append(t0)
    return bars, allreduce, ends


def plot_gantt(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Every policy's whole run (the same samples) as per-rank Gantt charts on one shared time axis,
    plus a panel of tokens/s and % of the step bound per policy.

    Colour: SP size of the micro-batch (legend); hatched: the micro-batch recomputes layers; dark
    grey: the step-end all-reduce + optimizer step (every rank); pale background: idle; white:
    the policy's run is over; thin vertical lines: step ends.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(rows)
    W = rows[0]["_plan"].world_size if rows else 1
    gantt_h = min(2.6, 0.9 + 0.05 * W)
    fig = plt.figure(figsize=(11, gantt_h * n + 2.4))
    grid = fig.add_gridspec(n + 1, 1, height_ratios=[gantt_h] * n + [2.0], hspace=0.45)
    axes = [fig.add_subplot(grid[0, 0])]
    axes += [fig.add_subplot(grid[i, 0], sharex=axes[0]) for i in range(1, n)]
    sizes: set[int] = set()
    horizon = max((r["_sim"].total_time for r in rows), default=1.0)
    for ax, r in zip(axes, rows):
        sim, plan = r["_sim"], r["_plan"]
        ax.set_facecolor("#f6e8e8")  # idle: what no bar covers
        if sim.timeline:
            bars, allreduce, ends = _run_bars(plan, sim)
            for (rank, sp, rec), spans in bars.items():
                sizes.add(sp)
                ax.broken_barh(spans, (rank - 0.5, 1.0), facecolors=SP_COLOURS.get(sp, "0.4"), edgecolor="none",
                               hatch="////" if rec else None, linewidth=0)
            ax.broken_barh(allreduce, (-0.5, W), facecolors="0.25", edgecolor="none")
            for t in ends:
                ax.axvline(t, color="black", linewidth=0.4)
            ax.axvspan(sim.total_time, horizon * 1.01, facecolor="white", edgecolor="none")  # run over
        ax.set_ylim(W - 0.5, -0.5)
        ax.set_ylabel("rank", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_title(f"{r['policy']}: {r['steps']} steps, {r['total_time_s']:.1f} s, idle {100 * r['imbalance']:.0f}%, "
                     f"{100 * r['fraction_of_bound']:.0f}% of step bound", fontsize=9, loc="left")
        if ax is not axes[-1]:
            plt.setp(ax.get_xticklabels(), visible=False)
    axes[-1].set_xlim(0, horizon * 1.01)
    axes[-1].set_xlabel("seconds (whole run, every policy on the same samples)", fontsize=8)
    plt.rcParams["hatch.linewidth"] = 0.6
    handles = [Patch(facecolor=SP_COLOURS.get(p, "0.4"), label=f"SP {p}") for p in sorted(sizes)]
    handles += [Patch(facecolor="white", edgecolor="0.3", hatch="////", label="recomputes layers"),
                Patch(facecolor="0.25", label="all-reduce + optimizer"), Patch(facecolor="#f6e8e8", label="idle"),
                Patch(facecolor="white", edgecolor="0.6", label="run finished")]
    axes[0].legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.12), ncol=len(handles), fontsize=7,
                   frameon=False, handlelength=1.5, columnspacing=1.0)
    _plot_rates(fig.add_subplot(grid[n, 0]), rows)
    if title:
        axes[0].text(0.0, 1.32 + 0.05 * (n > 4), title, transform=axes[0].transAxes, fontsize=10, weight="bold")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def _plot_rates(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Tokens/s per policy (bars), labelled with % of the step bound and the speedup over the first."""
    names = [r["policy"] for r in rows]
    rates = [r["tokens_per_s"] for r in rows]
    ax.barh(range(len(rows)), rates, color="0.55")
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()
    top = max(rates, default=1.0) or 1.0
    for i, r in enumerate(rows):
        ax.text(r["tokens_per_s"] + 0.01 * top, i, f"{r['tokens_per_s']:,.0f} tokens/s, {100 * r['fraction_of_bound']:.0f}% "
                f"of step bound, {r['speedup']:.2f}x", va="center", fontsize=7)
    ax.set_xlim(0, top * 1.6)
    ax.set_xlabel("tokens/s (label: % of the step bound, speedup over the first policy)", fontsize=8)
    ax.tick_params(labelsize=7)


def run(args: argparse.Namespace) -> int:
    from lightning_dcp.planning.errors import PlanningError
    from lightning_dcp.planning.planner import default_global_batch_tokens

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise CLIError("--policies is empty; name at least one policy")
    for p in policies:
        check_policy(p)
    if args.num_steps <= 0:
        raise CLIError(f"--num-steps must be positive, got {args.num_steps}")
    if args.global_batch_tokens is not None and args.global_batch_tokens <= 0:
        raise CLIError(f"--global-batch-tokens must be positive, got {args.global_batch_tokens}")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise CLIError(f"--plot writes a PNG; give a path ending in .png, got {args.plot}")
    cost_model = build_cost_model(args)
    if args.dataset is not None:
        from lightning_dcp.planning.distributions import get_distribution
        try:
            dist = get_distribution(args.dataset)
        except ValueError as err:
            raise CLIError(str(err)) from None
        dataset = dist.sample(DATASET_SIZE, args.seed)
        gbt = args.global_batch_tokens or default_global_batch_tokens(args.world_size, dataset, cost_model)
        mean = sum(dataset) / len(dataset)
        pool = dist.sample(int(args.num_steps * gbt / mean * 1.5) + 100, args.seed + 1)
        source = args.dataset
    else:
        dataset = read_lengths(args.lengths)
        gbt = args.global_batch_tokens or default_global_batch_tokens(args.world_size, dataset, cost_model)
        pool = dataset
        source = str(args.lengths)
    run_lengths = draw_run(pool, args.num_steps * gbt)
    try:
        rows = compare(args.world_size, cost_model, dataset, run_lengths, policies, global_batch_tokens=gbt,
                       seed=args.seed, timeline=args.plot is not None)
    except PlanningError as err:
        raise CLIError(str(err)) from None
    print(f"{source}: {len(run_lengths)} samples, {sum(run_lengths):,} tokens, {args.num_steps} global batches of "
          f"{gbt:,} tokens, {args.world_size} GPUs, model {(args.model or 'transformer-1d') if args.profile is None else args.profile}")
    print(format_table(rows))
    if args.json is not None:
        write_atomic(args.json, json.dumps({"source": source, "world_size": args.world_size, "global_batch_tokens": gbt,
                                             "samples": len(run_lengths), "rows": public(rows)}, indent=2) + "\n")
    if args.csv is not None:
        out = io.StringIO()
        pub = public(rows)
        writer = csv.DictWriter(out, fieldnames=list(pub[0]))
        writer.writeheader()
        writer.writerows(pub)
        write_atomic(args.csv, out.getvalue())
    if args.plot is not None:
        plot_gantt(rows, args.plot, f"{source}, {args.world_size} GPUs")
        print(f"wrote {args.plot}")
    return 0
