"""Ulysses attention on spawned gloo processes equals single-process varlen attention, with as
many key/value heads as query heads, fewer (GQA), fewer than the SP ranks (MQA), and soft-capping."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_dcp.sp.attention import varlen_attention
from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, SPContext, sp_context
from lightning_dcp.sp.ulysses import seq_all_to_all, ulysses_attention

try:
    from _dist import run_distributed
except ImportError:  # tests/ imported as a package
    from tests._dist import run_distributed

HEADS, DIM = 4, 3


def _packed_problem(lengths, sp, seed, kv_heads=HEADS):
    """Full (unsharded) q, k, v, output-gradient and batch for ``lengths``, padded to a multiple of ``sp``
    (k and v with ``kv_heads`` heads)."""
    total = sum(lengths)
    pad = (-total) % sp
    seg = list(lengths) + ([pad] if pad else [])
    g = torch.Generator().manual_seed(seed)
    q, k, v, gout = (torch.randn(total + pad, HEADS if i in (0, 3) else kv_heads, DIM, generator=g, dtype=torch.float64)
                     for i in range(4))
    cu = torch.tensor([0, *torch.tensor(seg).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, gout, {CU_SEQLENS: cu, MAX_SEQLEN: max(seg)}


def _reference(q, k, v, gout, batch, causal, softcap=None):
    """Single process: key/value heads repeated to the query heads as transformers' ``repeat_kv`` does."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = varlen_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), batch[CU_SEQLENS],
                           batch[MAX_SEQLEN], causal=causal, softcap=softcap)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), gout))


# Per SP-group data: different lengths for every group (the last needs padding for sp 2 and 4).
_GROUP_LENGTHS = [[5, 1, 6, 3], [7, 2, 4], [9], [3, 3, 3, 3]]


def _check_layout(rank, layout):
    """Every rank creates every group of ``layout`` (same order), runs its own group's data, checks its shard."""
    groups = [dist.new_group(ranks) for ranks in layout]
    (gi,) = [i for i, ranks in enumerate(layout) if rank in ranks]
    ranks = layout[gi]
    sp, sp_rank, group = len(ranks), ranks.index(rank), groups[gi]
    # (causal, key/value heads, softcap): MHA, GQA with 2 kv heads (< SP 4), MQA (< SP 2), soft-capped
    for causal, kv_heads, softcap in ((False, HEADS, None), (True, HEADS, None), (True, 2, None), (True, 1, 0.8)):
        q, k, v, gout, batch = _packed_problem(_GROUP_LENGTHS[gi], sp, seed=10 * gi + causal + kv_heads, kv_heads=kv_heads)
        ref = _reference(q, k, v, gout, batch, causal, softcap)
        local = q.shape[0] // sp
        sl = slice(sp_rank * local, (sp_rank + 1) * local)
        ql, kl, vl = (t[sl].clone().requires_grad_() for t in (q, k, v))
        with sp_context(SPContext(group=group, size=sp, rank=sp_rank)):
            out = ulysses_attention(ql, kl, vl, batch, causal=causal, softcap=softcap)
        # Backward outside the context: the all-to-all must have captured its group in forward.
        grads = torch.autograd.grad(out, (ql, kl, vl), gout[sl])
        assert grads[1].shape == kl.shape
        tag = f"rank {rank} group {ranks} causal={causal} kv_heads={kv_heads} softcap={softcap}"
        torch.testing.assert_close(out, ref[0][sl], atol=1e-10, rtol=1e-10, msg=lambda m: f"{tag} out: {m}")
        for name, got, want in zip("qkv", grads, ref[1:]):
            torch.testing.assert_close(got, want[sl], atol=1e-10, rtol=1e-10, msg=lambda m: f"{tag} d{name}: {m}")


def _world4_worker(rank, world_size):
    _check_layout(rank, [[0, 1, 2, 3]])  # one SP group of 4
    _check_layout(rank, [[0, 1], [2, 3]])  # two SP groups of 2 running different data concurrently


def test_ulysses_matches_single_process_world4():
    """sp=4, then two sp=2 groups side by side, against single-process varlen attention (fwd + grads)."""
    run_distributed(_world4_worker, 4)


