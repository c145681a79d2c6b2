"""Whether a cost model prices ring attention, and a ring item's memory: what both the plan check and the pricing ask.

:func:`ring_memory` sits below :mod:`~lightning_dcp.planning.plan` (whose memory check calls it) and
:mod:`~lightning_dcp.planning.item_pricing` (which prices plan items and imports the plan's types), on
the cost-model interface only, so calls run one way. Pure Python: no torch.
"""

from __future__ import annotations

import inspect
import math
from typing import Sequence

from lightning_dcp.planning.cost_model import CostModel, prices_ring_of

__all__ = ["ring_memory", "supports_ring"]

_RING_OK: dict[type, bool] = {}


def supports_ring(cost_model: CostModel) -> bool:
    """Whether ``cost_model.item_cost`` takes ``ring=`` (the agreed ring interface) and the model prices rings
    (``prices_ring``, where it says; a model that takes the keyword but prices no ring gets the fallback)."""
    cls = type(cost_model)
    ok = _RING_OK.get(cls)
    if ok is None:
        try:
            params = inspect.signature(cost_model.item_cost).parameters
        except (TypeError, ValueError):
            params = {}
        ok = "ring" in params
        _RING_OK[cls] = ok
    return ok and prices_ring_of(cost_model)


def ring_memory(cost_model: CostModel, lengths: Sequence[int], sp: int, recompute: int, ring: int) -> float:
    """Peak bytes per rank of a ring item: the cost model's when it takes ``ring=``, else the memory of the
    rank's ``1/sp`` share of the tokens on one device (its key/value ring buffers neglected)."""
    if ring > 1 and supports_ring(cost_model) and "ring" in inspect.signature(cost_model.item_memory).parameters:
        return cost_model.item_memory(lengths, sp, recompute, ring=ring)  # type: ignore[call-arg]
    share = max(1, math.ceil(sum(lengths) / sp))
    fast = getattr(cost_model, "item_memory_tokens", None)
    return fast(share, 1, recompute) if callable(fast) else cost_model.item_memory([share], 1, recompute)
