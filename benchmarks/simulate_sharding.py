"""What sharding the model states buys the planner: a 7B model on 32 H100s, long documents.

For each ``sharding`` mode of :mod:`lightning_dcp.planning.sharding` (``none``, ``zero1``,
``zero2``, ``fsdp``, as ``DCPStrategy(sharding=...)`` runs them), the H100 analytic cost model of
``--model`` (default ``llama-7b``, the Llama-2-7B shape) on ``--world-size`` GPUs reports the
model-state bytes per rank (in the micro-batch loop, which the planner budgets, and between
steps), the memory that frees against ``none``, the longest sample each SP size holds
without and with full recomputation, and -- planning and simulating the same run of
``--steps`` global batches of ``--global-batch-tokens`` tokens drawn from ``--dataset`` (default
``long``) with each of ``--policies`` -- tokens/s and % of the step bound. A mode the model does
not fit in is reported as such.

Writes ``benchmarks/results/simulate_sharding.md`` (another ``--model``:
``simulate_sharding_<model>.md``).

    python benchmarks/simulate_sharding.py
    python benchmarks/simulate_sharding.py --model wan-14b --dataset wan --global-batch-tokens 2097152
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_dcp.commands.simulate import DATASET_SIZE, compare, draw_run  # noqa: E402
from lightning_dcp.planning.analytic import AnalyticCostModel  # noqa: E402
from lightning_dcp.planning.distributions import get_distribution  # noqa: E402
from lightning_dcp.planning.errors import PlanningError  # noqa: E402
from lightning_dcp.planning.hardware import GiB, get_hardware  # noqa: E402
from lightning_dcp.planning.models import get_model  # noqa: E402
from lightning_dcp.planning.analytic import hsdp_view  # noqa: E402
from lightning_dcp.planning.sharding.registry import COST_MODEL_MODES as SHARDING_MODES  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "simulate_sharding.md"


def sp_and_recompute(plan, num_layers: int) -> tuple[float, float]:
    """Token-weighted mean SP size and fraction of layers recomputed over a plan's items."""
    items = [it for step in plan.steps for it in step.items]
    tokens = sum(it.tokens for it in items) or 1
    return (sum(it.sp_size * it.tokens for it in items) / tokens,
            sum(it.recompute * it.tokens for it in items) / tokens / num_layers)


def measure(model: str, world: int, dataset: str, gbt: int, steps: int, policies: list[str], seed: int = 0,
            shard_group_sizes: tuple[int, ...] = (8, 16, 32), offload_sizes: tuple[int, ...] = (8,)) -> list[dict]:
    """One dict per sharding mode: states, freed memory, max lengths per SP size, and per policy tokens/s and % of bound."""
    dist = get_distribution(dataset)
    lengths = dist.sample(DATASET_SIZE, seed)
    pool = dist.sample(int(steps * gbt / (sum(lengths) / len(lengths)) * 1.5) + 100, seed + 1)
    run = draw_run(pool, steps * gbt)
    spec, hw = get_model(model), get_hardware("h100")
    base = None
    rows = []
    none = AnalyticCostModel(spec, hw, world, sharding="none")
    models = [(mode, AnalyticCostModel(spec, hw, world, sharding=mode)) for mode in SHARDING_MODES]
    models += [(f"hsdp K={k}", hsdp_view(none, k)) for k in shard_group_sizes if world % k == 0]
    models += [(f"hsdp K={k} offload", hsdp_view(none, k, offload=True)) for k in offload_sizes if world % k == 0]
    for mode, cm in models:
        base = cm.state_bytes if base is None else base
        sps = cm.sp_sizes(world)
        row = {"mode": mode, "states": cm.state_bytes, "rest": cm.state_bytes_at_rest, "freed": base - cm.state_bytes,
               "room": cm.memory_limit - cm.state_bytes - cm.workspace_bytes, "samples": len(run),
               "max_len": {p: (cm.max_length(p, 0), cm.max_length(p)) for p in sps}, "policies": {}}
        try:
            res = compare(world, cm, lengths, run, policies, global_batch_tokens=gbt, seed=seed)
        except PlanningError as err:
            row["error"] = str(err).split(":")[0]
        else:
            row["policies"] = {r["policy"]: r for r in res}
            row["use"] = {r["policy"]: sp_and_recompute(r["_plan"], spec.num_layers) for r in res}
        rows.append(row)
        got = ", ".join(f"{k} {v['tokens_per_s']:,.0f} tok/s" for k, v in row["policies"].items()) or row.get("error")
        print(f"  {mode:6s} states {cm.state_bytes / GiB:6.1f} GiB  {got}", flush=True)
    return rows


