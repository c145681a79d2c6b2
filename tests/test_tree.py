"""Buddy-tree schedules (dcp's split-over-the-step SP groups): structure, assignment, and dcp plans that use them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _fakes import FakeCostModel
from lightning_dcp.planning.search.layouts import world_blocks
from lightning_dcp.planning.plan import is_aligned_block
from lightning_dcp.planning.checks import validate_plan
from lightning_dcp.planning.planner import Planner
from lightning_dcp.planning.policies.base import step_span
from lightning_dcp.planning.search.tree import BuddyTree

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("world", [1, 2, 6, 8, 13, 32])
def test_nodes_are_the_aligned_blocks_of_every_world_block(world):
    tree = BuddyTree(world, [1, 2, 4, 8])
    roots = [v for v in range(len(tree.size)) if tree.parent[v] < 0]
    assert [(tree.offset[v], tree.size[v]) for v in roots] == world_blocks(world)
    for v in range(len(tree.size)):
        assert is_aligned_block(tree.ranks(v))
        if tree.kids[v]:
            a, b = tree.kids[v]
            assert tree.ranks(a) + tree.ranks(b) == tree.ranks(v)
    assert sorted(tree.offset[v] for v in tree.leaves) == list(range(world))


def test_span_and_through_are_root_to_leaf_sums():
    tree = BuddyTree(8, [1, 2, 4, 8])
    own = [0.0] * len(tree.size)
    root = 0
    half = tree.kids[root][0]
    leaf = tree.leaves[-1]
    own[root], own[half], own[leaf] = 1.0, 2.0, 5.0
    assert tree.span(own) == 6.0  # root + last leaf beats root + first half
    thr = tree.through(own)
    assert thr[root] == 6.0 and thr[half] == 3.0 and thr[leaf] == 6.0


@SETTINGS
@given(world=st.sampled_from([1, 2, 3, 4, 6, 8, 16]), data=st.data())
def test_assign_places_every_unit_where_it_fits(world, data):
    classes = [p for p in (1, 2, 4, 8, 16) if p <= world_blocks(world)[0][1]]
    tree = BuddyTree(world, classes)
    n = data.draw(st.integers(1, 40))
    lengths = data.draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n))
    # unit i fits class k only from its smallest class up (at least SP 1 for the short ones)
    need = [data.draw(st.integers(0, len(classes) - 1)) if n_ > 2500 else 0 for n_ in lengths]
    var = [[(n_ / p if k >= need[i] else math.inf) for i, n_ in enumerate(lengths)] for k, p in enumerate(classes)]
    const = [[0.1] * n for _ in classes]
    order = sorted(range(n), key=lambda i: -lengths[i])
    deadline = data.draw(st.floats(0.0, 10000.0))
    got = [tree.assign(var, const, lengths, [4000] * len(classes), order, deadline, best_fit=b) for b in (False, True)]
    for where in got:
        assert all(v >= 0 for v in where)
        for i, v in enumerate(where):
            k = classes.index(tree.size[v])
            assert math.isfinite(var[k][i])
    assert tree.assign(var, const, lengths, [4000] * len(classes), order, deadline) == got[0]  # deterministic


def _batch(seed: int, n: int, cap: int) -> list[int]:
    rng = np.random.default_rng(seed)
    long = rng.integers(cap // 8, cap, size=max(1, n // 6))
    short = rng.integers(50, 3000, size=n)
    return [int(x) for x in np.concatenate([long, short])]


@SETTINGS
@given(world=st.sampled_from([4, 6, 8, 16, 32]), memory=st.sampled_from([40.0, 100.0, 300.0]),
       n=st.integers(2, 60), seed=st.integers(0, 50))
def test_dcp_with_trees_is_valid_and_never_slower_than_without(world, memory, n, seed):
    """A tree schedule replaces dcp's layout plan only when its exact span is lower; either way the plan is valid."""
    cm = FakeCostModel(memory_limit=memory)
    cap = Planner(world, cm).longest_fitting()
    lengths = _batch(seed, n, cap)
    samples = list(range(len(lengths)))
    with_tree = Planner(world, cm, "dcp", fallback=False).plan_batch(samples, lengths, step=seed)
    without = Planner(world, cm, "dcp", fallback=False, tree=False).plan_batch(samples, lengths, step=seed)
    validate_plan(with_tree, lengths, cm, samples=samples)
    planner = Planner(world, cm, "dcp")
    view = planner.view
    a, b = step_span(with_tree.steps[0], view), step_span(without.steps[0], view)
    assert a <= b * (1 + 1e-9)
    step = with_tree.steps[0]
    if step.notes.schedule == "buddy-tree":
        assert step.notes.estimated_time == pytest.approx(a)
        # every rank's items run from larger to smaller groups, each inside the previous one
        per_rank: dict[int, list[tuple[int, ...]]] = {}
        for item in step.items:
            for r in item.ranks:
                per_rank.setdefault(r, []).append(item.ranks)
        for groups in per_rank.values():
            for g, h in zip(groups, groups[1:]):
                assert set(h) <= set(g)


