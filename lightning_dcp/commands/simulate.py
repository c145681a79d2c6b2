"""``lightning-dcp simulate``: compare the planning policies on a simulated cluster.

Example (every argument has a default; this is what a bare ``lightning-dcp simulate`` runs)::

    lightning-dcp simulate --world-size 32 --dataset long --model transformer-1d --hardware h100

Draws a dataset from the named length distribution (``--dataset``, default ``long``; or a JSON
list with ``--lengths``), takes ``--num-steps`` global batches of up to ``--global-batch-tokens`` tokens
from it, cut as training cuts them (:mod:`~lightning_dcp.planning.batches`; the same samples for every
policy), plans them with each policy (every planner is given
the dataset's lengths once, for candidate layouts and bucket tuning) and simulates the plans on
the cost model. A run that leaves ``--world-size`` or ``--dataset`` out says which defaults it
used. One row per policy: tokens/s, speedup over bucket, imbalance %, % of the ideal
bound, % of the step bound (the sum over the global batches of
:func:`~lightning_dcp.planning.bound.step_bound` -- best-rate work spread over every rank, or the
heaviest sample's best time, plus the all-reduce -- divided by the policy's simulated time: the
same numerator for every policy, so bucket's extra steps count against it), the mean simulated
step (``step s``, execution only), planner milliseconds per step (``time.perf_counter`` around each
global batch's planning) and ``planning wait %``: the share of the run the GPUs wait on the planner.
Planning runs one step ahead, so a step lasts ``max(its time, the next step's planning)``
(:func:`~lightning_dcp.planning.simulator.charge_planning`); tokens/s and the bound fractions count
that wait (``--hide-planning``: they do not). Bucket runs more optimizer steps than there are global batches (see
:func:`steps_note`); the table's footnote and the chart say so.

Progress goes to stderr (``--quiet`` silences it): one line per policy as it finishes, a line
per planned global batch at most every :data:`PROGRESS_INTERVAL_S` seconds while a policy is
slow, and one line for the chart. ``--plot out.png`` draws every policy's whole run (the same
samples) as per-rank Gantt charts on one shared time axis -- colour SP size, hatched recompute,
dark grey all-reduce, pale idle -- above a panel of tokens/s and % of step bound per policy;
``--json`` / ``--csv`` write the rows.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from lightning_dcp.cli import CLIError
from lightning_dcp.commands.simulate_plot import plot_gantt, steps_note
from lightning_dcp.commands.plan import (add_cost_model_arguments, build_cost_model, check_policy, read_lengths, resolve_seed,
                                         write_atomic)

HELP = "simulate every planning policy on a length distribution and compare throughput and balance"

DATASET_SIZE = 50000
"""Samples drawn to stand for the whole dataset (candidate layouts, bucket tuning)."""

DEFAULT_WORLD_SIZE = 32
"""``--world-size`` when none is given: four 8-GPU nodes, the DCP paper's scale."""

DEFAULT_DATASET = "long"
"""``--dataset`` when neither it nor ``--lengths`` is given: the paper's long-dominated mixture."""

