"""Ring attention over packed variable-length samples, exact in forward and backward (the ring half of USP).

A ring item (``WorkItem.ring = r > 1``) runs its SP group of ``r * u`` ranks as ``r`` Ulysses subgroups of
``u`` ranks (:class:`~lightning_dcp.sp.context.RingGrid`). :func:`~lightning_dcp.sp.ulysses.ulysses_attention`
first trades, inside the subgroup, this rank's tokens for all of its subgroup's tokens of ``heads / u``
heads (DeepSpeed's all-to-all); :func:`ring_attention` then computes attention of those queries against
the keys and values of *every* subgroup: the ``r`` ranks at the same Ulysses position form a ring, and
each of ``r`` steps computes one key/value block while the block moves on to the next rank (P2P,
``batch_isend_irecv``, overlapping the compute). This is USP (Fang & Zhao, 2024); ``u = 1`` is plain ring
attention, ``r = 1`` never comes here.

**Exactness.** Every block's partial softmax is merged by its log-sum-exp (``lse``): ``out = sum_b
exp(lse_b - lse) out_b`` with ``lse = logsumexp_b lse_b``, in fp32 (fp64 for fp64 inputs). Backward runs the ring again: each
block's gradient is the attention backward of that block with the *global* ``out`` and ``lse`` (the
probabilities ``exp(S - lse)`` restricted to the block's keys, and ``D = rowsum(dO * out)``), which is
the exact gradient of the full attention; the key/value gradients travel with their block and reach
its owner after ``r`` hops, as in ring-flash-attn.

**Packing.** Which query may see which key comes from the *global* ``cu_seqlens`` and the global token
ranges each ring position holds (:func:`~lightning_dcp.sp.tokens.ring_spans`, the contiguous or zigzag
layout the batch was sharded with). A block pair splits into pieces, one per packed sample that has
tokens in both: two different ranges of one sample are either all-before (full attention) or
all-after (nothing, when causal); a range against itself is the causal diagonal. No mask is ever
built, and a piece runs on a standard fused kernel:

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which take the global
  ``out`` and ``lse`` as they are (PyTorch's own kernels, the ones its context-parallel API drives);
* elsewhere ``"math"``: the same computation written out in fp32, memory ``heads x lq x lk`` per piece
  (a CUDA kernel that returns ``lse`` -- flash-attn's varlen forward/backward -- is the follow-up; ring
  items are checked on CPU only).

**Why our own loop** (checked 2026-11-27): ring-flash-attn (zhuzilin) and yunchang (USP) do exactly this
but only on flash-attn's CUDA kernels (imported unconditionally), and their varlen variants need each
sample's length to divide ``2r`` (zigzag per sample) or all-gather the keys (llama3 variant); none runs
on CPU/gloo. torch's context parallel (``torch.distributed.tensor.experimental.context_parallel``) rings
SDPA only through the CUDA flash/efficient/cuDNN ops with ``is_causal`` and no document mask (its flex
path all-gathers keys and needs compiled flex attention), works on a DeviceMesh of the whole CP group
and patches SDPA globally -- it fits neither our per-item groups nor packed samples. The loop here is
~250 lines over PyTorch's own kernels and ``torch.distributed`` P2P, tested against single-process
attention (``tests/test_ring.py``).

Limits: no logit soft-capping, no dropout; grouped-query key/value heads are repeated to the query
heads before the ring (P2P bytes grow by that factor).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from lightning_dcp.sp.comm_timer import active_timer
from lightning_dcp.sp.context import RingGrid
from lightning_dcp.sp.tokens import ring_spans

__all__ = ["DEFAULT_KERNEL", "KERNELS", "Piece", "block_pieces", "ring_attention"]

#: Local block kernels: ``"auto"`` (``"cpu"`` on CPU, ``"math"`` elsewhere), ``"cpu"``, ``"math"``.
KERNELS = ("auto", "cpu", "math")

#: The kernel :func:`ring_attention` uses when none is passed (the attention helpers pass none).
DEFAULT_KERNEL = "auto"

#: Bytes of the fp32 scores a ``"math"`` piece may hold at once; longer pieces are tiled over queries.
_MATH_TILE_BYTES = 256 * 2 ** 20


@dataclass(frozen=True)
class Piece:
    """One sample's part of a (query block, key block) pair: local rows ``[q0, q1)`` of the query block against
    rows ``[k0, k1)`` of the key block, causal on the diagonal (the same token range) or full."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def block_pieces(bounds: Sequence[int], q_spans: Sequence[tuple[int, int]], k_spans: Sequence[tuple[int, int]],
                 causal: bool) -> list[Piece]:
    """The pieces of a query block holding the global token ranges ``q_spans`` (laid end to end) against a key
    block holding ``k_spans``, for packed samples with boundaries ``bounds`` (``cu_seqlens`` as a list).

    Ranges of one layout never overlap partly: two ranges are the same or disjoint (checked). Two disjoint
    ranges share at most one sample (the one holding both the last token of the earlier range and the first
    of the later), so a block pair costs one piece per sample of a range against itself, one per range pair
    otherwise."""
    pieces: list[Piece] = []
    oq = 0
    for a, b in q_spans:
        ok = 0
        for c, d in k_spans:
            if (a, b) == (c, d):
                first = bisect.bisect_right(bounds, a) - 1
                for s in range(first, len(bounds) - 1):
                    s0, s1 = bounds[s], bounds[s + 1]
                    if s0 >= b:
                        break
                    lo, hi = max(a, s0), min(b, s1)
                    if lo < hi:
                        pieces.append(Piece(oq + lo - a, oq + hi - a, ok + lo - c, ok + hi - c, causal))
            elif max(a, c) < min(b, d):
                raise ValueError(f"ring attention: token ranges [{a}, {b}) and [{c}, {d}) overlap without being equal")
            elif not (causal and c >= b):  # under a causal mask keys after the queries are invisible
                early_end, late_start = (d, a) if d <= a else (b, c)
                s = bisect.bisect_right(bounds, early_end - 1) - 1  # the sample of the earlier range's last token
                s0, s1 = bounds[s], bounds[s + 1]
                if s1 > late_start:  # it reaches into the later range
                    qa, qb, ka, kb = max(a, s0), min(b, s1), max(c, s0), min(d, s1)
                    pieces.append(Piece(oq + qa - a, oq + qb - a, ok + ka - c, ok + kb - c, False))
            ok += d - c
        oq += b - a
    return pieces


