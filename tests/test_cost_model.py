"""Cost models: hardware registry, analytic physics and calibration, profiled fits, closed forms."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp.planning.analytic import AnalyticCostModel, default_activation_factor
from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.hardware import HARDWARE, HardwareSpec, get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.profile import PROFILE_SCHEMA, ProfileError, save_profile
from lightning_dcp.planning.profiled import ProfiledCostModel, nonneg_fit

L1D = 42
CM = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), 8)
CM2D = AnalyticCostModel(get_model("transformer-2d"), get_hardware("h100"), 8)
SPS = [p for p in CM.sp_sizes(64) if p & (p - 1) == 0]  # [1, 2, 4, 8, 16]: the powers of two among 48's divisors

lengths_st = st.lists(st.integers(1, 600_000), min_size=1, max_size=6)
sp_st = st.sampled_from(SPS)
r_st = st.integers(0, L1D)


# ------------------------------------------------------------------ hardware


def test_hardware_registry():
    assert {"h100", "h200", "a100"} <= set(HARDWARE)
    h100 = get_hardware("h100")
    assert h100.peak_flops == pytest.approx(989.4e12)
    assert h100.usable_memory_bytes < h100.memory_bytes
    assert get_hardware("h200").hbm_bandwidth == 4.8e12
    assert get_hardware("a100").peak_flops == 312e12
    assert get_hardware("h200-80gb").usable_memory_bytes < 80e9
    with pytest.raises(ValueError, match="a100, h100, h200"):
        get_hardware("tpu")


def test_hardware_validation():
    base = get_hardware("h100").to_dict()
    with pytest.raises(ValueError, match="gemm_max_efficiency"):
        HardwareSpec(**{**base, "gemm_max_efficiency": 1.5})
    with pytest.raises(ValueError, match="usable_memory_bytes"):
        HardwareSpec(**{**base, "usable_memory_bytes": base["memory_bytes"] * 2})
    with pytest.raises(ValueError, match="peak_flops"):
        HardwareSpec(**{**base, "peak_flops": 0})


# ------------------------------------------------------------------ analytic: physics


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.integers(1, 50_000), sp_st, r_st)
def test_time_increases_with_length(lengths, extra, sp, r):
    longer = lengths[:-1] + [lengths[-1] + extra]
    assert CM.item_time(longer, sp, r) > CM.item_time(lengths, sp, r)
    assert CM2D.item_time([n * 2 for n in lengths], min(sp, 16), min(r, 28)) > CM2D.item_time(lengths, min(sp, 16), min(r, 28))


@settings(max_examples=60, deadline=None)
@given(lengths_st, sp_st, st.integers(0, L1D - 1))
def test_recompute_costs_time_and_saves_memory(lengths, sp, r):
    assert CM.item_time(lengths, sp, r + 1) > CM.item_time(lengths, sp, r)
    assert CM.item_memory(lengths, sp, r + 1) < CM.item_memory(lengths, sp, r)


@settings(max_examples=60, deadline=None)
@given(lengths_st, r_st)
def test_memory_falls_and_comm_rises_with_sp(lengths, r):
    """Per-rank memory falls with sp; communication grows: in GPU-seconds (sp x time) and as a share of the item.

    (Per-rank all-to-all *time* inside a node falls with sp: each rank sends t(sp-1)/sp of
    t = T/sp tokens -- the Ulysses property -- while the group's total volume T(sp-1)/sp grows.)
    """
    mems = [CM.item_memory(lengths, sp, r) for sp in SPS]
    costs = [CM.item_cost(lengths, sp, r) for sp in SPS]
    assert all(a > b for a, b in zip(mems, mems[1:]))
    assert costs[0].comm == 0.0
    gpu_comm = [sp * c.comm for sp, c in zip(SPS, costs)]
    share = [c.comm / c.total for c in costs]
    assert all(a < b for a, b in zip(gpu_comm, gpu_comm[1:]))
    assert all(a < b for a, b in zip(share, share[1:]))


@settings(max_examples=40, deadline=None)
@given(st.integers(65_536, 1_000_000), r_st)
def test_long_sequences_run_faster_with_more_sp(n, r):
    times = [CM.item_time([n], sp, r) for sp in SPS]
    assert all(a > b for a, b in zip(times, times[1:]))


def test_short_sequences_pay_for_sp():
    """Fig. 5: for a 4k sequence, SP costs more GPU time than it saves, and comm dominates more."""
    t1 = CM.item_time([4096], 1, L1D)
    for sp in SPS[1:]:
        assert sp * CM.item_time([4096], sp, L1D) > 1.2 * t1
    # crossing nodes makes a short sequence slower in wall time too
    assert CM.item_time([4096], 16, L1D) > CM.item_time([4096], 8, L1D)

    def share(n, sp):
        c = CM.item_cost([n], sp, L1D)
        return c.comm / c.total

    for sp in SPS[1:]:
        assert share(4096, sp) > 2 * share(262_144, sp)
    assert share(4096, 16) > 0.25


def test_item_cost_parts_and_fast_paths_agree():
    for lengths in ([8192], [1000, 3000, 50_000], [300_000]):
        T, W = sum(lengths), sum(n * n for n in lengths)
        for sp in SPS:
            for r in (0, 7, L1D):
                c = CM.item_cost(lengths, sp, r)
                t = CM.item_time(lengths, sp, r)
                assert c.total == pytest.approx(t, rel=1e-12)
                assert CM.item_time_sum(T, W, len(lengths), sp, r) == pytest.approx(t, rel=1e-12)
                assert CM.item_memory_tokens(T, sp, r) == CM.item_memory(lengths, sp, r)
                assert 0 < c.ideal < c.compute + c.overhead  # head per-token work is in overhead
                assert c.recompute == pytest.approx(r * CM.item_cost(lengths, sp, 1).recompute, rel=1e-12)
                assert c.comm == pytest.approx((2 * L1D + r) / (2 * L1D) * CM.item_cost(lengths, sp, 0).comm, rel=1e-12)
                assert c.ideal == pytest.approx(CM.item_cost(lengths, 1, 0).ideal / sp)
    # ideal_time is the sum over samples of their one-device ideal
    assert CM.item_cost([4096, 8192], 1, 0).ideal == pytest.approx(CM.ideal_time([4096, 8192]), rel=1e-12)
    assert CM.ideal_time([4096, 8192]) == pytest.approx(
        CM.item_cost([4096], 1, 0).ideal + CM.item_cost([8192], 1, 0).ideal)
    # 2d: sums over attention_work
    ls = [500, 5000, 100_000]
    W2 = sum(CM2D.attention_work(n) for n in ls)
    assert CM2D.item_time_sum(sum(ls), W2, 3, 4, 3) == pytest.approx(CM2D.item_time(ls, 4, 3), rel=1e-12)


def test_2d_attention_work():
    s = get_model("transformer-2d").spatial_tokens
    assert CM2D.attention_work(s // 2) == pytest.approx((s // 2) ** 2 + s // 2)  # one frame
    n = 10 * s  # 10 frames of s tokens: spatial 10*s^2, temporal s*10^2
    assert CM2D.attention_work(n) == pytest.approx(10 * s * s + s * 100)
    works = [CM2D.attention_work(n) for n in range(1, 300_000, 997)]
    assert all(a < b for a, b in zip(works, works[1:]))
    # far cheaper than full 1d attention over a long video
    assert CM2D.attention_work(200_000) < 0.01 * 200_000**2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 400_000), min_size=1, max_size=4), sp_st)
def test_min_recompute_closed_form_matches_bisection(lengths, sp):
    assert CM.min_recompute(lengths, sp) == CostModel.min_recompute(CM, lengths, sp)


def test_max_length_closed_form_matches_bisection_and_grows_with_sp():
    for cm in (CM, CM2D):
        prev = 0
        for sp in cm.sp_sizes(64):
            for r in (0, cm.num_layers // 2, None):
                assert cm.max_length(sp, r) == CostModel.max_length(cm, sp, r)
            m = cm.max_length(sp)
            assert m > prev
            prev = m
            assert cm.fits([m], sp, cm.num_layers) and not cm.fits([m + 1], sp, cm.num_layers)
    tiny = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), 1, memory_limit=10e9)
    assert tiny.max_length(1) == 0 == CostModel.max_length(tiny, 1)  # states alone exceed the limit
    assert tiny.min_recompute([10], 1) is None


def test_calibration_transformer_1d_h100():
    # full recompute on one 80 GB H100 holds 64k-128k tokens
    assert 64 * 1024 <= CM.max_length(1) <= 128 * 1024
    # the longest "long" sequences (up to 512k) need sp 8
    assert CM.max_length(4) < 512 * 1024 <= CM.max_length(8)
    # a 1d layer at 8k tokens in bf16 on one H100: 50-60 % MFU
    assert 0.50 <= CM.mfu([8192]) <= 0.60
    assert 0.45 <= CM.mfu([32768]) <= 0.60
    # dropping full recompute at 8k saves ~20-25 % (paper Fig. 10)
    saving = 1 - CM.item_time([8192], 1, 0) / CM.item_time([8192], 1, L1D)
    assert 0.20 <= saving <= 0.25
    # ... and 8k fits without any recompute on one device
    assert CM.min_recompute([8192], 1) == 0
    assert default_activation_factor(get_model("transformer-1d")) == pytest.approx(2 * (7 + 4 * 8192 / 3072))


def test_memory_model_terms():
    P = get_model("transformer-1d").params()
    W = 8
    assert CM.state_bytes == pytest.approx(2 * P + 2 * P + 12 * P / W)
    z0 = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), W, zero_stage=0)
    z2 = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), W, zero_stage=2)
    # zero2 holds full weights (plus FSDP's shard) and full local gradients in the micro-batch loop:
    # W/N above zero1 there; it holds less only between steps
    assert z0.state_bytes > z2.state_bytes > CM.state_bytes
    assert z2.state_bytes == pytest.approx(CM.state_bytes + 2 * P / W)
    assert z2.state_bytes_at_rest == pytest.approx(2 * P + 2 * P / W + (2 * P + 12 * P) / W)
    assert z2.state_bytes_at_rest < CM.state_bytes_at_rest
    # linear in tokens, paper eq. 6: each recomputed layer frees one layer of stashed activations
    d = CM.item_memory([10_000], 1, 0) - CM.item_memory([10_000], 1, 1)
    assert d == pytest.approx(10_000 * CM.act_bytes_per_token)
    big = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), W, activation_factor=70.0)
    assert big.item_memory([10_000], 1, 0) > CM.item_memory([10_000], 1, 0)
    lim = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h200"), W, memory_limit=80e9)
    assert lim.memory_limit == 80e9


def test_step_overhead():
    so = [CM.step_overhead(w) for w in (1, 2, 8, 16, 64)]
    P = get_model("transformer-1d").params()
    assert so[0] == pytest.approx(36 * P / 3.35e12)  # one device: only the (unsharded) Adam step
    assert so[1] < so[0]  # ZeRO halves the optimizer step; NVLink reduction costs less than that
    assert so[3] > 3 * so[2]  # leaving the node: IB instead of NVLink
    assert so[4] > so[3] * 0.9
    grad = get_model("transformer-1d").params() * 2
    assert CM.step_overhead(16) == pytest.approx(2 * 15 / 16 * grad / 45e9, rel=0.05)
    with pytest.raises(ValueError, match="world_size"):
        CM.step_overhead(0)


def test_analytic_errors_and_signature():
    with pytest.raises(ValueError, match=r"sp=5 does not divide num_heads=48"):
        CM.item_time([1000], 5, 0)
    with pytest.raises(ValueError, match="recompute must be in"):
        CM.item_cost([1000], 1, 43)
    with pytest.raises(ValueError, match="zero_stage"):
        AnalyticCostModel(get_model("tiny-1d"), get_hardware("h100"), 2, zero_stage=3)
    with pytest.raises(ValueError, match="world_size"):
        AnalyticCostModel(get_model("tiny-1d"), get_hardware("h100"), 0)
    sig = CM.signature()
    assert sig["source"] == "analytic" and sig["world_size"] == 8 and sig["model"]["name"] == "transformer-1d"
    json.dumps(sig)
    assert CM.sp_sizes(8) == [1, 2, 3, 4, 6, 8]  # every divisor of the 48 heads


def test_numpy_integers_accepted():
    import numpy as np

    cm = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), np.int64(8))
    lengths = [np.int64(4096), np.int64(70_000)]
    assert cm.item_time(lengths, np.int64(4), np.int64(3)) == CM.item_time([4096, 70_000], 4, 3)
    assert cm.item_memory(lengths, np.int64(2), 1) == CM.item_memory([4096, 70_000], 2, 1)
    assert cm.step_overhead(np.int64(16)) == CM.step_overhead(16)
    assert PM.item_time(lengths, np.int64(2), 1) == PM.item_time([4096, 70_000], 2, 1)


def test_fast_paths_agree_with_the_full_formulas_and_are_monotone():
    """The fast paths (a loop the planner runs thousands of times per step) give the full
    formulas' values and grow with tokens; no timed assertion (shared CI cores)."""
    prev_t = prev_m = -1.0
    for i in range(0, 20_000, 97):
        tokens = 4096 + i
        t = CM.item_time_sum(tokens, 1e8, 2, 8, 10)
        m = CM.item_memory_tokens(tokens, 8, 10)
        assert t > prev_t and m > prev_m
        prev_t, prev_m = t, m
    lengths = [3000, 5000]
    assert CM.item_time_sum(8000, float(sum(n * n for n in lengths)), 2, 8, 10) == pytest.approx(CM.item_time(lengths, 8, 10))
    assert CM.item_memory_tokens(8000, 8, 10) == pytest.approx(CM.item_memory(lengths, 8, 10))


# ------------------------------------------------------------------ profiled

# a synthetic "truth" per sp: per-layer times and bytes linear in (sum l^2, tokens, 1)
TRUTH = {
    1: dict(f=(2e-12, 3e-7, 1e-4), b=(5e-12, 6e-7, 2e-4), act=(1e5, 1e6), inp=(6e3, 0.0)),
    2: dict(f=(1e-12, 1.6e-7, 1.5e-4), b=(2.5e-12, 3.2e-7, 2.5e-4), act=(5e4, 1e6), inp=(3e3, 0.0)),
    4: dict(f=(5e-13, 9e-8, 2.5e-4), b=(1.25e-12, 1.8e-7, 3e-4), act=(2.5e4, 1e6), inp=(1.5e3, 0.0)),
}
GRID = [(1024, 4), (2048, 2), (4096, 1), (4096, 2), (8192, 1), (16384, 1)]


def make_profile(grid=GRID, truth=TRUTH, **const) -> dict:
    entries = []
    for sp, t in truth.items():
        for seq_len, mb in grid:
            sq, tok = mb * seq_len**2, mb * seq_len

            def lin3(c):
                return c[0] * sq + c[1] * tok + c[2]

            entries.append({"seq_len": seq_len, "micro_batch": mb, "sp": sp, "forward_s": lin3(t["f"]),
                            "backward_s": lin3(t["b"]), "activation_bytes": t["act"][0] * tok + t["act"][1],
                            "input_bytes": t["inp"][0] * tok + t["inp"][1], "peak_bytes": None})
    constant = {"time_s": 0.004, "optimizer_s": 0.02, "allreduce_s": 0.05, "memory_bytes": 3e10, "param_bytes": 1e10}
    constant.update(const)
    return {
        "schema": PROFILE_SCHEMA,
        "key": {"model_signature": "synthetic", "device": "test", "dtype": "bfloat16", "world_size": 8,
                "package_version": "0.1.0"},
        "model": {"num_layers": 42, "num_heads": 48, "hidden_size": 3072},
        "device": {"memory_limit_bytes": 80e9, "gpus_per_node": 8},
        "constant": constant,
        "entries": entries,
        "meta": {},
    }


PM = ProfiledCostModel(make_profile())


def test_profiled_fit_recovers_coefficients():
    for sp, t in TRUTH.items():
        fit = PM.fit_summary()[sp]
        for key, name in (("forward", "f"), ("backward", "b"), ("activation", "act"), ("input", "inp")):
            for got, want in zip(fit[key], t[name]):
                assert got == pytest.approx(want, rel=0.01, abs=1e-9 * max(t[name]))


def test_profiled_item_formulas():
    L = 42
    lengths = [3000, 5000]
    sq, tok = sum(n * n for n in lengths), sum(lengths)
    for sp, t in TRUTH.items():
        tf = t["f"][0] * sq + t["f"][1] * tok + t["f"][2]
        tb = t["b"][0] * sq + t["b"][1] * tok + t["b"][2]
        for r in (0, 5, L):
            assert PM.item_time(lengths, sp, r) == pytest.approx(L * (tf + tb) + r * tf + 0.004, rel=1e-6)
            assert PM.item_time_sum(tok, sq, 2, sp, r) == pytest.approx(PM.item_time(lengths, sp, r), rel=1e-12)
            c = PM.item_cost(lengths, sp, r)
            assert c.total == pytest.approx(PM.item_time(lengths, sp, r), rel=1e-12)
            assert c.comm == 0.0
            act = t["act"][0] * tok + t["act"][1]
            inp = t["inp"][0] * tok + t["inp"][1]
            want = 3e10 + L * inp + (L - r) * act + act
            assert PM.item_memory(lengths, sp, r) == pytest.approx(want, rel=1e-6)
        # ideal: sp=1 fitted compute without the fit's per-micro-batch constant, no recompute, / sp
        t1 = TRUTH[1]
        const1 = L * (t1["f"][2] + t1["b"][2])
        assert PM.item_cost(lengths, sp, 0).ideal == pytest.approx((PM.item_cost(lengths, 1, 0).compute - const1) / sp, rel=1e-6)
    assert PM.step_overhead(8) == pytest.approx(0.07)
    assert PM.step_overhead(1) == pytest.approx(0.02)
    assert PM.step_overhead(64) == pytest.approx(0.05 * (63 / 64) / (7 / 8) + 0.02)


def test_profiled_per_sample_term_for_models_that_declare_it():
    """A video DiT projects each sample's text in every block: the profile says ``per_sample_cost`` and the
    fit gets a per-sample term ``d``, which the item time charges per sample (fast path included); any other
    profile's fit has ``d = 0``, as before."""
    d_f, d_b = 3e-4, 5e-4
    profile = make_profile()
    profile["model"]["per_sample_cost"] = True
    for e in profile["entries"]:
        e["forward_s"] += d_f * e["micro_batch"]
        e["backward_s"] += d_b * e["micro_batch"]
    pm = ProfiledCostModel(profile)
    assert pm.per_sample and not PM.per_sample
    L, lengths = 42, [3000, 500, 500]
    sq, tok = sum(n * n for n in lengths), sum(lengths)
    for sp in TRUTH:
        assert pm.fit_summary()[sp]["forward"][3] == pytest.approx(d_f, rel=0.01)
        assert pm.fit_summary()[sp]["backward"][3] == pytest.approx(d_b, rel=0.01)
        assert PM.fit_summary()[sp]["forward"][3] == 0.0
        for r in (0, 7):
            extra = (L * (d_f + d_b) + r * d_f) * len(lengths)
            assert pm.item_time(lengths, sp, r) == pytest.approx(PM.item_time(lengths, sp, r) + extra, rel=1e-3)
            assert pm.item_time_sum(tok, sq, 3, sp, r) == pytest.approx(pm.item_time(lengths, sp, r), rel=1e-12)
            assert pm.item_cost(lengths, sp, r).total == pytest.approx(pm.item_time(lengths, sp, r), rel=1e-12)
    # three samples cost more than one of the same total length: packing many short samples is not free
    assert pm.item_time([1000, 1000, 1000], 1, 0) - PM.item_time([1000, 1000, 1000], 1, 0) > \
        pm.item_time([3000], 1, 0) - PM.item_time([3000], 1, 0)


def test_profiled_sp_sizes_and_closed_forms():
    assert PM.sp_sizes(64) == [1, 2, 4]
    assert PM.sp_sizes(2) == [1, 2]
    with pytest.raises(ValueError, match=r"sp=8 was not measured.*\[1, 2, 4\]"):
        PM.item_time([100], 8, 0)
    for sp in (1, 2, 4):
        for r in (0, 21, None):
            assert PM.max_length(sp, r) == CostModel.max_length(PM, sp, r)
        for n in (1000, 20_000, 100_000, 300_000, 900_000):
            assert PM.min_recompute([n], sp) == CostModel.min_recompute(PM, [n], sp)
    assert PM.max_length(1) < PM.max_length(2) < PM.max_length(4)


def test_profiled_small_grids():
    # a single measured entry still gives a usable model: time proportional to tokens
    one = ProfiledCostModel(make_profile(grid=[(4096, 1)], truth={1: TRUTH[1]}))
    assert one.sp_sizes(8) == [1]
    t = one.item_time([4096], 1, 0)
    assert t == pytest.approx(42 * (TRUTH[1]["f"][0] * 4096**2 + TRUTH[1]["f"][1] * 4096 + TRUTH[1]["f"][2]
                                    + TRUTH[1]["b"][0] * 4096**2 + TRUTH[1]["b"][1] * 4096 + TRUTH[1]["b"][2]) + 0.004)
    assert one.item_time([8192], 1, 0) > t
    # two points with collinear columns (same length, two batch sizes)
    two = ProfiledCostModel(make_profile(grid=[(4096, 1), (4096, 2)], truth={2: TRUTH[2]}))
    assert two.item_time([4096, 4096], 2, 0) == pytest.approx(
        ProfiledCostModel(make_profile(truth={2: TRUTH[2]})).item_time([4096, 4096], 2, 0), rel=1e-6)
    # without sp=1, ideal comes from the smallest measured size scaled up
    c2 = 42 * (TRUTH[2]["f"][2] + TRUTH[2]["b"][2])
    assert two.item_cost([4096], 2, 0).ideal == pytest.approx(two.item_cost([4096], 2, 0).compute - c2, rel=1e-6)


def test_nonneg_fit_clamps():
    import numpy as np

    # data that an unconstrained fit would explain with a negative intercept
    x = np.array([1.0, 2.0, 3.0, 4.0])
    y = np.array([0.5, 1.6, 2.7, 3.8])
    X = np.stack([x * x, x, np.ones_like(x)], axis=1)
    coef = nonneg_fit(X, y, relative=False)
    assert (coef >= 0).all()
    assert np.linalg.lstsq(X, y, rcond=None)[0][2] < 0  # the unconstrained fit would go negative


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda p: p.update(schema="other/v9"), "schema"),
        (lambda p: p.update(entries=[]), "no entries"),
        (lambda p: p["entries"][0].update(forward_s=-1.0), "non-negative"),
        (lambda p: p["entries"][0].pop("input_bytes"), "input_bytes"),
        (lambda p: p["model"].update(num_layers=0), "num_layers"),
        (lambda p: [e.update(sp=5) for e in p["entries"]], r"sp=\[5\].*num_heads=48"),
        (lambda p: [e.update(forward_s=0.0) for e in p["entries"]], "all-zero"),
        (lambda p: p["device"].update(gpus_per_node=0), "gpus_per_node"),
    ],
)
def test_bad_profiles(mutate, match):
    p = make_profile()
    mutate(p)
    with pytest.raises(ProfileError, match=match):
        ProfiledCostModel(p)


