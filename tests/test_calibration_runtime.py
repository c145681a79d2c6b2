"""Calibration in the run (:mod:`lightning_dcp.runtime.calibration`): measured rows ride on the step-end
gather, every rank refits the same factors, later steps are planned with them -- and nothing about the
gradients changes.

Structural checks only (no timing asserted): the switch happens at a step key no rank has planned
yet; ``"off"`` leaves the planner untouched; a refit never makes a plan that overflows memory; the
factors are equal on all ranks even when one rank is slowed down (``LIGHTNING_DCP_SLOW_RANK``); the
weights equal the single-process reference and the ``"off"`` run; a resumed fit plans with the
refitted model.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _dist import run_distributed
from _dcp_helpers import Dump, TinyLM, make_dataset, make_trainer, max_rel_err, reference_run
from _fakes import FakeCostModel
from lightning_dcp import DCPStrategy
from lightning_dcp.planning.calibrated import CalibratedCostModel
from lightning_dcp.planning.calibration import CalibrationFactors
from lightning_dcp.planning.measurements import ItemMeasurement, StepTiming, pack_payload, pack_rows, unpack_payload
from lightning_dcp.planning.plan import StepPlan
from lightning_dcp.planning.planner import Planner
from lightning_dcp.runtime.calibration import (
    SLOW_RANK_ENV, RunCalibration, VersionedPlanner, build_calibration, parse_slow_rank, step_key,
)
from lightning_dcp.runtime.planner_factory import PlannerFactory
from lightning_dcp.runtime.row import GatheredStep, StepRow
from lightning_dcp.runtime.sampler import DCPBatchSampler
from lightning_dcp.runtime.settings import DCPSettings
from lightning_dcp.runtime.model import SPCap

LENGTHS = [((i * 37) % 400) + 8 for i in range(64)]


def _factory(world: int = 4, **kw) -> PlannerFactory:
    return PlannerFactory(DCPSettings(**kw), world, SPCap(world), 64, "sp")


def _factors(scale: float = 1.5, speeds=(1.0, 0.5, 1.0, 1.0)) -> CalibrationFactors:
    return CalibrationFactors(((1, scale), (2, scale * 1.2)), scale, tuple(speeds))


# ---------------------------------------------------------------------------------------------- settings
def test_settings_validate_the_mode_and_the_period():
    with pytest.raises(ValueError, match="calibration must be one of"):
        DCPSettings(calibration="auto")
    with pytest.raises(ValueError, match="calibrate_every must be an int >= 1"):
        DCPSettings(calibrate_every=0)
    assert DCPSettings().calibration == "adaptive"
    assert DCPSettings(calibration="off").agreement()["calibration"] == "off"  # every rank must agree


def test_slow_rank_hook_parses_and_names_bad_values():
    assert parse_slow_rank(None, 2) is None and parse_slow_rank("", 2) is None
    assert parse_slow_rank("1:1.5", 2) == (1, 1.5)
    for bad in ("2:1.5", "1:0.5", "x", "1-1.5"):
        with pytest.raises(ValueError, match=SLOW_RANK_ENV):
            parse_slow_rank(bad, 2)


# ---------------------------------------------------------------------------------------------- the switch
def test_off_leaves_the_planner_as_is():
    factory = _factory(calibration="off")
    cm = FakeCostModel()
    planner = factory.planner(cm, LENGTHS)
    got, calibration = build_calibration(DCPSettings(calibration="off"), factory, planner, cm, LENGTHS, world_size=4,
                                         rank=0, device=torch.device("cpu"))
    assert got is planner and calibration is None


def test_versioned_planner_switches_at_the_agreed_key_only():
    factory, cm = _factory(), FakeCostModel()
    base = factory.planner(cm, LENGTHS)
    vp = VersionedPlanner(base, lambda f: factory.planner(CalibratedCostModel(cm, f), LENGTHS))
    samples = list(range(32))
    lengths = [LENGTHS[i] for i in samples]
    before = [vp.plan_batch(samples, lengths, step=k).to_dict() for k in (3, 7)]
    assert before == [base.plan_batch(samples, lengths, step=k).to_dict() for k in (3, 7)]  # no version: the base
    vp.install(5, _factors(), now=2)
    assert vp.plan_batch(samples, lengths, step=3).to_dict() == before[0]  # planned before the switch: unchanged
    assert vp.factors_at(4) == CalibrationFactors() and vp.factors_at(5) == _factors()
    calibrated = factory.planner(CalibratedCostModel(cm, _factors()), LENGTHS)
    assert vp.plan_batch(samples, lengths, step=7).to_dict() == calibrated.plan_batch(samples, lengths, step=7).to_dict()
    vp.install(9, _factors(2.0), now=8)
    assert vp.factors_at(8) == _factors() and vp.factors_at(9) == _factors(2.0)
    vp.install(12, _factors(3.0), now=10)  # from step 10 on, the version of key 5 is never used again
    assert [v[0] for v in vp.versions] == [9, 12]


def test_versioned_planner_prepares_every_version_with_the_epochs_batches():
    seen = []

    class Prepared:
        def __init__(self, name):
            self.name = name

        def prepare(self, batches):
            seen.append((self.name, batches))

    vp = VersionedPlanner(Prepared("base"), lambda f: Prepared(f"v{f.step_overhead_s}"))
    vp.install(2, CalibrationFactors(step_overhead_s=1.0), now=0)
    vp.prepare([[3, 4], [5]])
    vp.install(4, CalibrationFactors(step_overhead_s=2.0), now=3)  # built later: prepared at install
    assert seen == [("base", [[3, 4], [5]]), ("v1.0", [[3, 4], [5]]), ("v2.0", [[3, 4], [5]])]


def test_sampler_reports_every_step_key_it_submitted():
    sampler = DCPBatchSampler(LENGTHS, planner=_factory().planner(FakeCostModel(), LENGTHS), global_batch_size=16,
                              num_replicas=4, rank=0, seed=0)
    assert sampler.planned_upto == -1
    it = iter(sampler)
    next(it)
    assert sampler.planned_upto == step_key(0, 1)  # step 0 yielded, step 1 submitted ahead
    sampler.shutdown()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scale=st.floats(0.25, 4.0), speeds=st.lists(st.floats(0.25, 4.0), min_size=4, max_size=4),
       seed=st.integers(0, 50))
def test_a_refit_never_plans_over_the_memory_limit(scale, speeds, seed):
    cm = FakeCostModel(memory_limit=28.0)  # tight: long samples must spread or recompute
    factory = _factory()
    planner = factory.planner(CalibratedCostModel(cm, _factors(scale, speeds)), LENGTHS)
    samples = list(range(seed % 16, seed % 16 + 32))
    for item in planner.plan_batch(samples, [LENGTHS[i] for i in samples], step=seed).steps[0].items:
        assert cm.item_memory(list(item.lengths), len(item.ranks), item.recompute) <= cm.memory_limit


# ---------------------------------------------------------------------------------------------- rows
def test_rows_ride_between_the_step_row_and_the_flags():
    rows = torch.tensor(pack_rows([ItemMeasurement(3, 0, 0, 1, 0, 1, 5.0, 25.0, 0.1, 0.2)], 2), dtype=torch.float64)
    flags = torch.tensor([1.0, 0.0, 1.0])
    row = StepRow(0.5, 2.0, 5, 1, 5, 0.25, 0.0, planned_upto=7)
    table = torch.stack([row.to_tensor(flags, rows), row.to_tensor(flags, rows)])
    g = GatheredStep(table, rows.numel())
    assert g.rows[0] == row and g.column("planned_upto") == [7.0, 7.0]
    assert g.has_grad.tolist() == [2.0, 0.0, 2.0]
    assert g.measurements == rows.tolist() * 2


def _calibration(rank: int, planner=None) -> RunCalibration:
    return RunCalibration("adaptive", world_size=2, rank=rank, cost_model=FakeCostModel(), every=2, planner=planner,
                          device=torch.device("cpu"))


def test_ranks_that_measure_differently_refit_the_same_factors():
    """Each rank's own rows differ (rank 1 is slow); both refit from the same gathered table."""
    class _Step:
        epoch, plan = 0, None

    cals = [_calibration(0), _calibration(1)]
    for k in range(4):
        step = _Step()
        step.index = k
        gathered = []
        for r in range(2):
            ms = [ItemMeasurement(k, 3 * r + i, r, 1, 0, 1, 50.0, 2500.0, 0.1, 0.1 * (1.5 if r else 1.0) * (1 + i / 50))
                  for i in range(3)]
            gathered.extend(pack_payload(None, ms, 3))
        for c in cals:
            c.after_step(gathered, step, planned_upto=k + 1)
    assert cals[0].factors == cals[1].factors and cals[0].calibrator.refits == 2
    speeds = cals[0].factors.rank_speeds
    assert speeds is not None and speeds[1] < speeds[0]  # the slow rank is seen as slower


