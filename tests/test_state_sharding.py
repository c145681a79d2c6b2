"""Sharding the model states (``sharding="none" | "zero1" | "zero2" | "fsdp"``): what each mode frees,
what fsdp costs per micro-batch, the ``zero_stage`` alias, and the measured-profile side."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.profile import ProfileError
from lightning_dcp.planning.profiled import ProfiledCostModel
from lightning_dcp.planning.state_sharding import SHARDING_MODES, resolve_sharding, state_bytes
from test_cost_model import make_profile

H100 = get_hardware("h100")


def analytic(model="llama-7b", world=32, **kw):
    return AnalyticCostModel(get_model(model), H100, world, **kw)


positive = st.floats(1.0, 1e12, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(w=positive, g=positive, o=st.floats(0.0, 1e12), unit_share=st.floats(0.0, 1.0), world=st.integers(1, 4096))
def test_more_sharding_never_holds_more(w, g, o, unit_share, world):
    unit = unit_share * (w + g)
    peak = [state_bytes(m, world, weights=w, grads=g, optimizer=o, unit=unit) for m in SHARDING_MODES]
    rest = [state_bytes(m, world, weights=w, grads=g, optimizer=o, unit=unit, at_rest=True) for m in SHARDING_MODES]
    none, zero1, zero2, fsdp = peak
    assert none >= zero1 == zero2  # zero2 accumulates full-size gradients during the step: same peak as zero1
    assert rest[0] >= rest[1] >= rest[2] >= rest[3]  # at rest every step of sharding holds less (or equal)
    assert all(p >= r for p, r in zip(peak, rest))
    if world == 1:
        assert peak == [w + g + o] * 4  # one rank: nothing to shard over
    if 2 * unit <= (w + g) * (1 - 1 / world):  # many small units: fsdp's two gathered units cost less than it frees
        assert fsdp <= zero2 * (1 + 1e-12)
    assert fsdp <= (w + g + o) / world + (w + g) + 1e-6 * (w + g + o)  # gathered units never exceed one full copy


def test_analytic_states_per_mode_match_the_formulas():
    P, W = get_model("llama-7b").params(), 32
    cms = {m: analytic(sharding=m) for m in SHARDING_MODES}
    assert cms["none"].state_bytes == pytest.approx(16 * P)  # bf16 w + g, fp32 master + Adam m, v
    assert cms["zero1"].state_bytes == pytest.approx(4 * P + 12 * P / W)
    assert cms["zero2"].state_bytes == cms["zero1"].state_bytes
    assert cms["zero2"].state_bytes_at_rest == pytest.approx(2 * P + 14 * P / W)
    unit = max(get_model("llama-7b").layer_params(), get_model("llama-7b").edge_params())
    assert cms["fsdp"].state_bytes == pytest.approx(16 * P / W + 2 * 4 * unit)
    # what is freed goes to activations: the longest sample each SP size holds grows with sharding
    for p in (1, 8, 32):
        lens = [cms[m].max_length(p) for m in SHARDING_MODES]
        assert lens[0] <= lens[1] == lens[2] <= lens[3]
    assert cms["none"].max_length(32) == 0  # 16 bytes per parameter of a 7B model do not fit in 80 GB


def test_zero_stage_is_an_alias_of_sharding():
    for stage, mode in ((0, "none"), (1, "zero1"), (2, "zero2")):
        a, b = analytic(zero_stage=stage), analytic(sharding=mode)
        assert a.sharding == mode and a.zero_stage == stage and a.signature() == b.signature()
        assert a.state_bytes == b.state_bytes and a.item_time([5000, 9000], 2, 3) == b.item_time([5000, 9000], 2, 3)
    assert analytic().sharding == "zero1"  # the analytic model's default (the DCP paper's setting)
    assert analytic(sharding="fsdp").zero_stage == 3
    with pytest.raises(ValueError, match="sharding='fsdp'"):
        analytic(zero_stage=3)
    with pytest.raises(ValueError, match="pass only sharding="):
        analytic(zero_stage=1, sharding="fsdp")
    with pytest.raises(ValueError, match="none, zero1, zero2, fsdp"):
        analytic(sharding="zero3")
    assert resolve_sharding(None, default="none") == "none"


def test_fsdp_charges_weight_traffic_per_micro_batch():
    z1, fs = analytic(sharding="zero1"), analytic(sharding="fsdp")
    P, W = get_model("llama-7b").params(), 32
    extra = [fs.item_cost(ls, p, 0).comm - z1.item_cost(ls, p, 0).comm for ls, p in (([4096], 1), ([30000, 2000], 4))]
    # two all-gathers + one reduce-scatter of the bf16 weights over 32 ranks (inter-node), plus latencies
    want = 3 * (31 / 32 * 2 * P / H100.allreduce_bw_inter + 33 * H100.collective_latency_inter)
    assert extra == pytest.approx([want, want])  # the same for any micro-batch: a constant per micro-batch
    # so splitting a micro-batch in two costs one more round of traffic than under zero1
    split = lambda cm: cm.item_time([8000], 1, 0) * 2 - cm.item_time([8000, 8000], 1, 0)  # noqa: E731
    assert split(fs) - split(z1) == pytest.approx(want)
    # and the step end reduces nothing (the micro-batches did): only the sharded optimizer step
    assert fs.step_overhead(W) < z1.step_overhead(W)
    assert fs.step_overhead(W) == pytest.approx(36.0 * P / W / H100.hbm_bandwidth)
    # the fast path the planner uses agrees
    assert fs.item_time_sum(8000, 8000.0**2, 1, 1, 0) == pytest.approx(fs.item_time([8000], 1, 0))
    assert analytic(world=1, sharding="fsdp").item_cost([4096], 1, 0).comm == 0.0


def profiled(sharding=None, world_size=None, **const):
    base = {"optimizer_bytes": 1.2e10, "unit_param_bytes": 2e8}
    base.update(const)
    return ProfiledCostModel(make_profile(**base), sharding=sharding, world_size=world_size)


def test_profiled_sharding_frees_the_recorded_state_bytes():
    none = ProfiledCostModel(make_profile())  # param_bytes 1e10, memory_bytes 3e10, profile world 8
    assert none.sharding == "none" and none.freed_bytes == 0.0 and none.world_size == 8
    ls = [3000, 5000]
    z1, z2, fs = (profiled(m) for m in ("zero1", "zero2", "fsdp"))
    assert z1.freed_bytes == pytest.approx(1.2e10 * 7 / 8)
    assert z2.freed_bytes == z1.freed_bytes
    assert fs.freed_bytes == pytest.approx((1e10 + 1e10 + 1.2e10) * 7 / 8 - 2 * 2 * 2e8)
    for cm in (z1, fs):
        assert none.item_memory(ls, 2, 0) - cm.item_memory(ls, 2, 0) == pytest.approx(cm.freed_bytes)
        assert cm.max_length(2, 0) > none.max_length(2, 0)
    assert profiled("zero1", world_size=32).freed_bytes == pytest.approx(1.2e10 * 31 / 32)
    # time: the optimizer steps a 1/W shard; fsdp moves 1.5 all-reduces of weights per micro-batch
    assert z1.step_overhead(8) == pytest.approx(0.05 + 0.02 / 8)
    assert fs.step_overhead(8) == pytest.approx(0.02 / 8)
    assert fs.item_cost(ls, 2, 0).comm == pytest.approx(1.5 * 0.05)
    assert fs.item_time(ls, 2, 0) - none.item_time(ls, 2, 0) == pytest.approx(1.5 * 0.05)
    assert profiled("none").item_time(ls, 2, 3) == none.item_time(ls, 2, 3)
    assert fs.signature()["sharding"] == "fsdp"


def test_profiled_sharding_needs_the_state_split():
    with pytest.raises(ProfileError, match="constant.optimizer_bytes"):
        ProfiledCostModel(make_profile(), sharding="zero1")
    with pytest.raises(ProfileError, match="constant.unit_param_bytes"):
        ProfiledCostModel(make_profile(optimizer_bytes=1e10), sharding="fsdp")
    assert ProfiledCostModel(make_profile(optimizer_bytes=1e10), sharding="zero2").freed_bytes > 0
    with pytest.raises(ValueError, match="none, zero1, zero2, fsdp"):
        ProfiledCostModel(make_profile(), sharding="zero-1")
