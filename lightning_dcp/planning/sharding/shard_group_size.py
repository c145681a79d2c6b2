"""Which shard group ``K`` ``sharding="hsdp"`` runs when none is given: the smallest that fits, at least a node.

A larger shard group holds fewer state bytes per rank, leaving more room for activations (less
recompute, smaller SP groups); it costs collectives. Inside a node it costs almost nothing more: each
rank moves ``(K - 1)/K`` of a layer per collective, at the node's bandwidth, whatever ``K``; beyond a
node every round's collectives cross the slower inter-node links. So :func:`choose_shard_group_size`
takes the candidates -- the powers of two dividing the world, and the world -- from the largest that
fits in one node (``gpus_per_node``) up, and keeps the first whose states fit the memory limit
(``(W + G + O)/K + B + 2R + 4L`` plus the workspace) and, when it is given a way to tell, that holds
the dataset's longest sample on some SP size up to ``K`` with every layer recomputed: a node's group
when the model fits there (Wan-14B, HunyuanVideo-13B on 8-GPU nodes), else the smallest group above
a node that fits (Llama-70B on H100: 32). ``DCPStrategy(sharding="hsdp")``, ``lightning-dcp simulate``
and ``lightning-dcp plan`` all default to it. When no ``K`` fits, :class:`NoShardGroupFits` lists the
states' bytes per rank for every ``K`` (and what each holds), so the fix -- more ranks, ``offload``,
more memory -- is plain; it blames no sample unless the states fit and only the data does not. Pure Python.
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
    """The smallest shard group size, at least the largest candidate inside one node (``gpus_per_node``), whose
    states fit ``memory_limit`` and (given ``longest`` and ``longest_fitting(k)``, the longest sample a shard
    group of ``k`` holds) that holds the data.

    ``mode``: the registry's name of a mode with a shard group.

    Raises:
        NoShardGroupFits: none does; the message lists each candidate's state bytes per rank.
    """
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
