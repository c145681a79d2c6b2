"""THE registry of sharding modes: ``DCPStrategy(sharding=...)``, ``lightning-dcp plan`` / ``simulate`` and the
cost models read it, and nothing else names a mode. A new mode: its two files and one line in :data:`MODES`. Pure
Python.
"""

from __future__ import annotations

from lightning_dcp.planning.sharding.base import ShardingMode, StateParts
from lightning_dcp.planning.sharding.fsdp import Fsdp
from lightning_dcp.planning.sharding.hsdp import HsdpMode
from lightning_dcp.planning.sharding.none import NoSharding
from lightning_dcp.planning.sharding.zero1 import Zero1
from lightning_dcp.planning.sharding.zero2 import Zero2

__all__ = ["COST_MODEL_MODES", "DEFAULT_MODE", "MODES", "ZERO_STAGE_ALIASES", "get_mode", "resolve_sharding",
           "state_bytes"]

MODES: dict[str, type[ShardingMode]] = {
    NoSharding.name: NoSharding,
    Zero1.name: Zero1,
    Zero2.name: Zero2,
    Fsdp.name: Fsdp,
    HsdpMode.name: HsdpMode,
}
"""Mode name -> its pure counterpart, from least to most sharded."""

DEFAULT_MODE = NoSharding.name
"""``DCPStrategy``'s default: full replicas."""

COST_MODEL_MODES = tuple(name for name, mode in MODES.items() if not mode.options)
"""The modes a cost model plans by itself (``sharding=`` of the analytic and profiled models); a mode with
options (a shard group) is a view over the one-replica model (:meth:`ShardingMode.plan_with`)."""

ZERO_STAGE_ALIASES = {mode.zero_stage: name for name, mode in MODES.items() if mode.zero_stage in (0, 1, 2)}
"""``zero_stage=`` (the analytic model's older argument) to ``sharding=``."""


def get_mode(name: str, world_size: int, *, shard_group_size: int | None = None, offload: bool = False) -> ShardingMode:
    """Mode ``name`` on ``world_size`` ranks; ``ValueError`` for an unknown name (listing the known ones)."""
    cls = MODES.get(name)
    if cls is None:
        hint = " (ZeRO-3 is 'fsdp', or 'hsdp' sharded per layer)" if str(name).lower() in (
            "zero3", "zero-3", "full_shard") else ""
        raise ValueError(f"sharding must be one of {tuple(MODES)}, got {name!r}{hint}")
    return cls(world_size, shard_group_size=shard_group_size, offload=offload)


def state_bytes(mode: str, world_size: int, *, weights: float, buffers: float = 0.0, gradients: float,
                optimizer: float, at_rest: bool = False, shard_group_size: int | None = None,
                layer_bytes: float = 0.0, root_bytes: float = 0.0, offload: bool = False) -> float:
    """Model-state bytes one rank holds under ``mode`` (the package docstring's table), from the full model's bytes;
    ``world_size <= 1`` holds the full replica; ``at_rest``: between steps."""
    if mode not in MODES:
        raise ValueError(f"sharding must be one of {', '.join(MODES)}, got {mode!r}")
    parts = StateParts(weights=weights, buffers=buffers, gradients=gradients, optimizer=optimizer,
                       layer_bytes=layer_bytes, root_bytes=root_bytes)
    options = {"shard_group_size": shard_group_size, "offload": offload} if MODES[mode].options else {}
    return get_mode(mode, max(1, int(world_size)), **options).state_bytes(parts, at_rest=at_rest)


def resolve_sharding(sharding: str | None, zero_stage: int | None = None, *, default: str = "zero1") -> str:
    """A cost model's sharding mode from ``sharding=`` and/or the ``zero_stage=`` alias (``default`` if neither);
    ``ValueError`` for unknown names (a per-layer mode names the view to use), other stages, or the two disagreeing."""
    if sharding is not None and sharding not in COST_MODEL_MODES:
        hint = (f"; {sharding!r} shards per layer over shard groups: plan with the one-replica model seen through "
                "lightning_dcp.planning.analytic.hsdp_view") if sharding in MODES else ""
        raise ValueError(f"sharding must be one of {', '.join(COST_MODEL_MODES)}, got {sharding!r}{hint}")
    if zero_stage is not None:
        if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGE_ALIASES:
            raise ValueError(f"zero_stage must be 0, 1 or 2 (aliases of sharding='none', 'zero1', 'zero2'), got "
                             f"{zero_stage!r}; for weights sharded between steps use sharding='fsdp'")
        alias = ZERO_STAGE_ALIASES[zero_stage]
        if sharding is not None and sharding != alias:
            raise ValueError(f"zero_stage={zero_stage} means sharding={alias!r} but sharding={sharding!r} was given; "
                             f"pass only sharding={sharding!r}")
        return alias
    return sharding if sharding is not None else default
