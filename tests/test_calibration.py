"""Calibration (planning side): measurement rows, the deterministic refit, the calibrated view, speed-aware plans."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _fakes import FakeCostModel
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.calibrated import CalibratedCostModel
from lightning_dcp.planning.calibration import CalibrationConfig, CalibrationFactors, Calibrator, robust_mean, robust_ratio
from lightning_dcp.planning.measurements import (
    NUM_FIELDS, ItemMeasurement, StepTiming, pack_payload, pack_rows, unpack_payload, unpack_rows,
)
from lightning_dcp.planning.distributions import get_distribution
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.plan import Plan, StepPlan, WorkItem
from lightning_dcp.planning.planner import Planner, default_global_batch_tokens
from lightning_dcp.planning.analytic import hsdp_view
from lightning_dcp.planning.sharding.hsdp_cost import ShardGroupCostModel
from lightning_dcp.planning.simulator import simulate
from lightning_dcp.planning.speeds import parse_rank_speeds, rank_speeds_of

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])

W = 8


def synthetic_step(step: int, scale: dict[int, float], speeds: list[float], rnd: random.Random, *,
                   per_rank: int = 3, noise: float = 0.0, factor: float = 1.0, waits: bool = True) -> list[ItemMeasurement]:
    """Every rank's rows of one step: ``per_rank`` SP-1 items each, then one SP-2 item per rank pair.

    Measured = predicted x scale[sp] / (slowest member's speed) x (1 +- noise) x ``factor``. In an SP item
    each member computes ``predicted x scale[2] / its speed`` (x the same noise) and waits in the all-to-alls
    for the slowest member (when ``waits``; else the waits are unmeasured, -1)."""
    out, item = [], 0
    n = len(speeds)
    for r in range(n):
        for _ in range(per_rank):
            pred = rnd.uniform(0.05, 1.0)
            meas = pred * scale[1] / speeds[r] * (1 + rnd.uniform(-noise, noise)) * factor
            out.append(ItemMeasurement(step, item, r, 1, 0, 2, 4096.0, 8.0e6, pred, meas))
            item += 1
    for g in range(0, n - 1, 2):
        pred = rnd.uniform(0.05, 1.0)
        ranks = (g, g + 1)
        pace = min(speeds[r] for r in ranks)
        jitter = (1 + rnd.uniform(-noise, noise)) * factor
        meas = pred * scale[2] / pace * jitter
        for r in ranks:
            wait = meas - pred * scale[2] / speeds[r] * jitter if waits else -1.0
            out.append(ItemMeasurement(step, item, r, 2, 1, 1, 8192.0, 6.7e7, pred, meas, wait))
        item += 1
    return out


def run_calibrator(steps: list[list[ItemMeasurement]], config: CalibrationConfig, world: int = W) -> Calibrator:
    cal = Calibrator(world, config)
    for rows in steps:
        cal.observe(rows)
    return cal


speeds_st = st.lists(st.sampled_from([0.5, 0.7, 0.8, 1.25]), min_size=0, max_size=3).map(
    lambda slow: slow + [1.0] * (W - len(slow)))
scale_st = st.fixed_dictionaries({1: st.floats(0.5, 2.0), 2: st.floats(0.5, 2.0)})


# -- rows --------------------------------------------------------------------------------------
@SETTINGS
@given(st.integers(0, 10**6), st.integers(0, 500), st.integers(0, 1023), st.sampled_from([1, 2, 4, 8]),
       st.integers(0, 80), st.floats(0, 1e12), st.floats(0, 100), st.floats(0, 100), st.floats(-1, 10))
def test_measurement_rows_round_trip(step, item, rank, sp, rec, work, pred, meas, wait):
    m = ItemMeasurement(step, item, rank, sp, rec, 3, 12345.0, work, pred, meas, wait)
    row = m.to_floats()
    assert len(row) == NUM_FIELDS and all(isinstance(v, float) for v in row)
    assert ItemMeasurement.from_floats(row) == m
    flat = pack_rows([m, m], 5)
    assert len(flat) == 5 * NUM_FIELDS
    assert unpack_rows(flat) == [m, m]


def test_row_errors_name_the_fix():
    with pytest.raises(ValueError, match="rows >="):
        pack_rows([ItemMeasurement(0, 0, 0, 1, 0, 1, 1.0, 1.0, 1.0, 1.0)] * 3, 2)
    with pytest.raises(ValueError, match=f"{NUM_FIELDS} floats"):
        ItemMeasurement.from_floats([0.0] * 3)


# -- the refit ---------------------------------------------------------------------------------
@SETTINGS
@given(scale_st, speeds_st, st.integers(0, 2**31), st.integers(0, 2**31))
def test_refit_depends_only_on_the_gathered_set(scale, speeds, seed, perm_seed):
    """Every rank decodes the same gathered rows, in whatever order its all-gather delivered them:
    the factors (and the whole state) are bit-identical."""
    rnd = random.Random(seed)
    steps = [synthetic_step(s, scale, speeds, rnd, noise=0.1) for s in range(6)]
    cfg = CalibrationConfig(every=3)
    ref = run_calibrator(steps, cfg)
    for computing_rank in range(3):
        shuffle = random.Random(perm_seed + computing_rank)
        mine = []
        for rows in steps:
            rows = list(rows)
            shuffle.shuffle(rows)
            mine.append(rows)
        other = run_calibrator(mine, cfg)
        assert other.factors == ref.factors
        assert json.dumps(other.state_dict()) == json.dumps(ref.state_dict())


@SETTINGS
@given(scale_st, speeds_st, st.integers(0, 2**31), st.booleans())
def test_refit_converges_to_the_true_factors(scale, speeds, seed, waits):
    rnd = random.Random(seed)
    steps = [synthetic_step(s, scale, speeds, rnd, waits=waits) for s in range(40)]
    cal = run_calibrator(steps, CalibrationConfig(every=2))
    f = cal.factors
    assert f.scale(1) == pytest.approx(scale[1], rel=1e-4)
    assert f.scale(2) == pytest.approx(scale[2], rel=1e-4)
    got = f.rank_speeds or (1.0,) * W
    assert list(got) == pytest.approx(speeds, rel=1e-4)


@SETTINGS
@given(st.sampled_from([0.5, 2 / 3, 0.8, 1.25]), st.floats(0.5, 2.0), st.integers(0, 2**31))
def test_measured_waits_find_the_slow_member_of_sp_only_plans(slow, scale2, seed):
    """No SP-1 item at all: the members' compute seconds (measured - all-to-all seconds) give the speed ratio."""
    rnd = random.Random(seed)
    steps = []
    for s in range(12):
        rows = synthetic_step(s, {1: 1.0, 2: scale2}, [1.0, slow], rnd, per_rank=0)
        steps.append(rows)
    cal = run_calibrator(steps, CalibrationConfig(every=3, alpha=1.0), world=2)
    got = cal.factors.rank_speeds
    assert got is not None and got[1] / got[0] == pytest.approx(slow, rel=1e-6)
    blind = run_calibrator([[replace_wait(m) for m in rows] for rows in steps], CalibrationConfig(every=3), world=2)
    assert blind.factors.rank_speeds is None  # without waits two members of equal current speed tie: no sample


def replace_wait(m: ItemMeasurement) -> ItemMeasurement:
    vals = m.to_floats()
    vals[-1] = -1.0
    return ItemMeasurement.from_floats(vals)


@SETTINGS
@given(st.floats(0.0, 0.5), st.lists(st.floats(0.01, 1.0), min_size=2, max_size=2), st.integers(0, 2**31))
def test_the_step_overhead_is_the_whole_step_beyond_the_slowest_predicted_rank(overhead, busy, seed):
    """Each rank runs one item measured as predicted; the step (timed one step later) lasts the slowest item plus
    ``overhead``: the refit finds ``overhead``. Step 5's timing comes from one rank only: no sample."""
    rnd = random.Random(seed)
    cal = Calibrator(2, CalibrationConfig(every=4, alpha=1.0))
    previous: list[StepTiming] = []
    for s in range(9):
        took = [b * rnd.uniform(0.9, 1.1) for b in busy]
        rows = [ItemMeasurement(s, r, r, 1, 0, 1, 10.0, 100.0, took[r], took[r]) for r in range(2)]
        flat = pack_payload(previous[0] if previous else None, rows[:1], 1) + pack_payload(
            previous[1] if previous else None, rows[1:], 1)
        got_t, got_rows = unpack_payload(flat, 2)
        assert got_t == previous and got_rows == rows
        cal.observe(got_rows, got_t if s != 6 else got_t[:1])
        previous = [StepTiming(s, r, max(took) + overhead, took[r]) for r in range(2)]
    assert cal.factors.step_overhead_s == pytest.approx(overhead, abs=1e-9)
    assert CalibratedCostModel(FakeCostModel(), cal.factors).step_overhead(2) == pytest.approx(overhead, abs=1e-9)
    other = Calibrator(2)
    other.load_state_dict(json.loads(json.dumps(cal.state_dict())))
    assert other.factors == cal.factors and other.state_dict() == cal.state_dict()
    assert CalibratedCostModel(FakeCostModel()).step_overhead(2) == FakeCostModel().step_overhead(2)


@SETTINGS
@given(scale_st, speeds_st, st.integers(0, 2**31), st.floats(10.0, 1e6), st.integers(0, 3))
def test_one_crazy_step_is_rejected(scale, speeds, seed, crazy, which):
    """A step measured ``crazy`` x too slow (a stall, a checkpoint write) among four barely moves any factor."""
    rows = [synthetic_step(s, scale, speeds, random.Random(seed + s), noise=0.1) for s in range(4)]
    bad = [synthetic_step(s, scale, speeds, random.Random(seed + s), noise=0.1, factor=crazy if s == which else 1.0)
           for s in range(4)]
    cfg = CalibrationConfig(every=4, alpha=1.0, max_change=4.0)
    clean, hit = run_calibrator(rows, cfg).factors, run_calibrator(bad, cfg).factors
    for p in (1, 2):
        assert hit.scale(p) == pytest.approx(clean.scale(p), rel=0.1)
    for a, b in zip(hit.rank_speeds or (1.0,) * W, clean.rank_speeds or (1.0,) * W):
        assert a == pytest.approx(b, rel=0.1)


def test_noise_free_crazy_step_changes_nothing():
    scale, speeds = {1: 1.3, 2: 1.1}, [0.7] + [1.0] * (W - 1)
    rows = [synthetic_step(s, scale, speeds, random.Random(s)) for s in range(3)]
    bad = [synthetic_step(s, scale, speeds, random.Random(s), factor=1000.0 if s == 1 else 1.0) for s in range(3)]
    cfg = CalibrationConfig(every=3, alpha=1.0)
    clean, hit = run_calibrator(rows, cfg).factors, run_calibrator(bad, cfg).factors
    assert dict(hit.time_scale) == pytest.approx(dict(clean.time_scale), rel=1e-12)  # the crazy step is dropped whole
    assert hit.rank_speeds == pytest.approx(clean.rank_speeds, rel=1e-12)
    assert clean.scale(1) == pytest.approx(1.3) and clean.rank_speeds[0] == pytest.approx(0.7)


@SETTINGS
@given(st.floats(1e-3, 1e3), st.floats(1e-3, 1e3))
def test_factors_are_clamped_and_rate_limited(true_scale, first):
    cfg = CalibrationConfig(every=1, alpha=1.0, max_change=2.0)
    cal = Calibrator(W, cfg, factors=CalibrationFactors(((1, min(max(first, 0.25), 4.0)),), 1.0))
    before = cal.factors.scale(1)
    cal.observe(synthetic_step(0, {1: true_scale, 2: true_scale}, [1.0] * W, random.Random(0)))
    after = cal.factors.scale(1)
    assert cfg.low <= after <= cfg.high
    assert before / cfg.max_change * (1 - 1e-12) <= after <= before * cfg.max_change * (1 + 1e-12)


def test_a_slow_ranks_own_reports_make_it_slow():
    """The speeds come from the data: the rank whose rows say it is slow is the one that gets a low speed."""
    speeds = [1.0] * W
    speeds[5] = 0.5
    cal = run_calibrator([synthetic_step(s, {1: 1.0, 2: 1.0}, speeds, random.Random(s)) for s in range(30)],
                         CalibrationConfig(every=3))
    got = cal.factors.rank_speeds
    assert got is not None and got[5] == pytest.approx(0.5, rel=1e-3)
    assert all(v == pytest.approx(1.0) for r, v in enumerate(got) if r != 5)


def test_too_few_samples_leave_factors_alone():
    rows = [ItemMeasurement(0, 0, 0, 1, 0, 1, 1.0, 1.0, 1.0, 3.0)]
    cal = Calibrator(W, CalibrationConfig(every=1, min_samples=3))
    cal.observe(rows)
    assert cal.factors == CalibrationFactors()


def test_off_and_fixed_modes():
    rows = synthetic_step(0, {1: 2.0, 2: 2.0}, [1.0] * W, random.Random(0))
    off = Calibrator(W, CalibrationConfig(every=1), mode="off", factors=CalibrationFactors(((1, 3.0),)))
    assert off.observe(rows) is None and off.factors == CalibrationFactors() and not off.enabled
    fixed_f = CalibrationFactors(((1, 1.5),), 1.2, tuple([0.8] + [1.0] * (W - 1)))
    fixed = Calibrator(W, CalibrationConfig(every=1), mode="fixed", factors=fixed_f)
    for _ in range(3):
        assert fixed.observe(rows) is None
    assert fixed.factors == fixed_f and fixed.window == []
    with pytest.raises(ValueError, match="mode"):
        Calibrator(W, mode="sometimes")


@SETTINGS
@given(scale_st, speeds_st, st.integers(0, 2**31), st.integers(1, 7))
def test_state_dict_round_trip_resumes_identically(scale, speeds, seed, cut):
    rnd = random.Random(seed)
    steps = [synthetic_step(s, scale, speeds, rnd, noise=0.05) for s in range(8)]
    cfg = CalibrationConfig(every=3)
    whole = run_calibrator(steps, cfg)
    first = run_calibrator(steps[:cut], cfg)
    resumed = Calibrator(W)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for rows in steps[cut:]:
        resumed.observe(rows)
    assert resumed.factors == whole.factors and resumed.state_dict() == whole.state_dict()
    with pytest.raises(ValueError, match="world of"):
        Calibrator(W * 2).load_state_dict(first.state_dict())


def test_predicted_vs_measured():
    speeds = [0.5] + [1.0] * (W - 1)
    rows = synthetic_step(0, {1: 1.0, 2: 1.0}, speeds, random.Random(1))
    blind = Calibrator(W, mode="fixed").predict(rows, step=0)
    knows = Calibrator(W, mode="fixed", factors=CalibrationFactors((), 1.0, tuple(speeds))).predict(rows, step=0)
    assert blind.measured_s == pytest.approx(knows.measured_s) and blind.relative_error > 0.2
    assert knows.predicted_s == pytest.approx(knows.measured_s) and abs(knows.relative_error) < 1e-9


@SETTINGS
@given(st.lists(st.tuples(st.floats(0.01, 1.0), st.floats(-0.02, 0.02)), min_size=3, max_size=30),
       st.floats(0.5, 2.0), st.floats(20.0, 1e4), st.integers(0, 2**31))
def test_robust_ratio_predicts_the_total_time_and_drops_a_stall(items, scale, stall, seed):
    """Items measured within 2% of ``scale x predicted``: the robust ratio is total measured / total predicted
    (the scale that predicts the step's total); one stalled item among them is dropped; order does not matter."""
    preds = [p for p, _ in items]
    meas = [scale * p * (1 + u) for p, u in items]
    got = robust_ratio(meas, preds)
    assert got == pytest.approx(sum(meas) / sum(preds), rel=1e-12)
    m2, p2 = meas + [preds[0] * scale * stall], preds + [preds[0]]
    order = list(range(len(p2)))
    random.Random(seed).shuffle(order)
    assert robust_ratio([m2[i] for i in order], [p2[i] for i in order]) == robust_ratio(m2, p2) == got


def test_robust_mean_is_order_free():
    xs = [1.0, 1.1, 0.9, 1e6, 1.05]
    assert robust_mean(xs) == robust_mean(list(reversed(xs))) == pytest.approx(1.0125)


# -- the calibrated view -------------------------------------------------------------------------
def analytic(world: int = W) -> AnalyticCostModel:
    return AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), world)


