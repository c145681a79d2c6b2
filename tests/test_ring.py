"""Ring attention and Ulysses over any group size, exact against single-process attention.

Packed variable-length samples (a padding segment included), causal and full masks, forward and
backward: ``ulysses_attention`` on ``P`` gloo processes (plain Ulysses at SP 3 and 6; ring x Ulysses at
SP 4 on 2 heads, ring 4, ring 3, and at SP 6 ring 2 x 3 and 3 x 2), against ``varlen_attention`` on the
whole sequence in one process. Token layouts contiguous and zigzag; block kernels ``cpu`` and ``math``.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from _dist import run_distributed
from lightning_dcp.planning.plan import WorkItem
from lightning_dcp.runtime.step import RankItem
from lightning_dcp.sp.attention import varlen_attention
from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, sp_context
from lightning_dcp.sp.groups import SPGroups, groups_of_item
from lightning_dcp.sp.ring import block_pieces
from lightning_dcp.sp.tokens import pad_multiple, ring_spans, shard_spans

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [5, 17, 3, 9, 1]  # + a padding segment to the layout's multiple


def _bounds(sp: int, ring: int) -> list[int]:
    total = sum(LENGTHS)
    padded = -(-total // pad_multiple(sp, ring)) * pad_multiple(sp, ring)
    segs = LENGTHS + ([padded - total] if padded > total else [])
    return [0] + list(itertools.accumulate(segs))


@pytest.mark.parametrize("sp,ring", [(4, 2), (4, 4), (6, 2), (6, 3), (3, 3), (8, 2)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
def test_pieces_cover_exactly_the_packed_mask(sp, ring, layout, causal):
    """Over every (query position, key position) pair, the pieces mark exactly the token pairs of one sample
    (and key <= query when causal), each once."""
    rng = random.Random(sp * 10 + ring)
    lengths = [rng.randint(1, 13) for _ in range(rng.randint(1, 6))]
    total = sum(lengths)
    total = -(-total // pad_multiple(sp, ring)) * pad_multiple(sp, ring)
    bounds = [0] + list(itertools.accumulate(lengths))
    bounds = bounds + [total] if bounds[-1] < total else bounds
    seg = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    expect = seg[:, None] == seg[None, :]
    if causal:
        expect &= torch.ones(total, total, dtype=torch.bool).tril()
    got = torch.zeros(total, total, dtype=torch.int64)
    for j in range(ring):
        q_idx = torch.cat([torch.arange(a, b) for a, b in ring_spans(total, j, ring, layout)])
        for jj in range(ring):
            k_idx = torch.cat([torch.arange(a, b) for a, b in ring_spans(total, jj, ring, layout)])
            for p in block_pieces(bounds, ring_spans(total, j, ring, layout), ring_spans(total, jj, ring, layout), causal):
                block = torch.ones(p.q1 - p.q0, p.k1 - p.k0, dtype=torch.int64)
                if p.causal:
                    block = block.tril()
                got[q_idx[p.q0:p.q1, None], k_idx[None, p.k0:p.k1]] += block
    assert torch.equal(got, expect.to(torch.int64))
    # the shards of a Ulysses subgroup, laid end to end, are its ring position's tokens
    u = sp // ring
    for j in range(ring):
        laid = [r for i in range(u) for r in shard_spans(total, j * u + i, sp, ring, layout)]
        flat = [t for a, b in laid for t in range(a, b)]
        assert flat == [t for a, b in ring_spans(total, j, ring, layout) for t in range(a, b)]


def test_groups_of_a_ring_item_are_its_grid():
    assert groups_of_item((0, 1, 2, 3), ring=2) == [(0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3)]
    assert groups_of_item((3, 4, 5), ring=3) == [(3, 4, 5), (3, 4, 5)]
    g = SPGroups(8, rank=1, create=False, sizes=[3])
    assert g.blocks == [(0, 1, 2), (3, 4, 5)]
    items = [WorkItem((0, 1, 2, 3, 4, 5), (1,), (9,), ring=2), WorkItem((5, 6, 7), (2,), (4,))]
    assert g.missing(items) == [(0, 3), (1, 4), (2, 5), (5, 6, 7), (0, 1, 2, 3, 4, 5)]
    assert g.ensure(items) == 5 and g.missing(items) == [] and g.ensure(items) == 0
    with pytest.raises(ValueError, match=r"SP group \[2, 1\] must be distinct increasing ranks"):
        g.missing([WorkItem((2, 1), (0,), (3,))])


def _reference(heads: int, kv_heads: int, causal: bool, bounds: list[int], seed: int):
    total = bounds[-1]
    torch.manual_seed(seed)
    q = torch.randn(total, heads, 8, dtype=torch.float64)
    k = torch.randn(total, kv_heads, 8, dtype=torch.float64)
    v = torch.randn(total, kv_heads, 8, dtype=torch.float64)
    w = torch.randn(total, heads, 8, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    rep = heads // kv_heads
    cu = torch.tensor(bounds, dtype=torch.int32)
    out = varlen_attention(leaves[0], leaves[1].repeat_interleave(rep, 1), leaves[2].repeat_interleave(rep, 1), cu,
                           max(b - a for a, b in zip(bounds, bounds[1:])), causal=causal, backend="sdpa")
    (out * w).sum().backward()
    return (q, k, v, w), out.detach(), [t.grad for t in leaves]


def _check_case(rank: int, world: int, groups: SPGroups, ring: int, heads: int, kv_heads: int, causal: bool,
                layout: str, kernel: str, dtype: torch.dtype, seed: int) -> None:
    import lightning_dcp.sp.ring as ring_mod

    bounds = _bounds(world, ring)
    (q, k, v, w), out_ref, grads_ref = _reference(heads, kv_heads, causal, bounds, seed)
    item = WorkItem(tuple(range(world)), (0,), (bounds[-1],), ring=ring)
    groups.ensure([item])
    it = RankItem.of(item, index=0, micro_batch=0, rank=rank)
    spans = shard_spans(bounds[-1], rank, world, ring, layout)
    idx = torch.cat([torch.arange(a, b) for a, b in spans])
    local = [t[idx].to(dtype).requires_grad_(True) for t in (q, k, v)]
    batch = {CU_SEQLENS: torch.tensor(bounds, dtype=torch.int32), MAX_SEQLEN: max(b - a for a, b in zip(bounds, bounds[1:]))}
    from lightning_dcp.sp.ulysses import ulysses_attention

    before, ring_mod.DEFAULT_KERNEL = ring_mod.DEFAULT_KERNEL, kernel
    try:
        with sp_context(it.sp_context(groups, layout)):
            out = ulysses_attention(*local, batch, causal=causal)
    finally:
        ring_mod.DEFAULT_KERNEL = before
    (out * w[idx].to(dtype)).sum().backward()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    what = f"rank {rank} SP {world} ring {ring} heads {heads}/{kv_heads} causal={causal} {layout} {kernel} {dtype}"
    for name, got, ref in [("out", out, out_ref[idx])] + [(n, t.grad, g[idx]) for n, t, g in zip("qkv", local, grads_ref)]:
        err = float((got.detach().double() - ref).abs().max() / ref.abs().max())
        assert err < tol, f"{what}: {name} relative error {err:.2e}"


def _run_cases(rank: int, world: int, cases: list[tuple]) -> None:
    groups = SPGroups(world, rank, sizes=[world])
    try:
        for n, case in enumerate(cases):
            _check_case(rank, world, groups, *case, seed=n)
    finally:
        groups.destroy()


F32, F64 = torch.float32, torch.float64


def test_ring_at_sp4_on_two_heads_and_ring_four_are_exact():
    """SP 4 on a 2-head model is ring 2 x Ulysses 2 (USP); ring 4 x Ulysses 1 on 1 head; both layouts, both masks."""
    cases = [(2, 2, 2, True, "zigzag", "auto", F32), (2, 2, 2, False, "contiguous", "auto", F32),
             (2, 2, 1, True, "contiguous", "math", F64), (4, 1, 1, True, "zigzag", "math", F64),
             (4, 1, 1, False, "zigzag", "cpu", F32)]
    run_distributed(_run_cases, 4, cases, timeout=240.0)


def test_ulysses_and_ring_on_three_processes_are_exact():
    """Ulysses at SP 3 (6 heads, grouped-query 3 key/value heads) and ring 3 (1 head), causal and full."""
    cases = [(1, 6, 3, True, "contiguous", "auto", F32), (1, 6, 6, False, "contiguous", "auto", F32),
             (3, 1, 1, True, "zigzag", "auto", F32), (3, 2, 2, False, "contiguous", "math", F64)]
    run_distributed(_run_cases, 3, cases, timeout=240.0)


def test_ulysses_and_ring_on_six_processes_are_exact():
    """SP 6: Ulysses on 6 heads, ring 2 x Ulysses 3 on 3 heads, ring 3 x Ulysses 2 on 2 heads."""
    cases = [(1, 6, 6, True, "contiguous", "auto", F32), (2, 3, 3, True, "zigzag", "auto", F32),
             (3, 2, 1, False, "contiguous", "auto", F32), (3, 2, 2, True, "zigzag", "math", F64)]
    run_distributed(_run_cases, 6, cases, timeout=300.0)


def test_zigzag_shards_hold_every_token_once_and_keep_the_loss_exact():
    """A ring item's shards (zigzag, padded to twice the SP size) through the contract's local_batch: every token
    once, and the weighted losses summed over the shards are the item's loss-token sum."""
    from dataclasses import replace

    from _dcp_helpers import TinyLM
    from lightning_dcp.sp.context import LOSS_MASK
    from lightning_dcp.sp.contract import local_batch, read_model
    from lightning_dcp.sp.packing import pack_samples
    from lightning_dcp.sp.tokens import weighted_loss

    samples = [{"input_ids": torch.arange(n) + 100 * i, "labels": torch.arange(n) + 100 * i} for i, n in enumerate((5, 9, 2))]
    contract = replace(read_model(TinyLM()), ring_layout="zigzag")
    whole = pack_samples(samples, pad_to_multiple=pad_multiple(4, 2))
    assert whole[LOSS_MASK].shape[0] == 16
    parts = [local_batch(contract, pack_samples(samples, pad_to_multiple=8), r, 4, "token", ring=2) for r in range(4)]
    assert sum(p.loss_units for p in parts) == 16 and sum(p.real_tokens for p in parts) == 16
    spans = [shard_spans(16, r, 4, 2, "zigzag") for r in range(4)]
    for p, sp in zip(parts, spans):
        assert torch.equal(p.data["input_ids"], torch.cat([whole["input_ids"][a:b] for a, b in sp]))
    got = sum(float(weighted_loss(p.data["labels"].float(), p.data)) for p in parts)
    assert got == float(whole["labels"][whole[LOSS_MASK]].sum())
    hooked = replace(contract, shard_batch=lambda b, r, s: b, ring_layout=None)
    with pytest.raises(ValueError, match="needs ring attention, which TinyLM cannot run: it shards its own batches"):
        local_batch(hooked, pack_samples(samples, pad_to_multiple=8), 0, 4, "token", ring=2)


@pytest.mark.parametrize("sp", [3, 5, 6, 7])
def test_any_sp_size_pads_to_its_multiple_and_shards_every_token_once(sp):
    """The padding rule at SP sizes that are not powers of two: the packed tokens pad to a multiple of the SP size
    (a padding segment of its own), and the contiguous shards are equal and cover them in order."""
    from lightning_dcp.sp.packing import pack_samples
    from lightning_dcp.sp.tokens import shard_batch

    b = pack_samples([{"input_ids": torch.arange(n)} for n in (4, 11, 1)], pad_to_multiple=pad_multiple(sp))
    total = -(-16 // sp) * sp
    assert b["input_ids"].shape[0] == total and b[CU_SEQLENS].tolist()[-1] == total
    assert b[CU_SEQLENS].tolist()[:4] == [0, 4, 15, 16] and (total == 16 or len(b[CU_SEQLENS]) == 5)
    shards = [shard_batch(b, r, sp)["input_ids"] for r in range(sp)]
    assert {s.shape[0] for s in shards} == {total // sp} and torch.equal(torch.cat(shards), b["input_ids"])
