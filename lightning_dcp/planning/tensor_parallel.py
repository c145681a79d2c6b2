"""The cost of tensor parallelism inside an SP item (``WorkItem.tp``): the formulas, for any linear cost model.

An item of ``s`` ranks with ring degree ``r`` and tensor-parallel degree ``t`` runs ``r`` subgroups of ``q = s / r``
ranks (the ring's), each a grid of ``u = q / t`` Ulysses positions x ``t`` TP ranks: consecutive runs of ``t`` ranks
are TP groups (inside a node), the ranks at one TP position form the Ulysses group. ``t x u`` divides the heads, the
rule Ulysses has (each rank computes ``heads / (t u)`` heads).

Megatron-style column-/row-parallel blocks with sequence parallelism (Korthikanti et al. 2022): outside a block
every rank holds ``1 / s`` of the tokens; before each attention and MLP block (and cross-attention, 3d) an
all-gather over the TP group gives its ranks the group's ``T / (r u)`` tokens, the column-parallel projections
split the heads (or the MLP's width) ``t`` ways, the row-parallel one ends in a reduce-scatter back to the sequence
shard. So per rank:

* **compute** is the same micro-batch's on Ulysses ``q`` with ring ``r`` (the same FLOPs, element-wise bytes and GEMM
  tiles per rank: ``T / (r u)`` rows x ``1 / t`` of the columns tile like ``T / s`` rows x all of them);
* **all-to-all**: the Ulysses group has ``u`` ranks moving ``T / (r u)`` tokens of ``h / t`` width: the all-to-all of
  Ulysses ``q`` scaled by :func:`a2a_share` (none at ``u = 1``);
* **TP collectives** (:func:`tp_collective_time`): per layer and pass, :attr:`TPTerms.pairs_per_layer` all-gather +
  reduce-scatter pairs, each moving ``(t - 1) / t`` of the group's activations (``T / (r u) x h x dtype_bytes``)
  at the collectives' prices (intra-node: a TP group stays in a node); forward, backward and every recomputed
  forward, plus one pair for the head (all-gather before it, reduce-scatter of its input gradient). Not overlapped
  with compute (as the all-to-alls are not); the backward's re-gather of a block's input for its weight gradient is
  taken as hidden behind the gradient GEMMs (Megatron overlaps it);
* **memory**: activations as the same micro-batch's on ``s`` ranks (sequence parallelism divides every stashed
  activation by ``t``), plus one gathered block input in flight (:func:`tp_buffer_bytes`). Under ``hsdp`` the
  gathered layer and its per-layer pull and push are ``1 / t`` per rank
  (:class:`~lightning_dcp.planning.sharding.hsdp_cost.ShardGroupCostModel`).

Pure Python; the formulas take numpy arrays too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.planning.cost_model import Num
    from lightning_dcp.planning.prices import CollectivePrices

__all__ = ["HEAD_PAIRS", "TPTerms", "a2a_share", "tp_buffer_bytes", "tp_collective_time", "tp_ulysses"]

HEAD_PAIRS = 1
"""All-gather + reduce-scatter pairs per micro-batch outside the layers: the head's input gathered forward, its
gradient reduce-scattered backward."""


@dataclass(frozen=True)
class TPTerms:
    """What pricing a TP split needs from a cost model.

    Args:
        act_bytes_per_token: bytes of one block's input per token (``hidden_size x dtype_bytes``).
        pairs_per_layer: all-gather + reduce-scatter pairs of one layer's forward (attention and MLP: 2 per
            attention+MLP block, one more for cross-attention).
        prices: the collectives' bandwidths and latencies (the hardware's, or a profile's measured all-reduce).
        num_layers: the model's repeated layers.
    """

    act_bytes_per_token: float
    pairs_per_layer: int
    prices: CollectivePrices
    num_layers: int


def tp_ulysses(q: int, tp: int) -> int:
    """``u = q / tp``: the Ulysses positions of a subgroup of ``q`` ranks; ``ValueError`` unless ``tp`` divides it."""
    q, tp = int(q), int(tp)
    if tp < 1 or q % tp:
        raise ValueError(f"tensor-parallel degree {tp} must be >= 1 and divide the Ulysses subgroup of {q} ranks "
                         "(SP size / ring degree)")
    return q // tp


def a2a_share(q: int, tp: int) -> float:
    """The all-to-all time of a ``t x u`` subgroup relative to plain Ulysses on its ``q = t u`` ranks: the same bytes
    per rank, a ``(u - 1) / u`` share of them leaving it instead of ``(q - 1) / q`` (0 for pure TP, ``u = 1``)."""
    u = tp_ulysses(q, tp)
    if q <= 1:
        return 1.0
    return ((u - 1) / u) / ((q - 1) / q)


def tp_collective_time(terms: TPTerms, tokens: Num, ring: int, q: int, tp: int, recompute: Num) -> Num:
    """Time of an item's TP collectives (module docstring): ``((2 L + recompute) pairs_per_layer + HEAD_PAIRS)``
    pairs, each an all-gather and a reduce-scatter of the TP group's ``tokens / (ring u)`` tokens over ``tp``
    consecutive ranks. 0 at ``tp == 1``."""
    if tp <= 1:
        return 0.0 * tokens
    u = tp_ulysses(q, tp)
    one = terms.prices.ring(tokens / (ring * u) * terms.act_bytes_per_token, tp, extent=tp)
    return ((2 * terms.num_layers + recompute) * terms.pairs_per_layer + HEAD_PAIRS) * 2.0 * one


def tp_buffer_bytes(terms: TPTerms, tokens: Num, ring: int, q: int, tp: int) -> Num:
    """Extra bytes per rank of a TP item: one block input gathered over the TP group (beyond the rank's own shard),
    ``(t - 1) / t x tokens / (ring u) x act_bytes_per_token``; 0 at ``tp == 1``."""
    if tp <= 1:
        return 0.0 * tokens
    u = tp_ulysses(q, tp)
    return (tp - 1) / tp * tokens / (ring * u) * terms.act_bytes_per_token
