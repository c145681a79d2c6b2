"""The setup agreement check as the strategy runs it: one world all-gather of this rank's setup row
(:func:`~lightning_dcp.runtime.agreement.setup_row`) when the train loader is built, and once more
before the profiler's first collective; ranks that disagree all raise the same
:class:`~lightning_dcp.runtime.agreement.AgreementError`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from lightning_dcp.runtime.agreement import check_setup, planner_settings, setup_row
from lightning_dcp.runtime.settings import DCPSettings

__all__ = ["agreement_settings", "check_setup_agreement"]


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
