"""The cost of ring attention (and Ulysses x ring, USP) on an SP group: the formulas, for any cost model.

An SP group of ``s = r * u`` ranks runs ``r`` Ulysses subgroups of ``u`` ranks in a ring
(:class:`~lightning_dcp.planning.plan.WorkItem`'s ``ring``). Per layer, after its subgroup's all-to-all, a rank holds
``T / r`` tokens of ``heads / u`` heads and computes attention in ``r`` steps: its queries against its own key/value
block, then against the ``r - 1`` other subgroups' blocks passed around the ring. Causal blocks are balanced
(zigzag), so per step:

* **compute** ``c = A / r``, ``A`` the rank's whole attention time of the layer (the FLOPs of Ulysses on ``s`` ranks);
* **transfer** ``x``: one key/value block, ``T / r`` tokens x ``kv_bytes_per_token``, at the P2P bandwidth plus one
  latency; the backward sends the block and its gradient (:data:`BACKWARD_TRANSFER_FACTOR`);
* **overlap**: the first step needs no transfer, each later one lasts ``max(c, x)`` (double buffering): the layer's
  attention is ``A`` plus the exposed transfer ``(r - 1) max(0, x - c)``.

Everything else a rank does is the ``u``-rank item on ``T / r`` tokens and ``W / r^2`` work (the first step); the
``r - 1`` later steps come per layer forward, backward and recomputed forward (:func:`ring_steps`). Memory: the
``u``-rank item on ``T / r`` tokens plus the receive buffers (:func:`ring_buffer_bytes`). A ring crossing nodes runs
at the inter-node P2P bandwidth. Pure Python; the formulas take numpy arrays too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.cost_model import Num
    from lightning_dcp.planning.hardware import HardwareSpec

__all__ = ["BACKWARD_TRANSFER_FACTOR", "BUFFER_BLOCKS", "RingTerms", "hardware_ring_terms",
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


def hardware_ring_terms(hardware: "HardwareSpec", sp: int, attn_fwd_per_work: float, attn_bwd_per_work: float,
                        kv_bytes_per_token: float, num_layers: int) -> RingTerms:
    """:class:`RingTerms` with ``hardware``'s P2P bandwidth and latency: intra-node for a group of at most a node's
    GPUs, else inter-node (a ring step waits for its slowest hop)."""
    intra = sp <= hardware.gpus_per_node
    bw = (hardware.p2p_bw_intra or hardware.a2a_bw_intra) if intra else (hardware.p2p_bw_inter or hardware.a2a_bw_inter)
    lat = hardware.collective_latency if intra else hardware.collective_latency_inter
    return RingTerms(attn_fwd_per_work, attn_bwd_per_work, kv_bytes_per_token, bw, lat, num_layers)


def _max0(x: Num) -> Num:
    """``max(x, 0)`` for a float or a numpy array."""
    try:
        return x if x > 0.0 else 0.0
    except ValueError:  # an array
        return x.clip(min=0.0)


def _parts(terms: RingTerms, tokens: Num, work: Num, ring: int) -> tuple[Num, Num, Num, Num]:
    """Per ring step: forward and backward compute, forward and backward transfer."""
    r = float(ring)
    cf = terms.attn_fwd_per_work * work / (r * r)
    cb = terms.attn_bwd_per_work * work / (r * r)
    block = terms.kv_bytes_per_token * tokens / r
    xf = block / terms.bandwidth + terms.latency
    xb = BACKWARD_TRANSFER_FACTOR * block / terms.bandwidth + terms.latency
    return cf, cb, xf, xb


def ring_steps(terms: RingTerms, tokens: Num, work: Num, ring: int, recompute: Num) -> Num:
    """Time of the ``r - 1`` ring steps after the first, over every layer: ``(L + recompute) (r - 1)
    max(c_f, x_f) + L (r - 1) max(c_b, x_b)`` (0 for ``ring == 1``)."""
    if ring <= 1:
        return 0.0 * tokens
    cf, cb, xf, xb = _parts(terms, tokens, work, ring)
    steps = ring - 1
    fwd = cf + _max0(xf - cf)
    bwd = cb + _max0(xb - cb)
    return steps * ((terms.num_layers + recompute) * fwd + terms.num_layers * bwd)


def ring_steps_compute(terms: RingTerms, tokens: Num, work: Num, ring: int, recompute: Num) -> Num:
    """The compute part of :func:`ring_steps` (the transfer fully hidden): a lower bound of it, linear in the work."""
    if ring <= 1:
        return 0.0 * tokens
    cf, cb, _, _ = _parts(terms, tokens, work, ring)
    return (ring - 1) * ((terms.num_layers + recompute) * cf + terms.num_layers * cb)


def ring_exposed(terms: RingTerms, tokens: Num, work: Num, ring: int, recompute: Num) -> Num:
    """The transfer time compute does not hide: ``ring_steps - ring_steps_compute`` (communication)."""
    return ring_steps(terms, tokens, work, ring, recompute) - ring_steps_compute(terms, tokens, work, ring, recompute)


def ring_buffer_bytes(terms: RingTerms, tokens: Num, ring: int) -> Num:
    """Extra bytes per rank a ring layer holds (receive buffers, :data:`BUFFER_BLOCKS` blocks of
    ``T / r`` tokens); 0 for ``ring == 1``."""
    if ring <= 1:
        return 0.0 * tokens
    return BUFFER_BLOCKS * terms.kv_bytes_per_token * tokens / ring
