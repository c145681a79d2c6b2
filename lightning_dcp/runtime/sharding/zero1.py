"""``sharding="zero1"`` at run time: full replicas, the optimizer state sharded (``ZeroRedundancyOptimizer``).

The gradients are all-reduced as under ``"none"`` (:class:`~lightning_dcp.runtime.sharding.replicated.ReplicatedShards`);
at setup each optimizer becomes a :class:`~torch.distributed.optim.ZeroRedundancyOptimizer` of its class,
which steps this rank's partition and sends the updated weights to the others
(:mod:`lightning_dcp.planning.sharding.zero1`).
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

from lightning_dcp.runtime.sharding.replicated import ReplicatedShards

__all__ = ["Zero1Shards", "wrap_zero1"]


def wrap_zero1(optimizers: Sequence[Any], lr_scheduler_configs: Sequence[Any]) -> list[Any]:
    """Each optimizer as a ``ZeroRedundancyOptimizer`` of its class (its schedulers follow it)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    new = []
    for opt in optimizers:
        if isinstance(opt, ZeroRedundancyOptimizer):
            new.append(opt)
            continue
        groups = [dict(g) for g in opt.param_groups]
        # ``defaults`` can hold keys the constructor does not take (torch's AdamW records
        # ``decoupled_weight_decay``); the param groups keep every per-group value anyway.
        accepted = inspect.signature(type(opt).__init__).parameters
        defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
        zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(opt), **defaults)
        for cfg in lr_scheduler_configs:
            if getattr(cfg.scheduler, "optimizer", None) is opt:
                cfg.scheduler.optimizer = zero
        new.append(zero)
    return new


class Zero1Shards(ReplicatedShards):
    """ZeRO-1: the optimizers wrapped at setup."""

    def setup_optimizers(self, optimizers: list[Any], lr_scheduler_configs: Sequence[Any]) -> list[Any]:
        return wrap_zero1(optimizers, lr_scheduler_configs)

    @property
    def unsaveable_reason(self) -> str | None:
        return f"sharding={self.mode.name!r} shards the model states; gathering them needs every rank"
