"""The budget helper's measuring side: a model, a few samples and a device in, a
:class:`~lightning_dcp.planning.budget.BudgetReport` out.

:func:`measure_budget` profiles the model on the samples (:func:`~lightning_dcp.profiling.profile_module`,
SP 1 in one process, every SP size when ``torch.distributed`` runs on several ranks), fits the
measured cost model at this run's budget (:func:`resolve_budget`) and reports, per SP size, the
longest sample that fits with and without recompute, and the budgets below which the dataset's
lengths need SP > 1 or recompute (:func:`~lightning_dcp.planning.budget.budget_report`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from lightning_dcp.planning.budget import BudgetReport, budget_report
from lightning_dcp.planning.units import format_bytes
from lightning_dcp.profiling.assemble import CPU_MEMORY_LIMIT, default_memory_limit, profile_module
from lightning_dcp.profiling.grid import Samples

__all__ = ["measure_budget", "resolve_budget"]


def resolve_budget(device: torch.device | str, memory_limit_bytes: float | None = None,
                   source: str | None = None, setting: str | None = None) -> tuple[float, str]:
    """This run's memory budget and where it came from: ``memory_limit_bytes`` (named by ``source``,
    default ``setting``), else the documented default (CUDA total x 0.9, CPU 8 GiB) and the ``setting`` that
    changes it (default ``"DCPProfiler(memory_limit_bytes=...)"``; ``lightning-dcp train-video`` names its
    ``--budget``). Never a cached profile's stored limit: the cache holds measurements, not budgets."""
    device = torch.device(device)
    owner = "the default" if setting else "DCPProfiler's default"
    setting = setting or "DCPProfiler(memory_limit_bytes=...)"
    if memory_limit_bytes is not None:
        if not memory_limit_bytes > 0:
            raise ValueError(f"memory_limit_bytes must be positive (bytes per device), got {memory_limit_bytes!r}")
        return float(memory_limit_bytes), source or setting
    limit = default_memory_limit(device)
    what = "0.9 x the CUDA device's total memory" if device.type == "cuda" else f"{format_bytes(CPU_MEMORY_LIMIT)} on CPU"
    return limit, f"{owner}, {what}; set {setting} to change it"


def measure_budget(module: nn.Module, samples: Any, *, world_size: int = 1, lengths: Sequence[int] | None = None,
                   device: torch.device | str | None = None, memory_limit_bytes: float | None = None,
                   memory_limit_source: str | None = None, **profile_kwargs: Any) -> BudgetReport:
    """Profile ``module`` on ``samples`` and report what memory budget it needs.

    Args:
        module: the model, as :func:`~lightning_dcp.profiling.profile_module` takes it (a
            LightningModule with repeated layers), on ``device``.
        samples: a dataset with ``.lengths`` or a list of sample dicts: what the profile measures.
        world_size: the SP sizes to report go up to this (sizes the profile did not measure are
            estimated from SP 1).
        lengths: the dataset's lengths to find the thresholds for (default: ``samples``' lengths).
        device: where to measure (default: the module's).
        memory_limit_bytes: the budget the longest lengths are reported at (default as :func:`resolve_budget`).
        memory_limit_source: how the report names that budget's origin.
        **profile_kwargs: passed to :func:`~lightning_dcp.profiling.profile_module` (``lengths=`` there is
            ``grid_lengths=`` here).
    """
    from lightning_dcp.planning.profiled import ProfiledCostModel

    grid = profile_kwargs.pop("grid_lengths", None)
    profile = profile_module(module, samples, device=device, lengths=grid, **profile_kwargs)
    where = device if device is not None else next(module.parameters()).device
    limit, source = resolve_budget(where, memory_limit_bytes, memory_limit_source)
    cost_model = ProfiledCostModel(profile, memory_limit=limit, memory_limit_source=source)
    return budget_report(cost_model, world_size, list(lengths) if lengths is not None else Samples(samples).lengths)
