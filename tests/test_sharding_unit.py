"""Sharding as one unit (:mod:`lightning_dcp.planning.sharding`, :mod:`lightning_dcp.runtime.sharding`): the one
registry and where modes may be named, the shard group a run picks and its errors, every cost model planned under
hsdp (or refused by name), the SP cap's cause, the collectives' prices, and what dummy rounds cost. Pure planning
and single-process checks; the runs are in test_hsdp.py / test_sharding.py."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp import cli
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.default_cost import DefaultCostModel
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.hardware import get_hardware, hardware_named
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.plan import Plan, StepPlan, WorkItem
from lightning_dcp.planning.planner import Planner
from lightning_dcp.planning.sharding.base import StateParts
from lightning_dcp.planning.analytic import hsdp_view, replica_parts
from lightning_dcp.planning.prices import CollectivePrices
from lightning_dcp.planning.sharding.registry import MODES, get_mode
from lightning_dcp.planning.rounds import lockstep_rounds
from lightning_dcp.planning.sharding.shard_group_size import NoShardGroupFits, choose_shard_group_size
from lightning_dcp.planning.simulator import simulate
from lightning_dcp.runtime.model import SPCap, resolve_sp_cap
from lightning_dcp.runtime.planner_factory import PlannerFactory
from lightning_dcp.runtime.run_sharding import RunSharding
from lightning_dcp.runtime.settings import DCPSettings
from lightning_dcp.runtime.sharding.protocol import Shards
from lightning_dcp.runtime.sharding.states import ModelStates, plan_cost_model

ROOT = Path(__file__).resolve().parents[1]
H100 = get_hardware("h100")
GiB = 2**30


# ----------------------------------------------------------------------------- the registry
def test_every_mode_is_its_two_files_and_a_registry_line():
    """Each registry entry names its runtime, which implements the Shards protocol; the package's own files are the
    only ones that name a mode in code (a string equal to a mode's name, outside docstrings and messages)."""
    for name, cls in MODES.items():
        module, attr = cls.runtime.split(":")
        runtime = getattr(importlib.import_module(module), attr)
        missing = [m for m in ("setup_optimizers", "states", "begin_step", "rounds", "begin_round", "run_dummy",
                               "grad_reduction", "after_reduce", "after_step", "unshard", "at_rest", "reshard", "save_checkpoint",
                               "optimized_parameters",
                               "load_checkpoint", "model_state", "optimizer_state") if not callable(getattr(runtime, m, None))]
        assert not missing and hasattr(runtime, "sharded_checkpoint") and Shards is not None, (name, missing)
        assert cls(4).name == name and cls.shards_weights == runtime.sharded_checkpoint
    naming = []
    for path in sorted((ROOT / "lightning_dcp").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("lightning_dcp/planning/sharding/", "lightning_dcp/runtime/sharding/")):
            continue
        tree = ast.parse(path.read_text())
        skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        skip |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in ast.walk(n)}
        skip |= {id(n.args[1]) for n in ast.walk(tree) if isinstance(n, ast.Call) and len(n.args) >= 2
                 and isinstance(n.func, ast.Attribute) and n.func.attr == "__setattr__"}
        naming += [f"{rel}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in skip
                   and n.value in set(MODES) - {"none"}]
    assert naming == [], f"mode names in code outside lightning_dcp/*/sharding/: {naming}"


def test_options_belong_to_the_modes_that_take_them():
    with pytest.raises(ValueError, match="apply to sharding='hsdp' only"):
        get_mode("fsdp", 4, shard_group_size=2)
    with pytest.raises(ValueError, match="ZeRO-3 is 'fsdp'"):
        get_mode("zero3", 4)
    assert get_mode("hsdp", 8).shard_group_size == 8 and get_mode("hsdp", 8, shard_group_size=2).sp_domain == 8
    assert get_mode("hsdp", 8, shard_group_size=2).rounds.lockstep and not get_mode("fsdp", 8).rounds.lockstep


# ----------------------------------------------------------------------------- the shard group a run picks
def _llama70b_parts() -> StateParts:
    return replica_parts(AnalyticCostModel(get_model("llama-70b"), H100, 64, sharding="none"))