factors_st = st.builds(lambda a, b, c: CalibrationFactors(((1, a), (2, b)), c),
                       st.floats(0.25, 4.0), st.floats(0.25, 4.0), st.floats(0.25, 4.0))


@SETTINGS
@given(factors_st, st.lists(st.integers(1, 200000), min_size=1, max_size=4), st.sampled_from([1, 2, 4, 8]),
       st.integers(0, 42))
def test_calibration_scales_time_and_never_memory(factors, lengths, sp, rec):
    base = analytic()
    cm = CalibratedCostModel(base, factors)
    assert cm.item_memory(lengths, sp, rec) == base.item_memory(lengths, sp, rec)
    assert cm.max_length(sp, rec) == base.max_length(sp, rec)
    assert cm.item_time(lengths, sp, rec) == pytest.approx(base.item_time(lengths, sp, rec) * factors.scale(sp))
    assert cm.item_cost(lengths, sp, rec).total == pytest.approx(cm.item_time(lengths, sp, rec))
    work = float(sum(n * n for n in lengths))
    assert cm.item_time_sum(sum(lengths), work, len(lengths), sp, rec) == pytest.approx(
        base.item_time_sum(sum(lengths), work, len(lengths), sp, rec) * factors.scale(sp))
    assert cm.item_memory_tokens(sum(lengths), sp, rec) == base.item_memory_tokens(sum(lengths), sp, rec)


