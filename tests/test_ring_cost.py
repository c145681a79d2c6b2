"""Ring attention (and Ulysses x ring) in the cost models: lightning_dcp.planning.ring, ``ring=`` on the models,
the SP sizes it adds, and grouped-query all-to-all bytes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.ring import ring_exposed, ring_steps, ring_steps_compute
from lightning_dcp.planning.sp_sizes import kv_repeat, sp_splits

H100 = get_hardware("h100")
LLAMA = AnalyticCostModel(get_model("llama-7b"), H100, 32)  # 32 heads, causal
WAN = AnalyticCostModel(get_model("wan-1.3b"), H100, 32)  # 12 heads, full attention


def test_sp_sizes_of_the_issue_s_head_counts():
    assert list(sp_splits(28, 16, 8, ring=False)) == [1, 2, 4, 7, 14]
    assert list(sp_splits(12, 32, 8, ring=False)) == [1, 2, 3, 4, 6, 12]
    assert list(sp_splits(40, 40, 8, ring=False)) == [1, 2, 4, 5, 8, 10, 20, 40]
    # rings past the heads, each Ulysses subgroup inside a node: 2 heads on 4 ranks is 2 rings of 2
    assert sp_splits(2, 4, 8) == {1: (1,), 2: (1,), 4: (2,)}
    # 24 heads on 32 ranks: 16 and 32 as rings of 8-rank Ulysses groups; 12 and 24 also as Ulysses x ring
    splits = sp_splits(24, 32, 8)
    assert splits[16] == (2,) and splits[32] == (4,) and splits[24] == (1, 3) and splits[8] == (1,)


@pytest.mark.parametrize("heads,kv", [(64, 8), (32, 32), (28, 4), (12, 2), (40, 8)])
def test_kv_repeat_is_the_runtime_rule(heads, kv):
    from lightning_dcp.sp.ulysses import kv_repeat_before_all_to_all

    for u in [d for d in range(1, heads + 1) if heads % d == 0]:
        assert kv_repeat(heads, kv, u) == kv_repeat_before_all_to_all(heads, kv, u)


def test_grouped_query_all_to_all_moves_the_repeated_kv_bytes():
    """Llama-2-70B (8 key/value heads): up to 8 ranks k and v move 1/8 of q's bytes; at 16 ranks they are repeated
    twice before the all-to-all, so they move twice as much per rank-token."""
    spec = get_model("llama-70b")
    gqa = AnalyticCostModel(spec, H100, 16)
    mha = AnalyticCostModel(replace(spec, num_kv_heads=0), H100, 16)
    n = [4_000_000]  # long enough that the collectives' latencies do not matter
    for sp in (2, 8):
        ratio = gqa.item_cost(n, sp, 80).comm / mha.item_cost(n, sp, 80).comm
        assert ratio == pytest.approx((2 + 2 / 8) / 4, rel=0.02)  # latencies aside
    assert gqa.item_cost(n, 16, 80).comm / mha.item_cost(n, 16, 80).comm == pytest.approx((2 + 2 * 2 / 8) / 4, rel=0.02)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 400_000), min_size=1, max_size=5), st.sampled_from([(8, 2), (16, 2), (32, 4), (16, 4)]),
       st.integers(0, 32))
def test_ring_item_is_its_subgroup_s_item_plus_the_ring_steps(lengths, split, r):
    sp, ring = split
    cm = LLAMA
    T, W = sum(lengths), float(sum(n * n for n in lengths))
    u = sp // ring
    terms = cm.ring_terms(sp, ring)
    want = cm.item_time_sum(T / ring, W / ring ** 2, len(lengths), u, r) + ring_steps(terms, T, W, ring, r)
    assert cm.item_time(lengths, sp, r, ring=ring) == pytest.approx(want, rel=1e-12)
    cost = cm.item_cost(lengths, sp, r, ring=ring)
    assert cost.total == pytest.approx(cm.item_time(lengths, sp, r, ring=ring), rel=1e-9)
    exposed = ring_exposed(terms, T, W, ring, r)
    assert exposed >= 0.0 and ring_steps_compute(terms, T, W, ring, r) >= 0.0
    assert cm.item_time_lower(lengths, sp, r, ring=ring) == pytest.approx(cost.total - exposed, rel=1e-9)
    assert cost.ideal == pytest.approx(cm.item_cost(lengths, sp, r).ideal if cm.num_heads % sp == 0
                                       else cm.item_cost(lengths, 1, 0).ideal / sp, rel=1e-9)
    # memory: the subgroup's on 1/ring of the tokens, plus the ring's buffers
    assert cm.item_memory(lengths, sp, r, ring=ring) > cm.item_memory_tokens(T / ring, u, r)


def test_long_sequences_hide_the_ring_transfers_and_short_ones_do_not():
    """Blockwise attention per ring step grows with the block squared, the key/value block linearly: a long
    sample's transfers hide behind compute, a short one's show (communication in the item's cost)."""
    def exposed_share(n: int) -> float:
        c = LLAMA.item_cost([n], 32, 0, ring=4)
        terms = LLAMA.ring_terms(32, 4)
        return ring_exposed(terms, n, float(n) * n, 4, 0) / c.total

    assert exposed_share(1_000_000) == 0.0
    assert exposed_share(4096) > 0.1


def test_causal_masks_halve_the_ring_s_compute_not_its_transfers():
    full = AnalyticCostModel(replace(get_model("llama-7b"), causal=False), H100, 32)
    n, W = 200_000, 200_000.0 ** 2
    a, b = LLAMA.ring_terms(32, 4), full.ring_terms(32, 4)
    assert ring_steps_compute(a, n, W, 4, 0) == pytest.approx(0.5 * ring_steps_compute(b, n, W, 4, 0))
    assert a.kv_bytes_per_token == b.kv_bytes_per_token and a.bandwidth == b.bandwidth


def test_usp_across_nodes_beats_ulysses_across_nodes_for_long_video():
    """Wan 1.3B (12 heads): 12 ranks as three 4-rank Ulysses groups in a ring keep the all-to-alls in a node."""
    n = [75_600]
    assert WAN.item_time(n, 12, 0, ring=3) < WAN.item_time(n, 12, 0)
    assert WAN.item_cost(n, 12, 0, ring=3).comm < 0.2 * WAN.item_cost(n, 12, 0).comm


def test_a_ring_crossing_nodes_uses_the_inter_node_p2p_bandwidth():
    assert LLAMA.ring_terms(8, 2).bandwidth == H100.p2p_bw_intra
    assert LLAMA.ring_terms(16, 2).bandwidth == H100.p2p_bw_inter
    assert LLAMA.ring_terms(16, 2).latency == H100.collective_latency_inter


def test_vectorized_fast_path_matches_scalar():
    T = np.array([1000.0, 50_000.0, 300_000.0])
    W = T * T
    n = np.array([1, 1, 1])
    rc = np.array([0.0, 3.0, 10.0])
    got = LLAMA.item_time_sum(T, W, n, 32, rc, ring=4)
    want = [LLAMA.item_time_sum(float(t), float(w), 1, 32, float(r), ring=4) for t, w, r in zip(T, W, rc)]
    assert np.allclose(got, want, rtol=1e-12)


def test_2d_models_price_no_ring():
    cm = AnalyticCostModel(get_model("transformer-2d"), H100, 32)
    assert not cm.prices_ring and all(c == (1,) for c in cm.sp_splits(32).values())
    with pytest.raises(ValueError, match="no ring pricing"):
        cm.item_time([1000], 32, 0, ring=2)


def test_profiled_model_estimates_rings_from_its_terms_and_the_hardware():
    from test_cost_model import make_profile  # a measured-like profile at SP 1, 2, 4 (48 heads)

    from lightning_dcp.planning.profiled import ProfiledCostModel

    data = make_profile()
    data["model"]["hidden_size"] = 3072
    plain = ProfiledCostModel(data)
    assert not plain.prices_ring and max(plain.sp_splits(16)) == 4
    cm = ProfiledCostModel(data, hardware="h100")
    splits = cm.sp_splits(16)
    assert cm.prices_ring and splits[8] == (2,) and splits[16] == (4,)  # rings of the measured 4-rank groups
    n = [60_000]
    assert cm.item_time(n, 8, 0, ring=2) > cm.item_time_sum(30_000, 30_000.0 ** 2, 1, 4, 0)
    assert cm.item_memory(n, 8, 0, ring=2) < cm.item_memory(n, 4, 0)
    assert cm.with_sharding({"sharding": "none", "world_size": 8}).prices_ring


def test_models_without_the_ring_keyword_are_never_offered_rings():
    from _fakes import FakeCostModel

    from lightning_dcp.planning.planner import Planner

    planner = Planner(16, FakeCostModel(num_heads=4), "dcp")
    assert planner.ring_degrees == {1: 1, 2: 1, 4: 1}
    p = planner.plan_batch(list(range(6)), [30000, 2000, 500, 9000, 100, 40000])
    assert all(it.ring == 1 and it.sp_size <= 4 for it in p.steps[0].items)
