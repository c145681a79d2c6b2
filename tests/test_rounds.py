"""Per-layer sharding (``sharding="hsdp"``) in planning: lockstep rounds of a shard group
(:mod:`lightning_dcp.planning.rounds`), the memory and time of :class:`ShardGroupCostModel`, the planner's
round alignment, the simulator's lockstep span, the CLI, and the large-model presets."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _round_cases import align_rounds, best_sp1_span, sp1_step
from lightning_dcp import cli
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.plan import Plan, PlanError, StepPlan, WorkItem
from lightning_dcp.planning.checks import check_deadlock_free
from lightning_dcp.planning.planner import Planner
from lightning_dcp.planning.rounds import (Lockstep, check_shard_groups, lockstep_rounds, round_ends, round_span,
                                          shard_groups)
from lightning_dcp.planning.analytic import hsdp_view
from lightning_dcp.planning.sharding.hsdp_cost import ShardGroupCostModel
from lightning_dcp.planning.simulator import simulate
from lightning_dcp.planning.cost_model import with_rounds
from lightning_dcp.planning.sharding.registry import state_bytes

H100 = get_hardware("h100")


@st.composite
def steps(draw, max_world=16):
    """A deadlock-free step: items on aligned power-of-two blocks, in a global order."""
    world = draw(st.sampled_from([w for w in (2, 4, 8, 16) if w <= max_world]))
    k = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if d <= world and world % d == 0]))
    n = draw(st.integers(1, 24))
    items, sample = [], 0
    for _ in range(n):
        sp = draw(st.sampled_from([p for p in (1, 2, 4) if p <= k]))
        start = draw(st.integers(0, world // sp - 1)) * sp
        length = draw(st.integers(1, 5000))
        items.append(WorkItem(tuple(range(start, start + sp)), (sample,), (length,), draw(st.integers(0, 3))))
        sample += 1
    return world, k, StepPlan(tuple(items))


def _per_rank(step, world):
    return {r: [id(it) for it in step.items if r in it.ranks] for r in range(world)}


@settings(max_examples=200, deadline=None)
@given(steps())
def test_rounds_keep_order_run_sp_items_together_and_one_item_per_rank(case):
    world, k, step = case
    groups = lockstep_rounds(step, world, k)
    assert [g.ranks for g in groups] == shard_groups(world, k)
    seen = sorted(i for g in groups for rnd in g.rounds for i in rnd)
    assert seen == list(range(len(step.items)))  # every item once
    for g in groups:
        for rnd in g.rounds:
            assert rnd, "a round without an item"
            ranks = [r for i in rnd for r in step.items[i].ranks]
            assert len(ranks) == len(set(ranks)), "a rank runs two items in one round"
            assert set(ranks) <= set(g.ranks)
        per_rank_rounds = {r: [n for n, rnd in enumerate(g.rounds) for i in rnd if r in step.items[i].ranks]
                           for r in g.ranks}
        for r, rounds in per_rank_rounds.items():  # each rank's items keep the plan's order
            items = [i for i in range(len(step.items)) if r in step.items[i].ranks]
            assert rounds == sorted(rounds) and len(rounds) == len(items)
        most = max((len(v) for v in per_rank_rounds.values()), default=0)
        assert g.num_rounds >= most
        assert g.dummies(step) == len(g.ranks) * g.num_rounds - sum(step.items[i].sp_size for rnd in g.rounds
                                                                     for i in rnd)


@st.composite
def spanning_steps(draw):
    """A step whose SP items may span shard groups (contiguous runs of any length at any offset)."""
    world = draw(st.sampled_from([2, 4, 8, 12]))
    k = draw(st.sampled_from([d for d in (1, 2, 3, 4) if world % d == 0 and d < world]))
    items = []
    for sample in range(draw(st.integers(1, 16))):
        sp = draw(st.integers(1, world))
        start = draw(st.integers(0, world - sp))
        items.append(WorkItem(tuple(range(start, start + sp)), (sample,), (draw(st.integers(1, 5000)),), 0))
    return world, k, StepPlan(tuple(items))


@settings(max_examples=300, deadline=None)
@given(spanning_steps())
def test_an_item_across_shard_groups_meets_every_group_in_one_round_and_nothing_waits_in_a_cycle(case):
    world, k, step = case
    groups = lockstep_rounds(step, world, k)
    where: dict[int, set[int]] = {}
    for g, grp in enumerate(groups):
        for n, rnd in enumerate(grp.rounds):
            ranks = [r for i in rnd for r in step.items[i].ranks if r in grp.ranks]
            assert len(ranks) == len(set(ranks)), "a rank runs two items in one round"
            for i in rnd:
                where.setdefault(i, set()).add(n)
                assert set(step.items[i].ranks) & set(grp.ranks)
        assert grp.dummies(step) == len(grp.ranks) * grp.num_rounds - sum(
            len(set(step.items[i].ranks) & set(grp.ranks)) for rnd in grp.rounds for i in rnd)
    assert sorted(where) == list(range(len(step.items)))
    assert all(len(v) == 1 for v in where.values()), "an item in two round indices"
    if any(len({r // k for r in it.ranks}) > 1 for it in step.items):  # one last round for the replicas' all-reduce
        assert len({g.num_rounds for g in groups}) == 1
    for i, item in enumerate(step.items):  # in every group it touches
        assert {g for g, grp in enumerate(groups) for rnd in grp.rounds if i in rnd} == {r // k for r in item.ranks}
    for r in range(world):  # each rank's items keep the plan's order
        mine = [i for i, it in enumerate(step.items) if r in it.ranks]
        assert [min(where[i]) for i in mine] == sorted(min(where[i]) for i in mine)
    # the groups run their rounds in order; a round starts once every group an item of it spans is at that round
    at = [0] * len(groups)
    while any(at[g] < grp.num_rounds for g, grp in enumerate(groups)):
        ready = [g for g, grp in enumerate(groups) if at[g] < grp.num_rounds and all(
            at[h] == at[g] for i in grp.rounds[at[g]] for h in {x // k for x in step.items[i].ranks})]
        assert ready, f"the groups wait on each other at rounds {at}"
        for g in ready:
            at[g] += 1
    times = [float(it.lengths[0]) for it in step.items]
    ends, starts = round_ends(step, groups, times)
    for i, item in enumerate(step.items):
        before = [j for j in range(i) if set(step.items[j].ranks) & set(item.ranks)]
        assert all(starts[i] >= starts[j] + times[j] - 1e-9 for j in before)
    if all(len({r // k for r in it.ranks}) == 1 for it in step.items):  # no item spans: each group on its own
        assert [e[-1] if e else 0.0 for e in ends] == pytest.approx([round_span(g, times) for g in groups])
    assert Lockstep(k, domain=world).span(step, world, times) == pytest.approx(max((e[-1] for e in ends if e),
                                                                                  default=0.0))


def test_rounds_meet_where_an_item_spans_two_shard_groups():
    """Shard groups of 2 on 4 ranks: rank 0 runs a 5 s item, ranks 2-3 a 1 s SP-2 item, then an SP-4 item on every
    rank waits for rank 0 (both groups start it at 5 s), and rank 2's last item follows at 5 + 2 s."""
    step = StepPlan((WorkItem((0,), (0,), (5,), 0), WorkItem((2, 3), (1,), (1,), 0),
                     WorkItem((0, 1, 2, 3), (2,), (2,), 0), WorkItem((2,), (3,), (3,), 0)))
    times = [5.0, 1.0, 2.0, 3.0]
    rounds = Lockstep(2, domain=4)
    assert rounds.starts(step, 4, times) == [0.0, 0.0, 5.0, 7.0]
    assert rounds.span(step, 4, times) == 10.0
    # both groups run three rounds (the last, where the replicas' all-reduce runs, is the same round everywhere)
    assert [rounds.rank_rounds(step, 4, r) for r in range(4)] == [[0, 1, None], [None, 0, None], [0, 1, 2],
                                                                 [0, 1, None]]
    assert rounds.dummy_rounds(step, 4) == 4  # rank 1 in round 0, ranks 0, 1 and 3 in round 2
    assert Lockstep(2, 0.5, domain=4).span(step, 4, times) == 10.0  # group 0's dummy round ends at 7.5
    with pytest.raises(PlanError, match=r"spans two shard groups of 2 ranks"):
        Lockstep(2).span(step, 4, times)
    with pytest.raises(PlanError, match=r"spans two blocks of 2 ranks|must be a multiple"):
        check_shard_groups(step, 4, 2, 3)


