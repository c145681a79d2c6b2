""":class:`DCPProfiler`: the Lightning callback that profiles (or loads the cached profile) at fit
start and hands the measured cost model to the strategy."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_dcp.planning.profiled import ProfiledCostModel
from lightning_dcp.profiling import cache as profile_cache
from lightning_dcp.profiling.assemble import profile_module
from lightning_dcp.profiling.budget import resolve_budget
from lightning_dcp.profiling.deadline import DEFAULT_TIME_SOURCE, ProfileDeadline, skipped_line
from lightning_dcp.profiling.grid import DENSITIES, Samples
from lightning_dcp.profiling.layers import LayerStack, NoRepeatedLayersError, layer_stack
from lightning_dcp.sp.contract import ModelContract, read_model

log = logging.getLogger(__name__)

__all__ = ["DCPProfiler"]


class DCPProfiler(Callback):
    """Profile (or load the cached profile) at fit start and hand the cost model to the strategy.

    At ``on_fit_start`` (after ``strategy.setup``, before the dataloaders and the DCP sampler
    exist): under :class:`~lightning_dcp.DCPStrategy`, first the agreement check (every rank must
    have the same sample lengths, settings and profiler inputs; else every rank stops with one
    :class:`~lightning_dcp.AgreementError` before any profiling collective); compute the cache key
    (model signature with its configuration, the shape of the dataset's shortest and longest samples
    apart from their length, device name, precision, world size, package version); rank 0 looks it up in the cache; on a hit the profile is broadcast to every rank;
    otherwise every rank runs :func:`~lightning_dcp.profiling.profile_module` together (SP sizes
    above 1 on the strategy's real groups) and rank 0 writes the file. A corrupt or foreign cache
    file is reported with a warning and replaced. Then
    ``trainer.strategy.set_cost_model(ProfiledCostModel(profile, memory_limit=budget))`` when the
    strategy has it, ``budget`` being this run's ``memory_limit_bytes`` or the documented default
    (the cache stores measurements, not a run's budget); the
    profile and cost model also stay on the callback (:attr:`profile`, :attr:`cost_model`), as do
    :attr:`cache_status` and :attr:`profiling_s`. Rank 0 prints one line when profiling starts
    and one when it ends (or one for a cache hit).

    A module without repeated layers (no :class:`~lightning_dcp.sp.recompute.RecomputeLayers`, no
    ``dcp_repeated_layers()``) is not profiled: one line says so on rank 0, :attr:`cache_status`
    is ``"no-layers"`` and no cost model is set (the strategy keeps its own); nor is a module in safe
    mode (its batches come from its own ``collate_fn``; :attr:`cache_status` ``"safe-mode"``).

    Args:
        cache_dir: cache directory (default ``$LIGHTNING_DCP_CACHE`` or ``~/.cache/lightning-dcp/profiles``).
        time_budget_s: wall seconds for the whole profile, from the start of ``on_fit_start`` (reading the samples,
            the cache lookup, every grid point and the constant parts): each SP size's cheapest point always runs,
            every other one only when it is forecast to end within the budget; what is skipped is said in one line
            (the lengths and settings, and how to give more time) and the cost model extrapolates from what was
            measured (``None``: no budget, every point).
        time_budget_source: how that line names the setting that gives more time (default
            ``"DCPProfiler(time_budget_s=...)"``; e.g. a command-line flag).
        density: ``"coarse"`` (4 lengths x micro-batch {1, 2}) or ``"fine"`` (8 x {1, 2, 4}).
        lengths: explicit grid lengths (default: quantiles of the dataset's lengths).
        micro_batch_sizes: explicit micro-batch sizes (default by density).
        sp_sizes: explicit SP sizes (default: under a strategy with ``sp_groups``, the sizes it created
            aligned blocks for -- every divisor of the heads up to its SP cap; ``[1]`` otherwise).
        memory_limit_bytes: usable bytes per device the planner may use: this run's budget, applied to a
            cached profile too (default: CUDA total x 0.9, CPU 8 GiB; a cached profile's stored limit
            is never used).
        memory_limit_source: how errors name where ``memory_limit_bytes`` came from (default
            ``"DCPProfiler(memory_limit_bytes=...)"``; e.g. a command-line flag).
        memory_limit_setting: how messages name the setting that changes the budget, the default's too (default
            ``"DCPProfiler(memory_limit_bytes=...)"``; ``lightning-dcp train-video``: its ``--budget``).
        enabled: ``False`` turns the callback into a no-op.
        layers_attr: dotted attribute path to the repeated layers when the model has several stacks (see
            :mod:`lightning_dcp.sp.contract`). Under :class:`~lightning_dcp.DCPStrategy` the profiler
            measures the strategy's layers (``DCPStrategy(layers_attr=...)``); a ``layers_attr`` here that
            names other layers is an error.
        dataset: the dataset to draw micro-batches from (default: the train dataloader's dataset,
            obtained by calling the ``train_dataloader`` hook once more).
        step_fn: ``step_fn(module, batch) -> loss`` (default ``module.training_step(batch, 0)``).
        use_cache: ``False`` always profiles and writes nothing.
    """

    def __init__(self, cache_dir: str | None = None, time_budget_s: float | None = 60.0, density: str = "coarse",
                 lengths: Sequence[int] | None = None, micro_batch_sizes: Sequence[int] | None = None,
                 sp_sizes: Sequence[int] | None = None, memory_limit_bytes: float | None = None, enabled: bool = True,
                 layers_attr: str | None = None, dataset: Any = None,
                 step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None, use_cache: bool = True,
                 memory_limit_source: str | None = None, time_budget_source: str | None = None,
                 memory_limit_setting: str | None = None):
        if density not in DENSITIES:
            raise ValueError(f"density must be one of {sorted(DENSITIES)}, got {density!r}")
        if time_budget_s is not None and time_budget_s < 0:
            raise ValueError(f"time_budget_s must be >= 0 or None, got {time_budget_s}")
        self.cache_dir = cache_dir
        self.time_budget_s = time_budget_s
        self.density = density
        self.lengths = list(lengths) if lengths is not None else None
        self.micro_batch_sizes = list(micro_batch_sizes) if micro_batch_sizes is not None else None
        self.sp_sizes = list(sp_sizes) if sp_sizes is not None else None
        if memory_limit_bytes is not None and not memory_limit_bytes > 0:
            raise ValueError(f"memory_limit_bytes must be positive (bytes per device), got {memory_limit_bytes!r}")
        self.memory_limit_bytes = memory_limit_bytes
        self.memory_limit_source = memory_limit_source
        self.time_budget_source = time_budget_source
        self.memory_limit_setting = memory_limit_setting
        self.enabled = enabled
        self.layers_attr = layers_attr
        self.dataset = dataset
        self.step_fn = step_fn
        self.use_cache = use_cache
        self.profile: dict | None = None
        self.cost_model: Any = None
        self.cache_status: str | None = None
        self.cache_file: str | None = None
        self.profiling_s: float = 0.0

    # -- helpers -------------------------------------------------------------------------------

    def _dataset(self, trainer: Any) -> Any:
        if self.dataset is not None:
            return self.dataset
        loaders = getattr(trainer.strategy, "fit_start_loader", None)  # DCPStrategy's, read at its setup
        source = trainer.fit_loop._data_source
        if loaders is None and not source.is_defined():
            raise RuntimeError("DCPProfiler found no train dataloader to take samples from; pass DCPProfiler(dataset=...)")
        loaders = loaders if loaders is not None else source.dataloader()
        loader = loaders if not isinstance(loaders, (list, tuple, dict)) else (
            next(iter(loaders.values())) if isinstance(loaders, dict) else loaders[0])
        return getattr(loader, "dataset", loader)

    def _key(self, trainer: Any, module: nn.Module, data: Any) -> profile_cache.ProfileKey:
        from lightning_dcp._version import __version__

        samples = Samples(data)
        ends = sorted({min(samples.lengths), max(samples.lengths)})
        picked = [(samples[samples.pick(n, 1)[1][0]], n) for n in ends]  # the shortest and the longest sample
        return profile_cache.ProfileKey(profile_cache.model_signature(module),
                                        profile_cache.device_name(trainer.strategy.root_device), str(trainer.precision),
                                        trainer.world_size, __version__,
                                        profile_cache.inputs_signature(picked, self.layers_attr))

    def _contract(self, strategy: Any, pl_module: Any) -> ModelContract:
        """The strategy's model contract (the layers it recomputes and shards), else one read here."""
        theirs = getattr(strategy, "model_contract", None)
        if theirs is None:
            return read_model(pl_module, self.layers_attr)
        if self.layers_attr is not None:
            mine = read_model(pl_module, self.layers_attr, theirs.support)
            if mine.layers != theirs.layers:
                strategy_attr = getattr(getattr(strategy, "settings", None), "layers_attr", None)
                raise ValueError(
                    f"DCPProfiler(layers_attr={self.layers_attr!r}) names {mine.layers_source}, {len(mine.layers)} layers, "
                    f"but {type(strategy).__name__}(layers_attr={strategy_attr!r}) recomputes and shards "
                    f"{theirs.layers_source}, {len(theirs.layers)} layers: the profile must measure the layers the "
                    f"strategy runs. Pass layers_attr={self.layers_attr!r} to the strategy (the profiler then needs none)")
        return theirs

    def _sp_sizes(self, strategy: Any, contract: ModelContract) -> list[int] | None:
        sp_groups = getattr(strategy, "sp_groups", None)
        if self.sp_sizes is not None:
            return self.sp_sizes
        if getattr(sp_groups, "group_for", None) is None:
            return [1]  # no SP groups to profile on (not a DCP strategy)
        if getattr(sp_groups, "sizes", None):
            heads = contract.num_heads  # the strategy's groups, those the heads allow
            return [p for p in sp_groups.sizes if heads is None or heads % p == 0]
        return None

    def _inputs(self, key: profile_cache.ProfileKey) -> dict:
        """What the profile depends on besides the data: every rank must have the same (the strategy
        compares it before profiling, :meth:`~lightning_dcp.DCPStrategy.check_agreement_before_profiling`)."""
        return {"key": key.to_dict(), "density": self.density, "lengths": self.lengths,
                "micro_batch_sizes": self.micro_batch_sizes, "sp_sizes": self.sp_sizes,
                "memory_limit_bytes": self.memory_limit_bytes, "layers_attr": self.layers_attr,
                "time_budget_s": self.time_budget_s, "use_cache": self.use_cache}

    def _measure(self, trainer: Any, pl_module: Any, key: profile_cache.ProfileKey, stack: LayerStack, data: Any,
                 contract: ModelContract, deadline: ProfileDeadline) -> dict:
        strategy = trainer.strategy
        path = profile_cache.profile_path(key, self.cache_dir) if self.use_cache else None
        budget = ("no time budget" if self.time_budget_s is None
                  else f"budget {self.time_budget_s:g} s for the whole profile ({deadline.elapsed():.1f} s spent)")
        rank_zero_info(f"DCP profiling {stack.name} ({len(stack)} layers) on {key.device}, {budget}; "
                       + (f"cache {self.cache_status}, will write {path}" if path else "cache off"))
        optimizers = getattr(trainer, "optimizers", None) or [None]
        profile = profile_module(
            pl_module, data, device=strategy.root_device, precision=str(trainer.precision),
            autocast=strategy.precision_plugin.train_step_context, step_fn=self.step_fn, optimizer=optimizers[0],
            group_for=getattr(getattr(strategy, "sp_groups", None), "group_for", None), lengths=self.lengths,
            micro_batch_sizes=self.micro_batch_sizes, sp_sizes=self._sp_sizes(strategy, contract), density=self.density,
            # the file records the device's own limit: a run's budget is applied when planning, not cached
            deadline=deadline, memory_limit_bytes=None, key=key.to_dict(), contract=contract,
        )
        if self.use_cache and trainer.is_global_zero:
            profile_cache.store(profile, self.cache_dir)
        strategy.barrier("dcp_profile_stored")
        return profile

    def _report(self, trainer: Any, profile: dict) -> None:
        meta = profile.get("meta", {})
        if self.cache_status == profile_cache.HIT:
            rank_zero_info(f"DCP profile loaded from cache {self.cache_file} ({meta.get('grid')} grid points, "
                           f"measured {meta.get('created', '?')})")
        else:
            where = f"written to {self.cache_file}" if self.cache_file else "not cached"
            rank_zero_info(f"DCP profiling done: {meta.get('grid')} grid points ({meta.get('skipped', 0)} skipped over "
                           f"budget) in {self.profiling_s:.1f} s; {where}")
            line = skipped_line(meta, self.time_budget_source)
            if line:
                rank_zero_info(line)
        logger = getattr(trainer, "logger", None)
        if logger is not None:
            try:
                logger.log_metrics({"dcp/profile_s": float(self.profiling_s), "dcp/profile_grid": float(meta.get("grid", 0)),
                                    "dcp/profile_cache_hit": float(self.cache_status == profile_cache.HIT)}, step=0)
            except Exception as err:  # noqa: BLE001 - a logger failure must not stop the fit
                log.warning("could not log profiling metrics: %s", err)

    def _report_capacity(self, trainer: Any) -> None:
        """Why a sample runs at SP > 1: the longest sample per SP size at this budget (the planner's own numbers)."""
        from lightning_dcp.planning.budget import capacity_line
        from lightning_dcp.planning.errors import PlanningError

        try:
            rank_zero_info(capacity_line(self.cost_model, max(1, int(trainer.world_size))))
        except PlanningError as err:  # a profile without SP 1: nothing to say
            log.debug("no capacity line: %s", err)

    # -- hook ----------------------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.enabled:
            self.cache_status = "disabled"
            return
        contract = self._contract(trainer.strategy, pl_module)
        try:
            stack = layer_stack(contract)
        except NoRepeatedLayersError:
            self.cache_status = "no-layers"
            rank_zero_info(f"no repeated layers found in {type(pl_module).__name__}: profiling skipped; the strategy runs "
                           "without a measured cost model; add RecomputeLayers or dcp_repeated_layers() to profile")
            return
        if contract.support == "safe":
            self.cache_status = "safe-mode"
            rank_zero_info(f"{contract.name} runs in safe mode (batches from its own collate_fn, no packing): profiling "
                           "(which measures packed micro-batches) skipped")
            return
        t0 = time.perf_counter()
        deadline = ProfileDeadline(self.time_budget_s, start=t0, source=self.time_budget_source or DEFAULT_TIME_SOURCE)
        strategy = trainer.strategy
        data = self._dataset(trainer)
        key = self._key(trainer, pl_module, data)
        agree = getattr(strategy, "check_agreement_before_profiling", None)
        if callable(agree):  # before any collective: ranks that disagree stop with one clear error
            agree(data, self._inputs(key))
        lookup = (profile_cache.load_cached(key, self.cache_dir, self.time_budget_s)
                  if self.use_cache and trainer.is_global_zero else None)
        status, profile = strategy.broadcast((lookup.status, lookup.profile) if lookup else ("off", None), src=0)
        self.cache_status = status
        self.cache_file = str(profile_cache.profile_path(key, self.cache_dir)) if self.use_cache else None
        if profile is None:
            profile = self._measure(trainer, pl_module, key, stack, data, contract, deadline)
        self.profiling_s = time.perf_counter() - t0
        self.profile = profile
        # The budget is this run's (argument or documented default), on a cache hit too.
        limit, source = resolve_budget(strategy.root_device, self.memory_limit_bytes, self.memory_limit_source,
                                       self.memory_limit_setting)
        self.cost_model = ProfiledCostModel(profile, memory_limit=limit, memory_limit_source=source)
        set_cost_model = getattr(strategy, "set_cost_model", None)
        if callable(set_cost_model):
            set_cost_model(self.cost_model)
        self._report(trainer, profile)
        self._report_capacity(trainer)
