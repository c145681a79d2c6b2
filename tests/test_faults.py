"""Bad inputs and faults: clear errors, never a hang, never silently wrong (issue #9).

Unit checks run in this process. Whole-Trainer fault runs (2-3 spawned gloo processes each)
run ``tests/_fault_runs.py`` in a subprocess with a hard time-out, so a regression that hangs
fails the test instead of blocking CI.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.runtime.lengths import check_lengths, resolve_lengths
from lightning_dcp.runtime.sampler import DCPBatchSampler
from lightning_dcp import DCPStrategy, DefaultCostModel


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Lengths(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {}


# ---------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("lengths,match", [
    ([4, 152.7], r"_Lengths.lengths\[1\] is 152.7, not an integer"),
    ([4, 5, "abc"], r"_Lengths.lengths\[2\] is 'abc' \(str\), not an integer"),
    ([True, 3], r"_Lengths.lengths\[0\] is True \(bool\), not an integer"),
    ([3, 0], r"_Lengths.lengths\[1\] is 0; every sample needs >= 1 token"),
    ([float("nan")], r"_Lengths.lengths\[0\] is nan, not an integer"),
    ([], r"the train dataset _Lengths is empty"),
])
def test_bad_lengths_name_index_and_source(lengths, match):
    with pytest.raises(ValueError, match=match):
        resolve_lengths(_Lengths(lengths))


def test_integer_like_lengths_are_accepted():
    import numpy as np

    assert resolve_lengths(_Lengths([2.0, torch.tensor(3), np.int64(4)])) == [2, 3, 4]
    with pytest.raises(ValueError, match=r"lengths\[1\] is 2.5"):
        resolve_lengths(_Lengths([1, 2]), [3, 2.5])
    with pytest.raises(ValueError, match="empty"):
        DCPBatchSampler([], planner=None, global_batch_size=1)
    assert check_lengths(range(1, 4)) == [1, 2, 3]


def test_heads_without_power_of_two_factor_cap_sp_once_and_errors_do_not_suggest_max_sp_size():
    from lightning_dcp.runtime.model import resolve_sp_cap
    from lightning_dcp.runtime.planner_factory import PlannerFactory

    with pytest.warns(UserWarning, match="the model has 3 attention heads: SP sizes must divide it, so SP is capped at 1"):
        cap = resolve_sp_cap(None, world_size=2, heads=3)
    assert cap.size == 1
    planners = PlannerFactory(DCPStrategy().settings, 2, cap, num_heads=3, support="sp")
    with pytest.raises(PlanningError) as info:
        planners.planner(DefaultCostModel(num_layers=2, num_heads=3, max_tokens=100), [10, 1000])
    msg = str(info.value)
    assert "sample 1 has length 1000" in msg and "capped by the model's 3 attention heads" in msg
    assert "max_sp_size" not in msg and "more ranks" not in msg


# ------------------------------------------------------------------------- whole-Trainer fault runs
_RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fault_runs.py")


def _run(scenario: str, out: str, timeout: float = 120.0) -> tuple[int, float]:
    """Run a fault scenario (2-3 gloo processes) with a hard time-out; (return code, seconds).

    The time-out only tells a hang from an ending (a hung scenario fails the test there); no test
    asserts how fast a scenario ends."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, _RUNS, scenario, out], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        proc.communicate()
        raise AssertionError(f"fault scenario {scenario!r} hung for {timeout:.0f} s")
    with open(os.path.join(out, "output.txt"), "wb") as f:
        f.write(output)
    return proc.returncode, time.monotonic() - t0


def _errors(out: str, world: int = 2) -> list[str]:
    files = [os.path.join(out, f"error_rank{r}.txt") for r in range(world)]
    missing = [f for f in files if not os.path.exists(f)]
    assert not missing, f"no error recorded by {missing}; output:\n" + open(os.path.join(out, "output.txt")).read()[-3000:]
    return [open(f).read() for f in files]


