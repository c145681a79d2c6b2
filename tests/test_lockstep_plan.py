"""The round planner of a shard group (:mod:`lightning_dcp.planning.lockstep`, ``Lockstep.plan_step``):
every sample once, the rounds the runtime and the simulator find in the plan's order are the planned ones, the
planned span is the simulated one, memory holds, and pairing never loses to sorting each rank's queue."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _round_cases import align_rounds, best_sp1_span, sp1_step
from lightning_dcp.planning.cost_model import with_rounds
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.item_pricing import item_cost_of
from lightning_dcp.planning.lockstep import plan_group, plan_lockstep
from lightning_dcp.planning.lockstep.packing import level
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.planning.checks import check_deadlock_free, validate_step
from lightning_dcp.planning.planner import Planner
from lightning_dcp.planning.view import CostView
from lightning_dcp.planning.rounds import Lockstep, lockstep_rounds, round_span, shard_groups
from lightning_dcp.planning.analytic import hsdp_view
from lightning_dcp.planning.simulator import simulate

H100 = get_hardware("h100")


@st.composite
def nested_steps(draw):
    """A step of items on aligned power-of-two blocks inside shard groups (laminar lanes, as dcp's layouts and
    trees make them), sometimes with a block that straddles two aligned halves (not laminar)."""
    world = draw(st.sampled_from([2, 4, 8, 16]))
    k = draw(st.sampled_from([d for d in (2, 4, 8, 16) if d <= world and world % d == 0]))
    items, sample = [], 0
    for _ in range(draw(st.integers(1, 30))):
        sp = draw(st.sampled_from([p for p in (1, 2, 4, 8) if p <= k]))
        if sp > 1 and draw(st.integers(0, 9)) == 0:
            start = draw(st.integers(0, world - sp))  # any run: may cut another lane
            if start // k != (start + sp - 1) // k:
                start = (start // k) * k
        else:
            start = draw(st.integers(0, world // sp - 1)) * sp
        count = draw(st.integers(1, 3))
        lengths = tuple(draw(st.integers(1, 5000)) for _ in range(count))
        items.append(WorkItem(tuple(range(start, start + sp)), tuple(range(sample, sample + count)), lengths,
                              draw(st.integers(0, 3))))
        sample += count
    return world, k, StepPlan(tuple(items))


def _cost(item: WorkItem) -> float:
    return float(sum(n * (1 + n / 4000) for n in item.lengths)) / item.sp_size + 50.0


def _span(step: StepPlan, world: int, k: int, cost=_cost) -> float:
    return max(round_span(g, [cost(it) for it in step.items]) for g in lockstep_rounds(step, world, k))


@settings(max_examples=300, deadline=None)
@given(nested_steps())
def test_paired_rounds_are_the_ones_the_runtime_runs_and_never_lose_to_sorting(case):
    world, k, step = case
    out = plan_lockstep(step, world, k, _cost)
    assert sorted(out.items, key=lambda it: it.samples) == sorted(step.items, key=lambda it: it.samples)
    check_deadlock_free(out, world)
    # the planned rounds, round by round, are what lockstep_rounds finds in the plan's order
    for ranks in shard_groups(world, k):
        mine = [it for it in step.items if it.ranks[0] in ranks]
        if not mine:
            continue
        planned = plan_group(mine, _cost)
        assert planned.ordered_items() == [it for it in out.items if it.ranks[0] in ranks]
        got = lockstep_rounds(StepPlan(tuple(planned.ordered_items())), world, k)[ranks[0] // k]
        assert [len(r) for r in got.rounds] == [len(r) for r in planned.rounds]
        assert planned.span == pytest.approx(round_span(got, [_cost(it) for it in planned.ordered_items()]))
    assert out.notes.estimated_time == pytest.approx(_span(out, world, k))
    assert _span(out, world, k) <= _span(align_rounds(step, world, k, _cost), world, k) * (1 + 1e-9)


@settings(max_examples=200, deadline=None)
@given(world=st.sampled_from([2, 4, 8]), data=st.data())
def test_sp1_items_pair_costliest_with_costliest(world, data):
    """One item per rank and round: the i-th costliest items of every rank share a round (optimal)."""
    costs = {r: data.draw(st.lists(st.integers(1, 1000), max_size=6), label=f"rank {r}") for r in range(world)}
    step = sp1_step(costs, data.draw(st.integers(0, 99)))
    cost = lambda it: float(it.lengths[0])  # noqa: E731
    out = plan_lockstep(step, world, world, cost)
    assert _span(out, world, world, cost) == best_sp1_span(costs)


# -------------------------------------------------------------------------------------- planned with dcp
def _hsdp(model: str, world: int, k: int):
    return hsdp_view(AnalyticCostModel(get_model(model), H100, world, sharding="none"), k)


_MODELS = {(m, w, k): _hsdp(m, w, k) for m, w, k in (("llama-70b", 32, 32), ("wan-14b", 16, 8), ("wan-14b", 16, 4),
                                                      ("llama-7b", 8, 4))}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(_MODELS)), seed=st.integers(0, 10_000), count=st.integers(4, 60))
def test_dcp_rounds_hold_every_sample_once_fit_memory_and_price_exactly(key, seed, count):
    cm = _MODELS[key]
    _, world, k = key
    view = CostView(cm, k, world_size=world)
    rng = random.Random(seed)
    top = min(view.max_len(view.sp_sizes[-1]), 120_000)
    lengths = [rng.choice([rng.randint(1, 4000), rng.randint(1, top)]) for _ in range(count)]
    planner = Planner(world, cm, "dcp", seed=seed)
    plan = planner.plan(lengths, global_batch_size=count)
    assert sorted(plan.samples) == list(range(count))
    sim = simulate(plan, cm)  # checks the plan order is deadlock-free
    for step, span in zip(plan.steps, sim.compute_spans):
        validate_step(step, world, cm)
        assert all(cm.fits(it.lengths, it.sp_size, it.recompute, ring=it.ring) for it in step.items)
        assert cm.dummy_memory() <= cm.memory_limit
        rounds = [cm.rounds.rank_rounds(step, world, r) for r in range(world)]
        for g in shard_groups(world, k):
            assert len({len(rounds[r]) for r in g}) == 1  # every rank of a group runs the same number of rounds
        for it in step.items:  # an SP item sits in the same round on all its ranks
            where = {next(n for n, pos in enumerate(rounds[r]) if pos is not None and
                          step.items_for_rank(r)[pos] is it) for r in it.ranks}
            assert len(where) == 1
        assert step.notes.estimated_time == pytest.approx(span, rel=1e-9)
        if all(len({r // k for r in it.ranks}) == 1 for it in step.items):  # SP inside the shard groups
            ordered = Lockstep(k).plan_step(step, world, lambda it: item_cost_of(cm, it).total)
            assert ordered.notes.estimated_time == pytest.approx(span, rel=1e-9)  # planned again: the same span


def test_round_planning_is_deterministic_and_beats_aligning_on_a_70b_step():
    cm = _MODELS[("llama-70b", 32, 32)]
    rng = random.Random(3)
    lengths = [rng.choice([rng.randint(500, 6000), rng.randint(6000, 60000)]) for _ in range(120)]
    plans = [Planner(32, cm, "dcp", seed=0).plan(lengths, global_batch_size=120) for _ in range(2)]
    assert plans[0].to_dict() == plans[1].to_dict()
    step = plans[0].steps[0]
    time = lambda it: item_cost_of(cm, it).total  # noqa: E731
    aligned = align_rounds(step, 32, 32, time)
    assert _span(step, 32, 32, time) <= _span(aligned, 32, 32, time)


def test_a_policy_that_keeps_its_packing_gets_its_own_items_in_rounds():
    wide = _MODELS[("wan-14b", 16, 4)]
    cm = with_rounds(wide, wide.rounds.with_domain(4))  # SP groups inside the shard groups, as align_rounds wants
    lengths = [random.Random(i).choice([2000, 8000, 30000, 60000]) for i in range(40)]
    planner = Planner(16, cm, "dcp-intra", dataset_lengths=lengths)
    assert planner.policy.plans_rounds is False and Planner(16, cm, "dcp").policy.plans_rounds is True
    samples = list(range(20))
    own = planner.policy.plan_batch(samples, lengths[:20])[0]
    planned = planner.plan_batch(samples, lengths[:20]).steps[0]
    assert sorted(planned.items, key=lambda it: it.samples) == sorted(own.items, key=lambda it: it.samples)
    time = lambda it: item_cost_of(cm, it).total  # noqa: E731
    assert _span(planned, 16, 4, time) <= _span(align_rounds(own, 16, 4, time), 16, 4, time) * (1 + 1e-9)


def test_a_lane_fills_the_round_another_lanes_long_sample_holds_up():
    """Two SP-16 lanes, each with one long sample and short ones: the lane whose long sample is shorter packs short
    samples beside it up to the other's, and the group lasts as long as its busiest lane."""
    cm = _MODELS[("llama-70b", 32, 32)]
    view = CostView(cm, 32, world_size=32)
    rng = random.Random(0)

    def item(ranks, lengths, start):
        return WorkItem(ranks, tuple(range(start, start + len(lengths))), tuple(lengths),
                        view.min_recompute(sum(lengths), len(ranks)), view.ring_of(len(ranks)))

    short = lambda n: [rng.randint(1500, 2500) for _ in range(n)]  # noqa: E731
    a, b = tuple(range(16)), tuple(range(16, 32))
    items = [item(a, [235713], 0), item(a, short(100), 100), item(a, short(100), 300),
             item(b, [200000], 1000), item(b, short(110), 1100), item(b, short(110), 1300)]
    time = lambda it: item_cost_of(cm, it).total  # noqa: E731
    aligned = plan_group(items, time)
    planned = plan_group(items, time, view)
    assert planned.span < aligned.span - 1.0
    tall = planned.rounds[0]
    beside = next(planned.items[x][k] for x, k in tall if planned.lanes[x] == b)
    assert 200000 in beside.lengths and len(beside.samples) > 1
    assert planned.span == pytest.approx(max(sum(t) for t in planned.times), rel=1e-9)
    assert sorted(s for it in (it for items in planned.items for it in items) for s in it.samples) == sorted(s for it in items for s in it.samples)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0, 50)), min_size=1, max_size=8), st.floats(0, 400))
