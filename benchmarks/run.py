"""Measured policy comparison: train one model for N steps under each planner policy, same data and processes.

For every policy (``dcp``, ``dcp-inter``, ``dcp-intra``, ``bucket``, ``packed``, ``static``) one
``Trainer.fit`` runs, in sequence, with the same model initialisation (seeded), the same dataset,
the same global batches (the DCP sampler's seeded permutation; ``bucket`` may split a global
batch into several optimizer steps), the same number of processes, and the same cost model (the
:class:`~lightning_dcp.profiling.DCPProfiler` measures the model in the first fit and the cache
hands the same profile to the others). ``--warmup-epochs`` epochs run first and are not measured;
the measured epochs cover every sample of the dataset exactly once per epoch under every policy,
so tokens/s compare the same work.

Reported per policy (CSV ``<out>/run.csv``, table ``<out>/run.md``, plots ``<out>/run.png`` and
``<out>/timeline.png``):

* measured: optimizer steps, tokens, wall seconds (first measured step start -> last measured
  step end, data loading included), tokens/s, mean step time (``on_train_batch_start`` ->
  ``on_train_batch_end``: micro-batches, gather, gradient all-reduce, optimizer step), per-rank
  busy and idle seconds (the strategy's :class:`~lightning_dcp.runtime.metrics.StepMetrics`, summed),
  imbalance ratio ``sum idle / (W * sum_steps max busy)`` (the simulator's definition);
* predicted: the exact step plans the run executed (recorded per step from
  ``strategy.last_step_plan``), simulated with :func:`lightning_dcp.planning.simulator.simulate`
  on the run's own profiled cost model: mean step time, imbalance, tokens/s; and the prediction
  error of the mean step time, ``(predicted - measured) / measured``.

CPU (spawned gloo processes, tiny sizes)::

    python benchmarks/run.py --model tiny-2d --distribution balanced --devices 2

GPUs (NCCL; the same script, only the sizes change)::

    python benchmarks/run.py --accelerator gpu --devices 8 --model transformer-2d --distribution video \\
        --num-samples 4096 --global-batch-size 256 --no-scale
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # `python benchmarks/run.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POLICIES = ("dcp", "dcp-inter", "dcp-intra", "bucket", "packed", "static")
HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------
# one fit
# ---------------------------------------------------------------------------------------------

def build_trainer_parts(policy: str, args: argparse.Namespace, record_dir: Path) -> tuple[Any, Any, Any]:
    """``(trainer, module, datamodule)`` for one policy's fit."""
    import lightning.pytorch as pl

    from benchmarks.data import BenchDataModule
    from benchmarks.models import BenchmarkModule, bench_spec
    from lightning_dcp.profiling import DCPProfiler
    from lightning_dcp import DCPStrategy

    spec = bench_spec(args.model)
    pl.seed_everything(args.seed, workers=True, verbose=False)
    module = BenchmarkModule(spec, lr=args.lr, num_threads=args.threads, record_dir=str(record_dir))
    dm = make_datamodule(args, spec)
    strategy_kw: dict[str, Any] = {}
    if args.start_method:
        strategy_kw["start_method"] = args.start_method
    if args.backend:
        strategy_kw["process_group_backend"] = args.backend
    # shuffle=False: the synthetic datasets are i.i.d. draws (already in random order), and every epoch then has
    # the same global batches -- so the warm-up and measured epochs have the same number of steps under every
    # policy (bucket's step count depends on which samples share a global batch; Lightning fixes an epoch's
    # length from the first epoch's len(dataloader)).
    strategy = DCPStrategy(policy=policy, global_batch_size=args.global_batch_size, seed=args.seed,
                           shuffle=args.shuffle, plan_ahead=True, max_sp_size=args.max_sp_size, log_metrics=False,
                           planner_options=json.loads(args.planner_options) if args.planner_options else None,
                           calibration=args.calibration, calibrate_every=args.calibrate_every, **strategy_kw)
    sp_sizes = [int(x) for x in args.profile_sp_sizes.split(",")] if args.profile_sp_sizes else None
    profiler = DCPProfiler(cache_dir=str(args.profile_cache), time_budget_s=args.profile_budget,
                           density=args.profile_density, enabled=not args.no_profile, sp_sizes=sp_sizes,
                           memory_limit_bytes=None if args.memory_limit_mib is None else args.memory_limit_mib * 2**20)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
        precision=args.precision, max_epochs=args.warmup_epochs + args.epochs, callbacks=[profiler], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    return trainer, module, dm


