"""Tensor parallelism inside SP items, priced (issue 36, item 1): the formulas of
lightning_dcp.planning.tensor_parallel in the cost models, the planner's TP splits (off by default, heads and
node rules, memory), the plan's optional ``tp`` field, and the runtime's refusal."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _fakes import FakeCostModel
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.bound import step_bound
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.item_pricing import item_cost_of, item_memory_of
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.plan import Plan, PlanError, StepPlan, WorkItem
from lightning_dcp.planning.checks import validate_plan, validate_step
from lightning_dcp.planning.planner import Planner
from lightning_dcp.planning.analytic import hsdp_view
from lightning_dcp.planning.simulator import simulate
from lightning_dcp.planning.tensor_parallel import HEAD_PAIRS

H100 = get_hardware("h100")


def _llama70b(world: int = 8) -> AnalyticCostModel:
    return AnalyticCostModel(get_model("llama-70b"), H100, world, sharding="zero1")


# ------------------------------------------------------------------------------------------------ the prices
@pytest.mark.parametrize("name", ["llama-70b", "transformer-2d", "wan-14b"])
def test_tp_one_is_the_item_itself(name):
    cm = AnalyticCostModel(get_model(name), H100, 16, sharding="zero1")
    lengths = [3000, 9000]
    for sp, ring in ((1, 1), (8, 1), (16, 2) if cm.prices_ring else (8, 1)):
        assert cm.tp_cost(lengths, sp, 3, ring, 1) == cm.ring_cost(lengths, sp, 3, ring)
        assert cm.tp_memory(lengths, sp, 3, ring, 1) == cm.ring_memory(lengths, sp, 3, ring)
        assert cm.tp_time_sum(12000, 9e7, 2, sp, 3, ring, 1) == cm.item_time_sum(12000, 9e7, 2, sp, 3, ring)


def test_pure_tp_pays_its_collectives_and_no_all_to_all():
    """8-way TP on one node: the compute of Ulysses 8, no all-to-all, ``((2 L + r) 2 + 1)`` all-gather +
    reduce-scatter pairs of the micro-batch's activations at the hardware's intra-node prices."""
    cm, T, r = _llama70b(), 4096, 5
    tp, sp = cm.tp_cost([T], 8, r, 1, 8), cm.item_cost([T], 8, r)
    assert (tp.compute, tp.recompute, tp.overhead, tp.ideal) == (sp.compute, sp.recompute, sp.overhead, sp.ideal)
    one = 7 / 8 * T * 8192 * 2 / H100.allreduce_bw_intra + H100.collective_latency
    assert tp.comm == pytest.approx(((2 * 80 + r) * 2 + HEAD_PAIRS) * 2 * one, rel=1e-12)
    assert tp.comm > sp.comm  # TP moves t/2 times Ulysses' bytes per rank: it wins on memory and pulls, not here


def test_tp_beside_ulysses_scales_the_all_to_all():
    """2-way TP x 4 Ulysses positions on 8 ranks: the bytes of the Ulysses all-to-all of 8 at a (3/4)/(7/8) share
    (4 ranks exchange the same bytes per rank; its latencies stay), plus the 2-rank TP pairs on the TP group's
    T / 4 tokens."""
    cm, T, r = _llama70b(), 16384, 3
    got = cm.tp_cost([T], 8, r, 1, 2)
    a2a = cm.item_cost([T], 8, r).comm
    latency = (2 * 80 + r) * 4 * H100.collective_latency  # four all-to-alls per layer and pass
    one = 1 / 2 * (T / 4) * 8192 * 2 / H100.allreduce_bw_intra + H100.collective_latency
    assert got.comm == pytest.approx((a2a - latency) * (3 / 4) / (7 / 8) + latency
                                     + ((2 * 80 + r) * 2 + HEAD_PAIRS) * 2 * one, rel=1e-12)
    assert cm.tp_time_sum(T, float(T) ** 2, 1, 8, r, 1, 2) == pytest.approx(got.total, rel=1e-12)  # fast path
    assert cm.tp_cost([T], 8, r, 1, 2).comm < cm.tp_cost([T], 8, r, 1, 8).comm  # more TP, more bytes


def test_tp_with_a_ring_keeps_the_ring_and_counts_its_subgroup():
    cm = _llama70b(32)
    lengths = [200_000]
    ring, tp = cm.tp_cost(lengths, 32, 40, 4, 8), cm.ring_cost(lengths, 32, 40, 4)
    assert ring.compute == tp.compute and ring.comm > tp.comm - 1e-12  # the same ring steps; pure TP in each subgroup
    assert cm.tp_time_sum(200_000, 4e10, 1, 32, 40, 4, 8) == pytest.approx(ring.total, rel=1e-12)


def test_tp_memory_is_the_sp_groups_plus_one_gathered_block_input():
    cm, T = _llama70b(), 16384
    for sp, ring, t in ((8, 1, 8), (8, 1, 2), (16, 2, 4)):
        u = sp // ring // t
        extra = (t - 1) / t * T / (ring * u) * 8192 * 2
        assert cm.tp_memory([T], sp, 7, ring, t) == pytest.approx(cm.ring_memory([T], sp, 7, ring) + extra, rel=1e-12)


def test_hsdp_tp_pulls_and_holds_a_slice_of_each_layer():
    """Under hsdp a TP rank gathers ``1 / t`` of each layer: its round's collectives and its layers in flight."""
    cm = hsdp_view(AnalyticCostModel(get_model("llama-70b"), H100, 64), 32)
    base, L, K = cm.base, cm.layer_bytes, cm.shard_group_size
    for t in (1, 2, 8):
        assert cm.layer_collective_s(t) == pytest.approx(3 * cm.prices.ring(L / t, K), rel=1e-12)
    T, ring = 8192, 1
    assert cm.tp_memory([T], 8, 0, ring, 8) == pytest.approx(
        base.tp_memory([T], 8, 0, ring, 8) + cm.state_bytes - base.state_bytes - 4 * L * 7 / 8, rel=1e-12)
    short = cm.tp_time_sum(T, float(T) ** 2, 1, 8, 0, 1, 8)
    assert short == pytest.approx(cm.round_time(base.tp_time_sum(T, float(T) ** 2, 1, 8, 0, 1, 8), 8), rel=1e-12)
    assert short < cm.item_time([T], 8, 0) / 4  # a short item's round: the pulls of 1/8 of a layer, not the layer
    item = WorkItem(tuple(range(8)), (0,), (T,), 0, 1, 8)
    assert item_cost_of(cm, item).total == pytest.approx(short, rel=1e-12)
    assert item_memory_of(cm, item) == cm.tp_memory([T], 8, 0, 1, 8)


