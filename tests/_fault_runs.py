"""Whole-Trainer fault runs for tests/test_faults.py: ``python tests/_fault_runs.py SCENARIO OUT_DIR``.

Each scenario fits a tiny model on spawned gloo CPU processes. Every rank writes
``OUT_DIR/error_rank{r}.txt`` (the message of the exception that stopped it) through a callback's
``on_exception``; rank 0 writes ``OUT_DIR/result.pt`` on success. The test runs this file in a
subprocess with a hard time-out, so a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _dcp_helpers import Dump, RandomPlanner, TinyLM, make_dataset, make_trainer  # noqa: E402
from lightning_dcp.sp.context import active_context  # noqa: E402
from lightning_dcp import DCPStrategy  # noqa: E402


class ErrorFile(pl.Callback):
    """Each rank writes the exception that stopped it."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        with open(os.path.join(self.out_dir, f"error_rank{trainer.global_rank}.txt"), "w") as f:
            f.write(f"{type(exception).__name__}: {exception}")


class RankFilteredLM(TinyLM):
    """A rank-dependent filter: rank r drops its dataset's last r samples."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(make_dataset(n=48 - self.trainer.global_rank), batch_size=4)


class RankDivergingPlanner(RandomPlanner):
    """Same plans on every rank up to step 1; from step 2 each rank seeds with its own rank (SP 2 items every step)."""

    def plan_batch(self, samples, lengths, step=0):
        if step >= 2:
            self.seed = 100 + dist.get_rank()
        return super().plan_batch(samples, lengths, step)


class SleepyLM(TinyLM):
    """Rank 1 stalls for ``stall_s`` seconds before its first micro-batch of step 1 (outside any collective)."""

    def __init__(self, stall_s: float = 30.0) -> None:
        super().__init__()
        self.stall_s = stall_s

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1 and self.trainer.global_rank == 1 and self.stall_s:
            time.sleep(self.stall_s)
            self.stall_s = 0.0
        return super().training_step(batch, batch_idx)


class HangLM(TinyLM):
    """At step 1 both ranks wait to receive from each other: a deadlock inside a collective, by construction.
    Each rank first writes ``hanging_rank{r}.txt`` holding its pid."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            rank = self.trainer.global_rank
            with open(os.path.join(self.out_dir, f"hanging_rank{rank}.txt"), "w") as f:
                f.write(str(os.getpid()))
            dist.recv(torch.zeros(1), src=1 - rank)
        return super().training_step(batch, batch_idx)


def _sigterm(out: str) -> None:
    strategy = DCPStrategy(planner=RandomPlanner(2, seed=2, max_sp=1), global_batch_size=8, start_method="popen",
                           sigterm_grace_s=5.0)
    make_trainer(2, strategy, [ErrorFile(out)], max_steps=4).fit(HangLM(out))


class OOMOnceLM(TinyLM):
    """Rank 1 raises torch.OutOfMemoryError once, in its first SP-1 item of step 2."""

    fired = False

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2 and self.trainer.global_rank == 1 and not self.fired and active_context().size == 1:
            self.fired = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
        return super().training_step(batch, batch_idx)


class OOMAtSP2LM(TinyLM):
    """Rank 1 raises torch.OutOfMemoryError in its first SP-2 item of step 1 (a partner waits in a collective),
    after saving that step's plan to ``out_dir/failed_plan.pt``."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1 and self.trainer.global_rank == 1 and active_context().size == 2:
            plan = self.trainer.strategy.batch_sampler.next_plan(0, 1).to_dict()
            torch.save(plan, os.path.join(self.out_dir, "failed_plan.pt"))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
        return super().training_step(batch, batch_idx)


class Record(pl.Callback):
    """Each rank saves the strategy's OOM re-plan count and the logged dcp/oom_replans."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        logged = trainer.callback_metrics.get("dcp/oom_replans")
        torch.save({"oom_replans": trainer.strategy.oom_replans, "logged": None if logged is None else float(logged)},
                   os.path.join(self.out_dir, f"record_rank{trainer.global_rank}.pt"))


def _oom(out: str) -> None:
    strategy = DCPStrategy(global_batch_size=8, profile=False, start_method="popen", seed=1)
    make_trainer(2, strategy, [ErrorFile(out), Dump(out, weights_at=(5,)), Record(out)], max_steps=5).fit(OOMOnceLM())


def _world3(out: str) -> None:
    """World size 3: SP 2 on the aligned block [0, 1] and SP 1 anywhere, against the single-process reference."""
    strategy = DCPStrategy(planner=RandomPlanner(3, seed=3, force_mix=True), global_batch_size=9, start_method="popen",
                           seed=1)
    make_trainer(3, strategy, [ErrorFile(out), Dump(out, weights_at=(4,))], max_steps=4).fit(TinyLM())


def _oom_sp2(out: str) -> None:
    """Out of memory in an SP-2 item of step 1: the failing rank writes ``out/dcp_oom/...ckpt`` and the run stops."""
    strategy = DCPStrategy(planner=RandomPlanner(2, seed=2, force_mix=True), global_batch_size=8, start_method="popen")
    make_trainer(2, strategy, [ErrorFile(out), Dump(out, weights_at=())], max_steps=4,
                 default_root_dir=out).fit(OOMAtSP2LM(out))


