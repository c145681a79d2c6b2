"""The peer policies follow their sources' rules on small hand-made inputs (one test per rule)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from _fakes import FakeCostModel
from lightning_dcp.planning.item_pricing import item_memory_of
from lightning_dcp.planning.parallel_costs import Scheme
from lightning_dcp.planning.checks import validate_plan
from lightning_dcp.planning.planner import POLICIES, Planner
from lightning_dcp.planning.view import CostView
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.peers.base import Axis, TunedPolicy, aligned_starts, geometric
from lightning_dcp.planning.peers.flexsp_milp import Bucket, bucketize, chunk_sorted, greedy, objective, solve, sp_options
from lightning_dcp.planning.peers.megatron import gpus_needed, make_buckets_equal, total_workload
from lightning_dcp.planning.peers.verl import balanced_partitions, dp_order, karmarkar_karp, order_micro_batches, workload
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.planning.step_time import step_time

CM = FakeCostModel()
PEERS = ["verl", "megatron-hcp", "hydraulis", "flexsp"]


# ---------------------------------------------------------------- the tuned-policy base

def test_geometric_grid_holds_both_ends_at_the_ratio():
    g = geometric(1000, 2000, 0.04)
    assert g[0] == 1000 and g[-1] == 2000 and g == sorted(set(g))
    assert max(b / a for a, b in zip(g, g[1:])) <= 1.04 + 1e-3
    assert geometric(5, 5, 0.01) == [5] and geometric(7, 3, 0.01) == [7]


class _Toy(TunedPolicy):
    """A peer whose step time is set by its knob: fastest at knob 40, failing above 90."""

    name = "toy"
    peer = "toy"

    def axes(self, batches):
        return [Axis("a", 10, 100), Axis("b", 10, 100)]

    def setting_of(self, choice, knob):
        return (choice, knob)

    def plan_with(self, setting, samples, lengths):
        choice, knob = setting
        if knob > 90:
            raise PlanningError("toy: knob over 90")
        rec = min(abs(knob - 40), CM.num_layers)
        return [StepPlan((WorkItem((0,), tuple(samples), tuple(lengths), rec),))]


def test_tuning_keeps_the_fastest_setting_first_on_ties_and_skips_failures():
    pol = _Toy(1, CostView(CM, 1))
    pol.prepare([[100, 200]])
    assert pol.setting == ("a", 40)  # "b" ties with it and comes later; the fine passes found the exact optimum
    assert any(t.failure for t in pol.trials) and all(t.setting[1] > 90 for t in pol.trials if t.failure)
    pol.prepare([[100, 200]])  # the same batches: tuned once
    assert pol.setting == ("a", 40)


def test_tuning_fails_naming_the_rule_when_no_setting_runs():
    pol = _Toy(1, CostView(CM, 1))
    pol.axes = lambda batches: [Axis("a", 95, 99)]
    with pytest.raises(PlanningError, match="none of the .* settings .* knob over 90"):
        pol.prepare([[100]])


def test_aligned_starts_places_largest_first_on_aligned_blocks():
    assert aligned_starts([1, 4, 2, 1], 8) == [6, 0, 4, 7]
    assert aligned_starts([4, 4, 1], 8) is None
    assert aligned_starts([2, 2, 2], 6) == [0, 2, 4]  # blocks [0-3], [4-5]


# ---------------------------------------------------------------- verl

def test_verl_karmarkar_karp_gives_the_sources_parts():
    # verl 0.9.1 seqlen_balancing.karmarkar_karp on these inputs (run once, pinned): same parts, same order
    vals = [8, 7, 6, 5, 4, 3, 2, 1, 9]
    assert karmarkar_karp(vals, 3, equal_size=False) == [[6, 0, 2], [7, 8, 3], [5, 1, 4]]
    assert karmarkar_karp(vals, 3, equal_size=True) == [[5, 0, 3], [6, 1, 2], [7, 8, 4]]
    assert balanced_partitions([5, 5, 5, 5, 1, 1], 3, equal_size=True) == [[0, 1], [2, 5], [3, 4]]
    with pytest.raises(PlanningError, match="equal count"):
        karmarkar_karp(vals[:8], 3, equal_size=True)
    with pytest.raises(PlanningError, match="at least one"):
        balanced_partitions([1, 2], 3, equal_size=False)


def test_verl_workload_and_orders_are_the_sources():
    assert [workload(n) for n in (100, 3000)] == [2467600, 82728000]  # calculate_workload: 24576 s + s^2
    assert dp_order([0, 1, 2, 3, 4], [5, 1, 4, 2, 3]) == [1, 4, 0, 2, 3]  # _balance_batch: even first, odd reversed
    assert order_micro_batches([[0], [1], [2], [3]], [1, 4, 3, 2]) == [[3], [1], [2], [0]]  # use_dynamic_bsz_balance


def test_verl_sp_sizes_divide_the_heads_and_the_world_with_no_ring():
    cm = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), 32)  # 48 heads, 8 GPUs a node
    pl = Planner(32, cm, "verl")
    assert pl.policy.sp_sizes == [1, 2, 4, 8, 16]  # not 3, 6, 12, 24 (the world), not 32 (the heads)
    assert pl.view.ring_of(16) > 1  # the view would run 16 as ring x Ulysses; verl runs Ulysses 16
    lengths = [150000] * 2 + [4000] * 30
    step = Planner(32, cm, "verl", sp=16, checkpointing=True, max_token_len_per_gpu=20000).plan_batch(
        range(32), lengths).steps[0]
    assert {it.sp_size for it in step.items} == {16} and all(it.ring == 1 for it in step.items)
    # 24 GPUs in nodes of 8: 3, 6 and 12 divide both, but their mesh blocks cross nodes, which the plan contract
    # does not allow a group of at most a node; 24 is three whole nodes
    assert Planner(24, AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), 24),
                   "verl").policy.sp_sizes == [1, 2, 4, 8, 24]
    with pytest.raises(PlanningError, match="divide"):
        Planner(32, cm, "verl", sp=12, dataset_lengths=lengths).plan(lengths)


def test_verl_equal_count_split_fails_when_the_replicas_do_not_divide_the_batch():
    lengths = [3000, 200, 1500, 800, 900, 100, 2500]
    pl = Planner(8, CM, "verl", sp=2, checkpointing=True, max_token_len_per_gpu=3000)
    with pytest.raises(PlanningError, match="multiple of 4"):
        pl.plan_batch(range(7), lengths)
    step = pl.plan_batch(range(8), lengths + [50]).steps[0]
    per_replica = {}
    for it in step.items:
        per_replica.setdefault(it.ranks, []).extend(it.lengths)
    assert sorted(len(v) for v in per_replica.values()) == [2, 2, 2, 2]  # equal_size=True


def test_verl_micro_batches_stay_under_the_budget_with_one_count_for_every_replica():
    lengths = [6000, 300, 200, 5000, 100, 2500, 2400, 900, 800, 50, 4000, 3500, 30, 1200, 700, 60]
    pl = Planner(8, CM, "verl", sp=2, checkpointing=True, max_token_len_per_gpu=3000)
    step = pl.plan_batch(range(len(lengths)), lengths).steps[0]
    groups = {}
    for it in step.items:
        assert it.sp_size == 2 and it.tokens <= 6000 and it.recompute == CM.num_layers  # every layer or none
        groups.setdefault(it.ranks, []).append(it)
    assert len(groups) == 4 and len({len(v) for v in groups.values()}) == 1  # same_micro_num_in_dp
    per_replica = {g: [n for it in v for n in it.lengths] for g, v in groups.items()}
    assert min(len(v) for v in per_replica.values()) >= step.notes.setting["micro_batches"] >= max(
        math.ceil(sum(v) / 6000) for v in per_replica.values())


def test_verl_fails_where_verl_does_instead_of_splitting_or_recomputing_more():
    pl = Planner(2, CM, "verl", sp=2, checkpointing=False, max_token_len_per_gpu=2000)
    with pytest.raises(PlanningError, match="over max_token_len"):  # the assert: it holds the longest
        pl.plan_batch(range(2), [4100, 100])
    with pytest.raises(PlanningError, match="out of memory"):  # a micro-batch over what the group holds: no split
        pl.plan_batch(range(2), [3000, 3000])


def test_verl_takes_one_more_micro_batch_while_one_is_over_the_budget():
    lengths = [2000, 2500, 2500, 100, 2300, 1500]  # KK on workloads into ceil(10900 / 2900) = 4 puts 2000 + 1500 together
    step = Planner(2, CM, "verl", sp=2, checkpointing=True, max_token_len_per_gpu=1450).plan_batch(
        range(6), lengths).steps[0]
    assert step.notes.setting["micro_batches"] == 5 and all(it.tokens <= 2900 for it in step.items)


def test_verl_must_hold_the_datasets_longest_sample():
    cm = FakeCostModel(num_heads=12)  # verl on 8 GPUs: SP 1, 2, 4 (the planner's own sizes go to 6)
    cap = CostView(cm, 8).capacities(4, ring=1)[cm.num_layers]
    pl = Planner(8, cm, "verl", dataset_lengths=[cap + 1] + [100] * 7)
    assert pl.policy.sp_sizes == [1, 2, 4]
    with pytest.raises(PlanningError, match="no Ulysses SP size holds the longest"):
        pl.plan([100] * 8)


# ---------------------------------------------------------------- megatron-hcp

def test_megatron_cp_sizes_are_powers_of_two_from_the_per_rank_capacity():
    assert [gpus_needed(n, 1000) for n in (1, 1000, 1001, 2000, 2001, 7999, 8001)] == [1, 1, 2, 2, 4, 8, 16]
    assert total_workload(4000, 4) == 4000 * 4000 / 4
    seqs = [(0, 3500), (1, 1800), (2, 900), (3, 800), (4, 500)]
    assert len(make_buckets_equal(seqs, 1000)) <= len({4, 2, 1})


def test_megatron_one_sample_per_ring_item_at_least_its_cp_size():
    lengths = [3500, 1800, 900, 900, 500, 400, 300, 200, 100, 50]
    pl = Planner(8, CM, "megatron-hcp", max_seqlen_per_dp_cp_rank=1000, cp_comm_type="p2p", recompute=2)
    p = pl.plan_batch(range(len(lengths)), lengths)
    step = p.steps[0]
    validate_plan(p, lengths, CM, samples=range(len(lengths)))
    for it in step.items:
        assert len(it.samples) == 1 and it.ring == it.sp_size  # p2p: pure ring CP, one sub-sample per micro-batch
        assert it.sp_size >= gpus_needed(it.lengths[0], 1000) and it.sp_size & (it.sp_size - 1) == 0
        assert it.recompute == 2  # Megatron's global recompute setting
    assert list(step.notes.barriers) == sorted(step.notes.barriers)
    bounds = [0] + list(step.notes.barriers) + [len(step.items)]
    for a, b in zip(bounds, bounds[1:]):  # fill_empty_gpus: every round uses all ranks
        assert set().union(*(set(it.ranks) for it in step.items[a:b])) == set(range(8))


def test_megatron_a2a_is_ulysses_and_needs_the_heads_to_divide():
    lengths = [3500, 1800, 900, 900, 500, 400, 300, 200]
    step = Planner(8, CM, "megatron-hcp", max_seqlen_per_dp_cp_rank=1000, cp_comm_type="a2a").plan_batch(
        range(8), lengths).steps[0]
    assert all(it.ring == 1 for it in step.items)
    with pytest.raises(PlanningError, match="divid"):  # CP 8 for 7000 tokens; 12 heads do not split 8 ways
        Planner(8, FakeCostModel(num_heads=12), "megatron-hcp", max_seqlen_per_dp_cp_rank=1000,
                cp_comm_type="a2a").plan_batch(range(2), [7000, 500])
    with pytest.raises(PlanningError, match="a2a"):
        Planner(8, CM, "megatron-hcp", cp_comm_type="a2a+p2p").plan_batch(range(8), lengths)


def test_megatron_recompute_is_the_fewest_layers_that_fit_the_run_and_too_long_fails():
    pl = Planner(8, CM, "megatron-hcp", max_seqlen_per_dp_cp_rank=1000, cp_comm_type="p2p")
    pl.prepare([[3500, 900, 300]])
    pol = pl.policy
    assert pol.setting.recompute == max(pol.holds(3500, 4, "p2p"), pol.holds(900, 1, "p2p"), pol.holds(300, 1, "p2p"))
    with pytest.raises(PlanningError, match="never places it"):  # needs CP 16 on 8 ranks
        pl.plan_batch(range(2), [8001, 10])


def test_megatron_round_closes_on_balance_and_longest_go_first():
    pl = Planner(4, CM, "megatron-hcp", max_seqlen_per_dp_cp_rank=1000, recompute=0)
    rounds = pl.policy.rounds([2000, 2000, 500, 500, 500, 500], 1000)
    first = rounds[0]
    assert first.sizes[0] == 2 and first.samples[0][0][1] == 2000  # the longest opens the first set


def test_megatron_tunes_max_seqlen_on_the_run():
    ds = [100, 2000, 30000, 500, 800, 12000, 300] * 6
    pl = Planner(8, CM, "megatron-hcp", dataset_lengths=ds)
    p = pl.plan(ds, global_batch_tokens=60000)
    validate_plan(p, ds, CM, samples=range(len(ds)))
    st = pl.policy.setting
    assert st.cp_comm_type in ("p2p", "a2a") and len({it.recompute for s in p.steps for it in s.items}) == 1
    assert len(pl.policy.trials) > 20  # the grid, not two guesses


# ---------------------------------------------------------------- flexsp

def _flex_problem(lengths, N=8, cap_per_rank=3000):
    cm = FakeCostModel()
    view = CostView(cm, N)
    cap = lambda s: cap_per_rank * s  # noqa: E731
    t_seq = lambda b, s: max(view.time([b], s, 0) - view.constant(s, 0), 0.0)  # noqa: E731
    const = lambda s: view.constant(s, 0)  # noqa: E731
    return cap, t_seq, const


def test_flexsp_solution_satisfies_its_constraints_and_beats_greedy():
    lengths = [7000] + [500] * 30  # one sequence needs SP 4, the short ones run best alone
    N = 8
    cap, t_seq, const = _flex_problem(lengths, N)
    buckets = [Bucket(n, (i,)) for i, n in enumerate(lengths)]
    sol = solve(N, buckets, [1, 2, 4, 8], cap, t_seq, const, time_limit=20)
    assert sum(sol.sizes) == N and aligned_starts(sol.sizes, N) is not None
    assert sorted(i for g in sol.groups for i in g) == list(range(len(lengths)))
    for s, g in zip(sol.sizes, sol.groups):
        assert g and sum(lengths[i] for i in g) <= cap(s)  # memory; every formed group runs something
    bound_of = dict(enumerate(lengths))
    need = [min(s for s in (1, 2, 4, 8) if cap(s) >= n) for n in lengths]
    base = greedy(N, buckets, sp_options(N, [1, 2, 4, 8], need), need, cap, t_seq, const)
    assert sol.M == pytest.approx(objective(sol.sizes, sol.groups, bound_of, t_seq, const))
    assert sol.M <= base.M + 1e-12
    assert sol.M < base.M and sorted(sol.sizes) == [1, 1, 1, 1, 4]  # heterogeneous groups win here


def test_flexsp_bucketing_is_the_least_padding():
    lengths = [5, 9, 1, 7, 3, 8, 2, 6]
    got = bucketize(lengths, 3)
    pad = sum(b.bound * len(b.members) for b in got) - sum(lengths)
    srt = sorted(lengths)
    best = min(sum(max(srt[a:b]) * (b - a) for a, b in zip((0,) + cut, cut + (8,))) - sum(lengths)
               for cut in itertools.combinations(range(1, 8), 2))
    assert pad == best and sorted(i for b in got for i in b.members) == list(range(8))


def test_flexsp_chunks_are_consecutive_in_sorted_order_with_the_smallest_largest():
    lengths = [10, 1, 7, 3, 8, 2, 6, 5]
    chunks = chunk_sorted(lengths, 3)
    flat = [i for c in chunks for i in c]
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)
    srt = sorted(lengths, reverse=True)
    best = min(max(sum(srt[a:b]) for a, b in zip((0,) + cut, cut + (8,))) for cut in itertools.combinations(range(1, 8), 2))
    assert max(sum(lengths[i] for i in c) for c in chunks) == best


def test_flexsp_group_sizes_are_its_solvers():
    cm = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), 32)  # 48 heads
    pol = Planner(32, cm, "flexsp").policy
    assert pol.sizes == [2, 4, 8, 16]  # get_sp_options skips 1; powers of two the heads divide, Ulysses (no ring)
    assert pol.cap(16, 0) == CostView(cm, 32).capacities(16, ring=1)[0]


def test_flexsp_plan_reforms_groups_per_micro_batch():
    lengths = [30000, 20000, 9000, 5000] + [800] * 30
    pl = Planner(8, CM, "flexsp", recompute=CM.num_layers, time_limit=5)
    p = pl.plan_batch(range(len(lengths)), lengths)
    validate_plan(p, lengths, CM, samples=range(len(lengths)))
    assert len(pl.policy.solve_log) == 1 and pl.policy.solve_log[0] >= 0
    assert p.steps[0].notes.setting["micro_batches"] == len(p.steps[0].notes.setting["solutions"])


# ---------------------------------------------------------------- hydraulis

def test_hydraulis_dispatch_respects_maxlen_and_balances():
    pl = Planner(8, CM, "hydraulis", dataset_lengths=[100, 2000, 30000, 500] * 10)
    pol = pl.policy
    schemes = sorted(pol.table.schemes, key=lambda s: pol.table.max_len(s))
    small, big = schemes[0], schemes[-1]
    pipes = [big] + [small] * 2
    lengths = [pol.table.max_len(small) + 1] + [300] * 40
    groups = pol.dispatch(pipes, lengths, np.random.default_rng(0))
    assert 0 in groups[0]  # only the big scheme holds the long sequence
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(groups[j] for j in (1, 2))  # the short ones spread, not piled on the first pipeline


def test_hydraulis_packing_keeps_micro_batches_within_maxlen():
    pl = Planner(8, CM, "hydraulis", dataset_lengths=[100, 2000, 30000, 500] * 10)
    pol = pl.policy
    s = pol.table.schemes[0]
    budget = pol.table.budget(s)
    lengths = [budget // 3] * 7 + [budget // 10] * 9
    mbs, est = pol.pack(s, lengths)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in mb) <= budget for mb in mbs)
    assert est > 0


def test_hydraulis_two_stage_plan_declares_its_pipelines():
    lengths = [30000, 12000, 5000, 3000] + [700] * 40
    pl = Planner(16, CM, "hydraulis", dataset_lengths=lengths * 3)
    p = pl.plan_batch(range(len(lengths)), lengths)  # proposes its strategies first (its tuning)
    assert pl.policy.strategies and all(sum(s.size * d for s, d in st) <= 16 for st in pl.policy.strategies)
    step = p.steps[0]
    pipes = {p.ranks: p for p in step.notes.pipelines}
    assert pipes and all(it.ranks in pipes for it in step.items)
    for it in step.items:
        assert item_memory_of(CM, it, pipes[it.ranks]) <= CM.memory_limit
    assert step.notes.estimated_time == pytest.approx(step_time(step, CM, 16).span, rel=1e-6)
    assert POLICIES["hydraulis"].runtime_refusal and POLICIES["flexsp"].runtime_refusal
    assert all(POLICIES[name].runtime_refusal is None for name in ("dcp", "verl", "bucket"))
    assert "barrier" in POLICIES["megatron-hcp"].runtime_refusal  # its rounds end in world barriers


@pytest.mark.parametrize("policy", PEERS)
def test_peers_are_tuned_on_the_dataset_and_cover_every_sample(policy):
    ds = [100, 2000, 30000, 500, 800, 12000, 300] * 6
    pl = Planner(8, CM, policy, dataset_lengths=ds, tune_tokens=60000)
    p = pl.plan(ds, global_batch_tokens=60000)
    validate_plan(p, ds, CM, samples=range(len(ds)))
    assert Scheme(1, 1).size == 1
