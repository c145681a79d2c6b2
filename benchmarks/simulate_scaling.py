"""Simulated scaling: every policy at 8 to 1024 GPUs, both paper models, all five length distributions.

For each model (``transformer-1d``, ``transformer-2d``), world size (default 8, 32, 256, 1024) and
distribution (``short``, ``balanced``, ``long``, ``video``, ``code``): the same run of samples
(``--steps`` default global batches of :func:`~lightning_dcp.planning.planner.default_global_batch_tokens`
tokens, drawn from the distribution) is planned by every policy with the H100 analytic cost
model (:class:`~lightning_dcp.planning.analytic.AnalyticCostModel`) and simulated
(:func:`~lightning_dcp.planning.simulator.simulate`), through the same
:func:`lightning_dcp.commands.simulate.compare` that ``lightning-dcp simulate`` and
``benchmarks/simulate_targets.py`` use. Reported: tokens/s, speedup over ``bucket`` (same
samples), imbalance ratio, fraction of the ideal bound and of the step bound, and dcp's planning
time per step beside its simulated step (a step lasts at least the next step's planning: the
simulator charges what a step does not hide, as ``lightning-dcp simulate`` does).

Measured profiles: every ``benchmarks/profiles/*.json`` (a v1 profile, e.g. written by
``lightning-dcp profile`` on a GPU) whose model shape (layers, hidden, heads) matches one of the
models is used as a second cost model for that model (the profile's SP sizes and memory limit
apply; world sizes it cannot plan are skipped). None are checked in yet: the CPU profiles that
``benchmarks/run.py`` writes are of the tiny models.

Writes ``benchmarks/results/simulate_scaling.md``, ``.csv`` and ``.png`` (tokens/s vs GPUs and
speedup over bucket vs GPUs, per model and distribution).

    python benchmarks/simulate_scaling.py                       # full grid (minutes on one core)
    python benchmarks/simulate_scaling.py --worlds 8,32 --dists balanced --models transformer-1d --steps 1
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_dcp.commands.simulate import DATASET_SIZE, compare, draw_run
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.distributions import get_distribution
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import ModelSpec, get_model
from lightning_dcp.planning.planner import default_global_batch_tokens

HERE = Path(__file__).resolve().parent
POLICIES = ("dcp", "dcp-inter", "dcp-intra", "bucket", "packed", "static")


def matching_profiles(spec: ModelSpec, directory: Path) -> list[tuple[str, dict]]:
    """``(file name, profile)`` of every profile in ``directory`` whose model shape matches ``spec``."""
    out = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            prof = json.loads(path.read_text())
            m = prof["model"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (m.get("num_layers"), m.get("hidden_size"), m.get("num_heads")) == (spec.num_layers, spec.hidden_size, spec.num_heads):
            out.append((path.name, prof))
    return out


def cost_models(spec: ModelSpec, world: int, hardware: str, profiles: Sequence[tuple[str, dict]]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [(f"analytic-{hardware}", AnalyticCostModel(spec, get_hardware(hardware), world))]
    from lightning_dcp.planning.profiled import ProfiledCostModel

    for name, prof in profiles:
        try:
            out.append((f"profile:{name}", ProfiledCostModel(prof)))
        except Exception as err:  # noqa: BLE001 - a bad profile is reported, not fatal
            print(f"  skipping profile {name}: {err}", flush=True)
    return out


def run_grid(models: Sequence[str], worlds: Sequence[int], dists: Sequence[str], policies: Sequence[str], steps: int,
             hardware: str = "h100", seed: int = 0, profile_dir: Path | None = None) -> list[dict]:
    rows = []
    for model in models:
        spec = get_model(model)
        profiles = matching_profiles(spec, profile_dir) if profile_dir else []
        for world in worlds:
            for cm_name, cm in cost_models(spec, world, hardware, profiles):
                for name in dists:
                    dist = get_distribution(name)
                    dataset = dist.sample(DATASET_SIZE, seed)
                    gbt = default_global_batch_tokens(world, dataset, cm)
                    mean = sum(dataset) / len(dataset)
                    pool = dist.sample(int(steps * gbt / mean * 1.5) + 100, seed + 1)
                    run = draw_run(pool, gbt, steps)
                    t0 = time.perf_counter()
                    try:
                        res = compare(world, cm, dataset, run, list(policies), global_batch_tokens=gbt, seed=seed)
                    except Exception as err:  # noqa: BLE001 - e.g. a profile whose memory cannot hold the data
                        print(f"  {model} {world:5d} {name:9s} {cm_name}: skipped ({type(err).__name__}: {err})", flush=True)
                        continue
                    for r in res:
                        rows.append({"model": model, "gpus": world, "dist": name, "cost_model": cm_name,
                                     "samples": len(run), "tokens_per_step": gbt, "policy": r["policy"],
                                     "steps": r["steps"], "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"],
                                     "imbalance": r["imbalance"], "fraction_of_ideal": r["fraction_of_ideal"],
                                     "fraction_of_bound": r["fraction_of_bound"],
                                     "planner_ms_per_step": r["planner_ms_per_step"], "step_s": r["step_s"]})
                    by = {r["policy"]: r for r in res}
                    d = by.get("dcp")
                    print(f"  {model} {world:5d} {name:9s} {cm_name}: " + "  ".join(
                        f"{p} {by[p]['speedup']:.2f}x" for p in policies if p in by)
                        + (f"  (dcp imbalance {100 * d['imbalance']:.1f}%)" if d else "")
                        + f"  [{time.perf_counter() - t0:.1f} s]", flush=True)
    return rows


def markdown(rows: Sequence[dict], policies: Sequence[str]) -> str:
    lines = []
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["cost_model"], r["gpus"], r["dist"]), {})[r["policy"]] = r
    for model in dict.fromkeys(k[0] for k in groups):
        for cm in dict.fromkeys(k[1] for k in groups if k[0] == model):
            lines += [f"### {model}, {cm}", "",
                      "Speedup over bucket (tokens/s ratio, same samples); dcp's tokens/s, imbalance, "
                      "fraction of the ideal bound and of the step bound (planning charged where a step does not "
                      "hide it), planning time per step and simulated step (without planning); imbalance of "
                      "bucket.", "",
                      "| GPUs | dataset | tokens/step | " + " | ".join(policies) + " | dcp tokens/s | dcp imbalance | "
                      "dcp % ideal | dcp % step bound | dcp planning ms/step | dcp step s | bucket imbalance |",
                      "|---:|---|---:|" + "---:|" * len(policies) + "---:|---:|---:|---:|---:|---:|---:|"]
            for key, by in groups.items():
                if key[0] != model or key[1] != cm:
                    continue
                any_r = next(iter(by.values()))
                d, b = by.get("dcp"), by.get("bucket")
                cells = [f"{by[p]['speedup']:.2f}x" if p in by else "-" for p in policies]
                lines.append(f"| {key[2]} | {key[3]} | {any_r['tokens_per_step']:,} | " + " | ".join(cells) + " | "
                             + (f"{d['tokens_per_s']:,.0f} | {100 * d['imbalance']:.1f}% | {100 * d['fraction_of_ideal']:.1f}% | "
                                f"{100 * d['fraction_of_bound']:.1f}% | {d['planner_ms_per_step']:,.0f} | {d['step_s']:.2f} | "
                                if d else "- | - | - | - | - | - | ")
                             + (f"{100 * b['imbalance']:.1f}% |" if b else "- |"))
            lines.append("")
    return "\n".join(lines)


def plot(rows: Sequence[dict], policies: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["model"], r["cost_model"], r["dist"]) for r in rows))
    models = list(dict.fromkeys((p[0], p[1]) for p in panels))
    dists = list(dict.fromkeys(p[2] for p in panels))
    fig, axes = plt.subplots(2 * len(models), len(dists), figsize=(3.2 * len(dists), 2.8 * 2 * len(models)), squeeze=False)
    for mi, (model, cm) in enumerate(models):
        for di, dist in enumerate(dists):
            sel = [r for r in rows if r["model"] == model and r["cost_model"] == cm and r["dist"] == dist]
            ax, ax2 = axes[2 * mi][di], axes[2 * mi + 1][di]
            for k, pol in enumerate(policies):
                pts = sorted((r["gpus"], r["tokens_per_s"], r["speedup"]) for r in sel if r["policy"] == pol)
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{k}", label=pol, markersize=3)
                ax2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", color=f"C{k}", label=pol, markersize=3)
            for a in (ax, ax2):
                a.set_xscale("log", base=2)
                a.grid(alpha=0.3)
            ax.set_yscale("log")
            ax.set_title(f"{model} {dist}\n{cm}", fontsize=8)
            if di == 0:
                ax.set_ylabel("tokens / s")
                ax2.set_ylabel("speedup over bucket")
            ax2.set_xlabel("GPUs")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="transformer-1d,transformer-2d")
    ap.add_argument("--worlds", default="8,32,256,1024")
    ap.add_argument("--dists", default="short,balanced,long,video,code")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--steps", type=int, default=2, help="global batches per run (the same samples for every policy)")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profiles", type=Path, default=HERE / "profiles", help="directory of measured v1 profiles")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "simulate_scaling.md")
    args = ap.parse_args(argv)
    models, dists, policies = args.models.split(","), args.dists.split(","), args.policies.split(",")
    worlds = [int(w) for w in args.worlds.split(",")]
    if "bucket" not in policies:
        ap.error("--policies must include bucket (the speedup baseline)")
    t0 = time.perf_counter()
    rows = run_grid(models, worlds, dists, policies, args.steps, args.hardware, args.seed, args.profiles)
    elapsed = time.perf_counter() - t0
    command = "python benchmarks/simulate_scaling.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = (f"# Simulated scaling\n\n- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
              f"- machine: {platform.platform()}, {os.cpu_count()} CPUs (simulation only; {elapsed:.0f} s)\n"
              f"- command: `{command}`\n- cost model: {args.hardware} analytic"
              + (f" plus matching profiles in {args.profiles}" if matching_profiles(get_model(models[0]), args.profiles) else
                 f" (no matching measured profile in {args.profiles.name}/)")
              + f"\n- each cell: {args.steps} global batches of the default size "
              "(`default_global_batch_tokens`), the same samples for every policy\n\n")
    text = header + markdown(rows, policies)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    with open(args.out.with_suffix(".csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["model"])
        w.writeheader()
        w.writerows(rows)
    if rows:
        plot(rows, policies, args.out.with_suffix(".png"))
    print(text)
    print(f"wrote {args.out}, {args.out.with_suffix('.csv').name}, {args.out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