PROGRESS_INTERVAL_S = 2.0
"""While a policy plans, at most one progress line per this many seconds."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    from lightning_dcp.planning.distributions import DISTRIBUTIONS

    src.add_argument("--dataset", help=f"length distribution: {', '.join(DISTRIBUTIONS)} (default {DEFAULT_DATASET})")
    src.add_argument("--lengths", type=Path, help="JSON list of sample lengths to use as the dataset instead")
    add_cost_model_arguments(parser, world_size_default=DEFAULT_WORLD_SIZE)
    parser.add_argument("--num-steps", type=int, default=4, help="global batches to simulate (default 4; more for steadier figures)")
    parser.add_argument("--policies", default="bucket,packed,static,dcp-inter,dcp-intra,dcp",
                        help="comma-separated policies (default: all; bucket first is the speedup baseline)")
    parser.add_argument("--plot", type=Path, default=None, help="write a chart of every policy's whole run on one time axis + tokens/s and %% of step bound (PNG)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument("--csv", type=Path, default=None, help="write the rows as CSV")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--hide-planning", action="store_true",
                        help="do not charge planning time (default: a step lasts at least the next step's planning)")
    parser.add_argument("--tp", type=int, nargs="?", const=0, default=None, metavar="T",
                        help="price tensor parallelism inside SP items: dcp may give an item any TP degree up to T "
                             "(default: a node's GPUs) whose TP groups stay inside a node (Planner(max_tp_size=T)); "
                             "planning and simulation only, the runtime does not run TP items")
    parser.add_argument("--pp", type=int, nargs="?", const=16, default=None, metavar="MAX",
                        help="also price pipeline parallelism on the same global batches: for each PP degree up to "
                             "MAX (default 16) the fastest <TP, PP> pipelines (TP inside a node) as Hydraulis assigns "
                             "them, against dcp's tokens/s; priced only, no runtime runs pipelines")
    from lightning_dcp.planning.speeds import RANK_SPEED_SYNTAX

    parser.add_argument("--rank-speed", default=None, metavar="SPEC",
                        help=f"simulate ranks slower or faster than the cost model: {RANK_SPEED_SYNTAX.replace('%', '%%')}. An item runs at "
                             "its slowest member's pace")
    aware = parser.add_mutually_exclusive_group()
    aware.add_argument("--speed-aware", dest="speed_aware", action="store_true", default=True,
                       help="with --rank-speed: the planner knows the speeds (default; dcp places work accordingly)")
    aware.add_argument("--speed-blind", dest="speed_aware", action="store_false",
                       help="with --rank-speed: the planner does not know them (what a run without calibration does)")


class Progress:
    """Progress lines on a stream (stderr): :meth:`line` always, :meth:`update` throttled.

    ``update`` prints only when ``interval`` seconds have passed since the last line, so a fast
    run prints one line per phase and a slow one a line every ``interval`` seconds at most.
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True, interval: float = PROGRESS_INTERVAL_S,
                 prefix: str = "simulate: "):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.interval = interval
        self.prefix = prefix
        self._last = time.perf_counter()

    def line(self, message: str) -> None:
        if self.enabled:
            sys.stdout.flush()  # keep the order of stdout and stderr lines when both go to one terminal or file
            print(self.prefix + message, file=self.stream, flush=True)
        self._last = time.perf_counter()

    def update(self, message: str) -> None:
        if time.perf_counter() - self._last >= self.interval:
            self.line(message)


def draw_run(lengths_pool: list[int], global_batch_tokens: int, num_steps: int) -> list[int]:
    """The lengths of the first ``num_steps`` global batches of ``lengths_pool``, cut in order as training cuts
    (:func:`~lightning_dcp.planning.batches.cut_batches`); the whole pool if it holds fewer."""
    from lightning_dcp.planning.batches import cut_batches

    batches = cut_batches(lengths_pool, global_batch_tokens=global_batch_tokens)[:num_steps]
    return [lengths_pool[i] for batch in batches for i in batch]


