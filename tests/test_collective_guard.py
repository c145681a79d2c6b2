"""World collectives inside training_step stop every rank at once, naming the call (issue #35, item 2).

The guard's rules run on 2 spawned gloo processes (tests/_dist.py); whole fits with uneven micro-batch
counts run ``tests/_collective_runs.py`` in a subprocess with a hard time-out (a hang fails the test; no
test asserts how fast a run ends -- ``python tests/_collective_runs.py measure CALL WORLD`` measures it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_collective_runs.py")


def _expect_refused(fn, *match: str) -> str:
    from lightning_dcp.runtime.collective_guard import CollectiveInLoopError

    try:
        fn()
    except CollectiveInLoopError as err:
        msg = str(err)
        assert all(m in msg for m in match), msg
        return msg
    raise AssertionError(f"not refused; expected {match}")


def _raise(err: BaseException) -> None:
    raise err


def _guard_rules(rank: int, world: int) -> None:
    import torch.nn as nn
    from torchmetrics import MeanMetric

    from lightning_dcp.runtime.collective_guard import LoopCollectiveGuard, strategy_call_error
    from lightning_dcp.sp.context import SPContext, sp_context

    original = dist.all_reduce
    sp, other = dist.new_group([0, 1]), dist.new_group([0, 1])
    module = nn.Module()
    module.metrics = nn.ModuleDict({"train_mean": MeanMetric(dist_sync_on_step=True)})
    guard = LoopCollectiveGuard(module, rank, world, timeout_s=300.0)
    t = torch.ones(1)
    with guard.loop():
        with guard.round("step 1 of epoch 0, item 0 (SP 2)"):
            msg = _expect_refused(lambda: dist.all_reduce(t), "torch.distributed.all_reduce on the world group",
                                  f"(rank {rank}, step 1 of epoch 0, item 0 (SP 2); called from ",
                                  "test_collective_guard.py:", "time-out (300 s)", "Fix: move the collective out")
            assert "in _guard_rules" in msg or "in <lambda>" in msg, msg
            _expect_refused(lambda: dist.distributed_c10d.all_gather([torch.ones(1)] * world, t, group=dist.group.WORLD),
                            "torch.distributed.all_gather on the world group")
            _expect_refused(lambda: dist.barrier(), "torch.distributed.barrier")
            _expect_refused(lambda: dist.new_group([0, 1]), "torch.distributed.new_group on a collective of the world")
            _expect_refused(lambda: module.metrics["train_mean"](t),
                            "(the state sync of the torchmetrics metric self.metrics.train_mean (MeanMetric))",
                            "built with dist_sync_on_step=True; build it with dist_sync_on_step=False",
                            "self.log('train_mean', self.metrics.train_mean, on_step=False, on_epoch=True)")
            _expect_refused(lambda: _raise(strategy_call_error("self.all_gather")),
                            "self.all_gather on the world group", "gather in on_train_batch_end")
            with sp_context(SPContext(group=sp, size=2, rank=rank)):
                u = torch.ones(1)
                dist.all_reduce(u, group=sp)  # the active SP group's collective runs
                assert u.item() == world
                _expect_refused(lambda: dist.all_reduce(u, group=other), "not the active SP group")
            v = torch.ones(1)
            thread = threading.Thread(target=dist.all_reduce, args=(v,))  # another thread's call passes
            thread.start()
            thread.join(60)
            assert v.item() == world
    assert dist.all_reduce is original and dist.distributed_c10d.all_reduce is original  # put back after the loop
    dist.all_reduce(t)  # and world collectives run outside the loop
    assert t.item() == world
    for g in (sp, other):
        dist.destroy_process_group(g)
    _report(rank, world)


def _report(rank: int, world: int) -> None:
    """Rank 1 alone tripped -- its user code caught the error and went on: the guard recorded the refused call
    anyway, and both ranks raise rank 1's message after the step-end flags."""
    from lightning_dcp.runtime.collective_guard import CollectiveInLoopError, LoopCollectiveGuard

    guard = LoopCollectiveGuard(None, rank, world)
    with guard.loop():
        if rank == 1:
            try:
                dist.all_reduce(torch.ones(1))
            except CollectiveInLoopError:
                pass  # swallowed: nothing tells the executor
    assert guard.flag == int(rank == 1)

    def gather(t: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t)
        return torch.stack(out)

    with pytest.raises(CollectiveInLoopError) as info:
        guard.stop_if_tripped([0.0, 1.0], gather)
    msg = str(info.value)
    assert msg.startswith("torch.distributed.all_reduce on the world group inside training_step under DCPStrategy "
                          "(rank 1; called from "), msg
    assert msg.endswith("Every rank stopped at the end of this step (rank 1 made such a call)"), msg
    guard.stop_if_tripped([0.0, 0.0], gather)  # nothing flagged: nothing raised, no collective


def test_guard_refuses_world_collectives_keeps_the_sp_groups_and_every_rank_raises_the_message():
    run_distributed(_guard_rules, 2, timeout=180)