def test_a_step_timing_rides_with_the_next_step_and_refits_the_overhead():
    """The payload of step k carries step k-1's timing (taken at the end of its optimizer step); every rank
    refits the same measured step overhead from the gathered timings."""
    class _Step:
        epoch, plan = 0, StepPlan(())

    cal = _calibration(0)
    first, second = _Step(), _Step()
    first.index, second.index = 0, 1
    cal.clock.begin()
    timings, rows = unpack_payload(cal.rows(first).tolist(), 1)
    assert timings == [] and rows == []  # nothing finished before the first step
    cal.step_done()
    cal.clock.begin()
    (timing,), _ = unpack_payload(cal.rows(second).tolist(), 1)
    assert (timing.step, timing.rank) == (step_key(0, 0), 0) and timing.step_s >= timing.busy_s >= 0
    cals = [_calibration(0), _calibration(1)]
    for k in range(1, 7):
        step = _Step()
        step.index = k
        gathered = []
        for r in range(2):  # rank 1 is the slowest (its items 1.5x rank 0's); 0.04 s beyond its loop
            busy = 0.2 + 0.1 * r
            ms = [ItemMeasurement(k, 3 * r + i, r, 1, 0, 1, 50.0, 2500.0, 0.1, busy / 3) for i in range(3)]
            gathered.extend(pack_payload(StepTiming(step_key(0, k - 1), r, 0.34, busy), ms, 3))
        for c in cals:
            c.after_step(gathered, step, planned_upto=k + 1)
    assert cals[0].factors == cals[1].factors
    assert cals[0].factors.step_overhead_s == pytest.approx(0.04)
    assert cals[0].last.overhead_s == pytest.approx(0.04)  # the prediction of the step planned with it


