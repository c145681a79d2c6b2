"""lightning-dcp: Data-Centric Parallel training for PyTorch Lightning.

Per step, the data chooses which ranks form sequence-parallel (Ulysses) groups of which size,
which samples each group runs in which packed micro-batches, how many micro-batches each rank
accumulates and how many layers recompute; the gradients stay those of plain data-parallel
training on the same global batch.

Imports are lazy (PEP 562): ``import lightning_dcp`` loads neither torch nor Lightning; each
public name below is imported from its module on first use (``lightning_dcp.DCPStrategy`` imports
:mod:`lightning_dcp.runtime.strategy`). The planner (:mod:`lightning_dcp.planning`) and the ``plan`` /
``simulate`` commands stay free of torch.

Importing the package registers the strategy names ``"dcp"`` and ``"dcp_spawn"`` with Lightning,
so ``Trainer(strategy="dcp")`` works whatever the import order: at once when Lightning is already
imported, else by a one-shot import hook that registers right after
``lightning.pytorch.strategies`` is imported (Lightning has no entry point for strategies; see
:mod:`lightning_dcp._registry`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_dcp import _registry
from lightning_dcp._version import __version__

#: Public name -> module that defines it.
_EXPORTS = {
    "AgreementError": "lightning_dcp.runtime.agreement",
    "AmbiguousLayersError": "lightning_dcp.sp.contract",
    "CollectiveError": "lightning_dcp.runtime.faults",
    "StepOutOfMemoryError": "lightning_dcp.runtime.oom",
    "DCPBatchSampler": "lightning_dcp.runtime.sampler",
    "DCPDataLoader": "lightning_dcp.runtime.loader",
    "DCPProfiler": "lightning_dcp.profiling",
    "DCPStrategy": "lightning_dcp.runtime.strategy",
    "DefaultCostModel": "lightning_dcp.planning.default_cost",
    "EMA": "lightning_dcp.callbacks.ema",
    "ProfiledCostModel": "lightning_dcp.planning.profiled",
    "RecomputeLayers": "lightning_dcp.sp.recompute",
    "SPContext": "lightning_dcp.sp.context",
    "SPGroups": "lightning_dcp.sp.groups",
    "StepLossLogging": "lightning_dcp.step_loss",
    "StepMetrics": "lightning_dcp.runtime.metrics",
    "active_context": "lightning_dcp.sp.context",
    "micro_batches": "lightning_dcp.runtime.manual",
    "pack_samples": "lightning_dcp.sp.packing",
    "profile_module": "lightning_dcp.profiling",
    "seq_all_to_all": "lightning_dcp.sp.ulysses",
    "sp_context": "lightning_dcp.sp.context",
    "ulysses_attention": "lightning_dcp.sp.ulysses",
    "varlen_attention": "lightning_dcp.sp.attention",
    "weighted_loss": "lightning_dcp.sp.tokens",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from lightning_dcp.runtime.agreement import AgreementError
    from lightning_dcp.sp.contract import AmbiguousLayersError
    from lightning_dcp.runtime.faults import CollectiveError
    from lightning_dcp.runtime.oom import StepOutOfMemoryError
    from lightning_dcp.sp.attention import varlen_attention
    from lightning_dcp.sp.context import SPContext, active_context, sp_context
    from lightning_dcp.sp.groups import SPGroups
    from lightning_dcp.runtime.manual import micro_batches
    from lightning_dcp.runtime.metrics import StepMetrics
    from lightning_dcp.sp.packing import pack_samples
    from lightning_dcp.profiling import DCPProfiler, profile_module
    from lightning_dcp.sp.recompute import RecomputeLayers
    from lightning_dcp.runtime.loader import DCPDataLoader
    from lightning_dcp.runtime.sampler import DCPBatchSampler
    from lightning_dcp.sp.tokens import weighted_loss
    from lightning_dcp.step_loss import StepLossLogging
    from lightning_dcp.planning.default_cost import DefaultCostModel
    from lightning_dcp.callbacks.ema import EMA
    from lightning_dcp.planning.profiled import ProfiledCostModel
    from lightning_dcp.runtime.strategy import DCPStrategy
    from lightning_dcp.sp.ulysses import seq_all_to_all, ulysses_attention


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_dcp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


_registry.install()