# ---------------------------------------------------------------------------------------------- kernels

def _kernel(name: str, device: torch.device) -> str:
    if name not in KERNELS:
        raise ValueError(f"ring attention: unknown kernel {name!r}; use one of {KERNELS}")
    if name == "auto":
        return "cpu" if device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") else "math"
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"ring attention kernel 'cpu' needs CPU tensors, got {device}; use 'auto' or 'math'")
    return name


def _bhld(t: torch.Tensor) -> torch.Tensor:
    """``[L, H, d]`` -> ``[1, H, L, d]``."""
    return t.transpose(0, 1).unsqueeze(0)


def _lhd(t: torch.Tensor) -> torch.Tensor:
    """``[1, H, L, d]`` -> ``[L, H, d]``."""
    return t.squeeze(0).transpose(0, 1)


def _acc(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype for inputs like ``t``: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def _math_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, row0: int) -> torch.Tensor:
    """Scores ``[H, lq, lk]`` (fp32 or fp64) of query rows ``row0..`` (causal: key ``j`` visible to row ``i`` iff
    ``j <= i``)."""
    s = torch.einsum("qhd,khd->hqk", q.to(_acc(q)), k.to(_acc(q))) * scale
    if causal:
        rows = torch.arange(row0, row0 + q.shape[0], device=q.device)[:, None]
        s = s.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > rows, float("-inf"))
    return s