def make_datamodule(args: argparse.Namespace, spec: Any) -> Any:
    from benchmarks.data import BenchDataModule

    scale_kw: dict[str, Any] = {}
    if args.no_scale:
        scale_kw = dict(scale=1.0, min_len=1, max_len=None)
    elif args.scale is not None:
        scale_kw = dict(scale=args.scale)
    return BenchDataModule(spec.kind, args.distribution, args.num_samples, args.seed,
                           vocab_size=max(spec.vocab_size, 4), in_channels=max(spec.in_channels, 1), **scale_kw)


def run_policy(policy: str, args: argparse.Namespace, record_dir: Path) -> list[dict]:
    """Fit once under ``policy``; return every rank's record file (rank order)."""
    if record_dir.exists():
        shutil.rmtree(record_dir)
    trainer, module, dm = build_trainer_parts(policy, args, record_dir)
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    fit_s = time.perf_counter() - t0
    files = sorted(record_dir.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise RuntimeError(f"policy {policy}: the fit wrote no records to {record_dir}")
    ranks = [json.loads(p.read_text()) for p in files]
    ranks[0]["fit_s"] = fit_s
    return ranks


# ---------------------------------------------------------------------------------------------
# analysis (pure: records in, numbers out)
# ---------------------------------------------------------------------------------------------

def measured_steps(records: Sequence[dict], warmup_epochs: int) -> list[dict]:
    return [r for r in records if r["epoch"] >= warmup_epochs]


def analyze(policy: str, ranks: Sequence[dict], warmup_epochs: int, cost_model: Any = None) -> tuple[dict, Any]:
    """Measured and predicted figures of one policy's run: ``(row, SimulationResult | None)``."""
    from lightning_dcp.planning.plan import Plan, StepPlan
    from lightning_dcp.planning.profiled import ProfiledCostModel
    from lightning_dcp.planning.simulator import simulate

    rank0 = ranks[0]
    world = int(rank0["world_size"])
    steps = measured_steps(rank0["records"], warmup_epochs)
    if not steps:
        raise ValueError(f"policy {policy}: no measured steps (records {len(rank0['records'])}, warm-up epochs "
                         f"{warmup_epochs}); run more epochs")
    tokens = sum(sum(sum(it["lengths"]) for it in s["plan"]["items"]) for s in steps)
    samples = sum(sum(len(it["samples"]) for it in s["plan"]["items"]) for s in steps)
    wall = steps[-1]["end"] - steps[0]["start"]
    step_s = [s["step_s"] for s in steps]
    busy = [0.0] * world
    idle = [0.0] * world
    span = 0.0
    for s in steps:
        m = s["metrics"]
        for r in range(world):
            busy[r] += m["busy_s"][r]
            idle[r] += m["idle_s"][r]
        span += max(m["busy_s"])
    micro = [0] * world
    for s in steps:
        for it in s["plan"]["items"]:
            for r in it["ranks"]:
                micro[r] += 1
    sp_used = sorted({len(it["ranks"]) for s in steps for it in s["plan"]["items"]})
    rec_used = sorted({int(it.get("recompute", 0)) for s in steps for it in s["plan"]["items"]})
    row: dict[str, Any] = {
        "policy": policy, "world_size": world, "steps": len(steps), "samples": samples, "tokens": tokens,
        "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "step_s_mean": statistics.fmean(step_s), "step_s_median": statistics.median(step_s),
        "imbalance": sum(idle) / (world * span) if span > 0 else 0.0,
        "imbalance_step_mean": statistics.fmean(s["metrics"]["imbalance"] for s in steps),
        "busy_s": busy, "idle_s": idle, "microbatches": micro, "sp_sizes": sp_used, "recompute": rec_used,
    }
    # contention-free view: CPU time of each rank's training thread (see benchmarks/models.py)
    by_rank = [{(s["epoch"], s["step"]): s for s in rk["records"]} for rk in ranks]
    keys = [(s["epoch"], s["step"]) for s in steps]
    if all("step_cpu_s" in s for s in steps) and all(all(k in br for k in keys) for br in by_rank):
        cpu_steps, cpu_busy = [], [0.0] * world
        cpu_span = 0.0
        for k in keys:
            per = [br[k] for br in by_rank]
            cpu_steps.append(max(p["step_cpu_s"] for p in per))
            b = [sum(it[3] - it[2] for it in p["items"] if it[3] == it[3]) for p in per]
            for r in range(world):
                cpu_busy[r] += b[r]
            cpu_span += max(b)
        row.update({"step_cpu_s_mean": statistics.fmean(cpu_steps), "busy_cpu_s": cpu_busy,
                    "imbalance_cpu": sum(cpu_span - b for b in cpu_busy) / (world * cpu_span) if cpu_span > 0 else 0.0})
    cal = [s["metrics"].get("calibration") for s in steps if s.get("metrics")]
    if cal and all(cal):  # calibration on: each step predicted with the factors it was planned with
        pred_cal = [c["predicted_s"] + c.get("overhead_s", 0.0) for c in cal]
        row.update({"pred_step_s_cal_mean": statistics.fmean(pred_cal),
                    "step_error_cal": (statistics.fmean(pred_cal) - row["step_s_mean"]) / row["step_s_mean"],
                    "refits": cal[-1].get("refits", 0), "rank_speeds": cal[-1].get("rank_speeds") or []})
    sim = None
    if cost_model is None and rank0.get("profile"):
        cost_model = ProfiledCostModel(rank0["profile"])
    if cost_model is not None:
        plan = Plan(policy, world, tuple(StepPlan.from_dict(s["plan"]) for s in steps))
        sim = simulate(plan, cost_model)
        pred_mean = statistics.fmean(sim.step_times)
        row.update({
            "pred_step_s_mean": pred_mean, "pred_imbalance": sim.imbalance, "pred_tokens_per_s": sim.tokens_per_s,
            "pred_busy_s": [sum(b[r] for b in sim.busy) for r in range(world)],
            "step_error": (pred_mean - row["step_s_mean"]) / row["step_s_mean"],
            "step_error_cpu": (pred_mean - row["step_cpu_s_mean"]) / row["step_cpu_s_mean"]
            if row.get("step_cpu_s_mean") else float("nan"),
            "step_abs_error_per_step": statistics.fmean(abs(p - m) / m for p, m in zip(sim.step_times, step_s) if m > 0),
            "item_ratio_by_sp": item_ratios(ranks, keys, cost_model),
        })
    return row, sim


def item_ratios(ranks: Sequence[dict], keys: Sequence[tuple], cost_model: Any) -> dict[str, list[float]]:
    """Per SP size: ``[items, predicted / measured wall, predicted / measured CPU time]`` of the micro-batches.

    A recorded item spans ``training_step`` to ``on_after_backward`` on one rank (forward, loss, backward and
    the all-to-alls of an SP group), so the prediction compared with it leaves out the host work
    (``host_s + host_per_token_s * tokens``, which runs before ``training_step``). Where the wall ratio is
    below the CPU ratio, the missing time is waiting: for a core, or for the SP partner inside a collective.
    """
    host_s = float(getattr(cost_model, "host_time", 0.0) or 0.0)
    host_tok = float(getattr(cost_model, "host_per_token", 0.0) or 0.0)
    sums: dict[int, list[float]] = {}
    for r, rk in enumerate(ranks):
        by_key = {(s["epoch"], s["step"]): s for s in rk["records"]}
        for k in keys:
            rec = by_key.get(k)
            if rec is None:
                continue
            mine = [it for it in rec["plan"]["items"] if r in it["ranks"]]
            for it, t in zip(mine, rec["items"]):
                if t[1] != t[1] or t[3] != t[3]:  # NaN: an item without a backward
                    continue
                sp = len(it["ranks"])
                pred = cost_model.item_time(it["lengths"], sp, int(it.get("recompute", 0)))
                pred -= host_s + host_tok * sum(it["lengths"])
                acc = sums.setdefault(sp, [0, 0.0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += pred
                acc[2] += t[1] - t[0]
                acc[3] += t[3] - t[2]
    return {str(sp): [n, p / w if w > 0 else float("nan"), p / c if c > 0 else float("nan")]
            for sp, (n, p, w, c) in sorted(sums.items())}


# ---------------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------------

CSV_FIELDS = ("policy", "world_size", "steps", "samples", "tokens", "wall_s", "tokens_per_s", "step_s_mean",
              "pred_step_s_mean", "step_error", "pred_step_s_cal_mean", "step_error_cal", "refits", "rank_speeds", "step_abs_error_per_step", "step_cpu_s_mean", "step_error_cpu",
              "imbalance", "pred_imbalance", "imbalance_cpu",
              "imbalance_step_mean", "pred_tokens_per_s", "busy_s", "idle_s", "pred_busy_s", "busy_cpu_s", "microbatches",
              "sp_sizes", "recompute", "repeat", "tokens_per_s_all", "step_error_all", "imbalance_all")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return " ".join(_fmt(x) for x in v)
    return str(v)


def write_csv(rows: Sequence[dict], path: Path) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_FIELDS)
        for r in rows:
            w.writerow([_fmt(r.get(k, "")) for k in CSV_FIELDS])


def machine_info(args: argparse.Namespace | None = None) -> dict[str, Any]:
    import torch

    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    import lightning

    info["lightning"] = lightning.__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["load_avg"] = os.getloadavg()
    except OSError:  # pragma: no cover
        pass
    return info


def markdown_table(rows: Sequence[dict]) -> str:
    head = ("| policy | steps | tokens | tokens/s | busy s per rank | idle s per rank | imbalance | pred. imbalance | "
            "step s (meas.) | step s (pred.) | error | step s (pred., calibrated) | error, calibrated | "
            "CPU-time step s | error vs CPU-time | SP sizes | mb per rank |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    nan = float("nan")
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['steps']} | {r['tokens']} | {r['tokens_per_s']:.0f} | "
            f"{' / '.join(f'{x:.2f}' for x in r['busy_s'])} | {' / '.join(f'{x:.2f}' for x in r['idle_s'])} | "
            f"{r['imbalance']:.3f} | {r.get('pred_imbalance', nan):.3f} | {r['step_s_mean']:.4f} | "
            f"{r.get('pred_step_s_mean', nan):.4f} | {100 * r.get('step_error', nan):+.1f}% | "
            f"{r.get('pred_step_s_cal_mean', nan):.4f} | {100 * r.get('step_error_cal', nan):+.1f}% | "
            f"{r.get('step_cpu_s_mean', nan):.4f} | {100 * r.get('step_error_cpu', nan):+.1f}% | "
            f"{','.join(map(str, r['sp_sizes']))} | {' / '.join(map(str, r['microbatches']))} |")
    return "\n".join(lines)


def write_markdown(rows: Sequence[dict], path: Path, args: argparse.Namespace, info: dict, data_desc: dict,
                   command: str, targets: list[str]) -> None:
    text = [
        f"# Measured policy comparison: {args.model}, {args.distribution}, {args.devices} x {args.accelerator}",
        "",
        f"- date: {info['date']}",
        f"- machine: {info['platform']}, {info['processor']}, {info['cpu_count']} CPUs"
        + (f", GPU {info['gpu']}" if "gpu" in info else "") + f"; load average at the end {info.get('load_avg')}",
        f"- software: python {info['python']}, torch {info['torch']}, lightning {info.get('lightning')}",
        f"- command: `{command}`",
        f"- data: {data_desc}",
        f"- runs: {args.warmup_epochs} warm-up epoch(s) (not measured) + {args.epochs} measured epoch(s); global batch "
        f"{args.global_batch_size} samples; {args.threads} torch thread(s) per process; seed {args.seed}; "
        f"{args.repeats} round(s) over all policies, the round with the median tokens/s reported",
        "- measured tokens/s: real tokens of the measured steps / wall seconds from the first measured step's start "
        "to the last one's end (data loading included); step s: on_train_batch_start -> on_train_batch_end; "
        "imbalance: sum of idle / (ranks x sum over steps of the slowest rank's busy); busy/idle: summed over the "
        "measured steps (the strategy's StepMetrics); pred.: the executed plans simulated on the run's profiled cost "
        "model; error: (pred. - meas.) / meas. of the mean step time; calibrated: each step's prediction by the "
        "calibration with the factors the step was planned with (the slowest rank's items + the step overhead). CPU-time step s: per step, the largest over "
        "ranks of the training thread's CPU time (time.thread_time) from step start to end -- the step time without "
        "waiting for a core on a shared machine; error vs CPU-time compares the prediction with it.",
        "",
        markdown_table(rows),
        "",
    ]
    if any(len(r.get("tokens_per_s_all", [])) > 1 for r in rows):
        text += ["Every round (tokens/s; prediction error of the mean step time; imbalance):", "",
                 "| policy | tokens/s per round | error per round | imbalance per round |", "|---|---|---|---|"]
        for r in rows:
            text.append(f"| {r['policy']} | {' / '.join(f'{x:.0f}' for x in r['tokens_per_s_all'])} | "
                        f"{' / '.join(f'{100 * x:+.0f}%' for x in r['step_error_all'])} | "
                        f"{' / '.join(f'{x:.3f}' for x in r['imbalance_all'])} |")
        text.append("")
    if any(r.get("item_ratio_by_sp") for r in rows):
        sps = sorted({int(k) for r in rows for k in r.get("item_ratio_by_sp", {})})
        text += ["Predicted / measured micro-batch time by SP size (forward + loss + backward on one rank, host work "
                 "left out; items, wall ratio, CPU-time ratio):", "",
                 "| policy | " + " | ".join(f"SP {sp}" for sp in sps) + " |", "|---|" + "---|" * len(sps)]
        for r in rows:
            cells = []
            for sp in sps:
                v = r.get("item_ratio_by_sp", {}).get(str(sp))
                cells.append(f"{v[0]}: {v[1]:.2f} wall, {v[2]:.2f} CPU" if v else "")
            text.append(f"| {r['policy']} | " + " | ".join(cells) + " |")
        text.append("")
    if targets:
        text += ["## Targets", ""] + [f"- {t}" for t in targets] + [""]
    path.write_text("\n".join(text))


def check_targets(rows: Sequence[dict], max_error: float = 0.20) -> list[str]:
    """The issue's targets, each as a line saying met / not met with the numbers."""
    by = {r["policy"]: r for r in rows}
    out = []
    if "dcp" in by and "bucket" in by:
        d, b = by["dcp"], by["bucket"]
        out.append(f"dcp imbalance {d['imbalance']:.3f} < bucket {b['imbalance']:.3f}: "
                   f"{'MET' if d['imbalance'] < b['imbalance'] else 'NOT MET'}")
        out.append(f"dcp tokens/s {d['tokens_per_s']:.0f} > bucket {b['tokens_per_s']:.0f} "
                   f"({d['tokens_per_s'] / b['tokens_per_s']:.2f}x): {'MET' if d['tokens_per_s'] > b['tokens_per_s'] else 'NOT MET'}")
        da, ba = d.get("tokens_per_s_all", []), b.get("tokens_per_s_all", [])
        if len(da) > 1 and len(da) == len(ba):
            wins = sum(x > y for x, y in zip(da, ba))
            out.append(f"  (per round, dcp tokens/s above bucket's in {wins} of {len(da)} rounds; imbalance below in "
                       f"{sum(x < y for x, y in zip(d['imbalance_all'], b['imbalance_all']))} of {len(da)})")
    errs = {r["policy"]: r["step_error"] for r in rows if "step_error" in r}
    cal = {r["policy"]: r["step_error_cal"] for r in rows if "step_error_cal" in r}
    if cal:
        bad = {p: e for p, e in cal.items() if abs(e) > 0.10}
        out.append("calibrated prediction of the mean step time within 10%: " + ("MET" if not bad else "NOT MET")
                   + " (" + ", ".join(f"{p} {100 * e:+.1f}%" for p, e in cal.items()) + ")")
    if errs:
        bad = {p: e for p, e in errs.items() if abs(e) > max_error}
        out.append("simulator predicts the measured mean step time within "
                   f"{100 * max_error:.0f}%: {'MET' if not bad else 'NOT MET'} ("
                   + ", ".join(f"{p} {100 * e:+.1f}%" for p, e in errs.items()) + ")")
    return out


def plot(rows: Sequence[dict], sims: dict[str, Any], ranks_by_policy: dict[str, list[dict]], out: Path,
         title: str, warmup_epochs: int) -> list[Path]:
    """``run.png``: tokens/s and imbalance per policy, measured vs predicted; ``timeline.png``: per-rank
    micro-batch timeline of one step per policy (the median-time step), measured and simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    names = [r["policy"] for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar([i - 0.2 for i in x], [r["tokens_per_s"] for r in rows], 0.4, label="measured")
    axes[0].bar([i + 0.2 for i in x], [r.get("pred_tokens_per_s", 0) for r in rows], 0.4, label="simulated")
    axes[0].set_ylabel("tokens / s")
    axes[0].set_title("throughput")
    axes[1].bar([i - 0.2 for i in x], [r["imbalance"] for r in rows], 0.4, label="measured")
    axes[1].bar([i + 0.2 for i in x], [r.get("pred_imbalance", 0) for r in rows], 0.4, label="simulated")
    axes[1].set_ylabel("imbalance ratio")
    axes[1].set_title("imbalance (idle / available)")
    world = rows[0]["world_size"]
    width = 0.8 / world
    for rk in range(world):
        pos = [i - 0.4 + width * (rk + 0.5) for i in x]
        axes[2].bar(pos, [r["busy_s"][rk] for r in rows], width, color=f"C{rk}", label=f"rank {rk} busy")
        axes[2].bar(pos, [r["idle_s"][rk] for r in rows], width, bottom=[r["busy_s"][rk] for r in rows],
                    color=f"C{rk}", alpha=0.3, hatch="//", label=f"rank {rk} idle")
    axes[2].set_ylabel("seconds (measured steps)")
    axes[2].set_title("busy / idle per rank")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    p = out / "run.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, axes = plt.subplots(len(rows), 2, figsize=(13, 1.0 + 1.1 * len(rows) * max(1, world / 2)), squeeze=False)
    for i, r in enumerate(rows):
        pol = r["policy"]
        ranks = ranks_by_policy[pol]
        steps0 = measured_steps(ranks[0]["records"], warmup_epochs)
        order = sorted(range(len(steps0)), key=lambda k: steps0[k]["step_s"])
        k = order[len(order) // 2]
        rec_step = (steps0[k]["epoch"], steps0[k]["step"])
        ax = axes[i][0]
        for rank_rec in ranks:
            rk = rank_rec["rank"]
            match = [s for s in rank_rec["records"] if (s["epoch"], s["step"]) == rec_step]
            if not match:
                continue
            s = match[0]
            for j, it in enumerate(s["items"]):
                a, b = it[0], it[1]
                if b == b:  # not NaN
                    ax.barh(rk, b - a, left=a, color=f"C{j % 10}", edgecolor="k", linewidth=0.4)
            ax.plot([s["step_s"]], [rk], "k|", markersize=14)
        ax.set_title(f"{pol}: measured, step {rec_step[1]} of epoch {rec_step[0]} ({steps0[k]['step_s'] * 1e3:.0f} ms)",
                     fontsize=8)
        ax2 = axes[i][1]
        sim = sims.get(pol)
        if sim is not None and sim.timeline:
            for (rk, a, b, item, kind) in sim.timeline[k]:
                ax2.barh(rk, b - a, left=a, color="0.6" if kind == "allreduce" else f"C{item % 10}",
                         edgecolor="k", linewidth=0.4)
            ax2.set_title(f"{pol}: simulated, same step ({sim.step_times[k] * 1e3:.0f} ms)", fontsize=8)
        for a in (ax, ax2):
            a.set_yticks(range(world))
            a.set_yticklabels([f"rank {q}" for q in range(world)], fontsize=7)
            a.invert_yaxis()
        lim = max(ax.get_xlim()[1], ax2.get_xlim()[1])
        ax.set_xlim(0, lim)
        ax2.set_xlim(0, lim)
    axes[-1][0].set_xlabel("seconds from step start (colour = micro-batch; | = step end)")
    axes[-1][1].set_xlabel("seconds from step start (grey = all-reduce + optimizer)")
    fig.tight_layout()
    p = out / "timeline.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-2d", help="benchmarks.models.SIZES name (tiny-1d, tiny-2d, small-1d, "
                   "small-2d, transformer-1d, transformer-2d)")
    p.add_argument("--distribution", default="balanced", help="short, balanced, long, video, code, tiny")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--start-method", default="spawn", help="Lightning launcher start method (spawn, popen, fork)")
    p.add_argument("--backend", default=None, help="process group backend (default: gloo on CPU, nccl on GPU)")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    p.add_argument("--num-samples", type=int, default=256, help="dataset size (one epoch = all of it)")
    p.add_argument("--global-batch-size", type=int, default=32, help="samples per global batch")
    p.add_argument("--epochs", type=int, default=1, help="measured epochs")
    p.add_argument("--warmup-epochs", type=int, default=1, help="unmeasured epochs first")
    p.add_argument("--repeats", type=int, default=1, help="rounds over all policies; the round with the median "
                   "tokens/s is reported per policy, with every round's tokens/s, error and imbalance")
    p.add_argument("--scale", type=float, default=None, help="divide the distribution's lengths by this (CPU scaling)")
    p.add_argument("--no-scale", action="store_true", help="GPU-scale lengths, unscaled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle", action="store_true", help="reshuffle the data each epoch (default: dataset order, "
                   "the same global batches every epoch; see build_trainer_parts)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-sp-size", type=int, default=None)
    p.add_argument("--calibration", default="adaptive", help="DCPStrategy(calibration=): adaptive, fixed or off")
    p.add_argument("--calibrate-every", type=int, default=None, help="steps between calibration refits")
    p.add_argument("--planner-options", default=None, help="JSON dict of planner options")
    p.add_argument("--profile-cache", default=None, help="profile cache directory (default <out>/profile_cache)")
    p.add_argument("--profile-budget", type=float, default=60.0, help="profiling time budget, seconds")
    p.add_argument("--memory-limit-mib", type=float, default=None,
        help="per-device memory the planner may use (default: the profiler's device default, 8 GiB on CPU); "
             "a tight budget makes the tiny models face the memory limits of full-size models on GPUs")
    p.add_argument("--profile-density", default="coarse")
    p.add_argument("--no-profile", action="store_true", help="no profiler: the strategy's DefaultCostModel plans "
                   "(SP 1 only) and no prediction is made")
    p.add_argument("--profile-sp-sizes", default=None, help="comma-separated SP sizes to profile (default: the "
                   "profiler's: powers of two up to the world dividing the heads); the planner can only use these")
    p.add_argument("--reprofile", action="store_true", help="clear the profile cache first")
    p.add_argument("--out", default=str(HERE / "results"), help="output directory")
    p.add_argument("--tag", default=None, help="file name prefix (default <model>_<distribution>_<devices>x<acc>)")
    p.add_argument("--max-error", type=float, default=0.20, help="target for the prediction error")
    args = p.parse_args(argv)
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    bad = [s for s in args.policies if s not in POLICIES]
    if bad:
        p.error(f"unknown policies {bad}; known: {', '.join(POLICIES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*The number of training batches.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    tag = args.tag or f"{args.model}_{args.distribution}_{args.devices}x{args.accelerator}"
    out = Path(args.out) / tag
    out.mkdir(parents=True, exist_ok=True)
    args.profile_cache = Path(args.profile_cache) if args.profile_cache else out / "profile_cache"
    if args.reprofile and args.profile_cache.exists():
        shutil.rmtree(args.profile_cache)
    command = "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv)

    from benchmarks.models import bench_spec
    from lightning_dcp.planning.profiled import ProfiledCostModel

    data_desc = make_datamodule(args, bench_spec(args.model)).describe()
    print(f"[run] {tag}: data {data_desc}", flush=True)
    rows, sims, ranks_by_policy = [], {}, {}
    cost_model = None
    profile = None
    runs: dict[str, list[tuple[dict, Any, list[dict]]]] = {p: [] for p in args.policies}
    for rep in range(args.repeats):  # rounds over all policies: slow drifts of a shared machine hit every policy
        for policy in args.policies:
            t0 = time.perf_counter()
            ranks = run_policy(policy, args, out / "records" / (policy if args.repeats == 1 else f"{policy}.{rep}"))
            if profile is None and ranks[0].get("profile"):
                profile = ranks[0]["profile"]
                cost_model = ProfiledCostModel(profile)
                (out / "profile.json").write_text(json.dumps(profile, indent=1))
            elif ranks[0].get("profile") and ranks[0]["profile"] != profile:
                print(f"[run] warning: policy {policy} planned with a different profile than the first policy", flush=True)
            row, sim = analyze(policy, ranks, args.warmup_epochs,
                               ProfiledCostModel(ranks[0]["profile"]) if ranks[0].get("profile") else cost_model)
            row["fit_s"] = ranks[0].get("fit_s")
            row["repeat"] = rep
            runs[policy].append((row, sim, ranks))
            print(f"[run] {policy} (round {rep + 1}/{args.repeats}): {row['steps']} steps, {row['tokens_per_s']:.0f} tok/s, "
                  f"imbalance {row['imbalance']:.3f} (pred {row.get('pred_imbalance', float('nan')):.3f}), step "
                  f"{row['step_s_mean'] * 1e3:.1f} ms (pred {row.get('pred_step_s_mean', float('nan')) * 1e3:.1f} ms, "
                  f"{100 * row.get('step_error', float('nan')):+.1f}%), fit {time.perf_counter() - t0:.0f} s", flush=True)
    for policy in args.policies:
        # report the round with the median tokens/s; keep the spread over rounds
        done = sorted(runs[policy], key=lambda t: t[0]["tokens_per_s"])
        row, sim, ranks = done[(len(done) - 1) // 2]
        row = dict(row)
        row["tokens_per_s_all"] = [t[0]["tokens_per_s"] for t in runs[policy]]
        row["step_error_all"] = [t[0].get("step_error", float("nan")) for t in runs[policy]]
        row["imbalance_all"] = [t[0]["imbalance"] for t in runs[policy]]
        rows.append(row)
        sims[policy] = sim
        ranks_by_policy[policy] = ranks

    info = machine_info(args)
    targets = check_targets(rows, args.max_error)
    write_csv(rows, out / "run.csv")
    (out / "run.json").write_text(json.dumps({"machine": info, "command": command, "args": {k: str(v) for k, v in vars(args).items()},
                                              "data": data_desc, "rows": rows, "targets": targets}, indent=1))
    write_markdown(rows, out / "run.md", args, info, data_desc, command, targets)
    plot(rows, sims, ranks_by_policy, out, f"{tag} ({info['date'][:10]})", args.warmup_epochs)
    print(markdown_table(rows))
    for t in targets:
        print("[target]", t)
    print(f"[run] wrote {out}/run.csv, run.md, run.png, timeline.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