# ---------------------------------------------------------------------------------------------- in a fit
CM = FakeCostModel(num_layers=3, num_heads=4, memory_limit=23.0, inp=0.02)  # <= 50 tokens per item: several a step


def _fit(out, world: int, steps: int, mode: str, ckpt=None, **kw):
    strategy = DCPStrategy(cost_model=CM, global_batch_size=16, calibration=mode, calibrate_every=2, seed=1,
                           profile=False, planner_options={"max_sp_size": 2})
    dump = CalibrationDump(str(out), weights_at=(steps,))
    trainer = make_trainer(world, strategy, [dump], max_steps=steps, **kw)
    trainer.fit(TinyLM(), ckpt_path=ckpt)


def _on_and_off(rank, world, on, off, steps):
    """The calibrated fit with rank 1 slowed down, then the ``"off"`` fit, on the same processes (one spawn)."""
    os.environ[SLOW_RANK_ENV] = "1:1.5"  # rank 1's rows differ from rank 0's
    _fit(on, world, steps, "adaptive")
    del os.environ[SLOW_RANK_ENV]
    _fit(off, world, steps, "off")


class CalibrationDump(Dump):
    """:class:`Dump`, plus each rank's calibration state at the end (factors, versions, refits)."""

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        cal = trainer.strategy.calibration
        state = None if cal is None else cal.state_dict()
        torch.save(state, os.path.join(self.out_dir, f"calibration_rank{trainer.global_rank}.pt"))


