"""The setup agreement check as the strategy runs it: one world all-gather of this rank's setup row
(:func:`~lightning_dcp.runtime.agreement.setup_row`) when the train loader is built, and once more
before the profiler's first collective; ranks that disagree all raise the same
:class:`~lightning_dcp.runtime.agreement.AgreementError`. :class:`SetupAgreement` is the strategy's side
(a mixin of :class:`~lightning_dcp.DCPStrategy` before Lightning's ``DDPStrategy``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dcp.runtime.agreement import check_setup, planner_settings, setup_row
from lightning_dcp.runtime.executor import world_all_gather
from lightning_dcp.runtime.settings import DCPSettings

__all__ = ["SetupAgreement", "agreement_settings", "check_setup_agreement"]


def agreement_settings(settings: DCPSettings, planner: Any, *, world_size: int, max_sp_size: int, support: str | None,
                       **resolved: Any) -> dict:
    """What every rank must share: the settings, the values resolved at run time and the planner's own settings."""
    resolved.update(world_size=world_size, max_sp_size=max_sp_size, support=support)
    return planner_settings(planner, **settings.agreement(**resolved))


def check_setup_agreement(lengths: Sequence[int], settings: Mapping[str, Any], cost_model: Any, *,
                          gather: Callable[[Tensor], Tensor], where: str | None = None) -> None:
    """Gather every rank's setup row with ``gather`` (a world all-gather) and compare the columns."""
    row = setup_row(lengths, settings, cost_model)
    table = gather(torch.tensor(row, dtype=torch.float64)).tolist()
    if where is None:
        check_setup(table)
    else:
        check_setup(table, where=where)


class SetupAgreement:
    """The strategy's agreement checks (it reads the strategy's settings, world, SP cap, support level,
    shard group, cost model and ``train_lengths``)."""

    def _check_setup_agreement(self, lengths: list[int], planner: Any, **resolved: Any) -> None:
        """One world all-gather at setup: every rank must have the same lengths, planner settings and
        cost model (:mod:`lightning_dcp.runtime.agreement`); else every rank raises the same error."""
        if self.world_size == 1 or not dist.is_initialized():
            return
        cost_model = self._cost_model if self.settings.planner is None else getattr(planner, "cost_model", None)
        settings = agreement_settings(self.settings, planner, world_size=self.world_size, max_sp_size=self.max_sp_size,
                                      support=self.support, shard_group_size=self.shard_group_size, **resolved)
        check_setup_agreement(lengths, settings, cost_model, gather=self._world_gather)

    def check_agreement_before_profiling(self, dataset: Any, profiler_inputs: Mapping[str, Any]) -> None:
        """The setup agreement check, run by the profiler before its first collective: lengths, settings
        and the profiler's own inputs (its grid, memory limit, cache key). Ranks that disagree would
        otherwise profile different grids in lock-step collectives and crash or hang; now every rank
        raises the same :class:`~lightning_dcp.runtime.agreement.AgreementError` instead."""
        if self.world_size == 1 or not dist.is_initialized():
            return
        settings = agreement_settings(self.settings, None, world_size=self.world_size, max_sp_size=self.max_sp_size,
                                      support=self.support, profiler=dict(profiler_inputs),
                                      shard_group_size=self.shard_group_size)
        check_setup_agreement(self.train_lengths(dataset), settings, None, gather=self._world_gather,
                              where="at fit start, before profiling")

    def _world_gather(self, t: Tensor) -> Tensor:
        return world_all_gather(t, world_size=self.world_size, device=self.root_device)