def compare(world_size: int, cost_model: Any, dataset: list[int], run_lengths: list[int], policies: list[str], *,
            global_batch_tokens: int, seed: int = 0, timeline: bool = False,
            progress: Progress | None = None, rank_speeds: Any = None,
            speed_aware: bool = True, charge_planning: bool = True, ring: bool = True,
            max_tp_size: int = 1) -> list[dict[str, Any]]:
    """Plan and simulate ``run_lengths`` with each policy; one dict per policy (plus its plan and result).

    ``charge_planning``: each global batch's planning seconds (``time.perf_counter`` around it; a
    policy that plans the run as one set, bucket, has them spread over its steps) are given to the
    simulator, which charges what the previous step does not hide
    (:func:`~lightning_dcp.planning.simulator.charge_planning`). The peers tune on the run's global
    batches (:meth:`Planner.prepare`) before the timed planning.

    ``progress``: where to report each policy as it finishes (and slow planning as it goes).
    ``rank_speeds``: the ranks' true speeds: the simulation (and the run's step bound) uses them; the
    planners see them only when ``speed_aware``. ``ring``: the planners may use ring sizes (the step
    bound counts them either way). ``max_tp_size``: the planners may give items tensor-parallel splits up to that
    degree (only dcp chooses a split per item; the step bound counts them too); each row then has ``tp_share``,
    the share of its tokens per TP degree.
    The run's step bound and every simulation share one cached
    :class:`~lightning_dcp.planning.bound.StepBounder` (:func:`~lightning_dcp.planning.bound.step_bound`).
    """
    from lightning_dcp.planning.batches import cut_batches
    from lightning_dcp.planning.bound import step_bound
    from lightning_dcp.planning.planner import POLICIES, Planner
    from lightning_dcp.planning.simulator import simulate

    batches = [[run_lengths[i] for i in b] for b in cut_batches(run_lengths, global_batch_tokens=global_batch_tokens)]
    bound_time = sum(step_bound(b, cost_model, world_size, rank_speeds=rank_speeds, max_tp_size=max_tp_size)
                     for b in batches)
    plan_speeds = rank_speeds if speed_aware or rank_speeds is None else [1.0] * world_size
    rows = []
    for k, name in enumerate(policies):
        tag = f"[{k + 1}/{len(policies)}] {name}"
        opts = {"tune_tokens": global_batch_tokens} if "tune_tokens" in POLICIES[name].option_names() else {}
        if max_tp_size > 1:
            opts["max_tp_size"] = max_tp_size
        planner = Planner(world_size, cost_model, name, seed=seed, dataset_lengths=dataset, rank_speeds=plan_speeds,
                          ring=ring, **opts)
        planner.prepare(batches)  # a peer tunes on the run's batches here, before the run: not planning time
        t0 = time.perf_counter()
        marks = [t0]

        def report(done: int, total: int, tag: str = tag, t0: float = t0) -> None:
            marks.append(time.perf_counter())
            if progress is not None:
                progress.update(f"{tag}: planned {done}/{total} global batches ({time.perf_counter() - t0:.1f} s)")
        plan = planner.plan(run_lengths, global_batch_tokens=global_batch_tokens, progress=report)
        elapsed = time.perf_counter() - t0
        per_batch = np.diff(marks).tolist()
        n_steps = max(len(plan.steps), 1)
        planning = per_batch if len(per_batch) == len(plan.steps) else [elapsed / n_steps] * len(plan.steps)
        sim = simulate(plan, cost_model, timeline=timeline, rank_speeds=rank_speeds,
                       planning_times=planning if charge_planning else None, max_tp_size=max_tp_size)
        if progress is not None:
            progress.line(f"{tag}: {len(plan.steps)} steps planned in {elapsed:.2f} s, simulated in "
                          f"{time.perf_counter() - t0 - elapsed:.2f} s")
        rows.append({
            "policy": name, "steps": len(plan.steps), "global_batches": len(batches), "tokens": sim.tokens,
            "total_time_s": sim.total_time,
            "tokens_per_s": sim.tokens_per_s, "imbalance": sim.imbalance, "fraction_of_ideal": sim.fraction_of_ideal,
            "fraction_of_bound": bound_time / sim.total_time if sim.total_time > 0 else 0.0,
            "mean_step_bound_fraction": sim.mean_step_bound_fraction,
            "planner_ms_per_step": 1e3 * elapsed / n_steps, "step_s": sum(sim.step_times) / n_steps,
            "planning_wait_s": sim.planning_wait,
            "solver_s_per_step": sum(getattr(planner.policy, "solve_log", [])) / n_steps,
            **{f"icc_{k}": v for k, v in sim.icc.items()}, "_plan": plan, "_sim": sim,
        })
        if max_tp_size > 1:
            rows[-1]["tp_share"] = tp_share(plan)
    base = next((r["tokens_per_s"] for r in rows if r["policy"] == "bucket"), rows[0]["tokens_per_s"] if rows else 1.0)
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base if base > 0 else math.nan
    return rows


def tp_share(plan: Any) -> dict[int, float]:
    """Share of the plan's tokens per tensor-parallel degree of their items (``{1: 1.0}`` without TP)."""
    tokens: dict[int, int] = {}
    for step in plan.steps:
        for item in step.items:
            tokens[item.tp] = tokens.get(item.tp, 0) + item.tokens
    total = sum(tokens.values()) or 1
    return {t: n / total for t, n in sorted(tokens.items())}


