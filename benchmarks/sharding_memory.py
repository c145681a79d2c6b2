"""Model-state memory per rank of each ``DCPStrategy(sharding=...)`` mode, measured (a report, not a test).

One fit per mode on the same model, data and CPU processes (gloo). Each rank counts the bytes of
the tensors it holds (unique storages; a DTensor counts its local shard, padding included; a freed
FSDP buffer counts 0) in three groups: **weights** (the module's parameters, plus FSDP's shards),
**gradients** (``.grad`` of those, plus the runtime's all-reduce buckets) and **optimizer** state.
CPU RSS is too noisy for this; tensor bytes are exact. Measured at two points of every step after the
first (when AdamW's state exists):

- **loop**: after the rank's last micro-batch, before the gradient reduction -- the static memory the
  micro-batches' activations come on top of (what the planner budgets); under ``hsdp`` also right after
  every repeated layer's forward (the layers in flight: FSDP swaps a gathered unit's full weights onto
  the module), the maximum of all these (one layer's transient full gradient during its backward is
  not seen);
- **rest**: after the optimizer step (``on_train_batch_end``) -- what stays between steps.

Activations are not counted (they are the planner's variable part, equal in every mode).

    python benchmarks/sharding_memory.py --devices 4 --layers 8 --hidden 768 --vocab 32000 --shard-group-size 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Iterable

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_dcp import DCPStrategy
from lightning_dcp.data import SyntheticTokenDataset, plain_collate
from lightning_dcp.models.module import DCPTransformerModule
from lightning_dcp.planning.models import ModelSpec
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.runtime import buckets as buckets_module
from lightning_dcp.runtime.sharding.hsdp import HsdpGrads

MODES = ("none", "zero1", "zero2", "fsdp", "hsdp")


class TwoPerRank:
    """Rank r runs two SP-1 micro-batches of the step's samples (a fixed plan: every mode runs the same)."""

    one_step_per_batch = True

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def plan_batch(self, samples, lengths, step=0):
        items = [WorkItem((i % self.world_size,), (s,), (n,), 0) for i, (s, n) in enumerate(zip(samples, lengths))]
        return [StepPlan(tuple(items))]


def _storages(tensors: Iterable[Any], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size and ptr not in seen:
            seen.add(ptr)
            total += size
    return total


def resident(strategy: Any) -> dict[str, int]:
    """This rank's weight, gradient and optimizer-state bytes (unique storages)."""
    module = strategy.lightning_module
    params = list(module.parameters())
    shards = strategy.shards
    if shards is not None and shards.sharded_checkpoint:  # the fully_shard units: their shards and full weights
        params += list(shards.sharded.values()) + list(shards.full.values())
    seen: set[int] = set()
    weights = _storages(params, seen)
    grads = _storages([p.grad for p in params], seen)
    executor = strategy.executor
    if executor is not None and isinstance(executor.buckets, buckets_module.GradBuckets):
        grads += _storages(executor.buckets.buffers, seen)
    if executor is not None and isinstance(executor.buckets, HsdpGrads):
        grads += _storages(executor.buckets.parked, seen)
    opt = strategy.optimizers[0]
    opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer: its local optimizer
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"weights": weights, "gradients": grads, "optimizer": _storages(state, seen)}


class Measure(pl.Callback):
    """Records ``resident`` in the loop (wrapping the buckets' ``park``) and at rest, from step 1 on."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.loop: list[dict] = []
        self.rest: list[dict] = []

    def on_train_start(self, trainer, pl_module) -> None:
        strategy, records = trainer.strategy, self.loop

        def wrap(cls):
            park = cls.park

            def measured(buckets):
                if trainer.global_step >= 1:
                    records.append(resident(strategy))
                park(buckets)

            cls.park = measured

        wrap(buckets_module.GradBuckets)
        wrap(buckets_module.ShardedGradBuckets)
        wrap(HsdpGrads)
        if strategy.sharding == "hsdp":  # the layers in flight: right after each layer's forward
            def after_layer(*_: Any) -> None:
                if trainer.global_step >= 1:
                    records.append(resident(strategy))

            for layer in strategy.model_contract.layers:
                layer.register_forward_hook(after_layer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= 2:
            self.rest.append(resident(trainer.strategy))

    def on_train_end(self, trainer, pl_module) -> None:
        peak = {k: max(r[k] for r in self.loop) for k in self.loop[0]}
        rest = {k: max(r[k] for r in self.rest) for k in self.rest[0]}
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"loop": peak, "rest": rest}, f)


class Module(DCPTransformerModule):
    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)


def run(mode: str, spec: ModelSpec, args: argparse.Namespace, out: str) -> list[dict]:
    n = args.devices * 2 * (args.steps + 1)
    lengths = [args.length] * n
    loader = DataLoader(SyntheticTokenDataset(lengths, vocab_size=spec.vocab_size, seed=0), batch_size=2,
                        collate_fn=plain_collate)
    hsdp = {"shard_group_size": args.shard_group_size} if mode == "hsdp" else {}
    strategy = DCPStrategy(planner=TwoPerRank(args.devices), global_batch_size=2 * args.devices, sharding=mode,
                           start_method="spawn", shuffle=False, log_metrics=False, **hsdp)
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Measure(out)])
    paths = [os.path.join(out, f"rank{r}.json") for r in range(args.devices)]
    try:
        trainer.fit(Module(model=spec, lr=1e-4), loader)
    except torch.multiprocessing.ProcessExitedException as err:  # a rank died after writing its figures
        if not all(os.path.exists(p) for p in paths):
            raise
        print(f"note: sharding={mode!r}: {err} after the fit had finished and every rank had written its figures",
              file=sys.stderr)
    return [json.load(open(p)) for p in paths]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--shard-group-size", type=int, default=2, help="hsdp: ranks K the states are sharded over")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = p.parse_args(argv)
    spec = ModelSpec("mem-1d", "1d", args.layers, args.hidden, args.heads, True, args.ffn, vocab_size=args.vocab)
    rows = []
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as d:
            ranks = run(mode, spec, args, d)
        rows.append((mode, {w: {k: max(r[w][k] for r in ranks) for k in ranks[0][w]} for w in ("loop", "rest")}))
    mb = 2 ** 20
    numel = sum(p.numel() for p in Module(model=spec).parameters())
    print(f"model {spec.num_layers} layers x {spec.hidden_size} (ffn {spec.ffn_hidden_size}, vocab {spec.vocab_size}): "
          f"{numel / 1e6:.1f} M fp32 parameters, AdamW; {args.devices} CPU processes; MiB per rank (max over ranks)")
    print("| sharding | loop: weights | grads | optimizer | **total** | rest: weights | grads | optimizer | **total** |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, r in rows:
        cells = []
        for w in ("loop", "rest"):
            v = r[w]
            cells += [f"{v['weights'] / mb:.0f}", f"{v['gradients'] / mb:.0f}", f"{v['optimizer'] / mb:.0f}",
                      f"**{sum(v.values()) / mb:.0f}**"]
        name = f"hsdp K={args.shard_group_size}" if mode == "hsdp" else mode
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