def test_round_times_are_vectorized_and_equal_the_scalar_ones():
    cm = hsdp_view(AnalyticCostModel(get_model("wan-14b"), H100, 32), 8)
    ts = np.array([0.0, 0.05, 0.3, 4.0])
    for t in (1, 4):
        assert cm.round_time(ts, t).tolist() == [cm.round_time(float(x), t) for x in ts.tolist()]
    tokens, sq, n, r = np.array([2048.0, 60000.0]), np.array([2048.0 ** 2, 6e4 ** 2]), np.array([1.0, 1.0]), np.zeros(2)
    assert cm.tp_time_sum(tokens, sq, n, 8, r, 1, 2).tolist() == \
        [cm.tp_time_sum(float(a), float(b), 1, 8, 0, 1, 2) for a, b in zip(tokens, sq)]


def test_a_model_that_prices_no_tp_says_so():
    cm = FakeCostModel()
    assert not cm.prices_tp
    with pytest.raises(ValueError, match="max_tp_size=1"):
        cm.tp_cost([10], 2, 0, 1, 2)
    with pytest.raises(PlanningError, match=r"max_tp_size=4: the cost model \(FakeCostModel\) prices no tensor"):
        Planner(8, cm, max_tp_size=4)
    with pytest.raises(PlanningError, match="max_tp_size must be a positive integer"):
        Planner(8, _llama70b(), max_tp_size=0)


# ------------------------------------------------------------------------------------------------ the planner
def test_tp_is_off_by_default():
    cm = AnalyticCostModel(get_model("llama-7b"), H100, 16, sharding="zero1")
    planner = Planner(16, cm)
    assert planner.max_tp_size == 1
    assert planner.item_splits == {p: tuple((r, 1) for r in rings) for p, rings in planner.item_rings.items()}


