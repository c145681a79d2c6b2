"""Plan digests: a safety net for refactors of ``lightning_dcp/planning`` (issue #37).

For a fixed set of small cells, every policy plans ``--steps`` global batches the way ``lightning-dcp simulate``
does (the same dataset draw, cost model, default global batch and run cut:
:func:`~lightning_dcp.commands.simulate.draw_run`; the planner shown the run's batches first, as
:func:`~lightning_dcp.commands.simulate.compare` does) and the script prints, per cell and policy, one line per step::

    <cell> <policy> step <k> items <StepPlan.digest()> full <sha256 of the step's whole JSON, notes included>

and one line with the plan's simulated tokens/s (planning time not charged, so the figure depends on the plan
alone), printed with ``repr`` (every bit of the float)::

    <cell> <policy> tokens/s <value> steps <n>

A policy that refuses a cell prints ``<cell> <policy> refused <error class>: <message>``. A pure refactor leaves
the output identical: record it before a change, rerun after, diff::

    python benchmarks/plan_digests.py > /tmp/digests_before.txt
    ... change ...
    python benchmarks/plan_digests.py > /tmp/digests_after.txt && diff /tmp/digests_before.txt /tmp/digests_after.txt

Cells (``--cells``, comma-separated, default all): ``w{8,32}-{video,code,long,short}-{none,zero1,hsdp}`` (the
analytic Transformer-1D on H100 under ``--sharding none``, ``zero1`` (simulate's default) or ``hsdp`` with its
default shard group; the model does not fit some ``none`` cells, whose policies print their refusal), plus a few
that reach other code paths: ``w32-long-speeds`` (ranks 0-7 at 0.7x, the planner aware), ``w32-code-noring``
(``--no-ring``), ``w16-video-heads28`` (``--num-heads 28``: rings past the heads), ``w16-video-tp`` (``--tp``:
tensor parallelism up to a node's GPUs) and ``w16-code-hsdp-tp4`` (``--sharding hsdp --tp 4``). ``--policies`` (default:
every policy of :data:`~lightning_dcp.planning.planner.POLICIES`) and ``--steps`` (default 2) narrow or widen it.
To keep the run short and its output a function of the code alone, the peers tune on a coarser grid than their
default (:data:`PEER_GRID_SCALE`) and flexsp's MILP is held to its root node (:data:`MILP_NODE_LIMIT`). Not a test (minutes on two cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from lightning_dcp.commands.plan import build_cost_model
from lightning_dcp.commands.simulate import DATASET_SIZE, add_arguments, draw_run
from lightning_dcp.planning.batches import cut_batches
from lightning_dcp.planning.distributions import get_distribution
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.plan import PlanError
from lightning_dcp.planning.planner import POLICIES, Planner, default_global_batch_tokens
from lightning_dcp.planning.simulator import simulate
from lightning_dcp.planning.speeds import parse_rank_speeds

EXTRA_CELLS = {
    "w32-long-speeds": ["--world-size", "32", "--dataset", "long", "--rank-speed", "0-7:0.7"],
    "w32-code-noring": ["--world-size", "32", "--dataset", "code", "--no-ring"],
    "w16-video-heads28": ["--world-size", "16", "--dataset", "video", "--num-heads", "28"],
    "w16-video-tp": ["--world-size", "16", "--dataset", "video", "--tp"],
    "w16-code-hsdp-tp4": ["--world-size", "16", "--dataset", "code", "--sharding", "hsdp", "--tp", "4"],
}
"""Cells beside the grid: name -> ``lightning-dcp simulate`` arguments."""


PEER_GRID_SCALE = 0.25
"""The peers tune on a grid this many times as fine as their default (``grid_scale=``, :mod:`~lightning_dcp.planning.peers.base`):
coarser, to keep the run short; the same code runs."""


MILP_NODE_LIMIT = 1
"""flexsp's MILP explores this many branch-and-bound nodes (``node_limit=``; default 2,000) with no time limit to
speak of (``time_limit=3600``; default 10 s) and a fixed recompute (all layers, ``recompute=``: no tuning, whose
limit is 2 s): a MILP that stops at a time limit plans differently on a loaded machine."""


def cells() -> dict[str, list[str]]:
    """Every cell: name -> its ``lightning-dcp simulate`` arguments."""
    out = {f"w{w}-{d}-{s}": ["--world-size", str(w), "--dataset", d, "--sharding", s]
           for w in (8, 32) for d in ("video", "code", "long", "short") for s in ("none", "zero1", "hsdp")}
    out.update(EXTRA_CELLS)
    return out


def run_cell(name: str, argv: list[str], policies: list[str], steps: int, out) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv + ["--num-steps", str(steps), "--seed", "0"])
    dist = get_distribution(args.dataset)
    dataset = dist.sample(DATASET_SIZE, args.seed)  # as lightning-dcp simulate draws it
    cost_model = build_cost_model(args, dataset)
    gbt = args.global_batch_tokens or default_global_batch_tokens(args.world_size, dataset, cost_model)
    pool = dist.sample(int(args.num_steps * gbt / (sum(dataset) / len(dataset)) * 1.5) + 100, args.seed + 1)
    run = draw_run(pool, gbt, args.num_steps)
    batches = [[run[i] for i in b] for b in cut_batches(run, global_batch_tokens=gbt)]
    speeds = parse_rank_speeds(args.rank_speed, args.world_size) if args.rank_speed else None
    max_tp = 1 if args.tp is None else (args.tp or int(cost_model.gpus_per_node or 1))  # as simulate reads --tp
    for policy in policies:
        t0 = time.perf_counter()
        names = POLICIES[policy].option_names()
        opts = {"tune_tokens": gbt, "grid_scale": PEER_GRID_SCALE} if "grid_scale" in names else {}
        if "node_limit" in names:
            opts.update(node_limit=MILP_NODE_LIMIT, time_limit=3600.0, recompute=cost_model.num_layers)
        if max_tp > 1:
            opts["max_tp_size"] = max_tp
        try:
            planner = Planner(args.world_size, cost_model, policy, seed=args.seed, dataset_lengths=dataset,
                              rank_speeds=speeds, ring=args.ring, **opts)
            planner.prepare(batches)
            plan = planner.plan(run, global_batch_tokens=gbt)
        except (PlanningError, PlanError) as err:
            print(f"{name} {policy} refused {type(err).__name__}: {err}", file=out, flush=True)
            continue
        for k, step in enumerate(plan.steps):
            full = hashlib.sha256(json.dumps(step.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
            print(f"{name} {policy} step {k} items {step.digest()} full {full}", file=out)
        sim = simulate(plan, cost_model, timeline=False, rank_speeds=speeds, max_tp_size=max_tp)
        print(f"{name} {policy} tokens/s {sim.tokens_per_s!r} steps {len(plan.steps)}", file=out, flush=True)
        print(f"plan_digests: {name} {policy} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies (default: all)")
    parser.add_argument("--steps", type=int, default=2, help="global batches per cell (default 2)")
    args = parser.parse_args(argv)
    every = cells()
    names = list(every) if args.cells is None else [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = [c for c in names if c not in every]
    if unknown:
        parser.error(f"unknown cells {unknown}; known: {', '.join(every)}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in names:
        t0 = time.perf_counter()
        run_cell(name, every[name], policies, args.steps, sys.stdout)
        print(f"plan_digests: {name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