def test_level_spreads_a_total_within_each_rounds_bounds(bounds, total):
    lo = [min(a, b) for a, b in bounds]
    hi = [max(a, b) for a, b in bounds]
    got = level(lo, hi, total)
    assert all(a - 1e-9 <= x <= b + 1e-9 for x, a, b in zip(got, lo, hi))
    if sum(lo) <= total <= sum(hi):
        assert sum(got) == pytest.approx(total, abs=1e-6)
        raised = [x for x, a, b in zip(got, lo, hi) if a < x < b]
        assert max(raised, default=0) - min(raised, default=0) <= 1e-6  # one level for every round it moves


@pytest.mark.parametrize("key", [("wan-14b", 16, 8), ("llama-70b", 32, 32)])
def test_with_uneven_rank_speeds_the_planned_span_is_the_simulated_one(key):
    cm, world = _MODELS[key], key[1]
    rng = random.Random(1)
    speeds = [rng.choice([1.0, 1.0, 0.8]) for _ in range(world)]
    lengths = [rng.choice([rng.randint(1, 4000), rng.randint(1, 80000)]) for _ in range(40)]
    plan = Planner(world, cm, "dcp", seed=1, rank_speeds=speeds).plan(lengths, global_batch_size=40)
    sim = simulate(plan, cm, rank_speeds=speeds)
    assert [st.notes.estimated_time for st in plan.steps] == pytest.approx(sim.compute_spans, rel=1e-9)
