"""Sharding the model states (``sharding="none" | "zero1" | "zero2" | "fsdp"``): the per-rank formulas
(:mod:`lightning_dcp.planning.sharding`, shared by the runtime's ``ModelStates``), what each mode
frees in both cost models, the ``zero_stage`` alias, and ``with_sharding`` (the runtime's hook)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.profile import ProfileError
from lightning_dcp.planning.profiled import ProfiledCostModel
from lightning_dcp.planning.sharding.registry import COST_MODEL_MODES as SHARDING_MODES, resolve_sharding, state_bytes
from lightning_dcp.runtime.sharding.states import ModelStates
from test_cost_model import make_profile

H100 = get_hardware("h100")


def analytic(model="llama-7b", world=32, **kw):
    return AnalyticCostModel(get_model(model), H100, world, **kw)


positive = st.floats(1.0, 1e12, allow_nan=False, allow_infinity=False)
nonneg = st.floats(0.0, 1e12, allow_nan=False, allow_infinity=False)


def per_mode(world, at_rest=False, **parts):
    return [state_bytes(m, world, at_rest=at_rest, **parts) for m in SHARDING_MODES]


def test_the_runtime_table():
    """W=100, B=4, G=100, O=200 on 4 ranks: the micro-batch loop and between steps, every mode."""
    parts = {"weights": 100.0, "buffers": 4.0, "gradients": 100.0, "optimizer": 200.0}
    assert per_mode(4, **parts) == [404.0, 254.0, 279.0, 279.0]  # W+B+G+O; W+B+G+O/N; W+W/N+B+G+O/N (x2)
    assert per_mode(4, at_rest=True, **parts) == [404.0, 254.0, 204.0, 104.0]  # zero2 W+W/N+B+G/N+O/N; fsdp (W+G+O)/N+B
    assert per_mode(1, **parts) == per_mode(1, at_rest=True, **parts) == [404.0] * 4  # one rank runs "none"
    with pytest.raises(ValueError, match="none, zero1, zero2, fsdp"):
        state_bytes("zero3", 4, **parts)


@settings(max_examples=200, deadline=None)
@given(w=positive, b=nonneg, o=nonneg, trainable=st.one_of(st.just(1.0), st.floats(0.0, 1.0)), world=st.integers(1, 4096))
def test_mode_order_in_the_loop_and_between_steps(w, b, o, trainable, world):
    g = trainable * w  # gradients of the trainable share of the weights
    parts = {"weights": w, "buffers": b, "gradients": g, "optimizer": o}
    none, zero1, zero2, fsdp = loop = per_mode(world, **parts)
    rest = per_mode(world, at_rest=True, **parts)
    tol = 1e-9 * (w + b + g + o)
    assert none >= zero1 - tol and zero1 <= zero2 + tol and zero2 == fsdp  # zero2/fsdp pay W/N over zero1 in the loop
    assert all(r <= p + tol for p, r in zip(loop, rest))  # nothing holds more between steps than in the loop
    assert rest[3] <= rest[2] + tol  # fsdp frees the full weights between steps
    if world >= 2 and g * (world - 1) >= w:  # e.g. every weight trainable: more sharding holds less between steps
        assert rest[3] <= rest[2] + tol <= rest[1] + 2 * tol
    if world == 1:
        assert loop == rest == [w + b + g + o] * 4


@settings(max_examples=100, deadline=None)
@given(w=positive, b=nonneg, g=nonneg, o=nonneg, world=st.integers(1, 512), mode=st.sampled_from(SHARDING_MODES))
def test_model_states_and_state_bytes_agree(w, b, g, o, world, mode):
    """The runtime's ModelStates has no formulas of its own: its step/rest bytes are state_bytes'."""
    states = ModelStates(w, b, g, o, sharding=mode, world_size=world)
    parts = {"weights": w, "buffers": b, "gradients": g, "optimizer": o}
    assert states.step_bytes == state_bytes(mode, world, **parts)
    assert states.rest_bytes == state_bytes(mode, world, at_rest=True, **parts)
    assert states.replica_bytes == state_bytes("none", world, **parts)


def test_analytic_states_per_mode_match_the_formulas():
    P, N = get_model("llama-7b").params(), 32
    cms = {m: analytic(sharding=m) for m in SHARDING_MODES}
    assert cms["none"].state_bytes == pytest.approx(16 * P)  # bf16 w + g, fp32 master + Adam m, v
    assert cms["zero1"].state_bytes == pytest.approx(4 * P + 12 * P / N)
    assert cms["zero2"].state_bytes == cms["fsdp"].state_bytes == pytest.approx(4 * P + 2 * P / N + 12 * P / N)
    assert cms["zero2"].state_bytes_at_rest == pytest.approx(2 * P + 2 * P / N + 14 * P / N)
    assert cms["fsdp"].state_bytes_at_rest == pytest.approx(16 * P / N)
    # what is freed in the loop goes to activations: zero1 leaves the longest samples, zero2 = fsdp a little less
    for p in (1, 8, 32):
        lens = [cms[m].max_length(p) for m in SHARDING_MODES]
        assert lens[0] <= lens[2] == lens[3] <= lens[1]
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


def test_no_mode_charges_time_per_micro_batch():
    """No world collective runs inside the loop: micro-batch costs are the same in every mode; the step end
    moves the all-reduce's bytes (zero2/fsdp: a reduce-scatter of G plus an all-gather of W)."""
    cms = {m: analytic(sharding=m) for m in SHARDING_MODES}
    P, N = get_model("llama-7b").params(), 32
    for ls, p in (([4096], 1), ([30000, 2000], 4)):
        costs = {m: cm.item_cost(ls, p, 0) for m, cm in cms.items()}
        assert len({(c.compute, c.comm, c.overhead) for c in costs.values()}) == 1
        assert len({cm.item_time(ls, p, 3) for cm in cms.values()}) == 1
    # bf16 gradients (and weights) over 4 nodes, two latencies per 500 MB bucket, Adam on a 1/N shard
    comm = 2 * 31 / 32 * 2 * P / H100.allreduce_bw_inter + 2 * math.ceil(2 * P / 5e8) * H100.collective_latency_inter
    optimizer = 36.0 * P / N / H100.hbm_bandwidth
    for m in ("zero1", "zero2", "fsdp"):
        assert cms[m].step_overhead(N) == pytest.approx(comm + optimizer)
    assert cms["none"].step_overhead(N) > cms["fsdp"].step_overhead(N)  # the unsharded optimizer step
    assert analytic(world=1, sharding="fsdp").step_overhead(1) == pytest.approx(36.0 * P / H100.hbm_bandwidth)