def test_tp_splits_follow_the_heads_and_the_node():
    """28 heads on 8-GPU nodes: TP 2 and 4 divide the node and (with Ulysses) the heads; 8 does not divide 28."""
    cm = AnalyticCostModel(replace(get_model("llama-7b"), num_heads=28), H100, 16)
    planner = Planner(16, cm, max_tp_size=8)
    splits = {t for p in planner.item_splits for _, t in planner.item_splits[p]}
    assert splits == {1, 2, 4}
    for p, got in planner.item_splits.items():
        for ring, t in got:
            assert 28 % (p // ring) == 0 and (p // ring) % t == 0 and 8 % t == 0
    assert all(t == 1 for _, t in planner.item_splits[7])  # 7 ranks: no TP degree divides them
    assert planner.item_splits[14][-1] == (7, 2)  # 14 ranks: a ring of 7 subgroups, each one TP group of 2
    off, on = Planner(16, cm).view.topology.align, planner.view.topology.align
    assert {p: a for p, a in on.items() if p <= 8} == {p: a for p, a in off.items() if p <= 8}  # a node's groups
    assert all(on[p] % 2 == 0 for p in planner.item_splits if p > 8)  # larger ones start where TP groups fit nodes


@st.composite
def tp_cases(draw):
    world = draw(st.sampled_from([4, 8, 12]))
    heads = draw(st.sampled_from([4, 8, 12]))
    max_tp = draw(st.sampled_from([2, 4]))
    hsdp = draw(st.booleans())
    return world, heads, max_tp, hsdp


def _tiny_tp(world: int, heads: int, hsdp: bool):
    """A tiny model on nodes of 4 whose slow inter-node links make hsdp's pulls dear (TP's 1/t pulls can win),
    its memory holding 20,000 tokens on one rank with every layer recomputed."""
    spec = replace(get_model("tiny-1d"), num_heads=heads, hidden_size=heads * 16)
    hw = replace(H100, gpus_per_node=4, allreduce_bw_inter=2e7, a2a_bw_inter=2e7, p2p_bw_inter=2e7)
    free = AnalyticCostModel(spec, hw, world)
    cm = AnalyticCostModel(spec, hw, world, memory_limit=free.item_memory([20_000], 1, spec.num_layers))
    return hsdp_view(cm, world) if hsdp else cm


def _check_tp_plan(plan: Plan, planner: Planner, lengths, cm, max_tp: int) -> None:
    validate_plan(plan, lengths, cm, samples=range(len(lengths)))  # memory and placement, TP items included
    node = cm.gpus_per_node
    for step in plan.steps:
        for it in step.items:
            q = it.sp_size // it.ring
            assert (it.ring, it.tp) in planner.item_splits[it.sp_size]
            assert it.tp <= max_tp and q % it.tp == 0 and node % it.tp == 0
            assert cm.num_heads % q == 0  # t x u divides the heads, as a Ulysses group's size does
            assert item_memory_of(cm, it) <= cm.memory_limit
            for j in range(0, it.sp_size, it.tp):  # every TP group inside one node
                group = it.ranks[j:j + it.tp]
                assert group[0] // node == group[-1] // node, it
        assert simulate(Plan(plan.policy, plan.world_size, (step,)), cm, max_tp_size=max_tp).step_times[0] >= \
            step_bound(step.samples and [n for i in step.items for n in i.lengths], cm, plan.world_size,
                       max_tp_size=max_tp) * (1 - 1e-9)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tp_cases(), data=st.data(), seed=st.integers(0, 2))
