"""World collectives inside ``training_step`` with uneven micro-batch counts (tests/test_collective_guard.py).

``python tests/_collective_runs.py CALL WORLD OUT_DIR`` fits a tiny model on ``WORLD`` gloo CPU processes
(``start_method="popen"``) whose ``training_step`` makes the world collective ``CALL`` (``dist`` -- a direct
``torch.distributed.all_reduce``, ``all_gather`` -- ``self.all_gather``, ``metric`` -- a torchmetrics
``MeanMetric(dist_sync_on_step=True)``) from step 1 on, under plans where the ranks run different numbers of
micro-batches (an SP-2 item on ranks 0-1, then 1, 3 and -- on 3 processes -- 0 SP-1 items). ``caught-CALL``
makes the same call inside ``try: ... except CollectiveInLoopError: pass`` (user code that swallows the error:
the refused call still stops every rank at the step end). Every rank
writes the exception that stopped it to ``OUT_DIR/error_rank{r}.txt``, the wall time of its first call to
``OUT_DIR/call_rank{r}.txt`` and of its stop to ``OUT_DIR/stop_rank{r}.txt``.

``python tests/_collective_runs.py measure CALL WORLD`` runs one and prints the seconds from the first call
on any rank to the last rank's stop.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _dcp_helpers import TinyLM, make_trainer  # noqa: E402
from lightning_dcp import DCPStrategy  # noqa: E402
from lightning_dcp.planning.plan import StepPlan, WorkItem  # noqa: E402
from lightning_dcp.runtime.collective_guard import CollectiveInLoopError  # noqa: E402

CALLS = ("dist", "all_gather", "metric")
CAUGHT = tuple(f"caught-{call}" for call in CALLS)


class UnevenPlanner:
    """Per step: one SP-2 item on ranks 0-1, then SP-1 items -- 1 on rank 0, 3 on rank 1, none on rank 2 (a rank
    that never runs training_step in the step)."""

    one_step_per_batch = True

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        pairs = list(zip(samples, lengths))
        ranks = [(0, 1)] + [(0,)] + [(1,)] * 3
        ranks = ranks[:len(pairs)]
        chunks = [pairs[i::len(ranks)] for i in range(len(ranks))]
        items = tuple(WorkItem(r, tuple(s for s, _ in c), tuple(n for _, n in c), 0) for r, c in zip(ranks, chunks))
        return [StepPlan(items)]


class CallingLM(TinyLM):
    """From step 1 on, every micro-batch's training_step makes the world collective ``call`` after its forward
    (``caught-CALL``: and swallows the :class:`CollectiveInLoopError`)."""

    def __init__(self, call: str, out_dir: str) -> None:
        super().__init__()
        self.caught = call.startswith("caught-")
        self.call, self.out_dir = call.removeprefix("caught-"), out_dir
        if self.call == "metric":
            from torchmetrics import MeanMetric

            self.train_mean = MeanMetric(dist_sync_on_step=True)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx >= 1:
            path = os.path.join(self.out_dir, f"call_rank{self.global_rank}.txt")
            if not os.path.exists(path):
                with open(path, "w") as f:
                    f.write(repr(time.time()))
            try:
                self._collective(loss.detach().reshape(1))
            except CollectiveInLoopError:
                if not self.caught:
                    raise
        return loss

    def _collective(self, value: torch.Tensor) -> None:
        if self.call == "dist":
            dist.all_reduce(value)
        elif self.call == "all_gather":
            self.all_gather(value)
        else:
            self.train_mean(value)


class StopRecord(pl.Callback):
    """Each rank writes the exception that stopped it and when."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        rank = trainer.global_rank
        with open(os.path.join(self.out_dir, f"stop_rank{rank}.txt"), "w") as f:
            f.write(repr(time.time()))
        with open(os.path.join(self.out_dir, f"error_rank{rank}.txt"), "w") as f:
            f.write(f"{type(exception).__name__}: {exception}")


def fit(call: str, world: int, out: str) -> None:
    strategy = DCPStrategy(planner=UnevenPlanner(world), global_batch_size=8, start_method="popen", timeout=120)
    make_trainer(world, strategy, [StopRecord(out)], max_steps=4).fit(CallingLM(call, out))


def stop_seconds(out: str, world: int) -> float:
    """Seconds from the first call (on any rank) to the last rank's stop."""
    read = lambda name: [float(open(os.path.join(out, f"{name}_rank{r}.txt")).read())  # noqa: E731
                         for r in range(world) if os.path.exists(os.path.join(out, f"{name}_rank{r}.txt"))]
    return max(read("stop")) - min(read("call"))


def measure(call: str, world: int) -> None:
    out = tempfile.mkdtemp(prefix=f"dcp-{call}-{world}-")
    try:
        code = subprocess.run([sys.executable, os.path.abspath(__file__), call, str(world), out],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600).returncode
        stops = [r for r in range(world) if os.path.exists(os.path.join(out, f"stop_rank{r}.txt"))]
        if len(stops) < world:
            print(f"{call} on {world} processes: exit {code}, ranks {stops} stopped (not every rank)")
        else:
            print(f"{call} on {world} processes: exit {code}, stopped {stop_seconds(out, world):.2f} s after the first call")
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] == "measure":
        measure(sys.argv[2], int(sys.argv[3]))
    else:
        fit(sys.argv[1], int(sys.argv[2]), sys.argv[3])