def test_analytic_with_sharding_plans_with_the_runtime_states():
    base = analytic(sharding="zero1", world=32, memory_limit=70e9)
    runtime = ModelStates(1.3e10, 2e6, 1.3e10, 5.4e10, sharding="fsdp", world_size=16)
    cm = base.with_sharding(runtime.to_dict())
    assert isinstance(cm, AnalyticCostModel) and cm.sharding == "fsdp" and cm.world_size == 16
    assert cm.state_bytes == pytest.approx(runtime.step_bytes) and cm.state_bytes_at_rest == pytest.approx(runtime.rest_bytes)
    assert (cm.model, cm.hardware, cm.memory_limit, cm.activation_factor) == (
        base.model, base.hardware, 70e9, base.activation_factor)
    assert cm.item_time([5000, 9000], 2, 3) == base.item_time([5000, 9000], 2, 3)  # same costs, other static memory
    room = base.item_memory([5000], 2, 0) - cm.item_memory([5000], 2, 0)
    assert room == pytest.approx(base.state_bytes - runtime.step_bytes)
    assert cm.with_sharding(runtime.to_dict()).signature() == cm.signature()  # idempotent (the runtime may re-apply)
    # without measured bytes: the model-shape estimate under the runtime's mode
    bare = base.with_sharding({"sharding": "zero2", "world_size": 32})
    assert bare.state_bytes == analytic(sharding="zero2").state_bytes
    with pytest.raises(ValueError, match="optimizer missing"):
        analytic(state_parts={"weights": 1.0, "buffers": 0.0, "gradients": 1.0})


def profiled(sharding=None, world_size=None, **const):
    base = {"weight_bytes": 1.1e10, "buffer_bytes": 1e8, "optimizer_bytes": 1.2e10}  # param_bytes 1e10: 1e9 frozen
    base.update(const)
    return ProfiledCostModel(make_profile(**base), sharding=sharding, world_size=world_size)