def test_rank_dependent_dataset_stops_every_rank_at_setup(tmp_path):
    code, _ = _run("lengths", str(tmp_path))
    assert code != 0
    for msg in _errors(str(tmp_path)):
        assert "ranks disagree on the train dataset's sample count" in msg and "rank 0 has 48; rank 1 has 47" in msg
        assert "rank-dependent dataset filtering" in msg


@pytest.mark.parametrize("cached", [False, True], ids=["profiling", "cached-profile"])
def test_rank_dependent_dataset_stops_every_rank_before_profiling(tmp_path, cached):
    """Profiling on (the default), SP 2 possible: the same one-line agreement error on every rank, before
    any profiling collective, whether the profile is measured now or loaded from the cache."""
    if cached:
        code, _ = _run("profile_fill", str(tmp_path))
        assert code == 0, open(os.path.join(str(tmp_path), "output.txt")).read()[-3000:]
        assert os.listdir(os.path.join(str(tmp_path), "profiles"))
        os.remove(os.path.join(str(tmp_path), "output.txt"))
    code, _ = _run("lengths_profiled", str(tmp_path))
    assert code != 0
    for msg in _errors(str(tmp_path)):
        assert msg.startswith("AgreementError: ranks disagree on the train dataset's sample count (at fit start, "
                              "before profiling): rank 0 has 48; rank 1 has 47"), msg
        assert "rank-dependent dataset filtering" in msg
    output = open(os.path.join(str(tmp_path), "output.txt")).read()
    assert "DCP profil" not in output  # no rank started measuring or loaded the profile


def test_rank_dependent_sp2_plans_stop_one_step_ahead_without_a_hang(tmp_path):
    code, _ = _run("plan_sp2", str(tmp_path))
    assert code != 0
    for msg in _errors(str(tmp_path)):
        assert "ranks disagree on the plan of step 2 of epoch 0 (at the end of step 1 of epoch 0" in msg
        assert "pure function of the lengths, the seed and the step" in msg


def test_agreement_fingerprints_and_messages():
    from lightning_dcp.runtime.agreement import AgreementError, check_column, check_setup, plan_fingerprint, setup_row

    plan = {"items": [{"ranks": [0, 1], "samples": [3], "lengths": [9], "recompute": 1}]}
    assert plan_fingerprint(plan, 0, 1) == plan_fingerprint(dict(plan), 0, 1) != plan_fingerprint(plan, 0, 2)
    row = setup_row([3, 4], {"seed": 0}, DefaultCostModel(2, 4, 100))
    check_setup([row, list(row)])
    other = setup_row([3, 4], {"seed": 1}, DefaultCostModel(2, 4, 100))
    with pytest.raises(AgreementError, match=r"ranks disagree on the planner settings .*rank 1 has hash .*different "
                                             r"DCPStrategy / planner arguments per rank"):
        check_setup([row, other])
    with pytest.raises(AgreementError, match=r"ranks \[0, 2\] have 5; rank 1 has 4"):
        check_column([5.0, 4.0, 5.0], "x", "y", "z", show_values=True)


def test_stuck_collective_ends_the_run_naming_step_item_and_group(tmp_path):
    code, _ = _run("collective_timeout", str(tmp_path))
    assert code != 0
    msg = open(tmp_path / "error_rank0.txt").read()
    assert msg.startswith("CollectiveError: step 1 of epoch 0: item 0 (samples [") and "SP 2" in msg
    assert "failed in a collective of SP group [0, 1] (time-out 15 s)" in msg and "Timed out" in msg


def test_killed_worker_ends_its_partner_with_a_collective_error(tmp_path):
    """Rank 1 dies by SIGKILL inside an SP-2 item: rank 0 (waiting in that item's all-to-all) ends with a
    CollectiveError naming the step, the item and the group instead of a hang."""
    code, _ = _run("killed_rank1", str(tmp_path))
    assert code != 0
    assert not os.path.exists(tmp_path / "error_rank1.txt")  # SIGKILL leaves no word
    msg = open(tmp_path / "error_rank0.txt").read()
    assert msg.startswith("CollectiveError: step 1 of epoch 0: item ") and "SP group [0, 1]" in msg, msg