def test_the_smallest_shard_group_that_fits_and_an_error_that_lists_every_k():
    parts = _llama70b_parts()
    choice = choose_shard_group_size(64, parts, H100.usable_memory_bytes, mode="hsdp", gpus_per_node=8)
    assert choice.size == 32 and choice.reason.startswith("the smallest shard group above one node (8 ranks) that fits")
    assert choice.state_bytes[16] > H100.usable_memory_bytes >= choice.state_bytes[32]
    with pytest.raises(NoShardGroupFits) as err:
        choose_shard_group_size(16, parts, H100.usable_memory_bytes, mode="hsdp")
    msg = str(err.value)
    assert all(f"K={k}: " in msg for k in (1, 2, 4, 8, 16)) and "per rank in the loop" in msg and "offload=True" in msg
    assert "sample" not in msg.split(":", 1)[1].split(". Add")[0]  # nothing blamed on a sample
    with pytest.raises(NoShardGroupFits, match=r"K=64: [\d.]+ GiB per rank in the loop, holds samples up to 64000 tokens"):
        choose_shard_group_size(64, parts, H100.usable_memory_bytes, mode="hsdp", longest=10**9,
                                longest_fitting=lambda k: 1000 * k)


def test_a_model_that_fits_a_node_gets_the_node():
    """Inside a node a larger shard group moves (K-1)/K of a layer per rank at the same bandwidth: Wan-14B fits
    K=4 on H100 but gets the node's 8 (more room for activations, no slower links)."""
    wan = replica_parts(AnalyticCostModel(get_model("wan-14b"), H100, 32, sharding="none"))
    assert choose_shard_group_size(32, wan, H100.usable_memory_bytes, mode="hsdp").size == 4  # no node given
    node = choose_shard_group_size(32, wan, H100.usable_memory_bytes, mode="hsdp", gpus_per_node=8)
    assert node.size == 8 and node.reason.startswith("one node's 8 ranks")
    assert choose_shard_group_size(4, wan, H100.usable_memory_bytes, mode="hsdp", gpus_per_node=8).size == 4