def _all_to_all_worker(rank, world_size):
    group = dist.group.WORLD
    # [tokens, heads, dim]: scatter heads, gather tokens; and the inverse.
    x = torch.arange(2 * 4 * 2, dtype=torch.float64).reshape(2, 4, 2) + 1000 * rank
    x.requires_grad_()
    y = seq_all_to_all(x, scatter_dim=1, gather_dim=0, group=group)
    assert y.shape == (4, 2, 2)
    full = [torch.arange(16.0).reshape(2, 4, 2) + 1000 * r for r in range(2)]
    expected = torch.cat([f[:, 2 * rank : 2 * rank + 2] for f in full])
    torch.testing.assert_close(y, expected.double())
    back = seq_all_to_all(y, scatter_dim=0, gather_dim=1, group=group)
    torch.testing.assert_close(back, x)
    (g,) = torch.autograd.grad((back * (rank + 1)).sum(), x)
    torch.testing.assert_close(g, torch.full_like(x, rank + 1.0))
    # [batch, seq, heads, dim] layout, group taken from the active context.
    z = torch.randn(3, 2, 4, 5, dtype=torch.float64)
    with sp_context(SPContext(group=group, size=2, rank=rank)):
        zz = seq_all_to_all(seq_all_to_all(z, 2, 1), 1, 2)
    torch.testing.assert_close(zz, z)
    # Errors name both numbers.
    with pytest.raises(ValueError, match=r"heads=3 .* SP size 2"):
        seq_all_to_all(torch.zeros(2, 3, 2), scatter_dim=1, gather_dim=0, group=group)
    with sp_context(SPContext(group=group, size=2, rank=rank)):
        with pytest.raises(ValueError, match=r"heads=3 .*SP size 2"):
            batch = {CU_SEQLENS: torch.tensor([0, 4], dtype=torch.int32), MAX_SEQLEN: 4}
            ulysses_attention(*(torch.zeros(2, 3, 2),) * 3, batch)
        with pytest.raises(ValueError, match=r"covers 6 tokens .* 2 x SP size 2 = 4"):
            batch = {CU_SEQLENS: torch.tensor([0, 6], dtype=torch.int32), MAX_SEQLEN: 6}
            ulysses_attention(*(torch.zeros(2, 4, 2),) * 3, batch)


def _world2_worker(rank, world_size):
    _check_layout(rank, [[0, 1]])
    _all_to_all_worker(rank, world_size)


def test_ulysses_world2_and_seq_all_to_all_layouts():
    """sp=2 Ulysses against the reference, plus seq_all_to_all layouts, round trip, gradient and errors."""
    run_distributed(_world2_worker, 2)


def test_sp_size_one_is_plain_varlen_attention():
    q, k, v, gout, batch = _packed_problem([4, 2, 5], 1, seed=3)
    torch.testing.assert_close(
        ulysses_attention(q, k, v, batch, causal=True),
        varlen_attention(q, k, v, batch[CU_SEQLENS], batch[MAX_SEQLEN], causal=True),
    )
    q, k, v, gout, batch = _packed_problem([4, 2, 5], 1, seed=3, kv_heads=2)  # GQA at SP 1
    torch.testing.assert_close(ulysses_attention(q, k, v, batch, causal=True), _reference(q, k, v, gout, batch, True)[0])
    with pytest.raises(ValueError, match="multiple of the key/value heads 3"):
        ulysses_attention(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), batch)
    assert seq_all_to_all(q, 1, 0) is q
    with pytest.raises(KeyError, match="cu_seqlens"):
        ulysses_attention(q, k, v, {})


def _timer_worker(rank, world_size):
    """Rank 1 sleeps before the forward and before the backward: rank 0's marked spans hold that wait, rank 1's
    do not; one span per all-to-all, forward and backward, and none without an active timer."""
    import time

    from lightning_dcp.sp.comm_timer import AllToAllTimer, set_active

    group = dist.new_group([0, 1])
    x = torch.randn(8, HEADS, DIM, dtype=torch.float64, requires_grad=True)
    with sp_context(SPContext(group=group, size=2, rank=rank)):
        seq_all_to_all(x, scatter_dim=1, gather_dim=0).sum().backward()  # untimed: nothing marked anywhere
        timer = AllToAllTimer()
        set_active(timer)
        try:
            if rank == 1:
                time.sleep(0.3)
            out = seq_all_to_all(x, scatter_dim=1, gather_dim=0)
            loss = (out * out).sum()
            if rank == 1:
                time.sleep(0.3)
            loss.backward()
        finally:
            set_active(None)
    assert len(timer.spans) == 2, timer.spans  # the forward all-to-all and its backward
    waited = [None, None]
    dist.all_gather_object(waited, timer.seconds())
    assert waited[0] - waited[1] > 0.3, waited  # rank 0 waited for rank 1 twice (0.3 s each); rank 1 arrived last


def test_all_to_all_timer_marks_forward_and_backward_with_the_wait():
    run_distributed(_timer_worker, 2)