@FEW
@given(factors_st, st.sampled_from(["long", "short", "video"]), st.integers(0, 3))
def test_a_refit_never_makes_a_plan_overflow_memory(factors, dist, seed):
    base = analytic()
    d = get_distribution(dist)
    lengths = d.sample(150, seed)
    plan = Planner(W, CalibratedCostModel(base, factors), "dcp", seed=seed, dataset_lengths=lengths).plan(
        lengths, global_batch_tokens=default_global_batch_tokens(W, lengths, base))
    for step in plan.steps:
        for it in step.items:
            assert base.item_memory(list(it.lengths), it.sp_size, it.recompute) <= base.memory_limit


def test_signature_carries_the_factors():
    base = analytic()
    a = CalibratedCostModel(base, CalibrationFactors(((1, 1.2),)))
    b = CalibratedCostModel(base, CalibrationFactors(((1, 1.3),)))
    assert a.signature() != b.signature() and a.signature()["base"] == base.signature()
    assert a.signature() == CalibratedCostModel(base, CalibrationFactors(((1, 1.2),))).signature()


def test_composes_with_the_shard_group_view():
    base = analytic()
    f = CalibrationFactors(((1, 1.5), (2, 1.5)), 1.5, tuple([0.7] * 2 + [1.0] * (W - 2)))
    outer = CalibratedCostModel(hsdp_view(base, 4), f)
    inner_cal = CalibratedCostModel(base.with_sharding({"sharding": "none", "world_size": W, **base.full_state_parts}), f)
    h = hsdp_view(base, 4)
    inner = ShardGroupCostModel(inner_cal, h.mode, h.parts, prices=h.prices)
    for cm in (outer, inner):
        assert cm.sharding == "hsdp" and cm.shard_group_size == 4
        assert cm.item_memory([4096], 2, 3) == h.item_memory([4096], 2, 3)
        assert cm.item_time([4096], 2, 0) > h.item_time([4096], 2, 0)
        assert rank_speeds_of(cm) == f.rank_speeds
        lengths = get_distribution("long").sample(60, 0)
        plan = Planner(W, cm, "dcp", dataset_lengths=lengths).plan(lengths)
        assert simulate(plan, cm).tokens == sum(lengths)
    assert outer.item_time([4096], 2, 0) == pytest.approx(h.item_time([4096], 2, 0) * 1.5)