def test_the_plan_command_picks_the_shard_group_that_holds_the_states(tmp_path, capsys):
    """llama-70b on 64 GPUs under hsdp, no --shard-group-size: the states need K >= 32 (the old default of a node's 8
    stopped with an error blaming a sample); the CLI says which K and why, and the plan's items stay inside it."""
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([3000, 40000, 9000, 120000] * 8))
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--lengths", str(lengths), "--out", str(out), "--world-size", "64", "--model", "llama-70b",
                     "--sharding", "hsdp", "--no-drop-last"]) == 0
    said = capsys.readouterr().out
    assert "shard group size 32: the smallest shard group above one node (8 ranks) that fits: states fit" in said, said
    for step in Plan.from_json(out.read_text()).steps:
        assert all(len({r // 32 for r in it.ranks}) == 1 for it in step.items)
    assert cli.main(["plan", "--lengths", str(lengths), "--out", str(out), "--world-size", "16", "--model", "llama-70b",
                     "--sharding", "hsdp"]) != 0
    err = capsys.readouterr().err
    assert "no shard group size of the 16 ranks fits the model states" in err and "K=16: " in err, err


# ----------------------------------------------------------------------------- every cost model under hsdp
def test_the_fallback_cost_model_under_hsdp_keeps_its_token_memory():
    """DefaultCostModel counts tokens, not bytes: under hsdp its memory is its own (no replica bytes subtracted
    from tokens: the old -160,360 against a limit of 384), and its items get lockstep rounds."""
    for world, k, tokens in ((4, 4, 640), (2, 1, 20)):
        base = DefaultCostModel(num_layers=2, num_heads=4, max_tokens=4 * 96)
        states = ModelStates(4e4, 0.0, 4e4, 8e4, sharding="hsdp", world_size=world, shard_group_size=k)
        cm = plan_cost_model(base, states)
        assert cm.rounds.lockstep and cm.item_memory([tokens], 1, 0) == base.item_memory([tokens], 1, 0) >= 0
        assert cm.fits([20], 1, 0)
        plan = Planner(world, cm, "dcp").plan([20, 90, 40, 60, 30, 70, 20, 50] * 2, global_batch_size=8)
        assert simulate(plan, cm).tokens == 2 * 380


def test_profiled_and_analytic_models_under_hsdp_count_the_sharded_states():
    from test_cost_model import make_profile
    from lightning_dcp.planning.profiled import ProfiledCostModel

    profiled = ProfiledCostModel(make_profile())
    states = ModelStates(1e10, 0.0, 1e10, 2e10, sharding="hsdp", world_size=8, shard_group_size=4,
                         layer_bytes=1e8, root_bytes=5e8)
    cm = plan_cost_model(profiled, states)
    shift = states.step_bytes - states.replica_bytes
    assert cm.item_memory([4096], 2, 1) == pytest.approx(profiled.item_memory([4096], 2, 1) + shift)
    assert cm.prices is not None and cm.prices.source.startswith("the profile's all-reduce")  # not a fixed H100
    a100 = AnalyticCostModel(get_model("wan-14b"), get_hardware("a100"), 32, sharding="none")
    view = hsdp_view(a100, 8)
    assert view.prices == CollectivePrices.from_hardware(get_hardware("a100"))
    assert view.layer_collective_s() > hsdp_view(AnalyticCostModel(get_model("wan-14b"), H100, 32), 8).layer_collective_s()


def test_device_names_find_their_hardware_and_the_cpu_none():
    import torch

    assert hardware_named("NVIDIA H100 80GB HBM3").name == "h100"
    assert hardware_named("NVIDIA A100-SXM4-80GB").name == "a100" and hardware_named("NVIDIA H200").name == "h200"
    assert hardware_named("Tesla T4") is None and RunSharding.prices(torch.device("cpu"), 8) is None


# ----------------------------------------------------------------------------- SP across shard groups
def test_hsdp_sp_groups_may_span_shard_groups():
    """Shard groups of 1 on 2 ranks: a sample that needs SP 2 plans on both ranks (their rounds meet), and the
    planner's SP sizes are the model's over the world, not the shard group's."""
    settings = DCPSettings(sharding="hsdp", shard_group_size=1)
    base = AnalyticCostModel(get_model("tiny-1d"), H100, 2, sharding="none", memory_limit=2 * GiB)
    states = ModelStates(1e6, 0.0, 1e6, 2e6, sharding="hsdp", world_size=2, shard_group_size=1)
    planners = PlannerFactory(settings, 2, resolve_sp_cap(None, 2, 4), 4, "sp", states=states)
    cm = planners.cost_model(base, [100], num_layers=2)
    assert cm.rounds.shard_group_size == 1 and cm.rounds.domain == 2 and max(cm.sp_sizes(2)) == 2
    longest = max(cm.max_length(p) for p in cm.sp_sizes(2))
    assert longest > cm.max_length(1)  # more than one rank holds
    plan = planners.planner(cm, [100, longest]).plan([100, longest], global_batch_tokens=100 + longest)
    assert [len(it.ranks) for it in plan.steps[0].items if longest in it.lengths] == [2]


# ----------------------------------------------------------------------------- what dummy rounds cost
@st.composite
def _steps(draw):
    world = draw(st.sampled_from([2, 4, 8]))
    k = draw(st.sampled_from([d for d in (1, 2, 4, 8) if d <= world]))
    items, sample = [], 0
    for _ in range(draw(st.integers(1, 16))):
        sp = draw(st.sampled_from([p for p in (1, 2) if p <= k]))
        start = draw(st.integers(0, world // sp - 1)) * sp
        items.append(WorkItem(tuple(range(start, start + sp)), (sample,), (draw(st.integers(100, 60000)),),
                              draw(st.integers(0, 2))))
        sample += 1
    return world, k, StepPlan(tuple(items))


@settings(max_examples=60, deadline=None)
@given(_steps())
def test_a_round_lasts_its_slowest_item_plus_collectives_and_a_dummy_computes_nothing(case):
    """The simulator's lockstep span: per group the sum over rounds of round(max item time), round(0) for a group
    that only runs a dummy round (its replicas meet), the slowest group: dummies add no compute."""
    world, k, step = case
    base = AnalyticCostModel(get_model("wan-14b"), H100, world, sharding="none", memory_limit=1e12)
    cm = hsdp_view(base, k)
    sim = simulate(Plan("dcp", world, (step,), {}), cm, check=False)
    raw = [base.item_time(it.lengths, it.sp_size, it.recompute) for it in step.items]
    spans = []
    for g in lockstep_rounds(step, world, k):
        if g.rounds:
            spans.append(sum(cm.round_time(max(raw[i] for i in rnd)) for rnd in g.rounds))
        elif world > k:
            spans.append(cm.round_time(0.0))
    assert sim.compute_spans[0] == pytest.approx(max(spans))
    assert cm.rounds.dummy_round_s == pytest.approx(cm.round_time(0.0))
    assert cm.round_time(0.0) <= min(cm.round_time(t) for t in raw)
    assert 0 < cm.dummy_memory() <= min(cm.item_memory(it.lengths, it.sp_size, it.recompute) for it in step.items)