VIDEO_STEP = [93600, 46800, 46800, 46800, 46410, 44880, 44880, 20930, 20930, 20655, 20655, 11440, 11440, 10530, 10400,
              7344, 7344, 5265, 5265, 5265, 5083, 5083, 5083, 3744, 3744, 3744, 3744, 1872, 1872, 1590, 880, 880, 391,
              391, 144, 140, 140]
"""One 524,288-token global batch of the ``video`` distribution (seed 1, step 3 of benchmarks/bound_check.py)."""


def test_video_step_on_32_h100s_reaches_the_bound_the_layout_plan_missed():
    """The layout plan ran the 93,600-token sample on SP 16, then three ~45k samples on the same 16 ranks
    (77% of the step bound). The tree runs it on SP 16 and splits those ranks for the ~45k samples.

    SP sizes 1, 2, 4, 8, 16 (the case this was found on: 48 heads before any head divisor and rings were
    allowed): the same shape with 16 heads and no ring pricing."""
    from dataclasses import replace

    from lightning_dcp.planning.analytic import AnalyticCostModel
    from lightning_dcp.planning.bound import step_bound
    from lightning_dcp.planning.hardware import get_hardware
    from lightning_dcp.planning.models import get_model
    from lightning_dcp.planning.simulator import simulate

    cm = AnalyticCostModel(replace(get_model("transformer-1d"), num_heads=16), get_hardware("h100"), 32)
    cm.prices_ring = False
    samples = list(range(len(VIDEO_STEP)))
    plan = Planner(32, cm, "dcp").plan_batch(samples, VIDEO_STEP)
    validate_plan(plan, VIDEO_STEP, cm, samples=samples)
    old = Planner(32, cm, "dcp", tree=False, fallback=False).plan_batch(samples, VIDEO_STEP)
    bound = step_bound(VIDEO_STEP, cm, 32)
    got = bound / simulate(plan, cm, timeline=False).step_times[0]
    before = bound / simulate(old, cm, timeline=False).step_times[0]
    assert plan.steps[0].notes.schedule == "buddy-tree"
    assert before < 0.8 and got > 0.9, (before, got)
    big = next(it for it in plan.steps[0].items if 93600 in it.lengths)
    assert big.sp_size == 16 and any(set(it.ranks) < set(big.ranks) for it in plan.steps[0].items)


VIDEO_512K_STEP = [183600, 93600, 93288, 46800, 22880, 11440, 11440, 11440, 5265, 5265, 3640, 3588, 1820, 1610, 1590,
                   1590, 880, 880, 405, 391, 144]
"""Step 4 of ``lightning-dcp simulate --world-size 32 --dataset video --global-batch-tokens 524288 --num-steps 4``."""


def test_video_step_whose_last_ranks_form_one_group():
    """After the 183,600-token sample's 24-group only 8 ranks are left for the two ~93k-token samples, which prefer
    SP 12: the layout plan split those ranks into 3 + 1s and the tree ran everything on all 32 (92.3% of the step
    bound). The spilled allocation's (24, 8) runs one ~93k sample on the 8 ranks, the other after the longest."""
    from lightning_dcp.planning.analytic import AnalyticCostModel
    from lightning_dcp.planning.bound import step_bound
    from lightning_dcp.planning.hardware import get_hardware
    from lightning_dcp.planning.models import get_model
    from lightning_dcp.planning.simulator import simulate

    cm = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), 32, sharding="zero1")
    samples = list(range(len(VIDEO_512K_STEP)))
    plan = Planner(32, cm, "dcp").plan_batch(samples, VIDEO_512K_STEP)
    validate_plan(plan, VIDEO_512K_STEP, cm, samples=samples)
    got = step_bound(VIDEO_512K_STEP, cm, 32) / simulate(plan, cm, timeline=False).step_times[0]
    assert got > 0.96, got
    sizes = sorted({it.sp_size for it in plan.steps[0].items})
    assert sizes == [8, 24], sizes