# -- speed-aware planning ------------------------------------------------------------------------
def _plans_equal(a: Plan, b: Plan) -> bool:
    return json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)


@pytest.mark.parametrize("policy", ["dcp", "dcp-inter", "dcp-intra", "bucket", "packed", "static"])
@pytest.mark.parametrize("world,dist", [(8, "long"), (16, "video"), (12, "short")])
def test_speed_one_plans_exactly_as_without_speeds(policy, world, dist):
    base = analytic(world)
    d = get_distribution(dist)
    lengths = d.sample(200, 1)
    gbt = default_global_batch_tokens(world, lengths, base)
    for seed in (0, 5):
        ref = Planner(world, base, policy, seed=seed, dataset_lengths=lengths).plan(lengths, global_batch_tokens=gbt)
        ones = Planner(world, base, policy, seed=seed, dataset_lengths=lengths, rank_speeds=[1.0] * world).plan(
            lengths, global_batch_tokens=gbt)
        cal = Planner(world, CalibratedCostModel(base), policy, seed=seed, dataset_lengths=lengths).plan(
            lengths, global_batch_tokens=gbt)
        assert _plans_equal(ref, ones) and _plans_equal(ref, cal)
        sim = simulate(ref, base, timeline=False)
        assert simulate(ref, base, timeline=False, rank_speeds=[1.0] * world).step_times == sim.step_times