def test_the_strategys_own_collectives_raise_the_guard_error_inside_the_loop():
    """``self.all_gather``, ``barrier``, ``broadcast``, ``reduce_boolean_decision`` inside the loop raise the error
    the executor reports to every rank; ``reduce`` (``self.log(..., sync_dist=True)``) keeps the local value."""
    from types import SimpleNamespace

    from lightning_dcp.runtime.collective_guard import CollectiveInLoopError, LoopCollectiveGuard
    from lightning_dcp.runtime.guards import MicroLoopGuards
    from lightning_dcp.runtime.step_logs import StepLogs

    class Base:
        def all_gather(self, tensor, group=None, sync_grads=False):
            return "ddp"

        def reduce(self, tensor, group=None, reduce_op="mean"):
            return "ddp"

    class Strategy(MicroLoopGuards, Base):
        pass

    strategy = Strategy()
    strategy.executor = SimpleNamespace(in_micro_loop=True, step_logs=StepLogs(lambda: None))
    t = torch.ones(1)
    for call, name, fix in [(lambda: strategy.all_gather(t), "self.all_gather", "gather in on_train_batch_end"),
                            (strategy.barrier, "trainer.strategy.barrier", "move the barrier"),
                            (lambda: strategy.broadcast(1), "trainer.strategy.broadcast", "broadcast from a hook"),
                            (lambda: strategy.reduce_boolean_decision(True), "trainer.strategy.reduce_boolean_decision",
                             "call it outside training_step")]:
        with pytest.raises(CollectiveInLoopError, match=rf"^{name} on the world group inside training_step .*Fix: {fix}"):
            call()
    assert strategy.reduce(t) is t  # kept for the step's reduction at its end (tests/test_step_logs.py)
    with pytest.warns(UserWarning, match=r"trainer.strategy.reduce\(\.\.\.\) inside training_step"):
        strategy.executor.step_logs.signature()  # no self.log name took it: this rank's own value, warned
    guard = LoopCollectiveGuard(None, 0, 1)
    with guard.loop():  # inside the executor's loop the running guard records the refusal, caught or not
        try:
            strategy.all_gather(t)
        except CollectiveInLoopError:
            pass
        try:
            strategy.barrier()  # a second refusal: the first is the one reported
        except CollectiveInLoopError:
            pass
    assert guard.flag == 1
    with pytest.raises(CollectiveInLoopError, match=r"^self\.all_gather on the world group .*Every rank stopped at "
                                                    r"the end of this step \(rank 0 made such a call\)$"):
        guard.stop_if_tripped([1.0], lambda _: pytest.fail("no gather on one process"))
    assert guard.flag == 0
    strategy.executor.in_micro_loop = False
    assert strategy.all_gather(t) == "ddp" and strategy.reduce(t) == "ddp"


def _fit(call: str, world: int, out: str, timeout: float = 300.0) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, _RUNS, call, str(world), out], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{call} on {world} processes hung for {timeout:.0f} s")
    with open(os.path.join(out, "output.txt"), "wb") as f:
        f.write(output)
    return proc.returncode


_EXPECTED = {
    "dist": ("torch.distributed.all_reduce on the world group", "Fix: move the collective out of training_step"),
    "all_gather": ("self.all_gather on the world group", "Fix: gather in on_train_batch_end"),
    "metric": ("(the state sync of the torchmetrics metric self.train_mean (MeanMetric))",
               "build it with dist_sync_on_step=False (the default)"),
}


@pytest.mark.parametrize("call,world", [
    ("dist", 3), ("metric", 2),
    pytest.param("dist", 2, marks=pytest.mark.slow), pytest.param("all_gather", 2, marks=pytest.mark.slow),
    pytest.param("all_gather", 3, marks=pytest.mark.slow), pytest.param("metric", 3, marks=pytest.mark.slow),
    ("caught-all_gather", 2),
    pytest.param("caught-dist", 3, marks=pytest.mark.slow), pytest.param("caught-metric", 2, marks=pytest.mark.slow),
])
def test_world_collective_in_training_step_stops_every_rank_with_uneven_counts(tmp_path, call, world):
    """Ranks run 2, 4 (and on 3 processes 0) micro-batches per step; from step 1 every training_step makes the
    call: every rank stops in that step with the same error, naming the call and the fix -- no time-out.
    ``caught-CALL``: the user's training_step catches the error and returns its loss; the stop is the same."""
    code = _fit(call, world, str(tmp_path))
    assert code != 0
    output = open(tmp_path / "output.txt").read()
    files = [tmp_path / f"error_rank{r}.txt" for r in range(world)]
    assert all(f.exists() for f in files), output[-3000:]
    messages = [f.read_text() for f in files]
    assert len(set(messages)) == 1, messages
    msg = messages[0]
    assert msg.startswith("CollectiveInLoopError: "), msg
    assert all(m in msg for m in _EXPECTED[call.removeprefix("caught-")]), msg
    assert "step 1 of epoch 0, item 0 (samples [" in msg and "SP 2" in msg
    assert msg.endswith("Every rank stopped at the end of this step (ranks [0, 1] made such a call)"), msg
    assert "Timed out" not in output and "CollectiveError" not in output
