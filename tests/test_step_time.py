"""One step semantics (lightning_dcp.planning.step_time): the faster prices elsewhere are the same function.

Random plans, on the fast paths the planner uses: a cost view's item times (``item_time_sum``) against the
cost model's ``item_cost``; a buddy tree's root-to-leaf sums against the step listed level by level; a shard
group's planned rounds against the lockstep rounds the runtime finds; the simulator's span against it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _fakes import FakeCostModel
from lightning_dcp.planning.plan import Pipeline, Plan, Scheme, StepNotes, StepPlan, WorkItem, interleave_items
from lightning_dcp.planning.view import CostView
from lightning_dcp.planning.search.tree import BuddyTree
from lightning_dcp.planning.rounds import Lockstep
from lightning_dcp.planning.simulator import simulate
from lightning_dcp.planning.step_time import ItemPrices, run_step, step_time

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CM = FakeCostModel()


def _random_step(rng: np.random.Generator, world: int, view: CostView) -> StepPlan:
    """Items on random legal groups of the view's SP sizes, in a random order."""
    items = []
    for _ in range(int(rng.integers(1, 3 * world))):
        p = int(rng.choice([s for s in view.sp_sizes if s <= world]))
        start = int(rng.integers(0, world // p)) * p
        lens = tuple(int(x) for x in rng.integers(50, 3000, size=int(rng.integers(1, 4))))
        rec = view.min_recompute(sum(lens), p)
        if rec is None:
            continue
        items.append(WorkItem(tuple(range(start, start + p)), tuple(range(len(items) * 4, len(items) * 4 + len(lens))),
                              lens, rec, view.ring_of(p)))
    return StepPlan(tuple(items or [WorkItem((0,), (0,), (100,), 0)]))


@SETTINGS
@given(seed=st.integers(0, 10_000), world=st.sampled_from([2, 4, 8, 16]), slow=st.booleans())
def test_view_item_times_are_the_cost_models(seed, world, slow):
    speeds = [0.5 if slow and r == 1 else 1.0 for r in range(world)]
    view = CostView(CM, world, speeds, world_size=world)
    step = _random_step(np.random.default_rng(seed), world, view)
    exact = step_time(step, CM, world, speeds=speeds)
    fast = run_step(step, [view.item_time(it) for it in step.items], world)
    assert fast.span == pytest.approx(exact.span, rel=1e-9)
    assert fast.busy == pytest.approx(exact.busy, rel=1e-9)
    assert simulate(Plan("x", world, (step,)), CM, rank_speeds=speeds).compute_spans[0] == pytest.approx(exact.span)


@SETTINGS
@given(seed=st.integers(0, 10_000), world=st.sampled_from([4, 8, 13, 16]))
def test_a_buddy_trees_path_sums_are_the_steps_span(seed, world):
    """A tree schedule listed level by level (largest first, as dcp lists it) runs as its root-to-leaf sums say."""
    rng = np.random.default_rng(seed)
    tree = BuddyTree(world, [1, 2, 4, 8])
    own = [0.0] * len(tree.size)
    levels: dict[int, list[list[WorkItem]]] = {}
    for v in sorted(range(len(tree.size)), key=lambda u: (-tree.size[u], tree.offset[u])):
        if tree.size[v] not in (1, 2, 4, 8) or rng.random() < 0.4:
            continue
        items = []
        for _ in range(int(rng.integers(1, 3))):
            n = int(rng.integers(100, 4000))
            items.append(WorkItem(tree.ranks(v), (len(items),), (n,), 0))
            own[v] += CM.item_cost([n], tree.size[v], 0).total
        levels.setdefault(tree.size[v], []).append(items)
    step = StepPlan(tuple(it for p in sorted(levels, reverse=True) for it in interleave_items(levels[p])))
    assert step_time(step, CM, world).span == pytest.approx(tree.span(own), rel=1e-9)


def test_lockstep_rounds_and_barriers_and_pipelines():
    a, b, c = (WorkItem((r,), (r,), (n,), 0) for r, n in ((0, 4000), (1, 100), (1, 100)))
    t = [CM.item_cost(i.lengths, 1, 0).total for i in (a, b, c)]
    step = StepPlan((a, b, c))
    assert run_step(step, t, 2).span == pytest.approx(max(t[0], t[1] + t[2]))
    # lockstep: rank 1's second item runs in round 2, after round 1's slowest item
    assert run_step(step, t, 2, Lockstep(2)).span == pytest.approx(t[0] + t[2])
    assert run_step(step, t, 2, Lockstep(2), intervals=True).intervals[-1][1] == pytest.approx(t[0])
    # a barrier after the first two items: rank 1 waits for rank 0
    held = StepPlan((a, b, c), StepNotes(barriers=(2,)))
    assert run_step(held, t, 2).span == pytest.approx(t[0] + t[2])
    # a two-stage pipeline idles one slowest micro-batch after its last
    pipe = Pipeline(0, Scheme(1, 2))
    x, y = WorkItem((0, 1), (0,), (2000,), 0), WorkItem((0, 1), (1,), (500,), 0)
    piped = StepPlan((x, y), StepNotes(pipelines=(pipe,)))
    tx, ty = ItemPrices(CM).times(piped)
    assert step_time(piped, CM, 2).span == pytest.approx(tx + ty + max(tx, ty))
    assert step_time(piped, CM, 2).seconds == pytest.approx(tx + ty + max(tx, ty) + CM.step_overhead(2))


@SETTINGS
@given(seed=st.integers(0, 10_000), world=st.sampled_from([4, 8, 16]), n=st.integers(1, 120),
       slow=st.booleans(), tree=st.booleans())
def test_dcp_states_the_span_its_plan_runs(seed, world, n, slow, tree):
    """The span dcp's search states for the plan it returns (layout plan or buddy tree, at the ranks' speeds) is the
    step semantics' span of that plan."""
    from lightning_dcp.planning.planner import Planner

    rng = np.random.default_rng(seed)
    speeds = [0.5 if slow and r == world - 1 else 1.0 for r in range(world)]
    planner = Planner(world, CM, "dcp", rank_speeds=speeds, fallback=False, tree=tree)
    cap = planner.longest_fitting()
    lengths = [int(x) for x in rng.integers(1, cap + 1, size=n)]
    step = planner.plan_batch(range(n), lengths, step=seed).steps[0]
    assert step.notes.estimated_time == pytest.approx(step_time(step, CM, world, speeds=speeds).span, rel=1e-9)
