"""Plans with SP sizes of any divisor of the heads and with rings past them: every policy's plans are valid,
use only the rank tuples the planner lists, never run two items on one rank at once, fit memory and are
deterministic; and the issue's cases (28, 12, 24, 40 heads) plan."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _fakes import FakeCostModel
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.plan import Plan
from lightning_dcp.planning.checks import validate_plan
from lightning_dcp.planning.planner import POLICIES, Planner
from lightning_dcp.planning.search.objective import improves, makespan
from lightning_dcp.planning.simulator import simulate

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
H100 = get_hardware("h100")


def _tiny(heads: int, kind: str = "tiny-1d", world: int = 8, tokens: int = 20_000) -> AnalyticCostModel:
    """The tiny CPU model with ``heads`` heads, on nodes of 4, with a memory limit that holds ``tokens`` tokens on
    one rank with every layer recomputed (longer samples need SP)."""
    spec = replace(get_model(kind), num_heads=heads, hidden_size=heads * 16)
    hw = replace(H100, gpus_per_node=4)
    free = AnalyticCostModel(spec, hw, world)
    return AnalyticCostModel(spec, hw, world, memory_limit=free.item_memory([tokens], 1, spec.num_layers))


def check(plan: Plan, planner: Planner, lengths, cm) -> None:
    """Valid (each sample once, legal in-range groups, memory), only listed tuples, one item per rank at a time."""
    validate_plan(plan, lengths, cm, samples=range(len(lengths)))
    tuples = set(planner.rank_tuples(min_size=1))
    for step in plan.steps:
        for item in step.items:
            if planner.policy_name == "verl":  # verl's (dp, sp) device mesh: replica j is ranks [j sp, (j + 1) sp)
                assert item.ranks == tuple(range(item.ranks[0], item.ranks[0] + item.sp_size))
                assert item.ranks[0] % item.sp_size == 0, item
            else:
                assert item.ranks in tuples, item
            if planner.policy_name != "megatron-hcp":  # Megatron's context parallel: pure rings of its own
                assert item.ring in planner.item_rings[item.sp_size]
            if item.ring == 1 or cm.prices_ring:
                assert cm.item_memory(item.lengths, item.sp_size, item.recompute, item.ring) <= cm.memory_limit
    sim = simulate(plan, cm, timeline=True)  # deadlock-free order (the simulator checks it), then no overlaps
    for line in sim.timeline:
        per_rank: dict[int, list[tuple[float, float]]] = {}
        for r, a, b, _, kind in line:
            if kind == "item":
                per_rank.setdefault(r, []).append((a, b))
        for spans in per_rank.values():
            spans.sort()
            assert all(b0 <= a1 + 1e-12 for (_, b0), (a1, _) in zip(spans, spans[1:]))


def lengths_strategy(max_len: int):
    short = st.integers(1, max_len // 20)
    long = st.integers(max_len // 20, max_len)
    return st.lists(st.one_of(short, short, long), min_size=1, max_size=40)


POWER_OF_TWO_PEERS = {"megatron-hcp", "hydraulis", "flexsp"}
"""Peer planners whose sources use power-of-two groups only (pure-ring CP, <TP, PP> pipelines, FlexSP's MILP):
a sample only a group of 3, 7 or 14 ranks holds is beyond them (tests/test_peers.py covers them)."""


@pytest.mark.parametrize("policy", [p for p in POLICIES if p not in POWER_OF_TWO_PEERS])
@SETTINGS
@given(data=st.data(), world=st.sampled_from([3, 5, 6, 7, 12, 16]), heads=st.sampled_from([6, 12, 28]),
       seed=st.integers(0, 2))
def test_every_policy_plans_any_divisor_of_the_heads(policy, data, world, heads, seed):
    cm = FakeCostModel(num_heads=heads, gpus_per_node=4)
    opts = {"grid_scale": 0.25} if policy == "verl" else {}  # validity, not the tuning: a coarse grid
    planner = Planner(world, cm, policy, seed=seed, **opts)
    lengths = data.draw(lengths_strategy(planner.longest_fitting()))
    tokens = world * 8000
    if policy == "verl":  # its equal-count split: one batch of a multiple of the GPUs, as verl's runs have
        lengths, tokens = lengths * world, sum(lengths) * world
    planner = Planner(world, cm, policy, seed=seed, dataset_lengths=lengths, **opts)
    try:
        p1 = planner.plan(lengths, global_batch_tokens=tokens)
    except PlanningError as err:  # verl's sizes divide the heads and the world: fewer than the planner's
        assert policy == "verl" and "no Ulysses SP size holds" in str(err), err
        return
    check(p1, planner, lengths, cm)
    assert p1.to_json() == Planner(world, cm, policy, seed=seed, dataset_lengths=lengths, **opts).plan(
        lengths, global_batch_tokens=tokens).to_json()  # deterministic


@pytest.mark.parametrize("policy", ["dcp", "dcp-intra", "bucket"])
@SETTINGS
@given(data=st.data(), world=st.sampled_from([4, 6, 8]), heads=st.sampled_from([2, 6]))
def test_rings_past_the_heads_plan_validly(policy, data, world, heads):
    cm = _tiny(heads, world=world)
    planner = Planner(world, cm, policy)
    assert max(planner.ring_degrees) > heads or world < 2 * heads  # rings give more ranks than the heads
    lengths = data.draw(lengths_strategy(planner.longest_fitting()))
    planner = Planner(world, cm, policy, dataset_lengths=lengths)
    check(planner.plan(lengths, global_batch_tokens=sum(lengths)), planner, lengths, cm)


def test_a_two_head_model_gets_rings_of_two():
    """The runtime's exactness case: ring at SP 4 on a 2-head model (2 rings of 2-rank Ulysses groups)."""
    cm = _tiny(2, world=4)
    planner = Planner(4, cm, "dcp")
    assert planner.ring_degrees == {1: 1, 2: 1, 4: 2}
    cap = planner.longest_fitting()
    assert cap > Planner(4, cm, "dcp", ring=False).longest_fitting()  # a ring holds what 2 ranks cannot
    assert planner.item_rings[4] == (2, 4)  # per item: the default 2 x 2 and the pure ring (Ulysses 4: 2 heads, no)
    for length in (planner.view.max_len(4, 2), cap):
        plan = planner.plan_batch([0, 1], [length, 100])
        big = next(it for it in plan.steps[0].items if length in it.lengths)
        times = {r: cm.item_time([length], 4, planner.view.min_recompute(length, 4, r), r)
                 for r in (2, 4) if planner.view.min_recompute(length, 4, r) is not None}
        assert big.sp_size == 4 and big.ring == min(times, key=times.get)  # the fastest split that holds it
        assert big.to_dict()["ring"] == big.ring  # the plan's JSON names the ring (v1 readers see an extra field)


def test_llama_7b_with_28_heads_trains_the_long_sample_on_16_gpus():
    """The issue's case: 474,455 tokens fit no SP 4 (the old cap); SP 7 and 14 (and rings) hold it."""
    cm = AnalyticCostModel(replace(get_model("llama-7b"), num_heads=28), H100, 16)
    ulysses = Planner(16, cm, ring=False)
    assert ulysses.ring_degrees == {1: 1, 2: 1, 4: 1, 7: 1, 14: 1}
    assert ulysses.longest_fitting() >= 474_455 > cm.max_length(4)
    planner = Planner(16, cm)
    lengths = [474_455, 120_000, 30_000, 4_000, 2_000] * 2
    plan = planner.plan(lengths, global_batch_tokens=sum(lengths))
    check(plan, planner, lengths, cm)
    assert all(it.sp_size > 4 for s in plan.steps for it in s.items if 474_455 in it.lengths)


@pytest.mark.parametrize("model,heads,world,sizes", [
    ("wan-1.3b", 12, 32, {3, 6, 12}), ("hunyuanvideo-13b", 24, 32, {3, 6, 12, 24}), ("wan-14b", 40, 40, {5, 10, 20, 40}),
])
def test_the_issue_s_models_get_their_non_power_of_two_sizes(model, heads, world, sizes):
    cm = AnalyticCostModel(get_model(model), H100, world)
    assert cm.num_heads == heads
    planner = Planner(world, cm)
    assert sizes <= set(planner.ring_degrees)
    tuples = planner.rank_tuples()
    assert all(t[0] // 8 == t[-1] // 8 for t in tuples if len(t) <= 8)  # inside a node up to a node's GPUs


def test_wan_14b_on_40_gpus_runs_four_groups_of_ten_side_by_side():
    from lightning_dcp.planning.search.layouts import place

    planner = Planner(40, AnalyticCostModel(get_model("wan-14b"), H100, 40))
    groups = place([10, 10, 10, 10], planner.view.topology)
    assert groups == [tuple(range(a, a + 10)) for a in (0, 10, 20, 30)]
    assert place([5] * 5 + [2] * 5 + [1] * 5, planner.view.topology) is not None  # one 5-group per 8-GPU node


def test_one_makespan_objective():
    assert makespan([]) == 0.0 and makespan([1.0, 3.0, 2.0]) == 3.0
    assert improves(1.0, None) and improves(1.0, 2.0) and not improves(2.0, 2.0) and not improves(1.0 + 1e-12, 1.0)