def table(rows: list[dict], policies: list[str]) -> str:
    sps = list(rows[0]["max_len"])
    head = (["sharding", "states/rank GiB (in the loop)", "between steps GiB", "freed vs none GiB", "room for activations GiB"]
            + [f"max len SP {p} (r=0 / all)" for p in sps]
            + [f"{p} tokens/s" for p in policies] + [f"{p} % of step bound" for p in policies]
            + ["dcp imbalance", "dcp planner ms/step", "dcp mean SP (token-weighted)", "dcp layers recomputed"])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [r["mode"], f"{r['states'] / GiB:.1f}", f"{r['rest'] / GiB:.1f}", f"{r['freed'] / GiB:.1f}",
                 f"{r['room'] / GiB:.1f}"]
        cells += [("above the shard group" if p not in r["max_len"] else
                   f"{r['max_len'][p][0]:,} / {r['max_len'][p][1]:,}" if r["max_len"][p][1] else "does not fit")
                  for p in sps]
        if r["policies"]:
            cells += [f"{r['policies'][p]['tokens_per_s']:,.0f}" for p in policies]
            cells += [f"{100 * r['policies'][p]['fraction_of_bound']:.1f}%" for p in policies]
            sp, rec = r["use"].get("dcp", (math.nan, math.nan))
            dcp = r["policies"].get("dcp", {})
            cells += [f"{100 * dcp.get('imbalance', math.nan):.1f}%", f"{dcp.get('planner_ms_per_step', math.nan):,.0f}",
                      f"{sp:.2f}", f"{100 * rec:.0f}%"]
        else:
            cells += ["does not fit"] * (2 * len(policies) + 4)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--world-size", type=int, default=32)
    ap.add_argument("--dataset", default="long")
    ap.add_argument("--global-batch-tokens", type=int, default=1 << 20)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--policies", default="bucket,dcp")
    ap.add_argument("--shard-group-sizes", default="8,16,32", help="hsdp rows: shard group sizes (dividing the world)")
    ap.add_argument("--offload-sizes", default="8", help="hsdp rows with the states on the host")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"default {OUT.relative_to(OUT.parents[2])} (llama-7b), else simulate_sharding_<model>.md beside it")
    args = ap.parse_args()
    if args.out is None:
        args.out = OUT if args.model == "llama-7b" else OUT.with_name(f"simulate_sharding_{args.model}.md")
    policies = args.policies.split(",")
    sizes = tuple(int(k) for k in args.shard_group_sizes.split(",") if k)
    offload = tuple(int(k) for k in args.offload_sizes.split(",") if k)
    rows = measure(args.model, args.world_size, args.dataset, args.global_batch_tokens, args.steps, policies,
                   shard_group_sizes=sizes, offload_sizes=offload)
    text = table(rows, policies) + "\n"
    print(text)
    cmd = (f"python benchmarks/simulate_sharding.py --model {args.model} --world-size {args.world_size} --dataset "
           f"{args.dataset} --global-batch-tokens {args.global_batch_tokens} --steps {args.steps} --policies {args.policies}"
           f" --shard-group-sizes {args.shard_group_sizes} --offload-sizes {args.offload_sizes}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, {platform.node() or 'host'}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}). H100 analytic cost model, {args.world_size} GPUs, {rows[0]['samples']} samples "
        f"({args.steps} global batches of {args.global_batch_tokens:,} tokens) from `{args.dataset}`, the same for "
        "every mode. States per rank as `DCPStrategy(sharding=...)` holds them (bf16 weights and gradients, fp32 "
        "master and Adam m, v: `W`, `G`, `O`): in the micro-batch loop, which the planner budgets, `none` W+G+O, "
        "`zero1` W+G+O/N, `zero2` and `fsdp` W+W/N+G+O/N; between steps `zero2` W+W/N+G/N+O/N, `fsdp` (W+G+O)/N "
        "(`lightning_dcp.planning.sharding`); `hsdp K=k` "
        "(W+G+O)/K plus two layers' weights and gradients and the root's in flight, its per-layer all-gathers and "
        "reduce-scatters priced per lockstep round of each shard group (`lightning_dcp.planning.sharding.hsdp_cost`), "
        "the rounds planned by `lightning_dcp.planning.lockstep` (dcp re-packs its micro-batches for them; bucket "
        "keeps its own); `offload` keeps the shards on the host. The other modes add no time per micro-batch. "
        "Planner milliseconds per step on a machine shared with other jobs.\n\n" + text)


if __name__ == "__main__":
    main()
