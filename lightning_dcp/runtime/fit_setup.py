"""What the strategy resolves and adds at setup: the module's heads, support level and SP cap, and the
profiler callback."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dcp.runtime.model import SPCap, resolve_sp_cap
from lightning_dcp.runtime.settings import DCPSettings

__all__ = ["maybe_add_profiler", "resolve_model_setup"]


def resolve_model_setup(contract: Any, settings: DCPSettings, world_size: int) -> tuple[int | None, str, SPCap]:
    """(attention heads, support level, SP cap) from the module's contract (``None``: no module) on
    ``world_size`` ranks (or the ranks an SP group may span); a module below the ``"sp"`` support level runs
    at SP 1 (a ``max_sp_size`` above 1 is warned about and ignored); sizes past the heads' divisors need a module
    that runs ring attention (:attr:`~lightning_dcp.sp.contract.ModelContract.ring_layout`)."""
    num_heads = contract.num_heads if contract is not None else None
    support = contract.support if contract is not None else "sp"
    ring = contract is not None and contract.ring_layout is not None
    requested = settings.max_sp_size
    if support != "sp":
        if requested not in (None, 1):
            rank_zero_warn(f"max_sp_size={requested} ignored: the module runs at support level {support!r}, "
                           "which has no sequence parallelism (SP size 1)")
        return num_heads, support, SPCap(1, reason=f"the module's support level {support!r} (no sequence parallelism)")
    return num_heads, support, resolve_sp_cap(requested, world_size, num_heads, ring=ring and support == "sp")


def maybe_add_profiler(trainer: Any, settings: DCPSettings, cost_model: Any, support: str | None) -> None:
    """Append a :class:`~lightning_dcp.profiling.DCPProfiler` unless the trainer has one, ``profile=False``,
    (``profile=None``) a cost model or planner was given, or the module runs in safe mode (no repeated
    layers to measure)."""
    s = settings
    if s.profile is False or (s.profile is None and (cost_model is not None or s.planner is not None)):
        return
    if support == "safe":
        return
    from lightning_dcp.profiling import DCPProfiler

    if not any(isinstance(cb, DCPProfiler) for cb in trainer.callbacks):
        trainer.callbacks.append(DCPProfiler())