def tp_note(row: dict[str, Any]) -> str:
    """``dcp: tokens by TP degree: 1 62.0%, 8 38.0%`` (``--tp``)."""
    share = row.get("tp_share") or {1: 1.0}
    return f"{row['policy']}: tokens by TP degree: " + ", ".join(f"{t} {100 * v:.1f}%" for t, v in share.items())


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ["policy", "steps", "tokens/s", "speedup", "imbalance %", "% of ideal", "% of step bound", "step s",
            "planner ms/step", "planning wait %"]
    body = [[r["policy"], str(r["steps"]), f"{r['tokens_per_s']:,.0f}", f"{r['speedup']:.2f}x", f"{100 * r['imbalance']:.1f}",
             f"{100 * r['fraction_of_ideal']:.1f}", f"{100 * r['fraction_of_bound']:.1f}", f"{r.get('step_s', 0.0):.3g}",
             f"{r['planner_ms_per_step']:.2f}",
             f"{100 * r.get('planning_wait_s', 0.0) / r['total_time_s'] if r['total_time_s'] > 0 else 0.0:.1f}"]
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)


def public(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


def run(args: argparse.Namespace) -> int:
    from lightning_dcp.planning.errors import PlanningError
    from lightning_dcp.planning.planner import default_global_batch_tokens

    defaults = []
    if args.world_size is None:
        args.world_size = DEFAULT_WORLD_SIZE
        defaults.append(f"--world-size {DEFAULT_WORLD_SIZE}")
    if args.dataset is None and args.lengths is None:
        args.dataset = DEFAULT_DATASET
        defaults.append(f"--dataset {DEFAULT_DATASET}")
    policies = _check_args(args)
    speeds = rank_speeds_arg(args)
    if defaults:
        print(f"using defaults {' '.join(defaults)} (pass them to change)")
    progress = Progress(enabled=not args.quiet)
    if args.dataset is not None:
        from lightning_dcp.planning.distributions import get_distribution
        try:
            dist = get_distribution(args.dataset)
        except ValueError as err:
            raise CLIError(str(err)) from None
        dataset = dist.sample(DATASET_SIZE, args.seed)
        cost_model = build_cost_model(args, dataset)
        gbt = args.global_batch_tokens or default_global_batch_tokens(args.world_size, dataset, cost_model)
        mean = sum(dataset) / len(dataset)
        pool = dist.sample(int(args.num_steps * gbt / mean * 1.5) + 100, args.seed + 1)
        source = args.dataset
    else:
        dataset = read_lengths(args.lengths)
        cost_model = build_cost_model(args, dataset)
        gbt = args.global_batch_tokens or default_global_batch_tokens(args.world_size, dataset, cost_model)
        pool = dataset
        source = str(args.lengths)
    run_lengths = draw_run(pool, gbt, args.num_steps)
    max_tp = 1 if args.tp is None else (args.tp or int(cost_model.gpus_per_node or 1))
    if getattr(args, "shard_group_size", None) == "auto":
        cost_model = best_shard_group(args, cost_model, dataset, run_lengths, gbt, progress, max_tp)
    progress.line(f"{len(policies)} policies on {len(run_lengths)} samples ({sum(run_lengths):,} tokens), {args.world_size} GPUs")
    try:
        rows = compare(args.world_size, cost_model, dataset, run_lengths, policies, global_batch_tokens=gbt,
                       seed=args.seed, timeline=args.plot is not None, progress=progress, rank_speeds=speeds,
                       speed_aware=args.speed_aware, charge_planning=not args.hide_planning, ring=args.ring,
                       max_tp_size=max_tp)
    except PlanningError as err:
        raise CLIError(str(err)) from None
    model = (args.model or "transformer-1d") if args.profile is None else args.profile
    if getattr(args, "num_heads", None):
        model = f"{model} with {args.num_heads} heads"
    if not args.ring:
        model += ", no ring"
    if max_tp > 1:
        model += f", TP up to {max_tp}"
    print(f"{source}: {len(run_lengths)} samples, {sum(run_lengths):,} tokens, {rows[0]['global_batches']} global batches of "
          f"{gbt:,} tokens, {args.world_size} GPUs, model {model}{_sharding_note(args, cost_model)}"
          + (f", rank speeds {args.rank_speed} (planner {'aware' if args.speed_aware else 'blind'})" if speeds else ""))
    print(format_table(rows))
    for r in rows:
        note = steps_note(r)
        if note:
            print(textwrap.fill(note, 100, initial_indent="  ", subsequent_indent="    "))
    if max_tp > 1:
        for r in rows:
            print("  " + tp_note(r))
    pipes = None
    if args.pp is not None:
        pipes = pipeline_rows(rows, cost_model, args.world_size, run_lengths, gbt, args.pp, args.seed, progress)
        print(format_pipelines(pipes, rows))
    _write_outputs(args, rows, source, gbt, len(run_lengths), progress, pipes)
    return 0


def _check_args(args: argparse.Namespace) -> list[str]:
    """The policies named by ``--policies``; every other value checked (``CLIError`` naming it)."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise CLIError("--policies is empty; name at least one policy")
    for p in policies:
        check_policy(p)
    resolve_seed(args)
    if args.num_steps <= 0:
        raise CLIError(f"--num-steps must be positive, got {args.num_steps}")
    if args.global_batch_tokens is not None and args.global_batch_tokens <= 0:
        raise CLIError(f"--global-batch-tokens must be positive, got {args.global_batch_tokens}")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise CLIError(f"--plot writes a PNG; give a path ending in .png, got {args.plot}")
    if args.tp is not None and args.tp < 0:
        raise CLIError(f"--tp takes a positive TP degree (or none: a node's GPUs), got {args.tp}")
    if args.pp is not None and args.pp < 2:
        raise CLIError(f"--pp takes the largest PP degree to price (at least 2), got {args.pp}")
    return policies


def _write_outputs(args: argparse.Namespace, rows: list[dict], source: str, gbt: int, samples: int,
                   progress: Progress, pipes: list[dict] | None = None) -> None:
    """The files ``--json``, ``--csv`` and ``--plot`` ask for (``pipes``: ``--pp``'s rows, in the JSON)."""
    if args.json is not None:
        extra = {} if pipes is None else {"pipelines": pipes}
        write_atomic(args.json, json.dumps({"source": source, "world_size": args.world_size, "global_batch_tokens": gbt,
                                             "samples": samples, "rows": public(rows), **extra}, indent=2) + "\n")
    if args.csv is not None:
        out = io.StringIO()
        pub = public(rows)
        writer = csv.DictWriter(out, fieldnames=list(pub[0]))
        writer.writeheader()
        writer.writerows(pub)
        write_atomic(args.csv, out.getvalue())
    if args.plot is not None:
        t0 = time.perf_counter()
        progress.line(f"drawing {args.plot} ...")
        bars = plot_gantt(rows, args.plot, f"{source}, {args.world_size} GPUs")
        progress.line(f"drew {bars:,} bars in {time.perf_counter() - t0:.1f} s")
        print(f"wrote {args.plot}")


def reference_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row pipelines are compared with: dcp's when it ran, else the fastest."""
    return next((r for r in rows if r["policy"] == "dcp"), None) or max(rows, key=lambda r: r["tokens_per_s"])


def pipeline_rows(rows: list[dict[str, Any]], cost_model: Any, world_size: int, run_lengths: list[int], gbt: int,
                  max_pp: int, seed: int, progress: Progress) -> list[dict[str, Any]]:
    """``--pp``: per PP degree the fastest homogeneous ``<TP, PP>`` pipelines on the run's global batches
    (:func:`~lightning_dcp.planning.pipeline_estimate.estimate_pipelines`), against :func:`reference_row`."""
    from lightning_dcp.planning.batches import cut_batches
    from lightning_dcp.planning.pipeline_estimate import estimate_pipelines, pipeline_degrees, replica_cost_model

    batches = [[run_lengths[i] for i in b] for b in cut_batches(run_lengths, global_batch_tokens=gbt)]
    ref = reference_row(rows)
    out = []
    for pp in pipeline_degrees(replica_cost_model(cost_model), world_size, max_pp):
        t0 = time.perf_counter()
        est = estimate_pipelines(batches, cost_model, world_size, pp, seed=seed)
        progress.line(f"pipelines PP {pp}: priced in {time.perf_counter() - t0:.1f} s")
        if est is None:
            out.append({"pp": pp, "scheme": None})
            continue
        out.append({"pp": pp, "scheme": str(est.scheme), "tp": est.scheme.tp, "pipelines": est.pipelines,
                    "tokens_per_s": est.tokens_per_s, "step_s": est.total_time / max(len(est.step_times), 1),
                    "idle": est.idle, "vs_policy": ref["policy"],
                    "speedup": est.tokens_per_s / ref["tokens_per_s"] if ref["tokens_per_s"] > 0 else math.nan})
    return out


def format_pipelines(pipes: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """``--pp``'s report: a line per PP degree, then whether the best would win."""
    ref = reference_row(rows)
    lines = [f"pipeline parallelism (priced; no runtime runs it): the same global batches on homogeneous <TP, PP> "
             f"pipelines, TP inside a node, as Hydraulis assigns them; vs {ref['policy']} {ref['tokens_per_s']:,.0f} "
             f"tokens/s, step {ref['step_s']:.3g} s"]
    for p in pipes:
        if p["scheme"] is None:
            lines.append(f"  PP {p['pp']}: no TP degree's pipelines tile the world and hold the longest sample")
            continue
        lines.append(f"  PP {p['pp']}: {p['pipelines']} x {p['scheme']}: {p['tokens_per_s']:,.0f} tokens/s, step "
                     f"{p['step_s']:.3g} s, idle {100 * p['idle']:.1f}%: {p['speedup']:.2f}x {ref['policy']}")
    priced = [p for p in pipes if p["scheme"] is not None]
    if not priced:
        lines.append("  no PP degree holds this run")
        return "\n".join(lines)
    best = max(priced, key=lambda p: p["tokens_per_s"])
    verdict = "pipelines would win here" if best["speedup"] > 1.0 else "pipelines would not win here"
    lines.append(f"  best: PP {best['pp']} ({best['pipelines']} x {best['scheme']}), {best['speedup']:.2f}x "
                 f"{ref['policy']}: {verdict}")
    return "\n".join(lines)


def rank_speeds_arg(args: argparse.Namespace) -> tuple[float, ...] | None:
    """``--rank-speed``'s speeds for ``--world-size`` ranks, or None."""
    from lightning_dcp.planning.errors import PlanningError
    from lightning_dcp.planning.speeds import parse_rank_speeds

    if not getattr(args, "rank_speed", None):
        return None
    try:
        return parse_rank_speeds(args.rank_speed, args.world_size)
    except PlanningError as err:
        raise CLIError(f"--rank-speed: {err}") from None


def _sharding_note(args: argparse.Namespace, cost_model: Any) -> str:
    """``, sharding zero1`` for the header line (empty when the cost model does not say)."""
    from lightning_dcp.planning.sharding.registry import MODES, get_mode

    name = cost_model.sharding
    if name is None:
        return ""
    grouped = {"shard_group_size": cost_model.shard_group_size, "offload": args.offload} if MODES[name].options else {}
    return ", " + get_mode(name, args.world_size, **grouped).describe()


def best_shard_group(args: argparse.Namespace, cost_model: Any, dataset: list[int], run_lengths: list[int], gbt: int,
                     progress: Progress, max_tp_size: int = 1) -> Any:
    """``--shard-group-size auto``: simulate dcp with every power-of-two shard group size dividing the world and
    return the cost model of the fastest (printing each one's figure); ``max_tp_size``: with ``--tp``'s splits."""
    from lightning_dcp.commands.plan import mode_view
    from lightning_dcp.planning.errors import PlanningError
    from lightning_dcp.planning.sharding.shard_group_size import shard_group_candidates

    base = cost_model.base
    best, best_rate = None, -1.0
    for k in shard_group_candidates(args.world_size):
        candidate = mode_view(args, base, k)
        try:
            (row,) = compare(args.world_size, candidate, dataset, run_lengths, ["dcp"], global_batch_tokens=gbt,
                             seed=args.seed, max_tp_size=max_tp_size)
        except PlanningError as err:
            print(f"shard group {k}: does not run ({str(err).split(':')[0]})")
        else:
            print(f"shard group {k}: states {candidate.state_bytes / 2**30:.1f} GiB per rank in the loop, dcp "
                  f"{row['tokens_per_s']:,.0f} tokens/s")
            if row["tokens_per_s"] > best_rate:
                best, best_rate = candidate, row["tokens_per_s"]
    if best is None:
        raise CLIError(f"no shard group size runs this dataset under --sharding {args.sharding}; add ranks or --offload")
    print(f"best shard group size: {best.shard_group_size}")
    return best
