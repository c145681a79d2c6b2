"""DCPStrategy vs Lightning's DDPStrategy: mean step time on uniform lengths (a report, not a test).

Same tiny model, same CPU processes, same global batch per step (``--per-rank`` samples of
``--length`` tokens per rank). DCP runs a fixed planner giving each rank its ``per-rank``
samples as one packed SP-1 micro-batch (the DDP-equivalent plan), so the difference is the
strategy's own overhead: sampler/collate, gathering step metrics, bucketed all-reduce.

    python benchmarks/ddp_overhead.py --devices 2 --steps 40 --warmup 10
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_dcp.data import SyntheticTokenDataset, plain_collate
from lightning_dcp.models.module import DCPTransformerModule
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp import DCPStrategy


class UniformPlanner:
    """Rank r runs samples [r*k, (r+1)*k) of the global batch as one packed micro-batch (SP 1)."""

    one_step_per_batch = True

    def __init__(self, world_size: int):
        self.world_size = world_size

    def plan_batch(self, samples, lengths, step=0):
        k = len(samples) // self.world_size
        return [StepPlan(tuple(WorkItem((r,), tuple(samples[r * k:(r + 1) * k]), tuple(lengths[r * k:(r + 1) * k]))
                               for r in range(self.world_size)))]


class StepTimer(pl.Callback):
    def __init__(self, out: str, warmup: int):
        self.out, self.warmup, self.times, self._t = out, warmup, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._t)

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            with open(self.out, "w") as f:
                f.write(repr(sum(self.times) / len(self.times)))


class Module(DCPTransformerModule):
    def setup(self, stage):
        torch.set_num_threads(1)


def run(kind: str, args: argparse.Namespace, out: str) -> float:
    n = args.devices * args.per_rank * (args.steps + 2)
    ds = SyntheticTokenDataset([args.length] * n, seed=0)
    if kind == "dcp":
        strategy = DCPStrategy(planner=UniformPlanner(args.devices), global_batch_size=args.devices * args.per_rank,
                               start_method="spawn", shuffle=False, log_metrics=False)
    else:
        strategy = pl.strategies.DDPStrategy(start_method="spawn")
    loader = DataLoader(ds, batch_size=args.per_rank, collate_fn=plain_collate, shuffle=False)
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[StepTimer(out, args.warmup)])
    trainer.fit(Module(model=args.model), loader)
    with open(out) as f:
        return float(f.read())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--per-rank", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--model", default="tiny-1d")
    p.add_argument("--repeats", type=int, default=2, help="alternate DDP/DCP runs this many times, report the best")
    args = p.parse_args(argv)
    res = {"ddp": [], "dcp": []}
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.repeats):
            for kind in ("ddp", "dcp"):
                res[kind].append(run(kind, args, os.path.join(d, f"{kind}{i}.txt")))
    ddp, dcp = min(res["ddp"]), min(res["dcp"])
    print(f"uniform length {args.length}, {args.per_rank} samples/rank/step, {args.devices} CPU processes, "
          f"model {args.model}, mean of steps {args.warmup}..{args.steps - 1}, best of {args.repeats}")
    print(f"DDPStrategy: {ddp * 1e3:.1f} ms/step   all runs {[round(t * 1e3, 1) for t in res['ddp']]}")
    print(f"DCPStrategy: {dcp * 1e3:.1f} ms/step   all runs {[round(t * 1e3, 1) for t in res['dcp']]}")
    print(f"ratio DCP/DDP: {dcp / ddp:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