def _oom_sp2_resume(out: str) -> None:
    """The next launch: resume from the out-of-memory checkpoint and train to step 4."""
    ckpt = os.path.join(out, "dcp_oom", "epoch=0-step=1-rank=1.ckpt")
    resumed = os.path.join(out, "resumed")
    os.makedirs(resumed, exist_ok=True)
    strategy = DCPStrategy(planner=RandomPlanner(2, seed=2, force_mix=True), global_batch_size=8, start_method="popen")
    make_trainer(2, strategy, [ErrorFile(resumed), Dump(resumed, weights_at=(4,))], max_steps=4,
                 default_root_dir=out).fit(TinyLM(), ckpt_path=ckpt)


def _oom_hsdp(out: str) -> None:
    """Out of memory in an SP-1 micro-batch of step 1 under sharding="hsdp" (a lockstep round: the other rank of the
    shard group waits in the round's per-layer collectives): the run stops, naming the round."""
    strategy = DCPStrategy(planner=RandomPlanner(2, seed=2, max_sp=1, idle_prob=0.0), global_batch_size=8,
                           start_method="popen", sharding="hsdp", shard_group_size=2, timeout=60)
    make_trainer(2, strategy, [ErrorFile(out)], max_steps=4, default_root_dir=out).fit(OOMOnceLM())


def _lengths(out: str) -> None:
    strategy = DCPStrategy(planner=RandomPlanner(2, max_sp=1), global_batch_size=8, start_method="popen")
    make_trainer(2, strategy, [ErrorFile(out)], max_steps=3).fit(RankFilteredLM())


def _profiler(out: str) -> Any:
    from lightning_dcp import DCPProfiler

    return DCPProfiler(cache_dir=os.path.join(out, "profiles"), time_budget_s=5.0)


def _profile_fill(out: str) -> None:
    """Profile on agreeing ranks (fills the cache in ``out/profiles``); one step."""
    make_trainer(2, DCPStrategy(global_batch_size=8, start_method="popen"), [ErrorFile(out), _profiler(out)],
                 max_steps=1).fit(TinyLM())


def _lengths_profiled(out: str) -> None:
    """Rank-dependent dataset filtering with profiling on (SP 2 possible): the agreement error, not a crash."""
    make_trainer(2, DCPStrategy(global_batch_size=8, start_method="popen"), [ErrorFile(out), _profiler(out)],
                 max_steps=3).fit(RankFilteredLM())


def _plan_sp2(out: str) -> None:
    strategy = DCPStrategy(planner=RankDivergingPlanner(2, seed=2, force_mix=True), global_batch_size=8,
                           start_method="popen")
    make_trainer(2, strategy, [ErrorFile(out), Dump(out, weights_at=())], max_steps=6).fit(TinyLM())


class KilledLM(TinyLM):
    """Every rank writes ``pid_rank{r}.txt`` at step 0; rank ``victim`` is SIGKILLed in its first SP-2 item of step 1,
    while its partner works on to the same item's all-to-all (a worker dying without a word)."""

    def __init__(self, out_dir: str, victim: int) -> None:
        super().__init__()
        self.out_dir, self.victim = out_dir, victim

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        rank = self.trainer.global_rank
        if batch_idx == 0:
            with open(os.path.join(self.out_dir, f"pid_rank{rank}.txt"), "w") as f:
                f.write(str(os.getpid()))
        if batch_idx == 1 and rank == self.victim and active_context().size == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def _killed(out: str, victim: int) -> None:
    strategy = DCPStrategy(planner=RandomPlanner(2, seed=2, force_mix=True), global_batch_size=8,
                           start_method="popen", timeout=30)
    make_trainer(2, strategy, [ErrorFile(out)], max_steps=4).fit(KilledLM(out, victim))


def _collective_timeout(out: str) -> None:
    strategy = DCPStrategy(planner=RandomPlanner(2, seed=2, force_mix=True), global_batch_size=8,
                           start_method="popen", timeout=15)  # also the start-up rendezvous: room for a busy machine
    make_trainer(2, strategy, [ErrorFile(out)], max_steps=4).fit(SleepyLM(stall_s=45.0))


SCENARIOS = {"world3": _world3, "oom": _oom, "oom_hsdp": _oom_hsdp, "oom_sp2": _oom_sp2, "oom_sp2_resume": _oom_sp2_resume, "sigterm": _sigterm, "lengths": _lengths,
             "profile_fill": _profile_fill, "lengths_profiled": _lengths_profiled, "plan_sp2": _plan_sp2, "collective_timeout": _collective_timeout,
             "killed_rank1": lambda out: _killed(out, 1), "killed_rank0": lambda out: _killed(out, 0)}

if __name__ == "__main__":
    name, out_dir = sys.argv[1], sys.argv[2]
    SCENARIOS[name](out_dir)
