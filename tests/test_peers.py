"""The peer policies follow their sources' rules on small hand-made inputs (one test per rule)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from _fakes import FakeCostModel
from lightning_dcp.planning.item_pricing import item_memory_of
from lightning_dcp.planning.parallel_costs import Scheme
from lightning_dcp.planning.plan import validate_plan
from lightning_dcp.planning.planner import POLICIES, Planner
from lightning_dcp.planning.policies.costs import CostView
from lightning_dcp.planning.peers.flexsp_milp import Bucket, bucketize, chunk_sorted, greedy, objective, solve, sp_options
from lightning_dcp.planning.peers.megatron import gpus_needed, make_buckets_equal, total_workload
from lightning_dcp.planning.peers.base import aligned_starts, karmarkar_karp
from lightning_dcp.planning.peers.verl import order_micro_batches, workload
from lightning_dcp.planning.step_time import step_time

CM = FakeCostModel()
PEERS = ["verl", "megatron-hcp", "hydraulis", "flexsp"]


# ---------------------------------------------------------------- shared parts

def test_karmarkar_karp_balances_and_equal_size_gives_equal_counts():
    vals = [8, 7, 6, 5, 4, 3, 2, 1, 9]
    parts = karmarkar_karp(vals, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(vals)))
    sums = [sum(vals[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= 2  # 45 over 3: the differencing method lands within 2 here
    eq = karmarkar_karp(vals, 3, equal_size=True)
    assert [len(p) for p in eq] == [3, 3, 3]
    with pytest.raises(ValueError, match="divisible"):
        karmarkar_karp(vals[:8], 3, equal_size=True)


def test_aligned_starts_places_largest_first_on_aligned_blocks():
    assert aligned_starts([1, 4, 2, 1], 8) == [6, 0, 4, 7]
    assert aligned_starts([4, 4, 1], 8) is None
    assert aligned_starts([2, 2, 2], 6) == [0, 2, 4]  # blocks [0-3], [4-5]


# ---------------------------------------------------------------- verl

def test_verl_workload_is_the_sources_estimate():
    assert workload(1000) == 24576 * 1000 + 1000 ** 2


def test_verl_micro_batch_counts_equal_across_data_parallel_ranks():
    lengths = [6000, 300, 200, 5000, 100, 2500, 2400, 900, 800, 50, 4000, 3500, 30, 1200, 700, 60]
    pl = Planner(8, CM, "verl", sp=2, checkpointing=True, max_token_len_per_gpu=3000)
    step = pl.plan_batch(range(len(lengths)), lengths).steps[0]
    groups = {}
    for it in step.items:
        assert it.sp_size == 2
        groups.setdefault(it.ranks, []).append(it)
    assert len(groups) == 4  # static SP 2: four replicas
    counts = {g: len(v) for g, v in groups.items()}
    per_replica = {g: [n for it in v for n in it.lengths] for g, v in groups.items()}
    assert {len(v) for v in per_replica.values()} == {4}  # equal_size=True: 16 sequences, 4 each
    need = max(min(len(v), math.ceil(sum(v) / 6000)) for v in per_replica.values())
    assert set(counts.values()) == {need} == {step.notes.setting["micro_batches"]}  # same_micro_num_in_dp


def test_verl_micro_batches_are_kk_balanced_by_workload():
    lengths = [4000, 100, 3900, 200, 150, 120]
    pl = Planner(2, CM, "verl", sp=2, checkpointing=True, max_token_len_per_gpu=2000)
    items = pl.plan_batch(range(6), lengths).steps[0].items
    assert len(items) == 3  # ceil(8470 / 4000)
    w = [sum(workload(n) for n in it.lengths) for it in items]
    assert {4000, 3900} <= {max(it.lengths) for it in items}  # the two long ones apart
    assert max(w) <= workload(4000) + workload(200) + workload(150)
    # heaviest in the middle, lighter ones at both ends (verl's bubble-reducing order)
    assert order_micro_batches([[0], [1], [2], [3]], [1.0, 4.0, 3.0, 2.0]) == [[3], [1], [2], [0]]


# ---------------------------------------------------------------- megatron-hcp

def test_megatron_cp_sizes_are_powers_of_two_from_the_per_rank_capacity():
    assert [gpus_needed(n, 1000) for n in (1, 1000, 1001, 2000, 2001, 7999, 8001)] == [1, 1, 2, 2, 4, 8, 16]
    assert total_workload(4000, 4) == 4000 * 4000 / 4
    seqs = [(0, 3500), (1, 1800), (2, 900), (3, 800), (4, 500)]
    assert len(make_buckets_equal(seqs, 1000)) <= len({4, 2, 1})


def test_megatron_one_sample_per_ring_item_at_least_its_cp_size():
    lengths = [3500, 1800, 900, 900, 500, 400, 300, 200, 100, 50]
    pl = Planner(8, CM, "megatron-hcp", max_seqlen_per_dp_cp_rank=1000, recompute=2)
    step = pl.plan_batch(range(len(lengths)), lengths).steps[0]
    validate_plan(pl.plan_batch(range(len(lengths)), lengths), lengths, CM, samples=range(len(lengths)))
    for it in step.items:
        assert len(it.samples) == 1 and it.ring == it.sp_size  # pure ring CP, one sub-sample per micro-batch
        assert it.sp_size >= gpus_needed(it.lengths[0], 1000) and it.sp_size & (it.sp_size - 1) == 0
        assert it.recompute == 2  # Megatron's global recompute setting
    assert list(step.notes.barriers) == sorted(step.notes.barriers)
    # every round uses all ranks (fill_empty_gpus): between barriers the items' ranks cover the world
    bounds = [0] + list(step.notes.barriers) + [len(step.items)]
    for a, b in zip(bounds, bounds[1:]):
        assert set().union(*(set(it.ranks) for it in step.items[a:b])) == set(range(8))


def test_megatron_round_closes_on_balance_and_longest_go_first():
    pl = Planner(4, CM, "megatron-hcp", max_seqlen_per_dp_cp_rank=1000, recompute=0)
    rounds = pl.policy.rounds([2000, 2000, 500, 500, 500, 500], 1000)
    first = rounds[0]
    assert first.sizes[0] == 2 and first.samples[0][0][1] == 2000  # the longest opens the first set


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
    assert pl.policy.strategies and all(sum(s.size * d for s, d in st) <= 16 for st in pl.policy.strategies)
    p = pl.plan_batch(range(len(lengths)), lengths)
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
