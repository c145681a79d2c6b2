"""The cost of ring attention (and Ulysses x ring, USP) on an SP group, for any cost model.

An SP group of ``s = r * u`` ranks runs ``r`` Ulysses subgroups of ``u`` ranks in a ring
(:class:`~lightning_dcp.planning.plan.WorkItem`'s ``ring``). Each rank holds ``t = T / s`` of the
micro-batch's ``T`` tokens. Per layer, after the Ulysses all-to-all of its subgroup, a rank holds
``T / r`` tokens of ``heads / u`` heads and computes attention in ``r`` steps: its queries against
its own key/value block, then against the blocks of the ``r - 1`` other subgroups, passed around
the ring (position ``i`` of subgroup ``j`` sends to position ``i`` of ``j + 1``) while it computes.
Blocks are balanced for causal masks (zigzag: every step does the same work), so:

* **compute** per step: ``c = A / r`` with ``A`` the rank's whole attention time for the layer
  (forward or backward: the same FLOPs as Ulysses on ``s`` ranks);
* **transfer** per step: one key/value block, ``T / r`` tokens x ``kv_bytes_per_token`` (key and
  value of the rank's ``kv_heads / u`` heads, grouped-query heads repeated as the all-to-all left
  them), at the P2P bandwidth plus one latency; backward sends the block and its gradient (twice
  the bytes, :data:`BACKWARD_TRANSFER_FACTOR`);
* **overlap**: the first step needs no transfer; each later one lasts ``max(c, x)`` (double
  buffering: the next block arrives while this one is computed). A layer's attention then takes
  ``c + (r - 1) max(c, x)``: its compute ``A`` plus the *exposed* transfer ``(r - 1) max(0, x - c)``.

Everything else a rank does for the layer (GEMMs, element-wise passes, its subgroup's all-to-alls,
launches) is what it does on an SP group of ``u`` ranks holding ``T / r`` tokens. Hence
:func:`ring_time`: an item on ``r x u`` ranks costs the same item's cost on ``u`` ranks with
``T / r`` tokens and ``W / r^2`` attention work (the first ring step), plus the ``r - 1`` further
steps of every layer (forward, backward, and the forward again of each recomputed layer). Memory:
the ``u``-rank item on ``T / r`` tokens (the same tokens per rank) plus the ring's receive buffers
(:func:`ring_buffer_bytes`).

A ring crossing nodes runs at the inter-node P2P bandwidth (a ring step lasts as long as its
slowest hop). Pure Python; the scalar formulas also take numpy arrays (the planner's vectorized
fast path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_dcp.planning.cost_model import ItemCost

__all__ = ["BACKWARD_TRANSFER_FACTOR", "BUFFER_BLOCKS", "RingPriced", "RingTerms", "hardware_ring_terms",
           "ring_buffer_bytes", "ring_exposed", "ring_steps", "ring_steps_compute"]

BACKWARD_TRANSFER_FACTOR = 2.0
"""Backward ring steps send the key/value block and its gradient (ring-flash-attn's backward)."""

BUFFER_BLOCKS = 4.0
"""Key/value blocks a rank holds beyond its own during a ring layer: the block in flight and the next
one (double buffering), and in the backward their gradients (estimate)."""


@dataclass(frozen=True)
class RingTerms:
    """What pricing a ring needs from a cost model at the ring's Ulysses size ``u``.

    Args:
        attn_fwd_per_work: seconds of forward attention per unit of attention work (``sum l^2`` for
            1d models) on one rank of a ``u``-rank Ulysses group holding the whole micro-batch
            (the cost model's attention coefficient at SP ``u``).
        attn_bwd_per_work: the same for the backward.
        kv_bytes_per_token: bytes of key and value one rank holds per token of its block after the
            all-to-all (``2 * kv_heads * f / u * head_dim * dtype_bytes``).
        bandwidth: P2P bandwidth of one ring hop (bytes/s), inter-node when the group spans nodes.
        latency: fixed cost of one ring step's send/receive (s).
        num_layers: the model's repeated layers.
    """

    attn_fwd_per_work: float
    attn_bwd_per_work: float
    kv_bytes_per_token: float
    bandwidth: float
    latency: float
    num_layers: int


def hardware_ring_terms(hardware: Any, sp: int, attn_fwd_per_work: float, attn_bwd_per_work: float,
                        kv_bytes_per_token: float, num_layers: int) -> RingTerms:
    """:class:`RingTerms` with the P2P bandwidth and latency of ``hardware`` (a
    :class:`~lightning_dcp.planning.hardware.HardwareSpec`): intra-node for a group of at most a node's
    GPUs, else inter-node (a ring step waits for its slowest hop)."""
    intra = sp <= hardware.gpus_per_node
    bw = (hardware.p2p_bw_intra or hardware.a2a_bw_intra) if intra else (hardware.p2p_bw_inter or hardware.a2a_bw_inter)
    lat = hardware.collective_latency if intra else hardware.collective_latency_inter
    return RingTerms(attn_fwd_per_work, attn_bwd_per_work, kv_bytes_per_token, bw, lat, num_layers)


def _max0(x: Any) -> Any:
    """``max(x, 0)`` for a float or a numpy array."""
    try:
        return x if x > 0.0 else 0.0
    except ValueError:  # an array
        return x.clip(min=0.0)


def _parts(terms: RingTerms, tokens: Any, work: Any, ring: int) -> tuple[Any, Any, Any, Any]:
    """Per ring step: forward and backward compute, forward and backward transfer."""
    r = float(ring)
    cf = terms.attn_fwd_per_work * work / (r * r)
    cb = terms.attn_bwd_per_work * work / (r * r)
    block = terms.kv_bytes_per_token * tokens / r
    xf = block / terms.bandwidth + terms.latency
    xb = BACKWARD_TRANSFER_FACTOR * block / terms.bandwidth + terms.latency
    return cf, cb, xf, xb


def ring_steps(terms: RingTerms, tokens: Any, work: Any, ring: int, recompute: Any) -> Any:
    """Time of the ``r - 1`` ring steps after the first, over every layer: ``(L + recompute) (r - 1)
    max(c_f, x_f) + L (r - 1) max(c_b, x_b)`` (0 for ``ring == 1``)."""
    if ring <= 1:
        return 0.0 * tokens
    cf, cb, xf, xb = _parts(terms, tokens, work, ring)
    steps = ring - 1
    fwd = cf + _max0(xf - cf)
    bwd = cb + _max0(xb - cb)
    return steps * ((terms.num_layers + recompute) * fwd + terms.num_layers * bwd)


def ring_steps_compute(terms: RingTerms, tokens: Any, work: Any, ring: int, recompute: Any) -> Any:
    """The compute part of :func:`ring_steps` (the transfer fully hidden): a lower bound of it, linear in the work."""
    if ring <= 1:
        return 0.0 * tokens
    cf, cb, _, _ = _parts(terms, tokens, work, ring)
    return (ring - 1) * ((terms.num_layers + recompute) * cf + terms.num_layers * cb)


def ring_exposed(terms: RingTerms, tokens: Any, work: Any, ring: int, recompute: Any) -> Any:
    """The transfer time compute does not hide: ``ring_steps - ring_steps_compute`` (communication)."""
    return ring_steps(terms, tokens, work, ring, recompute) - ring_steps_compute(terms, tokens, work, ring, recompute)


def ring_buffer_bytes(terms: RingTerms, tokens: Any, ring: int) -> Any:
    """Extra bytes per rank a ring layer holds (receive buffers, :data:`BUFFER_BLOCKS` blocks of
    ``T / r`` tokens); 0 for ``ring == 1``."""
    if ring <= 1:
        return 0.0 * tokens
    return BUFFER_BLOCKS * terms.kv_bytes_per_token * tokens / ring


class RingPriced:
    """Mixin of a cost model with Ulysses fast paths: its answers for ``ring > 1`` (see the module docstring).

    The model provides ``item_time_sum(tokens, sq_sum, n, sp, recompute)``,
    ``item_memory_tokens(tokens, sp, recompute)``, ``_cost_sums(tokens, work, n, sp, recompute) -> ItemCost``
    and ``ring_terms(sp, ring)``;
    its own methods call the ``_ring_*`` ones below when ``ring > 1``.
    """

    prices_ring = True

    def ring_terms(self, sp: int, ring: int) -> RingTerms:  # pragma: no cover - provided by the model
        raise NotImplementedError

    def item_time_lower(self, lengths: Any, sp: int, recompute: int, ring: int = 1) -> float:
        """:meth:`CostModel.item_time_lower`: on a ring, the time with its transfers hidden."""
        if ring == 1:
            return self.item_time(lengths, sp, recompute)  # type: ignore[attr-defined]
        work = sum(self.attention_work(n) for n in lengths)  # type: ignore[attr-defined]
        return self._ring_time_sum(sum(lengths), work, len(lengths), sp, recompute, ring, exposed=False)

    def _check_ring(self, sp: int, ring: int) -> int:
        """The Ulysses size ``sp / ring``; ``ValueError`` naming the fix when ``ring`` does not divide ``sp``."""
        sp, ring = int(sp), int(ring)
        if ring < 1 or sp % ring:
            raise ValueError(f"ring degree {ring} must be >= 1 and divide the SP size {sp}")
        return sp // ring

    def _ring_time_sum(self, tokens: Any, sq_sum: Any, n: Any, sp: int, recompute: Any, ring: int,
                       exposed: bool = True) -> Any:
        """Item time on ``ring x (sp / ring)`` ranks from the sums (``exposed=False``: with the ring's
        transfers fully hidden, a lower bound linear in the sums)."""
        u = self._check_ring(sp, ring)
        base = self.item_time_sum(tokens / ring, sq_sum / (ring * ring), n, u, recompute)  # type: ignore[attr-defined]
        steps = ring_steps if exposed else ring_steps_compute
        return base + steps(self._terms(sp, ring), tokens, sq_sum, ring, recompute)

    def _terms(self, sp: int, ring: int) -> RingTerms:
        """:meth:`ring_terms`, computed once per ``(sp, ring)``."""
        cache = self.__dict__.setdefault("_ring_terms_cache", {})
        got = cache.get((sp, ring))
        if got is None:
            got = cache[(sp, ring)] = self.ring_terms(sp, ring)
        return got

    def _ring_memory_tokens(self, tokens: Any, sp: int, recompute: int, ring: int) -> Any:
        """Peak bytes per rank: the Ulysses subgroup's on ``tokens / ring`` tokens plus the ring's buffers."""
        u = self._check_ring(sp, ring)
        base = self.item_memory_tokens(tokens / ring, u, recompute)  # type: ignore[attr-defined]
        return base + ring_buffer_bytes(self._terms(sp, ring), tokens, ring)

    def _ring_cost(self, tokens: float, work: float, n: int, sp: int, recompute: int, ring: int) -> ItemCost:
        """:class:`ItemCost` on a ring: the subgroup's parts on its first ring step, the later steps' compute
        in ``compute`` / ``recompute`` and their exposed transfers in ``comm``."""
        u = self._check_ring(sp, ring)
        base = self._cost_sums(tokens / ring, work / (ring * ring), n, u, recompute)  # type: ignore[attr-defined]
        terms = self._terms(sp, ring)
        fwd_bwd = ring_steps_compute(terms, tokens, work, ring, 0)
        return ItemCost(
            compute=base.compute + fwd_bwd,
            recompute=base.recompute + ring_steps_compute(terms, tokens, work, ring, recompute) - fwd_bwd,
            comm=base.comm + ring_exposed(terms, tokens, work, ring, recompute),
            overhead=base.overhead,
            # the ideal (peak-rate compute / sp) does not depend on how the group splits: the subgroup's, rescaled
            ideal=self._cost_sums(tokens, work, n, u, 0).ideal * u / sp,  # type: ignore[attr-defined]
        )
