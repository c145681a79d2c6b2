"""lightning-dcp: Data-Centric Parallel training for PyTorch Lightning.

Per step, the data chooses which ranks form sequence-parallel (Ulysses) groups of which size,
which samples each group runs in which packed micro-batches, how many micro-batches each rank
accumulates and how many layers recompute; the gradients stay those of plain data-parallel
training on the same global batch.

Importing the package registers the strategy names ``"dcp"`` and ``"dcp_spawn"`` with Lightning,
so ``Trainer(strategy="dcp")`` works.
"""

from lightning_dcp._version import __version__

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_dcp.attention import varlen_attention
from lightning_dcp.context import SPContext, active_context, sp_context
from lightning_dcp.packing import pack_samples
from lightning_dcp.groups import SPGroups
from lightning_dcp.metrics import StepMetrics
from lightning_dcp.profiling import DCPProfiler, profile_module
from lightning_dcp.recompute import RecomputeLayers
from lightning_dcp.sampler import DCPBatchSampler, DCPDataLoader
from lightning_dcp.sharding import weighted_loss
from lightning_dcp.strategy import DCPStrategy, DefaultCostModel
from lightning_dcp.ulysses import seq_all_to_all, ulysses_attention

DCPStrategy.register_strategies(_StrategyRegistry)

__all__ = [
    "DCPBatchSampler",
    "DCPDataLoader",
    "DCPProfiler",
    "DCPStrategy",
    "DefaultCostModel",
    "RecomputeLayers",
    "SPContext",
    "SPGroups",
    "StepMetrics",
    "active_context",
    "pack_samples",
    "profile_module",
    "seq_all_to_all",
    "sp_context",
    "ulysses_attention",
    "varlen_attention",
    "weighted_loss",
]