def test_profile_files(tmp_path):
    path = save_profile(make_profile(), tmp_path / "p.json")
    m = ProfiledCostModel.from_file(path)
    assert m.item_time([5000], 2, 3) == pytest.approx(PM.item_time([5000], 2, 3))
    json.dumps(m.signature())
    with pytest.raises(ProfileError, match="does not exist"):
        ProfiledCostModel.from_file(tmp_path / "missing.json")
    bad = make_profile()
    for e in bad["entries"]:
        e["sp"] = 5
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"bad\.json.*sp=\[5\]"):
        ProfiledCostModel.from_file(tmp_path / "bad.json")
    assert not math.isnan(m.max_length(1))


def test_analytic_ideal_is_best_rate_compute_without_comm_recompute_or_constants():
    """ItemCost.ideal = GEMMs at max efficiency (no small-GEMM penalty) + attention + element-wise
    passes + head per-token work, no all-to-all, recompute, launch/head constant or all-reduce, / sp."""
    hw, m = CM.hardware, CM.model
    for lengths in ([4096], [1000, 3000, 50_000]):
        T, W = sum(lengths), sum(n * n for n in lengths)
        head = CM._head_s_per_token * T
        assert m.causal
        want = m.num_layers * (3 * 2 * m.layer_params() * T / (hw.peak_flops * hw.gemm_max_efficiency)
                               + (1 + 2.5) * 4 * m.hidden_size * 0.5 * W / (hw.peak_flops * hw.attn_max_efficiency)
                               + 3 * 2 * CM.act_bytes_per_token * T / hw.hbm_bandwidth) + head
        for sp in SPS:
            c = CM.item_cost(lengths, sp, 0)
            assert c.ideal == pytest.approx(want / sp, rel=1e-9)
            # the item's own compute differs from the ideal only by the per-micro-batch constants
            # (small-GEMM penalty, launches) and the head constant
            const = CM.item_cost(lengths, sp, 0).total - c.comm - c.ideal
            assert const == pytest.approx(CM.item_cost([1], sp, 0).total - CM.item_cost([1], sp, 0).comm
                                          - CM.item_cost([1], sp, 0).ideal, rel=1e-6)