def test_profiled_sharding_frees_the_recorded_state_bytes():
    none = ProfiledCostModel(make_profile())  # param_bytes 1e10, memory_bytes 3e10, profile world 8
    assert none.sharding == "none" and none.freed_bytes == 0.0 and none.world_size == 8
    ls = [3000, 5000]
    z1, z2, fs = (profiled(m) for m in ("zero1", "zero2", "fsdp"))
    assert z1.freed_bytes == pytest.approx(1.2e10 * 7 / 8)  # O - O/N
    assert z2.freed_bytes == fs.freed_bytes == pytest.approx(1.2e10 * 7 / 8 - 1.1e10 / 8)  # ... - W/N (all weights)
    for cm in (z1, z2, fs):
        assert none.item_memory(ls, 2, 0) - cm.item_memory(ls, 2, 0) == pytest.approx(cm.freed_bytes)
        assert cm.max_length(2, 0) > none.max_length(2, 0)
    assert z1.max_length(2, 0) >= fs.max_length(2, 0)
    assert profiled("zero1", world_size=32).freed_bytes == pytest.approx(1.2e10 * 31 / 32)
    # time: the optimizer steps a 1/N shard; every mode pays the measured all-reduce once per step, nothing per micro-batch
    for cm in (z1, z2, fs):
        assert cm.step_overhead(8) == pytest.approx(0.05 + 0.02 / 8)
        assert cm.item_cost(ls, 2, 0).comm == 0.0 and cm.item_time(ls, 2, 3) == none.item_time(ls, 2, 3)
    assert fs.signature()["sharding"] == "fsdp" and fs.signature()["freed_bytes"] == fs.freed_bytes


def test_profiled_sharding_needs_the_state_split():
    with pytest.raises(ProfileError, match="constant.optimizer_bytes"):
        ProfiledCostModel(make_profile(), sharding="zero1")
    with pytest.raises(ProfileError, match="constant.weight_bytes"):
        ProfiledCostModel(make_profile(optimizer_bytes=1e10), sharding="fsdp")
    assert ProfiledCostModel(make_profile(optimizer_bytes=1e10), sharding="zero1").freed_bytes > 0
    with pytest.raises(ValueError, match="none, zero1, zero2, fsdp"):
        ProfiledCostModel(make_profile(), sharding="zero-1")


def test_profiled_with_sharding_plans_with_the_runtime_states():
    """An older profile (no state split) works under the runtime: with_sharding brings the measured bytes."""
    old = ProfiledCostModel(make_profile(), memory_limit=60e9)  # param_bytes, memory_bytes only
    runtime = ModelStates(1e10, 0.0, 1e10, 1e10, sharding="fsdp", world_size=4)  # memory_bytes 3e10 = the replica
    cm = old.with_sharding(runtime.to_dict())
    assert isinstance(cm, ProfiledCostModel) and (cm.sharding, cm.world_size, cm.memory_limit) == ("fsdp", 4, 60e9)
    assert cm.freed_bytes == pytest.approx(runtime.replica_bytes - runtime.step_bytes)
    ls = [3000, 5000]
    assert old.item_memory(ls, 2, 0) - cm.item_memory(ls, 2, 0) == pytest.approx(runtime.replica_bytes - runtime.step_bytes)
    assert cm.item_time(ls, 2, 3) == old.item_time(ls, 2, 3)
    assert cm.with_sharding(runtime.to_dict()).signature() == cm.signature()  # idempotent (the runtime may re-apply)
    assert old.with_sharding(ModelStates(1e10, 0.0, 1e10, 1e10).to_dict()).freed_bytes == 0.0  # "none"
    # a new profile without measured bytes in states: the profile's own split
    new = profiled()
    assert new.with_sharding({"sharding": "zero2", "world_size": 8}).freed_bytes == profiled("zero2").freed_bytes


def test_with_sharding_keeps_a_users_subclass():
    """A user's subclass of a cost model keeps its overrides when the runtime re-plans it for its sharding."""
    class Mine(AnalyticCostModel):
        def step_overhead(self, world_size: int) -> float:
            return 42.0

    mine = Mine(get_model("transformer-1d"), get_hardware("h100"), 8)
    states = {"sharding": "zero1", "world_size": 4, "weights": 1e9, "buffers": 0.0, "gradients": 1e9, "optimizer": 2e9}
    got = mine.with_sharding(states)
    assert type(got) is Mine and got.step_overhead(4) == 42.0
    assert got.sharding == "zero1" and got.world_size == 4 and got.state_bytes == pytest.approx(1e9 + 1e9 + 2e9 / 4)
