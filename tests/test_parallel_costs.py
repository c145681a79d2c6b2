"""TP/PP costs (planning/parallel_costs.py), item pricing (ring fallback, pipelines) and the simulator's
pipeline bubbles, barriers and planning-time charge."""

from __future__ import annotations

import pytest

from _fakes import FakeCostModel
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.item_pricing import item_cost_of
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.parallel_costs import (Pipeline, Scheme, p2p_time, pipeline_time,
                                                   scheme_capacities, scheme_cost, scheme_memory, schemes_for, tp_comm_time)
from lightning_dcp.planning.plan import Plan, StepNotes, StepPlan, WorkItem
from lightning_dcp.planning.simulator import charge_planning, simulate
from lightning_dcp.planning.step_time import step_time

CM = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), 32)
FAKE = FakeCostModel()


def test_pipeline_time_is_sum_plus_bubble_of_the_slowest():
    assert pipeline_time([1.0, 3.0, 2.0], 1) == pytest.approx(6.0)
    assert pipeline_time([1.0, 3.0, 2.0], 4) == pytest.approx(6.0 + 3 * 3.0)
    assert pipeline_time([], 4) == 0.0


def test_schemes_divide_heads_and_layers():
    got = schemes_for(CM, 8)  # 48 heads, 42 layers: pp must divide 42
    assert Scheme(8, 1) in got and Scheme(4, 2) in got
    assert all(CM.num_heads % s.tp == 0 and CM.num_layers % s.pp == 0 and s.size == 8 for s in got)
    assert Scheme(2, 4) not in got  # 42 % 4 != 0


def test_tp_all_reduces_follow_the_bus_bandwidth_formula():
    hw, m = CM.hardware, CM.model
    T = 8192
    one = 2 * (4 - 1) / 4 * T * m.hidden_size * 2 / hw.allreduce_bw_intra + hw.collective_latency
    assert tp_comm_time(CM, T, 4, 0) == pytest.approx(2 * CM.num_layers * 2 * one)
    assert tp_comm_time(CM, T, 4, 6) == pytest.approx((2 * CM.num_layers + 6) * 2 * one)
    assert tp_comm_time(CM, T, 1, 0) == 0.0
    assert tp_comm_time(CM, T, 16, 0) > 4 * tp_comm_time(CM, T, 8, 0)  # 16 ranks cross nodes


def test_tp_moves_more_than_ulysses_and_p2p_only_with_stages():
    cost = scheme_cost(CM, [16384], Scheme(4, 1), 0)
    sp = CM.item_cost([16384], 4, 0)
    assert cost.compute == pytest.approx(sp.compute) and cost.comm > sp.comm
    assert p2p_time(CM, 16384, Scheme(4, 1)) == 0.0
    intra, inter = p2p_time(CM, 16384, Scheme(2, 2)), p2p_time(CM, 16384, Scheme(8, 2))
    assert intra > 0 and inter > intra / 4  # the 16-rank pipeline's sends cross nodes
    two = scheme_cost(CM, [16384], Scheme(4, 2), 0)
    assert two.compute == pytest.approx(sp.compute / 2)  # each stage runs half the layers
    one = scheme_cost(CM, [16384], Scheme(1, 1), 3)
    assert one.total == pytest.approx(CM.item_cost([16384], 1, 3).total)


def test_scheme_memory_shards_weights_over_tp_and_pp():
    base = scheme_memory(CM, 8192, Scheme(1, 1), 0)
    assert base == pytest.approx(CM.item_memory([8192], 1, 0))
    assert scheme_memory(CM, 8192, Scheme(2, 2), 0) < scheme_memory(CM, 8192, Scheme(2, 1), 0) < base
    caps = scheme_capacities(CM, Scheme(4, 1))
    assert caps == sorted(caps) and caps[0] > CM.max_length(4, 0)  # TP shards the weights, SP does not
    assert scheme_memory(CM, caps[0], Scheme(4, 1), 0) <= CM.memory_limit < scheme_memory(CM, caps[0] + 1, Scheme(4, 1), 0)


def test_pipelines_json_round_trip():
    pipes = (Pipeline(0, Scheme(4, 2)), Pipeline(8, Scheme(1, 1)))
    step = StepPlan((WorkItem((0,), (0,), (10,), 0),), StepNotes(pipelines=pipes))
    assert StepPlan.from_dict(step.to_dict()).notes.pipelines == pipes
    assert StepPlan.from_dict({"items": []}).notes.pipelines == ()


