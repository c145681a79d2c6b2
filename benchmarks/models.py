"""Benchmark LightningModules: the package's reference models with named sizes and per-step timing.

The models themselves are :class:`lightning_dcp.models.Transformer1D` (decoder: RMSNorm, RoPE,
causal varlen attention, SwiGLU; packed variable lengths) and
:class:`lightning_dcp.models.Transformer2D` (video DiT-like: spatial attention per frame,
temporal attention across frames; SP shards whole frames and switches axis by all-to-all for
temporal attention), trained by :class:`lightning_dcp.models.module.DCPTransformerModule`. This
file adds nothing to them but what a benchmark needs:

* :data:`SIZES` -- the names a benchmark accepts: the paper's Table 1 sizes
  (``transformer-1d``: 42 layers x 3072, 48 heads, ~5B; ``transformer-2d``: 28 layers x 1152,
  16 heads), the CPU sizes ``tiny-1d`` / ``tiny-2d`` (4 layers x 64, 4 heads), and ``small-1d``
  / ``small-2d`` (4 layers x 128, 4 heads: per-layer times large enough to measure well on CPU).
* :class:`BenchmarkModule` -- a :class:`DCPTransformerModule` that pins the intra-op thread
  count in every (spawned) process and records, per optimizer step and per rank: wall time of
  the step (``on_train_batch_start`` -> ``on_train_batch_end``: micro-batches, the strategy's
  gather, gradient all-reduce and optimizer step), the start / end of each micro-batch
  (``training_step`` entry -> ``on_after_backward``), and the strategy's step plan and
  :class:`~lightning_dcp.runtime.metrics.StepMetrics`. At the end of the fit each rank writes its
  records to ``record_dir/rank{r}.json`` (rank 0 adds the profile the planner used). On CUDA
  the timestamps synchronise the device first. Next to each wall-clock timestamp the CPU time of
  the training thread (``time.thread_time``) is recorded: on a CPU shared with other processes it
  is the contention-free part (what this rank computed, not what it waited for a core or for
  another rank).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import torch

from lightning_dcp.models.module import DCPTransformerModule
from lightning_dcp.planning.models import ModelSpec, get_model

__all__ = ["BenchmarkModule", "SIZES", "bench_spec"]


def _small(name: str) -> ModelSpec:
    base = get_model("tiny-" + name.split("-")[1])
    return replace(base, name=name, hidden_size=128, ffn_hidden_size=base.ffn_hidden_size * 2)


SIZES: dict[str, ModelSpec] = {
    "transformer-1d": get_model("transformer-1d"),
    "transformer-2d": get_model("transformer-2d"),
    "tiny-1d": get_model("tiny-1d"),
    "tiny-2d": get_model("tiny-2d"),
    "small-1d": _small("small-1d"),
    "small-2d": _small("small-2d"),
}


def bench_spec(name: str | ModelSpec) -> ModelSpec:
    """The :class:`ModelSpec` of a benchmark size name (or the spec itself)."""
    if isinstance(name, ModelSpec):
        return name
    try:
        return SIZES[name]
    except KeyError:
        raise ValueError(f"unknown benchmark model {name!r}; known: {', '.join(SIZES)}") from None


class BenchmarkModule(DCPTransformerModule):
    """:class:`DCPTransformerModule` with named sizes and per-step timing records (module docstring).

    Args:
        model: a name of :data:`SIZES` or a :class:`ModelSpec`.
        lr: AdamW learning rate.
        num_threads: ``torch.set_num_threads`` in every process at ``setup`` (None: leave it).
        record_dir: where each rank writes ``rank{r}.json`` at the end of the fit (None: keep the
            records in memory only, :attr:`records`).
        log_loss: log the step's ``train/loss`` as the base module does (off by default: the
            benchmark measures the strategy, not the logger).
    """

    def __init__(self, model: str | ModelSpec = "tiny-2d", lr: float = 1e-3, num_threads: int | None = None,
                 record_dir: str | None = None, log_loss: bool = False) -> None:
        super().__init__(bench_spec(model), lr=lr)
        self.num_threads = num_threads
        self.record_dir = record_dir
        self.log_loss = log_loss
        self.train_loss_key = "train/loss" if log_loss else None
        self.records: list[dict[str, Any]] = []
        self._t0: float | None = None
        self._items: list[list[float]] = []
        self._c0: float | None = None

    # ------------------------------------------------------------------ process setup
    def setup(self, stage: str) -> None:
        if self.num_threads:
            torch.set_num_threads(int(self.num_threads))
        hang = os.environ.get("DCP_BENCH_DUMP_STACKS_S")  # debugging aid: dump every rank's stacks periodically
        if hang:
            import faulthandler

            faulthandler.dump_traceback_later(float(hang), repeat=True)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ timing hooks
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._items = []
        self._t0 = self._now()
        self._c0 = time.thread_time()

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        if self._t0 is not None:
            self._items.append([self._now() - self._t0, float("nan"), time.thread_time() - self._c0, float("nan")])
        return self._mean_loss(batch)

    def on_after_backward(self) -> None:
        if self._t0 is not None and self._items and self._items[-1][1] != self._items[-1][1]:  # NaN: open item
            self._items[-1][1] = self._now() - self._t0
            self._items[-1][3] = time.thread_time() - self._c0

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._t0 is None:
            return
        end = self._now()
        cpu = time.thread_time() - self._c0
        strategy = self.trainer.strategy
        metrics = getattr(strategy, "last_step_metrics", None)
        plan = getattr(strategy, "last_step_plan", None)
        step = getattr(batch, "step", None)  # a DCP step (lightning_dcp.runtime.step.PreparedStep)
        self.records.append({
            "epoch": step.epoch if step is not None else int(self.current_epoch),
            "step": step.index if step is not None else int(batch_idx),
            "global_step": int(self.global_step), "start": self._t0, "end": end, "step_s": end - self._t0, "step_cpu_s": cpu,
            "items": self._items, "plan": plan, "metrics": metrics.to_dict() if metrics is not None else None,
        })
        self._t0 = None

    def on_fit_end(self) -> None:
        if not self.record_dir:
            return
        rank = int(self.global_rank)
        out = {"rank": rank, "world_size": int(self.trainer.world_size), "model": self.spec.to_dict(),
               "num_threads": torch.get_num_threads(), "records": self.records}
        if rank == 0:
            prof = next((cb for cb in self.trainer.callbacks if type(cb).__name__ == "DCPProfiler"), None)
            out["profile"] = getattr(prof, "profile", None)
            out["profile_cache"] = getattr(prof, "cache_status", None)
            out["profiling_s"] = getattr(prof, "profiling_s", None)
            cm = getattr(self.trainer.strategy, "cost_model", None)
            out["cost_model"] = type(cm).__name__ if cm is not None else None
        path = Path(self.record_dir)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".rank{rank}.json.{os.getpid()}"
        tmp.write_text(json.dumps(out))
        tmp.replace(path / f"rank{rank}.json")
