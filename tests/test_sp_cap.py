"""An SP cap names its source (issue 35 item 10): the heads, the world, max_sp_size, the shard group, rings."""

from __future__ import annotations

import pytest

from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.default_cost import DefaultCostModel
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import ModelSpec
from lightning_dcp.planning.planner import Planner


def _refusal(**kw) -> str:
    with pytest.raises(PlanningError) as info:
        Planner(2, DefaultCostModel(num_layers=2, num_heads=3, max_tokens=100), dataset_lengths=[10, 1000], **kw)
    return str(info.value)


def test_three_heads_on_two_ranks_name_the_heads_and_why_no_ring():
    msg = _refusal()
    assert "sample 1 has length 1000" in msg
    assert "3 attention heads allow Ulysses sizes [1] up to 2 ranks" in msg
    assert "DefaultCostModel) prices no ring attention" in msg and "a cost model that prices rings" in msg
    assert "more ranks" not in msg  # the world is not what limits it
    off = _refusal(ring=False)
    assert "ring attention is off" in off and "prices no ring" not in off


def test_the_option_and_the_world_are_named_only_when_they_limit():
    msg = _refusal(max_sp_size=1)
    assert "capped by max_sp_size=1" in msg and "a larger max_sp_size" in msg
    with pytest.raises(PlanningError) as info:
        Planner(2, DefaultCostModel(num_layers=2, num_heads=2, max_tokens=100), dataset_lengths=[10, 1000])
    assert "more ranks" in str(info.value) and "heads allow" not in str(info.value)


def test_a_cost_model_that_prices_rings_plans_the_ring_past_the_heads():
    spec = ModelSpec(name="three-heads", kind="1d", num_layers=2, hidden_size=96, num_heads=3, ffn_hidden_size=384, causal=True)
    cm = AnalyticCostModel(spec, get_hardware("h100"), 2, memory_limit=1.5 * 2 ** 30)
    cap1 = Planner(2, cm, max_sp_size=1).longest_fitting()
    planner = Planner(2, cm)
    assert planner.ring_degrees.get(2) == 2 and planner.longest_fitting() > cap1
    plan = planner.plan_batch([0], [int(1.5 * cap1)])
    (item,) = plan.steps[0].items
    assert item.sp_size == 2 and item.ring == 2
