"""Cheap checks before expensive work (issue #35, item 6): option values when DCPStrategy is built, the train
dataset against the global batch before profiling, and fit-start errors printed once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dcp import DCPStrategy
from lightning_dcp.runtime.preflight import FIT_START_MARK, check_train_data, fit_start
from lightning_dcp.runtime.settings import DCPSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kwargs,match", [
    (dict(policy="dpc"), r"policy must be one of \('dcp', .*got 'dpc' \(did you mean 'dcp'\?\)"),
    (dict(policy="Bucket"), r"got 'Bucket' \(did you mean 'bucket'\?\)"),
    (dict(sharding="zero-2"), r"sharding must be one of \('none', .*got 'zero-2' \(did you mean 'zero2'\?\)"),
    (dict(sharding="zero3"), r"got 'zero3' \(ZeRO-3 is 'fsdp'"),
    (dict(loss_reduction="tokens"), r"loss_reduction must be one of \('token', 'sample'\), got 'tokens' \(did you mean 'token'\?\)"),
    (dict(calibration="adaptiv"), r"calibration must be one of .*\(did you mean 'adaptive'\?\)"),
    (dict(support="SP"), r"support must be one of \('safe', 'packed', 'sp'\) \(or None to detect\), got 'SP' \(did you mean 'sp'\?\)"),
    (dict(planner_options={"trails": 4}), r"planner_options has 'trails' \(did you mean 'trials'\?\), which is neither a "
                                          r"Planner argument nor an option of policy 'dcp'"),
    (dict(policy="static", planner_options={"recompte": 1}), r"'recompte' \(did you mean 'recompute'\?\)"),
    (dict(planner_options={"seed": 1}), r"DCPStrategy sets seed itself \(pass DCPStrategy\(seed=...\)\)"),
    (dict(policy="hydraulis"), r"policy 'hydraulis' cannot train: .*train with policy='dcp'"),
    (dict(planner=object()), r"planner must have a plan_batch\(samples, lengths, step=0\) method"),
    (dict(cost_model="h100"), r"cost_model must be a lightning_dcp.planning.cost_model.CostModel .*got str"),
    (dict(shuffle="yes"), r"shuffle must be True or False, got 'yes'"),
    (dict(profile=1), r"profile must be True or False, or None"),
    (dict(seed=1.5), r"seed must be an int"),
    (dict(lengths="lengths"), r"lengths must be a sequence of ints .* got str"),
    (dict(bucket_cap_mb="25"), r"bucket_cap_mb must be a number > 0, got '25'"),
    (dict(sigterm_grace_s=-1), r"sigterm_grace_s must be a number >= 0 or None, got -1"),
    (dict(max_oom_replans=True), r"max_oom_replans must be an int >= 0, got True"),
])
def test_option_values_fail_when_the_strategy_is_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DCPStrategy(**kwargs)


def test_valid_options_pass():
    DCPStrategy(policy="dcp-inter", planner_options={"max_sp_size": 2}, shuffle=False, lengths=[3, 4], profile=None)
    DCPStrategy(policy="static", planner_options={"sp": 1, "recompute": 0}, sigterm_grace_s=None)
    DCPStrategy(planner=type("P", (), {"plan_batch": lambda self, s, n, step=0: []})(), planner_options={"any": 1})


class _Sized(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {}


def test_train_data_is_checked_against_the_global_batch():
    six = DataLoader(_Sized([5] * 6), batch_size=4)
    with pytest.raises(ValueError, match=r"^the train dataset \(_Sized, 6 samples\) gives no full global batch of 32 "
                                         r"samples \(DCPStrategy\(global_batch_size=32\)\), so with drop_last=True an "
                                         r"epoch has no step. Lower the global batch to at most 6 \(DCPStrategy\("
                                         r"global_batch_size=6\)\), train the 6 samples as one smaller step with "
                                         r"DCPStrategy\(drop_last=False\), or add samples$"):
        check_train_data(six, DCPSettings(global_batch_size=32), world_size=8)
    with pytest.raises(ValueError, match=r"global batch of 8 samples \(the DataLoader's batch_size 4 x 2 ranks "
                                         r"\(DCPStrategy's default global batch\)\)"):
        check_train_data(six, DCPSettings(), world_size=2)
    with pytest.raises(ValueError, match=r"\(_Sized, 6 samples, 30 tokens\) gives no full global batch of 31 tokens "
                                         r"\(DCPStrategy\(global_batch_tokens=31\)\).*global_batch_tokens=30\)"):
        check_train_data(six, DCPSettings(global_batch_tokens=31), world_size=2)
    check_train_data(six, DCPSettings(global_batch_size=6), world_size=8)  # one full batch
    check_train_data(six, DCPSettings(global_batch_tokens=30), world_size=2)
    check_train_data(six, DCPSettings(global_batch_size=32, drop_last=False), world_size=8)  # one smaller step
    check_train_data(None, DCPSettings(global_batch_size=32), world_size=8)  # no loader to check: later hooks do


def _raise_from_package() -> None:
    check_train_data(DataLoader(_Sized([5]), batch_size=1), DCPSettings(global_batch_size=2), world_size=1)


@pytest.mark.parametrize("rank", [0, 1])
def test_fit_start_errors_print_once(rank, capsys, monkeypatch):
    # Start from Python's own hook: an earlier test's init_process_group in this process wraps sys.excepthook in
    # torch's "[rankN]: " prefixing one, which a real run installs before fit start (and so under ours).
    from lightning_dcp.runtime import preflight
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(preflight, "_hook_installed", False)
    with pytest.raises(ValueError) as info:
        with fit_start(rank):
            _raise_from_package()
    err = info.value
    assert getattr(err, FIT_START_MARK) == rank
    sys.excepthook(type(err), err, err.__traceback__)
    printed = capsys.readouterr().err
    if rank == 0:
        assert printed == (f"ValueError: {err}\n(a DCPStrategy check at fit start: every rank stopped there; "
                           "no traceback)\n")
    else:
        assert printed == "[rank1]: stopped at fit start by the ValueError rank 0 printed\n"
    with pytest.raises(ValueError) as info:  # a user's own error keeps its traceback
        with fit_start(rank):
            raise ValueError("from user code")
    assert not hasattr(info.value, FIT_START_MARK)


def test_small_dataset_stops_before_profiling_and_prints_once(tmp_path):
    """The README's case in small: 6 samples, global batch 32, profiling on, 2 processes: the error comes at
    strategy setup, before the profiler measures anything, printed once (rank 0), one short line from rank 1."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    runs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fit_start_runs.py")
    proc = subprocess.Popen([sys.executable, runs, "small_dataset", str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("the small-dataset fit hung")
    assert proc.returncode != 0
    assert output.count("gives no full global batch of 32 samples") == 1, output
    assert "ValueError: the train dataset (SyntheticTokenDataset, 6 samples) gives no full global batch" in output
    assert "[rank1]: stopped at fit start by the ValueError rank 0 printed" in output
    assert "Traceback" not in output and "DCP profil" not in output, output
    assert not os.path.exists(tmp_path / "profiles")
