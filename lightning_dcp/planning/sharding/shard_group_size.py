"""Which shard group ``K`` ``sharding="hsdp"`` runs when none is given: the smallest that fits, at least a node.

A larger group holds fewer state bytes per rank (room for activations) and costs collectives: almost nothing more
inside a node (``(K - 1)/K`` of a layer per rank at the node's bandwidth, whatever ``K``), the slower links beyond.
So the candidates (powers of two dividing the world, and the world) are tried from the largest inside one node up
(docs/sharding.md, "A shard group that picks itself"). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from lightning_dcp.planning.sharding.base import StateParts
from lightning_dcp.planning.sharding.registry import get_mode
from lightning_dcp.planning.units import format_bytes

__all__ = ["NoShardGroupFits", "ShardGroupChoice", "choose_shard_group_size", "shard_group_candidates"]


class NoShardGroupFits(ValueError):
    """No shard group size fits the states (and the data); the message lists every candidate."""


@dataclass(frozen=True)
class ShardGroupChoice:
    """The shard group picked, why, and every candidate's state bytes per rank in the loop."""

    size: int
    reason: str
    state_bytes: dict[int, float] = field(default_factory=dict)


def shard_group_candidates(world_size: int) -> list[int]:
    """The shard group sizes tried, smallest first: the powers of two dividing the world, and the world."""
    n = int(world_size)
    out, k = [], 1
    while k <= n:
        if n % k == 0:
            out.append(k)
        k *= 2
    return out if out[-1] == n else [*out, n]


def choose_shard_group_size(world_size: int, parts: StateParts, memory_limit: float, *, mode: str,
                            gpus_per_node: int = 1, offload: bool = False, workspace_bytes: float = 0.0,
                            longest: int | None = None, longest_fitting: Callable[[int], int] | None = None,
                            limit_source: str = "") -> ShardGroupChoice:
    """The smallest shard group size of ``mode``, at least the largest candidate inside one node, whose states plus
    ``workspace_bytes`` fit ``memory_limit`` and (given ``longest`` and ``longest_fitting(k)``, the longest sample a
    group of ``k`` holds) that holds the data; :class:`NoShardGroupFits` lists every candidate's bytes per rank (it
    blames no sample unless the states fit)."""
    limit_text = format_bytes(memory_limit) + (f" ({limit_source})" if limit_source else "")
    table: dict[int, float] = {}
    rows: list[str] = []
    candidates = shard_group_candidates(world_size)
    node = max((k for k in candidates if k <= max(1, int(gpus_per_node))), default=1)
    for k in candidates:
        states = get_mode(mode, world_size, shard_group_size=k, offload=offload).state_bytes(parts)
        table[k] = states
        if k < node:
            rows.append(f"K={k}: {format_bytes(states)} per rank in the loop")
            continue
        need = states + workspace_bytes
        if need > memory_limit:
            rows.append(f"K={k}: {format_bytes(states)} per rank in the loop: does not fit")
            continue
        if longest is not None and longest_fitting is not None:
            holds = int(longest_fitting(k))
            if holds < longest:
                rows.append(f"K={k}: {format_bytes(states)} per rank in the loop, holds samples up to {holds} tokens")
                continue
            why = (f"states fit ({format_bytes(states)} per rank in the loop, memory {limit_text}) and it holds the "
                   f"longest sample ({longest} tokens; up to {holds})")
        else:
            why = f"states fit ({format_bytes(states)} per rank in the loop, memory {limit_text})"
        where = (f"one node's {k} ranks (inside a node a larger shard group costs no more bandwidth and frees memory)"
                 if k == node else f"the smallest shard group above one node ({node} ranks) that fits")
        return ShardGroupChoice(k, f"{where}: {why}", table)
    longest_note = f" and the longest sample ({longest} tokens)" if longest is not None and longest_fitting else ""
    raise NoShardGroupFits(
        f"sharding={mode!r}: no shard group size of the {world_size} ranks fits the model states{longest_note} in "
        f"{limit_text}: " + "; ".join(rows) + ". Add ranks (a larger shard group), offload=True (the shards on the "
        "host), or more memory per device")
