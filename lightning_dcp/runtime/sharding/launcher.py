"""The spawn launcher for the modes whose weights are ``fully_shard`` DTensors (``ShardingMode.shards_weights``)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

__all__ = ["ShardedSpawnLauncher"]


class ShardedSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher for sharded weights: after the fit, rank 0 hands the main process the
    *full* weights, gathered from every rank's shards (all ranks take part), instead of its own DTensor
    shards, which the main process -- outside the process group -- could not load."""

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        module = trainer.lightning_module
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        module.state_dict = lambda *args, **kwargs: full  # what the base class saves for the main process
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
