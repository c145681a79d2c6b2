"""The sharding modes at run time: one :class:`~lightning_dcp.runtime.sharding.protocol.Shards` per mode.

:func:`build_shards` makes the runtime of a mode from its pure counterpart
(:attr:`ShardingMode.runtime <lightning_dcp.planning.sharding.base.ShardingMode.runtime>`, named in the one
registry, :mod:`lightning_dcp.planning.sharding.registry`): :mod:`.replicated` (``none``), :mod:`.zero1`,
:mod:`.zero2` and :mod:`.fsdp` (:mod:`.gathered`), :mod:`.hsdp` (with :mod:`.dummy`), on
:mod:`.units`; the bytes they measure: :mod:`.states`.
"""

from __future__ import annotations

import importlib
from typing import Sequence

import torch
from torch import nn

from lightning_dcp.planning.sharding.base import ShardingMode
from lightning_dcp.runtime.sharding.protocol import Shards

__all__ = ["Shards", "build_shards"]


def build_shards(mode: ShardingMode, module: nn.Module, device: torch.device, *, layers: Sequence[nn.Module] = (),
                 coresident: Sequence[nn.Module] = ()) -> Shards:
    """The runtime of ``mode`` over ``module`` (its sharded units made now, where the mode shards weights)."""
    path, name = mode.runtime.split(":")
    cls = getattr(importlib.import_module(path), name)
    return cls(module, mode, device, layers=layers, coresident=coresident)