def _tiles(lq: int, lk: int, heads: int) -> range:
    step = max(1, _MATH_TILE_BYTES // max(1, 4 * heads * lk))
    return range(0, lq, step)


def _forward_piece(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [lq, H, d], lse [H, lq])`` of one piece, in the accumulation dtype."""
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(_bhld(q), _bhld(k), _bhld(v), 0.0, causal,
                                                                              scale=scale)
        return _lhd(out).to(_acc(q)), lse.squeeze(0).to(_acc(q))
    outs, lses = [], []
    step = _tiles(q.shape[0], k.shape[0], q.shape[1]).step
    for t in range(0, q.shape[0], step):
        s = _math_scores(q[t:t + step], k, causal, scale, t)
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v.to(s.dtype)))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _backward_piece(kernel: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one piece given the *global* ``out`` ``[lq, H, d]`` and ``lse`` ``[H, lq]`` of its rows."""
    if kernel == "cpu":
        lse = lse.to(_acc(q))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhld(dout), _bhld(q), _bhld(k), _bhld(v), _bhld(out), lse.unsqueeze(0), 0.0, causal, scale=scale)
        return _lhd(dq), _lhd(dk), _lhd(dv)
    acc = _acc(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    kf, vf = k.to(acc), v.to(acc)
    step = _tiles(q.shape[0], k.shape[0], q.shape[1]).step
    for t in range(0, q.shape[0], step):
        rows = slice(t, t + step)
        qf, do, o = q[rows].to(acc), dout[rows].to(acc), out[rows].to(acc)
        p = torch.exp(_math_scores(qf, kf, causal, scale, t) - lse[:, rows, None])  # [H, lq, lk]
        dv += torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, vf)
        ds = p * (dp - (do * o).sum(-1).transpose(0, 1)[..., None])
        dq[rows] = torch.einsum("hqk,khd->qhd", ds, kf) * scale
        dk += torch.einsum("hqk,qhd->khd", ds, qf) * scale
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------- the ring

@dataclass(frozen=True)
class _Ring:
    """What one ring-attention call needs, captured in forward for backward (the strategy moves on)."""

    grid: RingGrid
    position: int
    pieces: tuple[tuple[Piece, ...], ...]  # per ring step t: the pieces against the block of position - t
    scale: float
    kernel: str
    timer: Any

    @property
    def next_rank(self) -> int:
        return self.grid.ring_ranks[(self.position + 1) % self.grid.degree]

    @property
    def prev_rank(self) -> int:
        return self.grid.ring_ranks[(self.position - 1) % self.grid.degree]

    def shift(self, send: torch.Tensor, tag: int = 0) -> "_Pending":
        """Start sending ``send`` to the next rank of the ring and receiving the previous rank's (same shape)."""
        recv = torch.empty_like(send)
        group = self.grid.ring_group
        start = self.timer.mark() if self.timer is not None else None
        ops = [dist.P2POp(dist.isend, send, self.next_rank, group, tag),
               dist.P2POp(dist.irecv, recv, self.prev_rank, group, tag)]
        return _Pending(dist.batch_isend_irecv(ops), recv, self.timer, start)


