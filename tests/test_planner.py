"""Planner properties for every policy: each sample once, memory limit, aligned in-range groups, deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _fakes import FakeCostModel, SlowPathCostModel
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.search.layouts import allocate, place, world_blocks
from lightning_dcp.planning.plan import Plan, PlanError, StepPlan, WorkItem, is_aligned_block
from lightning_dcp.planning.checks import validate_plan
from lightning_dcp.planning.planner import POLICIES, Planner, plan

CM = FakeCostModel()
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def lengths_strategy(max_len: int = 30000):
    short = st.integers(1, 3000)
    long = st.integers(3000, max_len)
    return st.lists(st.one_of(short, short, short, long), min_size=1, max_size=60)


def check(p: Plan, lengths, cm=CM) -> None:
    validate_plan(p, lengths, cm, samples=range(len(lengths)))  # once each, memory, aligned, in range
    for step in p.steps:
        for item in step.items:
            assert is_aligned_block(item.ranks)
            assert cm.item_memory(item.lengths, item.sp_size, item.recompute) <= cm.memory_limit


def _refused_by_its_rules(policy: str, err: PlanningError) -> bool:
    """verl, as its own code does, refuses a batch its equal-count split cannot divide or its static SP cannot hold
    (tests/test_peers.py pins those rules); every other policy plans every valid batch."""
    return policy == "verl" and ("split evenly" in str(err) or "holds the longest" in str(err))


@pytest.mark.parametrize("policy", list(POLICIES))
@SETTINGS
@given(lengths=lengths_strategy(), world=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), seed=st.integers(0, 3))
def test_policy_properties(policy, lengths, world, seed):
    limit = Planner(world, CM).longest_fitting()
    lengths = [min(n, limit) for n in lengths]
    try:
        p1 = plan(lengths, world, CM, policy, seed=seed, global_batch_tokens=world * 8000)
    except PlanningError as err:
        assert _refused_by_its_rules(policy, err), err
        return
    check(p1, lengths)
    if POLICIES[policy].one_step_per_batch:
        assert len(p1.steps) == len(Planner(world, CM, policy).batches(lengths, global_batch_tokens=world * 8000))
    p2 = plan(lengths, world, CM, policy, seed=seed, global_batch_tokens=world * 8000)
    assert p1.to_json() == p2.to_json()  # deterministic
    back = Plan.from_json(p1.to_json())
    assert back == p1 and back.to_dict() == p1.to_dict()  # JSON round trip


@pytest.mark.parametrize("policy", list(POLICIES))
def test_plan_batch_samples_are_dataset_indices(policy):
    planner = Planner(4, CM, policy, seed=1, dataset_lengths=[100, 2000, 30000, 500] * 5)
    samples = [40, 7, 93, 12, 5, 66]
    lengths = [100, 2000, 30000, 500, 700, 9000]
    p = planner.plan_batch(samples, lengths, step=3)
    validate_plan(p, dict(zip(samples, lengths)), CM, samples=samples)
    assert planner.one_step_per_batch == (policy != "bucket")
    if planner.one_step_per_batch:
        assert len(p.steps) == 1
    assert planner.plan_batch(samples, lengths, step=3).to_json() == p.to_json()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_slow_path_cost_model(policy):
    cm = SlowPathCostModel()
    lengths = [50, 900, 3000, 12000, 200, 40000, 1000, 8] * 3
    check(plan(lengths, 8, cm, policy, global_batch_tokens=30000), lengths, cm)


def test_dcp_uses_heterogeneous_groups_and_less_recompute():
    lengths = [40000] + [1000] * 400
    p = plan(lengths, 16, CM, "dcp", global_batch_tokens=10**9)
    sizes = {item.sp_size for item in p.steps[0].items}
    assert len(sizes) > 1
    short = [it for it in p.steps[0].items if max(it.lengths) == 1000]
    assert all(it.recompute < CM.num_layers for it in short)


def test_bucket_needs_several_steps():
    planner = Planner(4, CM, "bucket", dataset_lengths=[500] * 200)
    assert not planner.one_step_per_batch
    p = planner.plan([500] * 200)
    assert len(p.steps) > 1
    assert all(len(step.items) <= 4 for step in p.steps)


def test_default_and_explicit_batching():
    planner = Planner(2, CM, "dcp")
    lengths = [1000] * 50
    assert [len(b) for b in planner.batches(lengths, global_batch_tokens=10000)] == [10] * 5
    assert [len(b) for b in planner.batches(lengths, global_batch_size=20)] == [20, 20, 10]
    assert len(planner.plan(lengths, global_batch_size=20).steps) == 3


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("bad", [[], [0], [5, -3], [1.5], ["7"], [True]])
def test_bad_lengths(bad):
    with pytest.raises(PlanningError):
        plan(bad, 4, CM)


def test_sample_too_long_names_sample_length_and_limit():
    planner = Planner(4, CM)
    limit = planner.longest_fitting()
    with pytest.raises(PlanningError) as err:
        planner.plan([10, 20, limit + 1])
    msg = str(err.value)
    assert "sample 2" in msg and str(limit + 1) in msg and str(limit) in msg
    with pytest.raises(PlanningError, match="sample 9"):
        planner.plan_batch([4, 9], [10, limit + 5])


def test_unknown_policy_and_option():
    with pytest.raises(PlanningError, match="known policies"):
        Planner(4, CM, "fastest")
    with pytest.raises(PlanningError, match="no option"):
        Planner(4, CM, "dcp", warp_speed=True)
    with pytest.raises(PlanningError):
        Planner(0, CM)


def test_batch_input_errors():
    planner = Planner(4, CM)
    with pytest.raises(PlanningError, match="more than once"):
        planner.plan_batch([1, 1], [10, 10])
    with pytest.raises(PlanningError, match="2 samples but 1 lengths"):
        planner.plan_batch([1, 2], [10])


# ---------------------------------------------------------------- layouts

def test_world_blocks_non_power_of_two():
    assert world_blocks(6) == [(0, 4), (4, 2)]
    assert world_blocks(13) == [(0, 8), (8, 4), (12, 1)]
    assert place([4, 2], 6) == [(0, 1, 2, 3), (4, 5)]
    assert place([4, 4], 6) is None
    p = plan([30000, 50, 60], 6, CM, "dcp")  # needs SP > 2: must use the 4-block
    check(p, [30000, 50, 60])
    assert p.steps[0].items[0].ranks == (0, 1, 2, 3)


@given(world=st.integers(1, 64), data=st.data())
@SETTINGS
def test_allocate_fills_world_with_aligned_groups(world, data):
    sizes = [p for p in (1, 2, 4, 8, 16, 32) if p <= world_blocks(world)[0][1]]
    work = {p: data.draw(st.floats(0, 10)) for p in sizes}
    must = data.draw(st.sampled_from(sizes))
    lay = allocate(work, world, sizes, must)
    groups = place(lay, world)
    assert groups is not None and sum(lay) == world and max(lay) >= must
    assert all(is_aligned_block(g) for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(world))


def test_plan_json_file_round_trip(tmp_path):
    lengths = [100, 5000, 20000, 700]
    p = plan(lengths, 4, CM)
    path = tmp_path / "plan.json"
    path.write_text(p.to_json())
    back = Plan.from_json(path.read_text())
    assert back == p
    assert json.loads(path.read_text())["schema"] == "lightning-dcp/plan/v1"


def test_validate_rejects_what_can_go_wrong():
    """The checks that can fail: invalid or out-of-range groups, duplicate or missing samples,
    lengths that disagree, recompute out of range, an item over the memory limit."""
    ok = StepPlan((WorkItem((0, 1), (0,), (100,), 0), WorkItem((2,), (1,), (50,), 0)))
    validate_plan(Plan("x", 4, (ok,)), [100, 50], CM, samples=[0, 1])
    bad = {
        "consecutive": StepPlan((WorkItem((0, 2), (0,), (100,), 0),)),
        "consecutive ": StepPlan((WorkItem((2, 1), (0,), (100,), 0),)),
        "does not divide the model's 64 heads": StepPlan((WorkItem((0, 1, 2), (0,), (100,), 0),)),
        "world has 4 ranks": StepPlan((WorkItem((4, 5), (0,), (100,), 0),)),
        "appears twice": StepPlan((WorkItem((0,), (0,), (100,), 0), WorkItem((1,), (0,), (100,), 0))),
        "recomputes": StepPlan((WorkItem((0,), (0,), (100,), CM.num_layers + 1),)),
        "needs": StepPlan((WorkItem((0,), (0,), (10**9,), 0),)),
    }
    for msg, step in bad.items():
        with pytest.raises(PlanError, match=msg.strip()):
            validate_plan(Plan("x", 4, (step,)), None, CM)
    with pytest.raises(PlanError, match="crosses a node boundary"):  # 8 GPUs per node
        validate_plan(Plan("x", 16, (StepPlan((WorkItem((6, 7, 8, 9), (0,), (100,), 0),)),)), None, CM)
    validate_plan(Plan("x", 24, (StepPlan((WorkItem(tuple(range(4, 20)), (0,), (100,), 0),)),)), None, CM)  # > a node
    with pytest.raises(PlanError, match="has length"):
        validate_plan(Plan("x", 4, (ok,)), [100, 51], CM)
    with pytest.raises(PlanError, match="misses samples"):
        validate_plan(Plan("x", 4, (ok,)), [100, 50, 7], CM, samples=[0, 1, 2])


# ---------------------------------------------------------------- max_sp_size

@pytest.mark.parametrize("policy", list(POLICIES))
def test_max_sp_size_caps_every_policy(policy):
    cap_planner = Planner(16, CM, policy, max_sp_size=2)
    limit = cap_planner.longest_fitting()
    assert limit <= Planner(16, CM).longest_fitting()
    lengths = [min(n, limit) for n in [40000, 30000, 1000, 200, 5000, 12000] * 4]
    try:
        p = Planner(16, CM, policy, max_sp_size=2, dataset_lengths=lengths).plan(lengths, global_batch_tokens=60000)
    except PlanningError as err:
        assert _refused_by_its_rules(policy, err), err
        return
    check(p, lengths)
    assert max(it.sp_size for s in p.steps for it in s.items) <= 2


def test_max_sp_size_errors_name_sample_length_and_limit():
    with pytest.raises(PlanningError, match="max_sp_size"):
        Planner(8, CM, max_sp_size=0)
    full = Planner(8, CM).longest_fitting()
    capped = Planner(8, CM, max_sp_size=1)
    limit = capped.longest_fitting()
    assert limit < full
    with pytest.raises(PlanningError) as err:
        capped.plan_batch([3, 7], [10, limit + 1])
    msg = str(err.value)
    assert "sample 7" in msg and str(limit + 1) in msg and str(limit) in msg and "max_sp_size=1" in msg
    with pytest.raises(PlanningError, match="max_sp_size"):
        Planner(8, CM, "dcp", max_sp_size=1, dataset_lengths=[limit + 1])


# ---------------------------------------------------------------- DCP-paper ablations

def test_dcp_inter_recomputes_everything_intra_less():
    lengths = [40000] + [1000] * 300 + [6000] * 20
    inter = plan(lengths, 8, CM, "dcp-inter", global_batch_tokens=10**9)
    intra = plan(lengths, 8, CM, "dcp-intra", global_batch_tokens=10**9)
    for p in (inter, intra):
        assert len(p.steps) == 1
        check(p, lengths)
    assert all(it.recompute == CM.num_layers for it in inter.steps[0].items)
    short = [it for it in intra.steps[0].items if max(it.lengths) == 1000]
    assert short and all(it.recompute < CM.num_layers for it in short)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.01, 10.0), min_size=1, max_size=400), st.sampled_from([(1, 1, 2), (2, 2, 4, 4), (1, 2, 2, 4, 8)]),
       st.booleans())
def test_lpt_dispatch_covers_every_unit_once(costs, layout, with_floor):
    """Dispatch: every unit in exactly one group, loads = what its units add (floors included)."""
    import numpy as np

    from lightning_dcp.planning.search.dispatch import lpt_dispatch

    classes = sorted(set(layout))
    base = np.array(costs)
    cost = np.vstack([base / p for p in classes])
    cost[0, base > 9.0] = np.inf  # the longest do not fit the smallest class
    floor = np.vstack([base / (2 * p) for p in classes]) if with_floor else None
    members, loads, span = lpt_dispatch(cost, layout, classes, base, floor=floor)
    got = sorted(i for m in members for i in m)
    assert got == list(range(len(costs)))
    for g, mem in enumerate(members):
        k = classes.index(layout[g])
        want = float(np.sum(cost[k, mem])) if mem else 0.0
        if floor is not None and mem:
            want = max(want, float(np.max(floor[k, mem])))
        assert np.isfinite(want)
        assert abs(loads[g] - want) <= 1e-9 * max(1.0, want)
    assert span == max(loads)


# --------------------------------------------------------------- dcp never behind its own parts (issue #10)

TINY_PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "tiny-2d_balanced_2xcpu_mem20MiB" / "profile.json"


def _cost_model(kind: str, memory: float):
    if kind == "fake":
        return FakeCostModel(memory_limit=memory * 100.0)
    from lightning_dcp.planning.profiled import ProfiledCostModel

    base = ProfiledCostModel.from_file(TINY_PROFILE)  # measured CPU model: SP 2 has a large per-item constant
    return ProfiledCostModel.from_file(TINY_PROFILE, memory_limit=base.memory_limit * memory)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["fake", "profiled"]), memory=st.sampled_from([0.3, 0.5, 0.7, 1.0, 1.5, 3.0]),
       world=st.sampled_from([2, 4, 8, 16]), fractions=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50),
       scale=st.sampled_from([0.02, 0.1, 0.3, 1.0]), seed=st.integers(0, 3))
def test_dcp_never_behind_its_parts(kind, memory, world, fractions, scale, seed):
    """dcp's simulated step <= 1.02 x min(dcp-inter, dcp-intra) on the same batch and cost model."""
    from lightning_dcp.planning.simulator import simulate

    cm = _cost_model(kind, memory)
    try:
        cap = Planner(world, cm).longest_fitting()
    except PlanningError:  # the model does not fit this memory at all
        return
    lengths = [max(1, int(cap * scale * f)) for f in fractions]
    samples = list(range(len(lengths)))
    t = {p: simulate(Planner(world, cm, p, seed=seed).plan_batch(samples, lengths), cm, timeline=False).total_time
         for p in ("dcp", "dcp-inter", "dcp-intra")}
    assert t["dcp"] <= 1.02 * min(t["dcp-inter"], t["dcp-intra"]), t