def test_ring_fallback_splits_the_work_and_overlaps_p2p():
    assert CM.prices_ring  # the analytic model prices rings itself (lightning_dcp/planning/ring.py)
    cm = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), 32)
    cm.prices_ring = False  # a model that does not: the fallback prices its rings
    assert not cm.prices_ring
    one = cm.item_cost([65536], 1, 0)
    ring = cm.ring_cost([65536], 8, 0, 8)
    assert ring.ideal == pytest.approx(one.ideal / 8)
    assert ring.comm == 0.0  # intra-node ring steps hide behind the 64k attention
    far = cm.ring_cost([8192], 32, 0, 32)  # inter-node, little attention: exposed
    assert far.comm > 0
    assert item_cost_of(cm, WorkItem(tuple(range(8)), (0,), (65536,), 0, ring=8)) == ring
    with pytest.raises(ValueError, match="pure ring"):
        cm.ring_cost([4096], 8, 0, 2)


class RingCostModel(FakeCostModel):
    """A cost model that prices rings itself (``prices_ring``)."""

    prices_ring = True

    def item_cost(self, lengths, sp, recompute, ring=1):
        base = super().item_cost(lengths, sp, recompute)
        return type(base)(base.compute, base.recompute, base.comm + 0.5 * ring, base.overhead, base.ideal)


def test_ring_interface_is_used_when_the_cost_model_has_it():
    cm = RingCostModel()
    assert cm.prices_ring
    item = WorkItem((0, 1, 2, 3), (0,), (4000,), 0, ring=4)
    assert item_cost_of(cm, item).comm == pytest.approx(FakeCostModel().item_cost([4000], 4, 0).comm + 2.0)


def test_simulator_adds_pipeline_bubbles_and_barriers():
    pipe = Pipeline(0, Scheme(1, 2))
    a, b = WorkItem((0, 1), (0,), (2000,), 0), WorkItem((0, 1), (1,), (500,), 0)
    step = StepPlan((a, b), StepNotes(pipelines=(pipe,)))
    ta, tb = (scheme_cost(FAKE, it.lengths, pipe.scheme, 0).total for it in (a, b))
    res = simulate(Plan("x", 2, (step,)), FAKE)
    assert res.compute_spans[0] == pytest.approx(ta + tb + max(ta, tb))
    assert res.busy[0] == [pytest.approx(ta + tb)] * 2
    assert step_time(step, FAKE, 2).span == pytest.approx(res.compute_spans[0])
    # a barrier after the first item makes rank 1 wait for rank 0
    x, y, z = WorkItem((0,), (0,), (4000,), 0), WorkItem((1,), (1,), (100,), 0), WorkItem((1,), (2,), (100,), 0)
    t = [FAKE.item_cost(i.lengths, 1, 0).total for i in (x, y, z)]
    free = simulate(Plan("x", 2, (StepPlan((x, y, z)),)), FAKE).compute_spans[0]
    held = simulate(Plan("x", 2, (StepPlan((x, y, z), StepNotes(barriers=(2,))),)), FAKE).compute_spans[0]
    assert free == pytest.approx(max(t[0], t[1] + t[2]))
    assert held == pytest.approx(max(t[0], t[1]) + t[2])


def test_planning_time_is_charged_when_not_hidden():
    assert charge_planning([1.0, 1.0, 1.0], None) == [1.0, 1.0, 1.0]
    # step s overlaps the plan of step s + 1; the last one the mean plan
    assert charge_planning([1.0, 1.0, 1.0], [5.0, 0.5, 3.0]) == [1.0, 3.0, pytest.approx(17 / 6)]
    with pytest.raises(ValueError, match="one per step"):
        charge_planning([1.0], [1.0, 2.0])
    items = tuple(WorkItem((r,), (r,), (500,), 0) for r in range(2))
    plan = Plan("x", 2, (StepPlan(items), StepPlan(items)))
    plain = simulate(plan, FAKE)
    slow = simulate(plan, FAKE, planning_times=[0.0, 10.0])
    assert slow.step_times == plain.step_times
    assert slow.charged_step_times == [10.0, 5.0] and slow.total_time == pytest.approx(15.0)
    assert slow.planning_wait == pytest.approx(15.0 - sum(plain.step_times))
    assert slow.tokens_per_s == pytest.approx(plain.tokens / 15.0) and slow.fraction_of_bound < plain.fraction_of_bound