def test_profiled_optional_fields_recompute_and_per_token_constants():
    """recompute_s replaces t_f per recomputed layer; time/activation per local token are added."""
    L = 42
    prof = make_profile(time_per_token_s=2e-8, activation_bytes_per_token=6e4)
    rc = {sp: (3e-12, 4e-7, 3e-4) for sp in TRUTH}  # measured recompute: dearer than the forward
    for e in prof["entries"]:
        sq, tok = e["micro_batch"] * e["seq_len"] ** 2, e["micro_batch"] * e["seq_len"]
        c = rc[e["sp"]]
        e["recompute_s"] = c[0] * sq + c[1] * tok + c[2]
    pm = ProfiledCostModel(prof)
    base = PM
    lengths = [3000, 5000]
    sq, tok = sum(n * n for n in lengths), sum(lengths)
    for sp, t in TRUTH.items():
        tf = t["f"][0] * sq + t["f"][1] * tok + t["f"][2]
        trc = rc[sp][0] * sq + rc[sp][1] * tok + rc[sp][2]
        for r in (0, 7, L):
            want = base.item_time(lengths, sp, 0) + r * trc + 2e-8 * tok / sp
            assert pm.item_time(lengths, sp, r) == pytest.approx(want, rel=1e-6)
            assert pm.item_time_sum(tok, sq, 2, sp, r) == pytest.approx(want, rel=1e-9)
            c = pm.item_cost(lengths, sp, r)
            assert c.total == pytest.approx(want, rel=1e-9)
            assert c.recompute == pytest.approx(r * trc, rel=1e-6)
            assert pm.item_memory(lengths, sp, r) == pytest.approx(base.item_memory(lengths, sp, r) + 6e4 * tok / sp, rel=1e-9)
        assert tf < trc
    # closed forms stay consistent with the new terms
    for sp in (1, 2, 4):
        n = pm.max_length(sp)
        assert pm.fits([n], sp, L) and not pm.fits([n + 1], sp, L)
        assert n < PM.max_length(sp)
    # partial recompute_s (one entry lacks it): that SP size falls back to t_f
    prof2 = make_profile()
    prof2["entries"][0]["recompute_s"] = 1.0
    pm2 = ProfiledCostModel(prof2)
    assert pm2.item_time(lengths, 1, 5) == pytest.approx(PM.item_time(lengths, 1, 5), rel=1e-9)
    # validation: negative optional values are rejected, null is accepted
    bad = make_profile(time_per_token_s=-1.0)
    with pytest.raises(ProfileError, match="time_per_token_s"):
        ProfiledCostModel(bad)
    bad = make_profile()
    bad["entries"][0]["recompute_s"] = -0.1
    with pytest.raises(ProfileError, match="recompute_s"):
        ProfiledCostModel(bad)
    ProfiledCostModel(make_profile(activation_bytes_per_token=None))