def test_dcp_lone_short_sample_runs_where_it_is_fastest():
    """A step of one short sample: dcp runs it on the SP size where it is fastest alone (the old
    estimate charged it a share of a full micro-batch and chose SP 2 on this profile)."""
    from lightning_dcp.planning.profiled import ProfiledCostModel

    cm = ProfiledCostModel.from_file(TINY_PROFILE)
    got = Planner(8, cm, "dcp", fallback=False).plan_batch([0], [11]).steps[0].items
    best = min(cm.sp_sizes(8), key=lambda p: cm.item_time([11], p, cm.min_recompute([11], p)))
    assert [it.sp_size for it in got] == [best]


def _planning_imports() -> dict[str, set[str]]:
    """Module -> the planning modules it imports (anywhere in the file, lazy imports too; not ``TYPE_CHECKING`` ones,
    nor the package's face ``lightning_dcp.planning``)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "lightning_dcp" / "planning"
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        name = ".".join(("lightning_dcp", "planning", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d.startswith("lightning_dcp.planning.") and d != name}
    return graph


def test_planning_imports_run_one_way():
    """No import circle inside lightning_dcp/planning (plan.py's memory check used to import item_pricing, which
    imports plan.py's types): every module's imports, lazy ones included, form a graph without a cycle."""
    graph = _planning_imports()
    assert "lightning_dcp.planning.plan" in graph and graph["lightning_dcp.planning.item_pricing"]
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError(f"import circle: {' -> '.join(path[path.index(dep):] + [dep])}")
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_a_sample_too_long_is_named_as_the_dataset_names_it():
    """``Planner(sample_name=...)`` (the train dataset's ``sample_name``) names the sample in the error; a name function
    that fails, or none, leaves the index alone."""
    from lightning_dcp.planning.default_cost import DefaultCostModel
    from lightning_dcp.planning.sample_names import name_samples

    cm = DefaultCostModel(0, 1, 40)
    with pytest.raises(PlanningError, match=r"^sample 1 \(clips/cat\.mp4\) has length 50 tokens"):
        Planner(1, cm, dataset_lengths=[5, 50], sample_name=lambda i: ["clips/dog.mp4", "clips/cat.mp4"][i])
    for namer in (None, lambda i: 1 / 0, lambda i: ""):
        with pytest.raises(PlanningError, match=r"^sample 1 has length 50 tokens"):
            Planner(1, cm, dataset_lengths=[5, 50], sample_name=namer)
    assert name_samples([3, 4], lambda i: f"v{i}.mp4") == "[3 (v3.mp4), 4 (v4.mp4)]" and name_samples([3]) == "[3]"
