"""varlen_attention against a naive per-segment softmax reference (CPU, float64)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp.sp.attention import BACKENDS, _group_segments, attention_backend, varlen_attention


def naive_varlen(q, k, v, cu_seqlens, causal=False, scale=None, softcap=None):
    """Per segment, per head: softmax(q k^T * scale [soft-capped] [+ causal mask]) v."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = []
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, L, d]
        scores = qs @ ks.transpose(-1, -2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if causal:
            n = b - a
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(out) if out else q.new_empty(0, q.shape[1], v.shape[2])


def _inputs(lengths, heads=3, dim=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, max(lengths)


def _check(lengths, causal, scale=None, dtype=torch.float64, atol=1e-10, softcap=None):
    q, k, v, cu, mx = _inputs(lengths, dtype=dtype)
    g = torch.randn(q.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    out = varlen_attention(q, k, v, cu, mx, causal=causal, scale=scale, softcap=softcap, backend="sdpa")
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = naive_varlen(q, k, v, cu, causal=causal, scale=scale, softcap=softcap)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=atol, rtol=atol)


LAYOUTS = {
    "single": [7],
    "equal": [4, 4, 4],
    "mixed": [5, 1, 3, 8, 2],
    "with_empty": [3, 0, 4, 0],
    "one_long_many_short": [40, 1, 2, 3, 2, 1, 3],
    "padding_tail": [6, 5, 1],  # e.g. a 1-token padding segment the strategy appended
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_sdpa_matches_naive(layout, causal):
    _check(LAYOUTS[layout], causal)


def test_scale_and_float32():
    _check([3, 5, 2], causal=True, scale=0.37)
    _check([3, 5, 2], causal=False, dtype=torch.float32, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["single", "mixed", "with_empty", "one_long_many_short"])
def test_softcap_matches_naive(layout, causal):
    """Logit soft-capping (Gemma 2): scores -> cap * tanh(scores / cap) before the mask and softmax, forward and grads."""
    _check(LAYOUTS[layout], causal, softcap=0.7)
    _check(LAYOUTS[layout], causal, scale=0.37, softcap=2.0)


def test_softcap_changes_the_result_and_bad_values_raise():
    q, k, v, cu, mx = _inputs([5, 3])
    capped = varlen_attention(q, k, v, cu, mx, causal=True, softcap=0.5)
    assert (capped - varlen_attention(q, k, v, cu, mx, causal=True)).abs().max() > 1e-2
    torch.testing.assert_close(varlen_attention(q, k, v, cu, mx, softcap=0.0), varlen_attention(q, k, v, cu, mx))
    with pytest.raises(ValueError, match="softcap must be positive"):
        varlen_attention(q, k, v, cu, mx, softcap=-1.0)
    with pytest.raises(RuntimeError, match="no logit soft-capping"):
        varlen_attention(q, k, v, cu, mx, softcap=0.5, backend="torch-varlen")


def test_gradcheck_float64():
    q, k, v, cu, mx = _inputs([2, 1, 3], heads=1, dim=2)
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v: varlen_attention(q, k, v, cu, mx, causal=causal, backend="sdpa"), (q, k, v)
        )


def test_no_cross_segment_leak():
    q, k, v, cu, mx = _inputs([4, 4])
    out = varlen_attention(q, k, v, cu, mx)
    with torch.no_grad():
        v2 = v.clone()
        v2[4:] += 100.0  # changing the second segment must not move the first one's output
    out2 = varlen_attention(q, k, v2, cu, mx)
    torch.testing.assert_close(out[:4], out2[:4])
    assert not torch.allclose(out[4:], out2[4:])


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=8).filter(lambda ls: sum(ls) > 0),
    causal=st.booleans(),
)
def test_sdpa_matches_naive_random(lengths, causal):
    _check(lengths, causal)


def test_grouping_covers_every_nonempty_segment_once():
    lengths = [100, 1, 0, 2, 50, 50, 3, 100, 7]
    groups = _group_segments(lengths)
    flat = sorted(i for g in groups for i in g)
    assert flat == [i for i, n in enumerate(lengths) if n > 0]
    for g in groups:  # the first of each group is its longest member
        assert lengths[g[0]] == max(lengths[i] for i in g)


def test_backend_selection_and_errors():
    assert attention_backend("cpu") == "sdpa"
    assert attention_backend("cuda", torch.float32) == "sdpa"
    assert set(BACKENDS) == {"auto", "flash", "torch-varlen", "sdpa"}
    q, k, v, cu, mx = _inputs([2, 3])
    torch.testing.assert_close(varlen_attention(q, k, v, cu, mx), varlen_attention(q, k, v, cu, mx, backend="sdpa"))
    with pytest.raises(ValueError, match="unknown backend"):
        varlen_attention(q, k, v, cu, mx, backend="xformers")
    with pytest.raises(RuntimeError, match="CUDA|flash_attn"):
        varlen_attention(q, k, v, cu, mx, backend="flash")
    with pytest.raises(RuntimeError, match="CUDA|varlen_attn"):
        varlen_attention(q, k, v, cu, mx, backend="torch-varlen")
    with pytest.raises(ValueError, match="total_tokens=5"):
        varlen_attention(q, k, v, torch.tensor([0, 2, 4], dtype=torch.int32), mx)
    with pytest.raises(ValueError, match=r"\[total_tokens, heads, head_dim\]"):
        varlen_attention(q[None], k[None], v[None], cu, mx)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_backends_match_sdpa(causal):
    backend = attention_backend("cuda", torch.bfloat16)
    lengths = [37, 5, 128, 1, 64]
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, 4, 64, generator=g).cuda().bfloat16().requires_grad_() for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out = varlen_attention(q, k, v, cu, max(lengths), causal=causal)
    (gq, gk, gv) = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive_varlen(*(t.cpu() for t in ref_in), cu.cpu(), causal=causal)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_in)
    tol = dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.double().cpu(), ref, **tol)
    for a, b in zip((gq, gk, gv), ref_grads):
        torch.testing.assert_close(a.double().cpu(), b.cpu(), atol=0.1 * max(1.0, b.abs().max().item()), rtol=0.1)
    print(f"backend={backend}")
    assert math.isfinite(out.float().sum().item())