def test_profiled_model_charges_host_work_per_micro_batch():
    """host_s + host_per_token_s * (whole micro-batch tokens), on every SP size, in time but not in the ideal."""
    base = make_profile()
    with_host = make_profile()
    with_host["constant"].update(host_s=2e-3, host_per_token_s=1e-6)
    a, b = ProfiledCostModel(base), ProfiledCostModel(with_host)
    for sp in a.sp_sizes(8):
        for lengths in ([512], [1024, 2048, 256]):
            extra = 2e-3 + 1e-6 * sum(lengths)
            assert b.item_time(lengths, sp, 0) == pytest.approx(a.item_time(lengths, sp, 0) + extra)
            assert b.item_cost(lengths, sp, 0).ideal == pytest.approx(a.item_cost(lengths, sp, 0).ideal)
            t, q = sum(lengths), sum(n * n for n in lengths)
            assert b.item_time_sum(t, q, len(lengths), sp, 0) == pytest.approx(b.item_time(lengths, sp, 0))


# ---------------------------------------------------------------- Wan-shaped (3d) video DiT


def test_wan_presets_match_the_published_shapes():
    small, big = get_model("wan-1.3b"), get_model("wan-14b")
    assert (small.hidden_size, small.num_layers, small.num_heads, small.ffn_hidden_size) == (1536, 30, 12, 8960)
    assert (big.hidden_size, big.num_layers, big.num_heads, big.ffn_hidden_size) == (5120, 40, 40, 13824)
    assert small.text_len == big.text_len == 512 and small.in_channels == 16 * 1 * 2 * 2
    # diffusers' WanTransformer3DModel counts 1.419e9 and 14.288e9 (biases, norms, modulation tables included)
    assert small.params() == pytest.approx(1.419e9, rel=0.01) and big.params() == pytest.approx(14.288e9, rel=0.01)
    with pytest.raises(ValueError, match="planning and simulation only"):
        from lightning_dcp.models import build_model

        build_model("wan-1.3b")


