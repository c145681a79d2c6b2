"""The one linear cost form (lightning_dcp.planning.linear) and the cost-model interface around it: the values the
analytic and profiled models gave before they shared it (pinned), its parts against its totals, its vectorized
evaluation, its closed forms against the generic bisection, and the delegating views."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _fakes import FakeCostModel
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.calibrated import CalibratedCostModel
from lightning_dcp.planning.calibration import CalibrationFactors
from lightning_dcp.planning.cost_model import CostModel, DelegatingCostModel
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.lowered import LoweredMemory
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.profiled import ProfiledCostModel
from test_cost_model import make_profile

H100 = get_hardware("h100")


def _per_sample_profile() -> dict:
    p = make_profile()
    p["model"]["per_sample_cost"] = True
    for e in p["entries"]:
        e["forward_s"] += 1e-4
        e["backward_s"] += 2e-4
        e["recompute_s"] = e["forward_s"] * 1.1
    return p


MODELS = {
    "a:transformer-1d:zero1": lambda: AnalyticCostModel(get_model("transformer-1d"), H100, 32, sharding="zero1"),
    "a:transformer-2d:none": lambda: AnalyticCostModel(get_model("transformer-2d"), H100, 32, sharding="none"),
    "a:wan-1.3b:fsdp": lambda: AnalyticCostModel(get_model("wan-1.3b"), H100, 32, sharding="fsdp"),
    "a:llama-70b:zero1": lambda: AnalyticCostModel(get_model("llama-70b"), H100, 32, sharding="zero1"),
    "p:ring": lambda: ProfiledCostModel(make_profile(time_per_token_s=2e-8, activation_bytes_per_token=6e4, host_s=1e-4,
                                                     host_per_token_s=1e-8), hardware="h100"),
    "p:persample": lambda: ProfiledCostModel(_per_sample_profile(), hardware="h100", sharding="none"),
}

# (model, lengths, sp, ring, recompute): ItemCost parts, item_time, item_memory, min_recompute, item_time_lower --
# computed by the models before they shared LinearCost (main 2bcf84c)
PINNED = [
    ("a:transformer-1d:zero1", [10613, 67874], 2, 1, 32,
     [5.770928759655269, 1.3235363994743088, 0.16046378067027028, 0.03858749602382267, 5.784138595644063],
     7.293516435823669, 83000815871.99998, 34, 7.293516435823669),
    ("a:transformer-1d:zero1", [109950], 32, 4, 37,
     [0.8119360295686042, 0.21212252082497063, 0.03384284972972973, 0.0039688238089117785, 0.7905271933424887],
     1.0618702239322162, 26322864544.0, 0, 1.0618702239322162),
    ("a:transformer-2d:none", [10499, 66185, 89195], 4, 1, 25,
     [0.49095708230001955, 0.14451266791338316, 0.13846136147027027, 0.0002525135656519103, 0.4805574383154471],
     0.7741836252493249, 29611608832.0, 9, 0.7741836252493249),
    ("a:wan-1.3b:fsdp", [10159, 39947, 55351, 29656], 4, 1, 23,
     [2.185233070390546, 0.4966507174155213, 0.07647224112432432, 0.0005810165163856883, 2.1724437328914554],
     2.7589370454467774, 30954613248.0, 6, 2.7589370454467774),
    ("a:wan-1.3b:fsdp", [102471, 12356, 88858], 12, 3, 28,
     [2.095796967564574, 0.5701243826805706, 0.044244992000000004, 0.00048267595294117655, 2.0836865965380604],
     2.7106490181980853, 13205020672.0, 0, 2.7106490181980853),
    ("a:llama-70b:zero1", [104605, 52798], 2, 1, 77,
     [105.60554785501674, 31.229250968304378, 0.948144792908108, 0.18167447603124465, 105.49291780011319],
     137.96461809226048, 514309849088.0, None, 137.96461809226048),
    ("a:llama-70b:zero1", [111550], 16, 2, 36,
     [11.051799716692399, 1.5172766099102772, 0.13480816432432433, 0.017301717184363206, 10.774796902941974],
     12.721186208111362, 420037914624.0, None, 12.721186208111362),
    ("p:ring", [127909], 4, 1, 22,
     [2.676100412653507, 0.4387276550910024, 0.0, 0.0060186350000000005, 2.4118919476535177],
     3.12084670274451, 107150127000.00003, 31, 3.12084670274451),
    ("p:ring", [117341, 21210, 98086], 8, 2, 23,
     [2.240938478304755, 0.38774721221775177, 0.0, 0.0070579625, 1.994808105804763],
     2.635743653022507, 99861990728.00003, 30, 2.635743653022507),
    ("p:persample", [110588, 21921, 65562], 2, 1, 34,
     [6.522777298863022, 1.8307289464046024, 0.0, 0.004, 6.243807838862985],
     8.357506245267624, 144097896000.0, 41, 8.357506245267624),
    ("p:persample", [104601, 141315], 32, 8, 7,
     [0.668283484288875, 0.03769021272464251, 1.7188367677685314, 0.004, 0.5744858292888732],
     2.4288104647820488, 60015865476.000015, 0, 0.7099736970135175),
]


@pytest.mark.parametrize("name,lengths,sp,ring,r,parts,time,memory,min_rec,lower", PINNED)
def test_the_shared_form_gives_the_old_values(name, lengths, sp, ring, r, parts, time, memory, min_rec, lower):
    cm = MODELS[name]()
    cost = cm.item_cost(lengths, sp, r, ring)
    got = [cost.compute, cost.recompute, cost.comm, cost.overhead, cost.ideal]
    assert got == pytest.approx(parts, rel=1e-12, abs=1e-300)
    # the analytic models give the very same numbers; a profiled model's coefficients come from a least-squares
    # fit, whose last digits follow the machine's BLAS
    same = (lambda v: v) if name.startswith("a:") else (lambda v: pytest.approx(v, rel=1e-12))
    assert cm.item_time(lengths, sp, r, ring) == same(time)  # the planner's fast path
    assert cm.item_memory(lengths, sp, r, ring) == same(memory)
    assert cm.min_recompute(lengths, sp, ring) == min_rec
    assert cm.item_time_lower(lengths, sp, r, ring) == same(lower)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(MODELS)), st.lists(st.integers(1, 300_000), min_size=0, max_size=5), st.data())
def test_parts_sum_to_the_total_and_arrays_match_scalars(name, lengths, data):
    cm = MODELS[name]()
    sp = data.draw(st.sampled_from(cm.sp_sizes(32)))
    r = data.draw(st.integers(0, cm.num_layers))
    c = cm.linear(sp)
    T, W = cm._sums(lengths)
    cost = c.item_cost(T, W, len(lengths), r)
    assert cost.total == pytest.approx(c.item_time(T, W, len(lengths), r), rel=1e-12)
    Ts = np.array([T, 2.0 * T + 1, 0.0])
    Ws = np.array([W, 4.0 * W + 1, 0.0])
    ns = np.array([len(lengths), 2 * len(lengths) + 1, 0])
    rs = np.array([r, 0, cm.num_layers], dtype=np.float64)
    vec = cm.item_time_sum(Ts, Ws, ns, sp, rs)
    assert vec.tolist() == [cm.item_time_sum(float(t), float(w), int(n), sp, float(x)) for t, w, n, x in zip(Ts, Ws, ns, rs)]
    mem = cm.item_memory_tokens(Ts, sp, rs)
    assert mem.tolist() == [cm.item_memory_tokens(float(t), sp, float(x)) for t, x in zip(Ts, rs)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_closed_forms_are_the_generic_bisection(name):
    cm = MODELS[name]()
    for sp in cm.sp_sizes(32):
        for r in sorted({0, 1, cm.num_layers // 2, cm.num_layers}):
            assert cm.max_length(sp, r) == CostModel.max_length(cm, sp, r)
        for n in (1, 5_000, 80_000, 400_000, 3_000_000):
            assert cm.min_recompute([n], sp) == CostModel.min_recompute(cm, [n], sp)


def test_views_delegate_every_interface_answer():
    base = AnalyticCostModel(get_model("llama-7b"), H100, 32)
    view = DelegatingCostModel(base)
    ls, args = [30_000, 9_000], (16, 5, 2)
    assert view.item_cost(ls, *args) == base.item_cost(ls, *args)
    assert view.item_time_sum(39_000, 9e8 + 8.1e7, 2, *args) == base.item_time_sum(39_000, 9e8 + 8.1e7, 2, *args)
    assert (view.prices_ring, view.fast_paths, view.num_layers, view.memory_limit, view.rounds) == \
        (True, True, base.num_layers, base.memory_limit, base.rounds)
    assert view.sp_splits(32) == base.sp_splits(32)
    # a view that changes the limit answers the limit's questions itself
    low = LoweredMemory(base, base.memory_limit / 4)
    assert low.memory_limit == base.memory_limit / 4 and low.max_length(8) < base.max_length(8)
    assert low.item_memory(ls, *args) == base.item_memory(ls, *args) and "lowered" in low.describe_limit()
    cal = CalibratedCostModel(base, CalibrationFactors(time_scale=((16, 2.0),)))
    assert cal.item_time(ls, *args) == pytest.approx(2.0 * base.item_time(ls, *args))
    assert cal.item_time_lower(ls, *args) == pytest.approx(2.0 * base.item_time_lower(ls, *args))
    assert cal.hardware is base.hardware  # the calibrated view reads through to the base


def test_a_model_without_ring_pricing_says_so_and_gets_the_estimate():
    fake = FakeCostModel()
    assert not fake.prices_ring and fake.sp_splits(32) == {p: (1,) for p in fake.sp_splits(32)}
    with pytest.raises(ValueError, match="prices no ring"):
        fake.item_cost([4000], 4, 0, 4)
    est = fake.ring_cost([4000], 4, 0, 4)  # a peer's pure ring: each rank's share of the SP-1 work
    one, empty = fake.item_cost([4000], 1, 0), fake.item_cost([], 1, 0)
    assert est.compute == pytest.approx(empty.compute + (one.compute - empty.compute) / 4)
    assert fake.ring_memory([4000], 4, 0, 4) == fake.item_memory_tokens(1000, 1, 0)
    with pytest.raises(NotImplementedError, match="fast_paths is False"):
        CostModel.item_time_sum(fake, 1, 1.0, 1, 1, 0)
