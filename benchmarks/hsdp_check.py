"""The ``hsdp`` section of ``benchmarks/gpu_check.py``: per-layer sharding fits on two ranks.

Two short fits of ``tiny-1d`` (:class:`~lightning_dcp.models.DCPTransformerModule`) under
``DCPStrategy(sharding="hsdp", shard_group_size=2)`` on two processes, each spawned by Lightning:

1. ``bf16``: ``precision="bf16-mixed"`` on NCCL (one GPU per rank), a skewed plan (rank 0 one item, rank 1
   the rest: rank 0 runs dummy rounds, the collectives only);
2. ``offload``: the same with ``offload=True`` (FSDP2's ``CPUOffloadPolicy``: the shards in host memory).

Each records its losses per step (finite or not) and the step time. NCCL cannot put two ranks on one GPU:
with fewer than two GPUs both are skipped with that reason. Without CUDA (the dry run) the first runs on
two gloo CPU processes in fp32, and the second is skipped with the strategy's own refusal (the shards are
in host memory already).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import lightning.pytorch as pl
import torch

__all__ = ["section_hsdp", "summary"]


class SkewPlanner:
    """Every step: rank 0 runs one micro-batch, rank 1 the rest (rank 0 runs dummy rounds)."""

    one_step_per_batch = True

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list:
        from lightning_dcp.planning.plan import StepPlan, WorkItem

        pairs = list(zip(samples, lengths))
        ranks = [(0,)] + [(1,)] * (len(pairs) - 1)
        return [StepPlan(tuple(WorkItem(r, (s,), (n,), i % 2) for i, (r, (s, n)) in enumerate(zip(ranks, pairs))))]


class Losses(pl.Callback):
    """Rank 0 writes every step's loss and seconds to ``path`` (JSON) at the fit's end."""

    def __init__(self, path: str) -> None:
        self.path, self.rows, self._t0 = path, [], 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.rows.append({"loss": float(loss), "step_s": time.perf_counter() - self._t0})

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps({"rows": self.rows, "shard_group_size": trainer.strategy.shard_group_size}))


def _fresh_launch() -> None:
    """The earlier sections' one-device fits leave a process group and its ``MASTER_PORT`` in this process: the
    two ranks spawned here would inherit the port (``EADDRINUSE``). Drop both first."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        os.environ.pop(var, None)


def _fit(ctx: Any, name: str, offload: bool) -> dict:
    from torch.utils.data import DataLoader

    from lightning_dcp import DCPStrategy, DefaultCostModel
    from lightning_dcp.data import SyntheticTokenDataset, tiny_lengths
    from lightning_dcp.models import DCPTransformerModule

    s = ctx.sizes
    out = ctx.out / f"hsdp_{name}.json"
    strategy = DCPStrategy(planner=SkewPlanner(), global_batch_size=s.fit_global_batch, sharding="hsdp",
                           shard_group_size=2, offload=offload, start_method="spawn", profile=False,
                           cost_model=DefaultCostModel(num_layers=2, num_heads=4))
    trainer = pl.Trainer(accelerator=ctx.accelerator, devices=2, strategy=strategy, precision=ctx.precision,
                         max_steps=s.fit_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Losses(str(out))])
    data = SyntheticTokenDataset(tiny_lengths(s.fit_samples, max_len=s.fit_max_len), vocab_size=256)
    _fresh_launch()
    t0 = time.perf_counter()
    trainer.fit(DCPTransformerModule("tiny-1d", lr=1e-3), DataLoader(data, batch_size=1))
    got = json.loads(out.read_text())
    losses = [r["loss"] for r in got["rows"]]
    finite = bool(losses) and all(math.isfinite(v) for v in losses)
    return {"run": name, "status": "ok" if finite else "error", "offload": offload, "precision": ctx.precision,
            "backend": "nccl" if ctx.cuda else "gloo", "shard_group_size": got["shard_group_size"],
            "steps": len(losses), "losses": losses, "finite": finite, "step_s": [r["step_s"] for r in got["rows"]],
            "fit_s": time.perf_counter() - t0}


def _offload(ctx: Any) -> dict:
    if ctx.cuda:
        return _fit(ctx, "offload", offload=True)
    try:
        _fit(ctx, "offload", offload=True)
    except Exception as err:  # noqa: BLE001 - the strategy refuses offload on the CPU by name (raised in a rank)
        if "offload=True keeps the shards in host memory" in str(err):
            return {"run": "offload", "status": "skipped",
                    "reason": "no CUDA: DCPStrategy refuses offload=True on the CPU (the shards are in host memory already)"}
        raise
    return {"run": "offload", "status": "error", "error": "offload=True on the CPU was not refused"}


def _guarded(fn: Any, **row: Any) -> dict:
    """``fn()``, or ``row`` with ``status="error"`` and the exception's last line (one run must not lose the other)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        return {**row, "status": "error", "error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}"}


def section_hsdp(ctx: Any) -> dict:
    """Both fits (see the module docstring); ``failed`` names the runs that failed."""
    if ctx.cuda and torch.cuda.device_count() < 2:
        reason = (f"{torch.cuda.device_count()} GPU here: NCCL cannot put the two ranks of a shard group on one GPU; "
                  "run on a machine with 2 or more")
        runs = [{"run": "bf16", "status": "skipped", "reason": reason},
                {"run": "offload", "status": "skipped", "reason": reason}]
    else:
        runs = [_guarded(lambda: _fit(ctx, "bf16", offload=False), run="bf16"),
                _guarded(lambda: _offload(ctx), run="offload")]
    failed = [f"hsdp {r['run']}: " + (r.get("error") or f"non-finite losses {r.get('losses')}")
              for r in runs if r["status"] == "error"]
    return {"runs": runs, "failed": failed}


def summary(results: dict) -> str:
    """The section's cell in the report's table."""
    return "; ".join(f"{x['run']}: {x['status']}" + (f" ({x['reason'][:80]})" if "reason" in x else
                     f", loss {x['losses'][0]:.3f} -> {x['losses'][-1]:.3f}" if x.get("losses") else "")
                     for x in results["runs"])