def test_items_run_at_their_slowest_members_pace():
    cm = FakeCostModel()
    a, b = WorkItem((0,), (0,), (3000,), 0), WorkItem((0, 1), (1,), (2000,), 0)
    plan = Plan("x", 2, (StepPlan((a, b)),))
    ta, tb = cm.item_cost([3000], 1, 0).total, cm.item_cost([2000], 2, 0).total
    res = simulate(plan, cm, rank_speeds=[1.0, 0.5])
    assert res.compute_spans[0] == pytest.approx(ta + tb / 0.5)
    res = simulate(plan, cm, rank_speeds=[0.25, 1.0])
    assert res.compute_spans[0] == pytest.approx(ta / 0.25 + tb / 0.25)


def test_speed_aware_dcp_beats_speed_blind_on_a_slow_node():
    world = 32
    base = analytic(world)
    speeds = parse_rank_speeds("0-7:0.7", world)
    d = get_distribution("long")
    dataset = d.sample(5000, 0)
    gbt = default_global_batch_tokens(world, dataset, base)
    run = d.sample(400, 1)
    rate = {}
    for name, planner_speeds in (("blind", None), ("aware", speeds)):
        plan = Planner(world, base, "dcp", dataset_lengths=dataset, rank_speeds=planner_speeds).plan(
            run, global_batch_tokens=gbt)
        res = simulate(plan, base, timeline=False, rank_speeds=speeds)
        assert res.fraction_of_bound <= 1.0 + 1e-9
        rate[name] = res.tokens_per_s
    assert rate["aware"] > 1.1 * rate["blind"]


def test_rank_speed_syntax():
    assert parse_rank_speeds("0-3:0.7, 2:0.5", 8) == (0.7, 0.7, 0.5, 0.7, 1.0, 1.0, 1.0, 1.0)
    assert parse_rank_speeds("", 2) == (1.0, 1.0)
    for bad, msg in (("0-9:0.7", "outside the world"), ("3", "malformed"), ("1:-2", "positive"), ("a:1", "malformed")):
        with pytest.raises(PlanningError, match=msg):
            parse_rank_speeds(bad, 8)
    with pytest.raises(PlanningError, match="one speed per rank"):
        Planner(8, analytic(), rank_speeds=[1.0] * 4)