def test_two_processes_calibrated_weights_equal_off_and_ranks_agree(tmp_path, monkeypatch):
    on, off = tmp_path / "on", tmp_path / "off"
    on.mkdir(), off.mkdir()
    steps = 9
    monkeypatch.delenv(SLOW_RANK_ENV, raising=False)
    run_distributed(_on_and_off, 2, str(on), str(off), steps, timeout=600)
    log_on, log_off = (torch.load(os.path.join(d, "log_rank0.pt")) for d in (on, off))
    states = [torch.load(os.path.join(on, f"calibration_rank{r}.pt")) for r in range(2)]
    assert states[0]["calibrator"]["refits"] >= 3
    assert states[0]["calibrator"]["factors"] == states[1]["calibrator"]["factors"]
    assert states[0]["versions"] == states[1]["versions"] and states[0]["versions"]
    assert torch.load(os.path.join(off, "calibration_rank0.pt")) is None
    assert all(m["calibration"] is not None for m in log_on["metrics"])
    assert all(m["calibration"] is None for m in log_off["metrics"])
    _, ref = reference_run(log_on["plans"], steps, dataset=make_dataset())
    for r in range(2):
        a = torch.load(os.path.join(on, f"weights{steps}_rank{r}.pt"))
        b = torch.load(os.path.join(off, f"weights{steps}_rank{r}.pt"))
        for name in a:
            assert max_rel_err(a[name], b[name]) < 1e-6, name
            assert max_rel_err(a[name], ref[name]) < 1e-5, name


def test_resume_restores_the_refitted_model(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    part = tmp_path / "part"
    part.mkdir()
    ckpt = ModelCheckpoint(dirpath=str(part), every_n_train_steps=4, save_top_k=-1, save_last=False)
    strategy = DCPStrategy(cost_model=CM, global_batch_size=16, calibration="adaptive", calibrate_every=1, seed=1,
                           profile=False)
    make_trainer(1, strategy, [ckpt], max_steps=4, enable_checkpointing=True).fit(TinyLM())
    saved = strategy.calibration.state_dict()
    assert saved["calibrator"]["refits"] == 4 and saved["versions"]
    path = [os.path.join(part, f) for f in os.listdir(part) if f.endswith(".ckpt")]
    assert len(path) == 1
    assert torch.load(path[0], weights_only=False)["dcp_calibration"]["versions"] == saved["versions"]
    seen = {}

    class Peek(Dump):
        def on_train_start(self, trainer, pl_module) -> None:
            cal = trainer.strategy.calibration
            seen["state"] = cal.state_dict()
            last = cal.planner.versions[-1][0]
            seen["factors_at_resume"] = cal.planner.factors_at(last)  # what the steps from there on plan with

    resumed = DCPStrategy(cost_model=CM, global_batch_size=16, calibration="adaptive", calibrate_every=1, seed=1,
                          profile=False)
    make_trainer(1, resumed, [Peek(str(part), weights_at=())], max_steps=5).fit(TinyLM(), ckpt_path=path[0])
    assert seen["state"] == saved
    assert seen["factors_at_resume"] == CalibrationFactors.from_dict(saved["versions"][-1][1])
    assert seen["factors_at_resume"] != CalibrationFactors()  # a real refit (CPU steps are slower than the model)


def test_closing_summary_has_a_calibration_line():
    import types

    from lightning_dcp.commands.console import calibration_summary
    from lightning_dcp.runtime.metrics import CalibrationMetrics

    cal = _calibration(0)
    cal.calibrator.factors = CalibrationFactors((), 1.2, (1.0, 0.66))
    steps = [types.SimpleNamespace(calibration=CalibrationMetrics(1.0, 0.8, 1.1, [1.0, 0.66], 1)) for _ in range(4)]
    line = calibration_summary(types.SimpleNamespace(calibration=cal), steps)
    assert "calibration adaptive" in line and "off by 9.1%" in line and "uncalibrated 27.3%" in line
    assert "[1.00, 0.66]" in line
    assert calibration_summary(types.SimpleNamespace(calibration=None), steps) == ""
    m = CalibrationMetrics(1.0, 0.8, 1.1, [1.0, 0.66], 1).as_log_dict()
    assert m["dcp/rank_speed/1"] == 0.66 and m["dcp/rank_speed_min"] == 0.66 and "dcp/prediction_error" in m
