"""Simulator sanity: balanced plans idle 0, totals add up, waits follow the item order."""

from __future__ import annotations

import pytest

from _fakes import FakeCostModel
from lightning_dcp.planning.plan import Plan, PlanError, StepPlan, WorkItem
from lightning_dcp.planning.planner import plan
from lightning_dcp.planning.simulator import simulate

CM = FakeCostModel()


def test_perfectly_balanced_plan_has_no_idle_time():
    items = tuple(WorkItem((r,), (r,), (500,), 0) for r in range(4))
    res = simulate(Plan("static", 4, (StepPlan(items),)), CM)
    assert res.imbalance == pytest.approx(0.0)
    t = CM.item_cost([500], 1, 0).total
    assert res.compute_spans == [pytest.approx(t)]
    assert res.step_times == [pytest.approx(t + CM.step_overhead(4))]
    assert res.total_time == pytest.approx(sum(res.step_times))
    assert res.tokens == 2000 and res.tokens_per_s == pytest.approx(2000 / res.total_time)


def test_idle_and_waiting_follow_item_order():
    long, short = WorkItem((0,), (0,), (4000,), 0), WorkItem((1,), (1,), (100,), 0)
    pair = WorkItem((0, 1), (2,), (800,), 0)
    res = simulate(Plan("x", 2, (StepPlan((long, short, pair)),)), CM)
    t_long, t_short, t_pair = (CM.item_cost(i.lengths, i.sp_size, 0).total for i in (long, short, pair))
    span = t_long + t_pair  # rank 1 waits for rank 0 before the pair starts
    assert res.compute_spans[0] == pytest.approx(span)
    idle = (span - t_long - t_pair) + (span - t_short - t_pair)
    assert res.imbalance == pytest.approx(idle / (2 * span))
    starts = {(r, i): s for r, s, e, i, kind in res.timeline[0] if kind == "item"}
    assert starts[(1, 2)] == pytest.approx(t_long)
    assert {kind for *_, kind in res.timeline[0]} == {"item", "allreduce"}


def test_busy_time_and_ideal_bound_add_up():
    lengths = [300, 2000, 9000, 15000, 100, 700] * 4
    p = plan(lengths, 4, CM, "dcp", global_batch_tokens=40000)
    res = simulate(p, CM)
    busy = sum(sum(b) for b in res.busy)
    expected = sum(CM.item_cost(i.lengths, i.sp_size, i.recompute).total * i.sp_size for s in p.steps for i in s.items)
    assert busy == pytest.approx(expected)
    assert res.ideal_time == pytest.approx(sum(CM.item_cost([n], 1, 0).ideal for n in lengths) / 4)
    assert 0 < res.fraction_of_ideal <= 1
    assert res.fraction_of_ideal == pytest.approx(res.ideal_time / res.total_time)
    assert set(res.icc) >= {"idle_fraction", "comm_fraction", "compute_efficiency", "allreduce_fraction"}
    assert 0 <= res.imbalance < 1 and res.icc["idle_fraction"] == res.imbalance


def test_overlapping_groups_run_in_list_order():
    """Items whose rank sets overlap run in list order; the simulator honours the waits."""
    a = WorkItem((0, 1), (0,), (3000,), 0)
    b = WorkItem((2, 3), (1,), (10,), 0)
    c = WorkItem((0, 1, 2, 3), (2,), (10,), 0)
    res = simulate(Plan("x", 4, (StepPlan((a, b, c)),)), CM)
    ta = CM.item_cost([3000], 2, 0).total
    starts = {(r, i): s for r, s, e, i, kind in res.timeline[0] if kind == "item"}
    assert all(starts[(r, 2)] == pytest.approx(ta) for r in range(4))


def test_chart_bars_merge_back_to_back_micro_batches_and_keep_busy_time():
    import numpy as np

    from lightning_dcp.commands.simulate_plot import _run_bars, _runs, steps_note

    r, s, e = _runs(np.array([0, 0, 0, 1]), np.array([2.0, 0.0, 1.0, 0.0]), np.array([3.0, 1.0, 1.5, 1.0]), 1e-9)
    assert (r.tolist(), s.tolist(), e.tolist()) == ([0, 0, 1], [0.0, 2.0, 0.0], [1.5, 3.0, 1.0])
    lengths = [300, 2000, 9000, 15000, 100, 700, 40, 60, 80] * 6
    p = plan(lengths, 4, CM, "static", global_batch_tokens=30000)
    res = simulate(p, CM)
    bars, allreduce, ends = _run_bars(p, res, eps=1e-12)
    assert len(allreduce) == len(p.steps) and ends[-1] == pytest.approx(res.total_time)
    n_items = sum(len(it.ranks) for st in p.steps for it in st.items)
    assert sum(len(v[0]) for k, v in bars.items() if k != "recompute") < n_items  # merged
    for rank in range(4):
        drawn = sum(float(np.sum((v[2] - v[1])[v[0] == rank])) for k, v in bars.items() if k != "recompute")
        assert drawn == pytest.approx(sum(b[rank] for b in res.busy))  # nothing lost, nothing doubled
    row = {"policy": "bucket", "steps": 9, "global_batches": 4}
    assert "9 steps for the samples of 4 global batches" in steps_note(row)
    assert "no gradient accumulation" in steps_note(row)
    assert steps_note({"policy": "dcp", "steps": 4, "global_batches": 4}) is None