class _Pending:
    """An in-flight ring shift: :meth:`wait` returns the received tensor."""

    def __init__(self, works: list, recv: torch.Tensor, timer: Any, start: Any) -> None:
        self.works, self.recv, self.timer, self.start = works, recv, timer, start

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        if self.timer is not None:
            self.timer.add(self.start, self.timer.mark())
        return self.recv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring) -> torch.Tensor:
        r = ring.grid.degree
        acc = _acc(q)
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=acc, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
        kv = torch.cat([k, v], dim=-1).contiguous()
        dk_ = k.shape[-1]
        for t in range(r):
            pending = ring.shift(kv) if t < r - 1 else None
            kb, vb = kv[..., :dk_], kv[..., dk_:]
            for p in ring.pieces[t]:
                o_p, l_p = _forward_piece(ring.kernel, q[p.q0:p.q1], kb[p.k0:p.k1], vb[p.k0:p.k1], p.causal, ring.scale)
                old = lse[:, p.q0:p.q1]
                new = torch.logaddexp(old, l_p)
                out[p.q0:p.q1] = (out[p.q0:p.q1] * torch.exp(old - new).transpose(0, 1)[..., None]
                                  + o_p * torch.exp(l_p - new).transpose(0, 1)[..., None])
                lse[:, p.q0:p.q1] = new
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        r = ring.grid.degree
        dout = dout.contiguous()
        acc = _acc(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk_, dv_ = k.shape[-1], v.shape[-1]
        kv = torch.cat([k, v], dim=-1).contiguous()
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # the grads of the block held now
        for t in range(r):
            pending = ring.shift(kv) if t < r - 1 else None
            kb, vb = kv[..., :dk_], kv[..., dk_:]
            for p in ring.pieces[t]:
                g = _backward_piece(ring.kernel, dout[p.q0:p.q1], q[p.q0:p.q1], kb[p.k0:p.k1], vb[p.k0:p.k1],
                                    out[p.q0:p.q1], lse[:, p.q0:p.q1], p.causal, ring.scale)
                dq[p.q0:p.q1] += g[0].to(acc)
                dkv[p.k0:p.k1, :, :dk_] += g[1].to(acc)
                dkv[p.k0:p.k1, :, dk_:] += g[2].to(acc)
            dkv = ring.shift(dkv, tag=1).wait()  # the grads travel with their block; after r hops they are home
            if pending is not None:
                kv = pending.wait()
        return dq.to(q.dtype), dkv[..., :dk_].to(k.dtype), dkv[..., dk_:dk_ + dv_].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int],
                   grid: RingGrid, position: int, *, causal: bool = False, scale: float | None = None,
                   kernel: str | None = None) -> torch.Tensor:
    """Attention of this ring position's queries against the keys/values of every position (see the module docstring).

    Args:
        q, k, v: ``[tokens, heads, head_dim]``: the tokens of ring position ``position`` (its Ulysses subgroup's
            shards laid end to end, :func:`~lightning_dcp.sp.tokens.ring_spans`), ``heads`` this rank's share; ``k``
            and ``v`` with as many heads as ``q``.
        cu_seqlens: boundaries of the packed samples over the *whole* padded sequence.
        grid: the item's :class:`~lightning_dcp.sp.context.RingGrid` (ring group, its ranks, the token layout).
        position: this rank's ring position (``sp_rank // grid.ulysses``).
        causal: each token sees only earlier tokens of its own sample.
        scale: softmax scale (default ``head_dim ** -0.5``).
        kernel: one of :data:`KERNELS` (default :data:`DEFAULT_KERNEL`).

    Returns:
        ``[tokens, heads, head_dim]`` in ``q``'s dtype.
    """
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1] or k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must agree on "
                         "tokens and heads (repeat grouped-query key/value heads first)")
    bounds = [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    total, r = bounds[-1], grid.degree
    mine = ring_spans(total, position, r, grid.layout)
    if sum(b - a for a, b in mine) != q.shape[0]:
        raise ValueError(f"ring_attention: ring position {position} of {r} ({grid.layout} layout) holds "
                         f"{sum(b - a for a, b in mine)} of the {total} tokens cu_seqlens describes, but q has {q.shape[0]}; "
                         "cu_seqlens must describe the whole padded packed sequence and the batch be sharded with the same "
                         "layout (lightning_dcp.sp.tokens.shard_batch)")
    pieces = tuple(tuple(block_pieces(bounds, mine, ring_spans(total, (position - t) % r, r, grid.layout), causal))
                   for t in range(r))
    ring = _Ring(grid, position, pieces, q.shape[-1] ** -0.5 if scale is None else float(scale), _kernel(kernel or DEFAULT_KERNEL, q.device),
                 active_timer())
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring)