def test_tp_items_respect_memory_heads_and_nodes(case, data, seed):
    """Property: every plan with TP splits is valid (each sample once, memory with its TP price, legal groups), its
    TP degrees divide the node, the subgroup and (with the Ulysses positions) the heads, its TP groups stay in a
    node, it is never faster than the step bound that counts TP nor slower than dcp without TP, and it is
    deterministic."""
    world, heads, max_tp, hsdp = case
    cm = _tiny_tp(world, heads, hsdp)
    probe = Planner(world, cm, max_tp_size=max_tp)
    cap = probe.longest_fitting()
    lengths = data.draw(st.lists(st.one_of(st.integers(1, cap // 20), st.integers(1, cap // 20),
                                           st.integers(cap // 20, cap)), min_size=1, max_size=30))
    planner = Planner(world, cm, seed=seed, dataset_lengths=lengths, max_tp_size=max_tp)
    plan = planner.plan(lengths, global_batch_tokens=world * 8000)
    _check_tp_plan(plan, planner, lengths, cm, max_tp)
    again = Planner(world, cm, seed=seed, dataset_lengths=lengths, max_tp_size=max_tp)
    assert again.plan(lengths, global_batch_tokens=world * 8000).to_json() == plan.to_json()
    plain = Planner(world, cm, seed=seed, dataset_lengths=lengths).plan(lengths, global_batch_tokens=world * 8000)
    for on, off in zip(simulate(plan, cm).step_times, simulate(plain, cm).step_times):
        assert on <= off * (1 + 1e-9)  # TP is one more option: each step keeps the faster of the two plans


def test_tp_wins_where_the_pulls_cross_nodes():
    """The property's world with hsdp over both nodes: short samples on SP 1 wait for whole layers over the slow
    links; with TP some items take TP groups, pull less and the step is faster."""
    cm = _tiny_tp(8, 8, hsdp=True)
    lengths = [400, 900, 1500, 2500, 300, 700, 5000, 12000] * 3
    off = Planner(8, cm, dataset_lengths=lengths).plan_batch(list(range(len(lengths))), lengths)
    planner = Planner(8, cm, dataset_lengths=lengths, max_tp_size=4)
    on = planner.plan_batch(list(range(len(lengths))), lengths)
    _check_tp_plan(on, planner, lengths, cm, 4)
    assert any(it.tp > 1 for it in on.steps[0].items)
    assert simulate(on, cm, max_tp_size=4).total_time < simulate(off, cm).total_time


# ------------------------------------------------------------------------------------------------ the plan JSON
def test_the_tp_field_is_optional_and_defaults_to_one():
    old = {"ranks": [0, 1, 2, 3], "samples": [5], "lengths": [100], "recompute": 0}
    item = WorkItem.from_dict(old)
    assert item.tp == 1 and item.to_dict() == old  # plans without the field load and write as before
    tp = WorkItem((0, 1, 2, 3), (5,), (100,), 0, 1, 4)
    assert tp.to_dict()["tp"] == 4 and WorkItem.from_dict(tp.to_dict()) == tp
    assert StepPlan((item,)).digest() == StepPlan((WorkItem((0, 1, 2, 3), (5,), (100,)),)).digest()
    with pytest.raises(PlanError, match="tensor-parallel degree 3 must be >= 1 and divide the Ulysses subgroup of 4"):
        WorkItem((0, 1, 2, 3), (5,), (100,), 0, 1, 3)
    with pytest.raises(PlanError, match="divide the Ulysses subgroup of 2"):
        WorkItem((0, 1, 2, 3), (5,), (100,), 0, 2, 4)


def test_a_tp_group_that_leaves_a_node_is_refused():
    cm = AnalyticCostModel(get_model("llama-7b"), replace(H100, gpus_per_node=4), 16)
    ok = StepPlan((WorkItem(tuple(range(4, 12)), (0,), (4000,), 32, 1, 4),))
    validate_step(ok, 16, cm)
    with pytest.raises(PlanError, match="not a multiple of its tensor-parallel degree 4"):
        validate_step(StepPlan((WorkItem(tuple(range(2, 10)), (0,), (4000,), 32, 1, 4),)), 16, cm)
    with pytest.raises(PlanError, match="does not divide a node's 4 GPUs"):
        validate_step(StepPlan((WorkItem(tuple(range(0, 8)), (0,), (4000,), 32, 1, 8),)), 16, cm)


# ------------------------------------------------------------------------------------------------ the runtime
def test_the_strategy_refuses_tp_and_names_the_option():
    from lightning_dcp import DCPStrategy

    with pytest.raises(ValueError, match=r"planner_options\['max_tp_size'\]=2: DCPStrategy cannot train "
                                         r"tensor-parallel items yet"):
        DCPStrategy(planner_options={"max_tp_size": 2})
    DCPStrategy(planner_options={"max_tp_size": 1})  # the default is fine


def test_a_tp_plan_from_any_planner_stops_before_it_runs():
    from lightning_dcp.runtime.sampler import DCPBatchSampler

    class TPPlanner:
        one_step_per_batch = True

        def prepare(self, batches):
            pass

        def plan_batch(self, samples, lengths, step=0):
            return StepPlan((WorkItem((0, 1), tuple(samples), tuple(lengths), 0, 1, 2),))

    sampler = DCPBatchSampler([10, 20, 30, 40], planner=TPPlanner(), global_batch_size=4, num_replicas=2,
                              plan_ahead=False)
    with pytest.raises(PlanningError, match=r"has tp=2 \(Planner\(max_tp_size=\.\.\.\)\): DCPStrategy cannot train"):
        sampler.step_plan(0, 0)


def test_a_profile_prices_tp_from_its_hidden_size_and_the_hardware():
    """A profiled model prices TP with the profile's ``model.hidden_size`` at the hardware's (or its measured
    all-reduce's) prices, keeping its measured all-to-all (not separable from the fit): TP only adds."""
    from lightning_dcp.planning.profiled import ProfiledCostModel
    from test_cost_model import make_profile

    cm = ProfiledCostModel(make_profile(), hardware="h100")
    assert cm.prices_tp and 4 in cm.measured_sp
    plain, tp = cm.item_cost([4000], 4, 1), cm.tp_cost([4000], 4, 1, 1, 2)
    assert tp.compute == plain.compute and tp.comm > plain.comm
    assert cm.tp_memory([4000], 4, 1, 1, 2) > cm.item_memory([4000], 4, 1)
    profile = make_profile()
    profile["model"].pop("hidden_size", None)
    assert not ProfiledCostModel(profile, hardware="h100").prices_tp  # no width: no TP price