def test_wan_cross_attention_is_charged_linearly_in_video_tokens():
    from dataclasses import replace

    spec = get_model("wan-1.3b")
    bare = replace(spec, name="wan-1.3b-no-text", text_len=0, text_dim=0)
    cm, cb = AnalyticCostModel(spec, get_hardware("h100"), 8), AnalyticCostModel(bare, get_hardware("h100"), 8)
    h, L, text = spec.hidden_size, spec.num_layers, spec.text_len
    # FLOPs: per layer 2*2*T*text_len*h for QK^T and AV, the q/o projections per video token, the text's k/v
    # projections once per sample, and the text MLP once per sample; forward + 2x backward
    for lengths in ([32760], [1560, 1560, 7800]):
        T, n = sum(lengths), len(lengths)
        want = 3 * (L * (2 * 2 * T * text * h + 2 * 2 * h * h * T + 2 * 2 * h * h * text * n)
                    + 2 * (spec.text_dim + h) * h * text * n)
        assert cm.model_flops(lengths) - cb.model_flops(lengths) == pytest.approx(want, rel=1e-12)
    # self-attention stays l^2 (full 3d attention, no causal mask); the cross term adds no l^2
    assert cm.attention_work(1000) == 1000.0**2 == cb.attention_work(1000)
    extra = [cm.item_cost([n], 1, 0).compute - cb.item_cost([n], 1, 0).compute for n in (2000, 20000, 60000)]
    slope = (extra[1] - extra[0]) / 18000
    assert extra[2] - extra[1] == pytest.approx(slope * 40000, rel=1e-9)  # linear in the video tokens
    hw = get_hardware("h100")
    assert slope >= L * (1 + 2.5) * 4 * text * h / (hw.peak_flops * hw.attn_max_efficiency)
    # the text's keys/values and MLP: once per sample, on every rank of the SP group (not split by sp)
    per_sample = [cm.item_time_sum(40000, 1e9, 2, p, 0) - cm.item_time_sum(40000, 1e9, 1, p, 0) for p in (1, 4)]
    gemm = hw.peak_flops * hw.gemm_max_efficiency
    half = hw.gemm_half_tokens
    want = (L * 3 * 2 * 2 * h * h * (text + half) + 3 * 2 * (spec.text_dim + h) * h * (text + half)) / gemm
    assert per_sample == pytest.approx([want, want])
    ls = [1560, 32760, 7800]
    assert cm.item_time_sum(sum(ls), float(sum(n * n for n in ls)), 3, 4, 5) == pytest.approx(cm.item_time(ls, 4, 5), rel=1e-12)
    assert cm.item_cost(ls, 4, 5).total == pytest.approx(cm.item_time(ls, 4, 5), rel=1e-12)
    # the ideal counts the per-sample text work once (divided by sp), and stays additive over samples
    assert cm.item_cost(ls, 1, 0).ideal == pytest.approx(sum(cm.item_cost([n], 1, 0).ideal for n in ls), rel=1e-12)
    assert cm.item_cost(ls, 1, 0).ideal > cb.item_cost(ls, 1, 0).ideal


def test_wan_simulates_on_the_wan_distribution():
    from lightning_dcp.planning.distributions import get_distribution, video_tokens
    from lightning_dcp.planning.planner import plan
    from lightning_dcp.planning.simulator import simulate

    d = get_distribution("wan")
    xs = d.sample(400, 3)
    assert xs == d.sample(400, 3) and min(xs) >= 1560 and max(xs) <= 75600
    assert [f * hh * ww for f, hh, ww in d.sample_shapes(400, 3)] == xs
    assert video_tokens(81, 720, 1280) == (21, 45, 80) and video_tokens(1, 480, 832) == (1, 30, 52)
    cm = AnalyticCostModel(get_model("wan-1.3b"), get_hardware("h100"), 8)
    assert cm.sp_sizes(8) == [1, 2, 3, 4, 6]  # 12 heads
    p = plan(xs[:40], 8, cm, "dcp", global_batch_tokens=400_000)
    res = simulate(p, cm, timeline=False)
    assert res.tokens == sum(xs[:40]) and 0 < res.fraction_of_bound <= 1 + 1e-9