@settings(max_examples=200, deadline=None)
@given(steps())
def test_alignment_moves_no_item_to_another_rank_and_stays_deadlock_free(case):
    world, k, step = case
    aligned = align_rounds(step, world, k, lambda it: float(sum(it.lengths)))
    assert sorted(aligned.items, key=lambda it: it.samples) == sorted(step.items, key=lambda it: it.samples)
    check_deadlock_free(aligned, world)
    first_sp1 = [n for n, it in enumerate(aligned.items) if it.sp_size == 1]
    last_sp = [n for n, it in enumerate(aligned.items) if it.sp_size > 1]
    groups_of = [it.ranks[0] // k for it in aligned.items]
    assert groups_of == sorted(groups_of)
    if first_sp1 and last_sp and k == world:
        assert max(last_sp) < min(first_sp1)  # SP items open the rounds


@settings(max_examples=200, deadline=None)
@given(world=st.sampled_from([2, 4, 8]), data=st.data())
def test_alignment_never_lengthens_sp1_rounds(world, data):
    """SP-1 items only: the i-th costliest items of every rank share round i, which no other order beats."""
    costs = {r: data.draw(st.lists(st.integers(1, 1000), max_size=6), label=f"rank {r}") for r in range(world)}
    step = sp1_step(costs, data.draw(st.integers(0, 99)))
    cost = lambda it: float(it.lengths[0])  # noqa: E731
    span = lambda st_: sum(round_span(g, [cost(it) for it in st_.items]) for g in lockstep_rounds(st_, world, world))  # noqa: E731
    aligned = align_rounds(step, world, world, cost)
    assert span(aligned) <= span(step)
    assert span(aligned) == best_sp1_span(costs)


def test_an_item_across_two_shard_groups_is_refused_by_name():
    step = StepPlan((WorkItem((0, 1, 2, 3), (0,), (10,), 0),))
    with pytest.raises(PlanError, match=r"ranks \[0, 1, 2, 3\].*spans two shard groups of 2 ranks.*max_sp_size at 2"):
        check_shard_groups(step, 4, 2)
    with pytest.raises(PlanError, match="must be a positive divisor of the world size"):
        shard_groups(8, 3)


@settings(max_examples=300, deadline=None)
@given(w=st.floats(1, 1e11), g=st.floats(1, 1e11), o=st.floats(1, 1e12), b=st.floats(0, 1e9),
       layer=st.floats(0, 1e9), root=st.floats(0, 1e9), world=st.sampled_from([8, 16, 64, 256]))
def test_hsdp_state_formula(w, g, o, b, layer, root, world):
    parts = {"weights": w, "gradients": g, "optimizer": o, "buffers": b}
    flight = 2 * root + 4 * layer
    by_k = [state_bytes("hsdp", world, shard_group_size=k, layer_bytes=layer, root_bytes=root, **parts)
            for k in (1, 2, 4, 8)]
    assert by_k == sorted(by_k, reverse=True)  # larger shard groups hold less
    zero3 = state_bytes("hsdp", world, layer_bytes=layer, root_bytes=root, **parts)
    assert zero3 == pytest.approx((w + g + o) / world + b + flight)
    assert state_bytes("hsdp", world, at_rest=True, **parts) == pytest.approx((w + g + o) / world + b)
    offload = state_bytes("hsdp", world, shard_group_size=8, layer_bytes=layer, root_bytes=root, offload=True, **parts)
    assert offload == pytest.approx(b + flight) and offload <= by_k[-1]
    # inside the loop ZeRO-3 holds (W+G+O)/N plus the layers in flight, never W+G as zero2/fsdp do
    assert zero3 < state_bytes("fsdp", world, **parts) or g / world + flight >= (w + g) * (1 - 1e-12)


def test_shard_group_view_memory_time_and_sp_cap():
    base = AnalyticCostModel(get_model("wan-14b"), H100, 32, sharding="none")
    cm = hsdp_view(base, 8)
    assert isinstance(cm, ShardGroupCostModel) and cm.shard_group_size == 8 and cm.sharding == "hsdp"
    assert max(base.sp_sizes(32)) == 20 and max(cm.sp_sizes(32)) == 20  # 40 heads: SP 20 spans shard groups
    assert cm.rounds.shard_group_size == 8 and cm.rounds.domain == 32
    inside = with_rounds(cm, cm.rounds.with_domain(8))  # SP groups inside a shard group: the group caps them
    assert max(inside.sp_sizes(32)) == 8 and inside.item_time([20000], 8, 0) == cm.item_time([20000], 8, 0)
    lengths = [20000, 3000]
    assert cm.item_memory(lengths, 2, 0) == pytest.approx(base.item_memory(lengths, 2, 0) - base.state_bytes
                                                          + cm.state_bytes)
    assert cm.item_memory_tokens(23000, 2, 0) == pytest.approx(cm.item_memory(lengths, 2, 0))
    assert cm.item_time(lengths, 2, 1) == pytest.approx(cm.round_time(base.item_time(lengths, 2, 1)))
    assert cm.item_cost(lengths, 2, 1).total == pytest.approx(cm.item_time(lengths, 2, 1))
    assert cm.item_time_sum(23000, base.attention_work(20000) + base.attention_work(3000), 2, 2, 1) == \
        pytest.approx(cm.item_time(lengths, 2, 1))
    assert cm.state_bytes < AnalyticCostModel(get_model("wan-14b"), H100, 32, sharding="zero1").state_bytes
    c = cm.layer_collective_s()
    assert c > 0 and cm.round_time(0.0) == pytest.approx(cm.num_layers * c + c)  # a round of dummies: comm only
    assert cm.round_time(10.0) == pytest.approx(10.0 + c)  # a long round hides all but the first gather
    assert hsdp_view(base, 1).layer_collective_s() == 0.0
    assert hsdp_view(base, 32).layer_collective_s() > c  # across nodes the gathers are slower
    off = hsdp_view(base, 8, offload=True)
    assert off.state_bytes < cm.state_bytes and off.layer_collective_s() > c and off.step_overhead(32) > cm.step_overhead(32)


def test_planned_hsdp_steps_fit_and_pay_for_lockstep():
    base = AnalyticCostModel(get_model("wan-14b"), H100, 16, sharding="none")
    cm = hsdp_view(base, 8)
    lengths = [random.Random(i).choice([2000, 8000, 30000, 75000]) for i in range(40)]
    plan = Planner(16, cm, "dcp").plan(lengths, global_batch_tokens=400_000)
    for step in plan.steps:
        check_shard_groups(step, 16, 8, cm.rounds.domain)
        check_deadlock_free(step, 16)
        assert all(cm.fits(it.lengths, it.sp_size, it.recompute, it.ring) for it in step.items)
    sim = simulate(plan, cm)
    free_running = simulate(plan, base.with_sharding({"sharding": "zero1", "world_size": 16,
                                                      **base.full_state_parts}), check=False)
    assert all(a >= b for a, b in zip(sim.compute_spans, free_running.compute_spans))  # lockstep only adds


@pytest.mark.parametrize("policy", ["verl", "megatron-hcp", "flexsp", "hydraulis"])
def test_peers_under_hsdp_plan_and_price_every_sp_size_they_propose(policy):
    # verl proposed SP 16 over shard groups of 8 and the round check's PlanError ended `simulate --sharding hsdp
    # --policies verl` with a traceback; the peers' SP sizes now stop at the rounds' domain (CostView.max_sp), and
    # an SP group across shard groups is priced with the groups' rounds meeting
    base = AnalyticCostModel(get_model("wan-14b"), H100, 16, sharding="none")
    cm = hsdp_view(base, 8)
    lengths = [5000, 20000, 45000, 30000] * 8  # 16 samples a global batch: verl's equal counts divide them
    planner = Planner(16, cm, policy, dataset_lengths=lengths, tune_tokens=400_000)
    assert planner.view.max_sp == 16
    inside = Planner(16, with_rounds(cm, cm.rounds.with_domain(8)), policy, dataset_lengths=lengths,
                     tune_tokens=400_000)
    assert inside.view.max_sp == 8
    for p in (planner, inside):
        plan = p.plan(lengths, global_batch_tokens=400_000)
        for step in plan.steps:
            check_shard_groups(step, 16, 8, p.cost_model.rounds.domain)
        assert simulate(plan, p.cost_model).total_time > 0


def test_presets_for_models_that_do_not_fit_one_gpu():
    llama = get_model("llama-70b")
    assert llama.params() == pytest.approx(68.98e9, rel=1e-3)  # grouped-query attention: 8 KV heads
    hunyuan = get_model("hunyuanvideo-13b")
    assert hunyuan.params() == pytest.approx(12.97e9, rel=1e-3)
    assert hunyuan.layer_params() < hunyuan.stored_layer_params  # FLOPs use the weights a token passes
    for name, world in (("llama-70b", 64), ("hunyuanvideo-13b", 32)):
        none = AnalyticCostModel(get_model(name), H100, world, sharding="none")
        assert none.state_bytes > H100.memory_bytes  # one replica's states do not fit one GPU
        assert hsdp_view(none, world).state_bytes < H100.usable_memory_bytes


def test_cli_simulates_and_plans_hsdp(tmp_path, capsys):
    assert cli.main(["simulate", "--model", "wan-14b", "--dataset", "wan", "--world-size", "16", "--num-steps", "1",
                     "--policies", "dcp", "--sharding", "hsdp", "--shard-group-size", "auto", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "shard group 8:" in out and "best shard group size:" in out and "sharding hsdp over shard groups of" in out
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([4000, 30000, 12000, 800] * 6))
    plan_file = tmp_path / "plan.json"
    assert cli.main(["plan", "--lengths", str(lengths), "--out", str(plan_file), "--world-size", "8", "--model",
                     "wan-14b", "--sharding", "hsdp", "--shard-group-size", "4", "--no-drop-last"]) == 0
    plan = Plan.from_json(plan_file.read_text())
    for step in plan.steps:
        check_shard_groups(step, 8, 4, 8)
        check_deadlock_free(step, 8)
    assert cli.main(["plan", "--lengths", str(lengths), "--out", str(plan_file), "--world-size", "8",
                     "--shard-group-size", "4"]) != 0
    assert "apply to --sharding hsdp only" in capsys.readouterr().err