def test_killed_launcher_takes_its_ranks_with_it(tmp_path):
    """Rank 0 (the launcher process under start_method="popen") dies by SIGKILL: rank 1 exits on its own."""
    code, _ = _run("killed_rank0", str(tmp_path))
    assert code == -signal.SIGKILL
    pid1 = int((tmp_path / "pid_rank1.txt").read_text())
    deadline = time.monotonic() + 60
    while _alive(pid1) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid1), "rank 1 outlived its launcher by a minute"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_ends_every_process_of_a_run_hung_in_a_collective(tmp_path):
    """Both ranks block in a recv (a deadlock by construction); SIGTERM to the launcher (popen rank 0)
    ends it and rank 1 within a minute, although no Python signal handler can run while blocked."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, _RUNS, "sigterm", str(tmp_path)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        files = [tmp_path / f"hanging_rank{r}.txt" for r in range(2)]
        deadline = time.monotonic() + 90
        while not all(f.exists() and f.read_text() for f in files):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached its hang"
            time.sleep(0.5)
        pids = [int(f.read_text()) for f in files]
        time.sleep(1.0)  # both are inside recv now
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        proc.wait(timeout=60)
        while _alive(pids[1]) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        assert not _alive(pids[1]), "rank 1 survived SIGTERM to its launcher"
        assert time.monotonic() - t0 < 60
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_timeout_argument():
    from datetime import timedelta

    assert DCPStrategy()._timeout == timedelta(minutes=5)
    assert DCPStrategy(timeout=7)._timeout == timedelta(seconds=7)
    assert DCPStrategy(timeout=timedelta(seconds=3))._timeout == timedelta(seconds=3)
    with pytest.raises(ValueError, match="timeout must be seconds > 0"):
        DCPStrategy(timeout=0)


def test_out_of_memory_at_sp1_replans_the_step_and_trains_exactly(tmp_path):
    """Rank 1 raises torch.OutOfMemoryError once in an SP-1 item of step 2: every rank discards the step,
    re-plans it with less memory and runs it again; the weights equal plain data-parallel training."""
    from _dcp_helpers import max_rel_err, reference_run

    code, _ = _run("oom", str(tmp_path))
    assert code == 0, open(tmp_path / "output.txt").read()[-3000:]
    for r in range(2):
        record = torch.load(tmp_path / f"record_rank{r}.pt")
        assert record == {"oom_replans": 1, "logged": 1.0}, record
    plans = torch.load(tmp_path / "log_rank0.pt")["plans"]
    assert len(plans) == 5 and all(len(p["items"]) > 0 for p in plans)
    _, ref_weights = reference_run(plans, 5)
    for r in range(2):
        weights = torch.load(tmp_path / f"weights5_rank{r}.pt")
        for name, w in weights.items():
            assert max_rel_err(w, ref_weights[name]) < 1e-5, (r, name)
    out = open(tmp_path / "output.txt").read()
    assert "step 2 of epoch 0: item " in out and "ran out of memory; re-planning the step with less memory" in out


def test_lowered_memory_replans_a_failed_item_smaller():
    from lightning_dcp.planning.lowered import LoweredMemory, lowered_limit
    from lightning_dcp.planning.planner import Planner

    base = DefaultCostModel(num_layers=2, num_heads=4, max_tokens=400)
    failed = [{"lengths": [100, 100, 100], "recompute": 0}]
    limit = lowered_limit(base, failed)
    assert limit < base.item_memory([100, 100, 100], 1, 0) and limit < base.memory_limit
    lowered = LoweredMemory(base, limit)
    plan = Planner(1, lowered, policy="dcp", dataset_lengths=[100, 100, 100]).plan_batch([0, 1, 2], [100, 100, 100])
    for item in plan.steps[0].items:
        assert lowered.item_memory(item.lengths, 1, item.recompute) <= limit
    # an SP-2 item (the out-of-memory checkpoint's case) is measured at its own SP size
    sp2 = [{"lengths": [300], "recompute": 0, "ranks": [0, 1]}]
    assert lowered_limit(base, sp2) == pytest.approx(min(base.memory_limit, base.item_memory([300], 2, 0)) * 0.95)


def test_world_size_three_trains_exactly_with_sp2_on_the_aligned_block(tmp_path):
    from _dcp_helpers import max_rel_err, reference_run

    code, _ = _run("world3", str(tmp_path), timeout=150)
    assert code == 0, open(tmp_path / "output.txt").read()[-3000:]
    plans = torch.load(tmp_path / "log_rank0.pt")["plans"]
    ranks = [sorted({tuple(it["ranks"]) for it in p["items"]}) for p in plans]
    assert all((0, 1) in r for r in ranks) and any((2,) in r for r in ranks), ranks
    ref_grads, ref_weights = reference_run(plans, 4)
    for r in range(3):
        grads = torch.load(tmp_path / f"grads0_rank{r}.pt")
        weights = torch.load(tmp_path / f"weights4_rank{r}.pt")
        for name in ref_weights:
            assert max_rel_err(weights[name], ref_weights[name]) < 1e-5, (r, name)
        for name, g in grads.items():
            assert max_rel_err(g, ref_grads[name]) < 1e-5, (r, name)


def test_out_of_memory_at_sp2_stops_with_a_checkpoint_that_resumes_exactly(tmp_path):
    """A partner may wait inside the SP group's collective: no retry in process. The failing rank writes the
    state before the step; the next launch resumes from it, re-plans that step and ends with the weights of
    plain data-parallel training (no sample skipped or trained twice)."""
    from _dcp_helpers import max_rel_err, reference_run

    code, _ = _run("oom_sp2", str(tmp_path))
    assert code != 0
    msg = open(tmp_path / "error_rank1.txt").read()
    assert msg.startswith("StepOutOfMemoryError: step 1 of epoch 0: item 0 (samples [") and "SP 2" in msg
    ckpt = tmp_path / "dcp_oom" / "epoch=0-step=1-rank=1.ckpt"
    assert "cannot be retried in process" in msg and f"saved in {ckpt}" in msg, msg
    assert torch.load(ckpt, weights_only=False)["dcp_oom"]["step"] == 1
    first = torch.load(tmp_path / "log_rank0.pt")["plans"]
    assert len(first) == 1  # step 0 ran; step 1 failed

    code, _ = _run("oom_sp2_resume", str(tmp_path))
    assert code == 0, open(tmp_path / "output.txt").read()[-3000:]
    resumed = torch.load(tmp_path / "resumed" / "log_rank0.pt")["plans"]
    out = open(tmp_path / "output.txt").read()
    assert len(resumed) == 3 and "resuming after an out-of-memory error in step 1 of epoch 0" in out, out[-3000:]
    failed_plan = torch.load(tmp_path / "failed_plan.pt")
    assert resumed[0]["items"] != failed_plan["items"], "the resumed step was not re-planned"
    assert sorted(s for it in resumed[0]["items"] for s in it["samples"]) == sorted(
        s for it in failed_plan["items"] for s in it["samples"])  # the same samples
    _, ref_weights = reference_run(first + resumed, 4)
    for r in range(2):
        weights = torch.load(tmp_path / "resumed" / f"weights4_rank{r}.pt")
        for name, w in weights.items():
            assert max_rel_err(w, ref_weights[name]) < 1e-5, (r, name)


def test_out_of_memory_at_sp2_without_a_checkpoint_names_why():
    from lightning_dcp.runtime.oom import sp_oom_message

    msg = sp_oom_message("step 3 of epoch 0", "item 2", 1, 300.0, no_checkpoint="DCPStrategy(oom_checkpoint=False)")
    assert "No checkpoint was written (DCPStrategy(oom_checkpoint=False))" in msg and "resume" in msg
    msg = sp_oom_message("step 3 of epoch 0", "item 2", 1, 300.0, checkpoint="/x.ckpt", memory_limit=2**30)
    assert "ckpt_path='/x.ckpt'" in msg and "lowered to 1.00 GiB" in msg
