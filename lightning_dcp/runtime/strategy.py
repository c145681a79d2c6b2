"""DCPStrategy: Data-Centric Parallel training as a Lightning strategy -- the Lightning hooks only.

What each hook does (the work is done by the runtime's other rooms):

- ``__init__``: the arguments become a frozen :class:`~lightning_dcp.runtime.settings.DCPSettings`.
- ``setup_environment``: after DDP's process-group setup, the module's contract, read once
  (:func:`~lightning_dcp.sp.contract.read_model`, :attr:`DCPStrategy.model_contract`), the SP cap
  (:mod:`~lightning_dcp.runtime.model`) and the SP groups of the aligned blocks of every Ulysses size
  (:class:`~lightning_dcp.sp.groups.SPGroups`; other groups per step); the SIGTERM watchdog (:mod:`~lightning_dcp.runtime.watchdog`).
- ``setup``: the checks (:mod:`~lightning_dcp.runtime.checks`), ``accumulate_grad_batches`` taken over as a larger
  global batch (:mod:`~lightning_dcp.runtime.accumulation`), the profiler
  (:mod:`~lightning_dcp.runtime.fit_setup`), no DDP wrapper: ``configure_ddp`` broadcasts rank 0's
  weights, then builds the sharding mode's runtime :attr:`DCPStrategy.shards` (a
  :class:`~lightning_dcp.runtime.sharding.protocol.Shards` for every mode, chosen through
  :mod:`~lightning_dcp.runtime.run_sharding`, which also picks a shard group when ``"hsdp"`` gets none);
  then the mode's optimizer hook.
- ``process_dataloader`` (train only): the planner (:mod:`~lightning_dcp.runtime.planner_factory`), the
  :class:`~lightning_dcp.runtime.sampler.DCPBatchSampler` and :class:`~lightning_dcp.runtime.loader.DCPDataLoader`
  (:mod:`~lightning_dcp.runtime.train_loader`), the setup agreement check
  (:mod:`~lightning_dcp.runtime.setup_agreement`) and the :class:`~lightning_dcp.runtime.executor.StepExecutor`
  (built from a :class:`~lightning_dcp.runtime.rank.RankRuntime`). Evaluation loaders keep Lightning's sampling.
- ``batch_to_device`` / ``training_step``: the executor prepares this rank's micro-batches on the host,
  runs them and the step-end gather, and returns a :class:`~lightning_dcp.runtime.step.StepResult`; the
  strategy logs its metrics and hands Lightning the exact global loss (detached; ``backward`` skips it).
- ``optimizer_step`` wraps the closure: right after it, the executor reduces the parked gradients (the
  mode's reduction) and ``on_after_backward`` runs, once, on them; then clipping, the optimizer step, the mode's
  ``after_step``, the calibration's timing.
- manual optimization: ``training_step`` calls the module's once with a step to drive
  (:mod:`~lightning_dcp.runtime.manual`); ``backward`` (``manual_backward``) weights each micro-batch's loss, each
  loop's end reduces, ``optimizer_step`` steps.
- checkpoints and evaluation: the mode's (:mod:`~lightning_dcp.runtime.sharded_state`). World collectives from
  user code inside the micro-batch loop: :mod:`~lightning_dcp.runtime.guards`. Exactness, agreement,
  time-outs, out-of-memory recovery: :mod:`~lightning_dcp.runtime.executor`, ``agreement``, ``faults``, ``oom``.
"""

from __future__ import annotations

import os
from pathlib import Path
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.runtime.calibration import CHECKPOINT_KEY as CALIBRATION_KEY
from lightning_dcp.runtime.calibration import RunCalibration, build_calibration
from lightning_dcp.planning.sharding.base import ShardingMode
from lightning_dcp.planning.sharding.registry import DEFAULT_MODE
from lightning_dcp.runtime.accumulation import Accumulation, accumulation_message
from lightning_dcp.runtime.checks import check_fit, check_sharding, check_sharding_agreement
from lightning_dcp.runtime.guards import MicroLoopGuards
from lightning_dcp.runtime.executor import StepExecutor
from lightning_dcp.runtime.exit import destroy_at_exit, import_group_defaults
from lightning_dcp.runtime.fit_setup import maybe_add_profiler, resolve_model_setup
from lightning_dcp.runtime.loader import DCPDataLoader
from lightning_dcp.runtime.metrics import StepMetrics, StepMetricsTracker, log_step_metrics
from lightning_dcp.runtime.model import SPCap
from lightning_dcp.runtime.oom import CHECKPOINT_KEY, OOMRecovery
from lightning_dcp.runtime.planner_factory import PlannerFactory
from lightning_dcp.runtime.preflight import check_train_data, fit_start, train_dataset
from lightning_dcp.runtime.progress import mend_progress_bars
from lightning_dcp.runtime.run_sharding import RunSharding, contract_units
from lightning_dcp.runtime.rank import BatchTransfer, PrecisionBackward, RankRuntime
from lightning_dcp.runtime.sampler import DCPBatchSampler
from lightning_dcp.runtime.settings import DEFAULT_TIMEOUT_S, DCPSettings, split_strategy_kwargs
from lightning_dcp.runtime.setup_agreement import SetupAgreement
from lightning_dcp.runtime.sharded_state import ShardedStateHooks
from lightning_dcp.runtime.sharding import Shards, build_shards
from lightning_dcp.runtime.sharding.launcher import ShardedSpawnLauncher
from lightning_dcp.runtime.step import LoadedStep
from lightning_dcp.runtime.support import support_message
from lightning_dcp.runtime.train_loader import (build_loader, build_sampler, check_not_empty, global_batch,
                                                global_batch_source, map_style_dataset, sample_namer, train_lengths)
from lightning_dcp.sp.groups import SPGroups
from lightning_dcp.runtime.watchdog import ShutdownWatchdog, rank_watchdog
from lightning_dcp.sp.contract import ModelContract, read_model

__all__ = ["DCPStrategy"]


class DCPStrategy(MicroLoopGuards, SetupAgreement, ShardedStateHooks, DDPStrategy):
    """Data-Centric Parallel: per step, the data chooses SP groups, micro-batches per rank and recomputation.

    Gradients equal those of plain data-parallel training on the same global batch (fp32, up
    to summation order). Subclasses Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`
    (launchers, cluster environments, rank setup) without the DDP wrapper.

    What the user's ``training_step`` returns is the loss of *one micro-batch on this rank* (its mean
    over its local loss tokens, or a :func:`~lightning_dcp.sp.tokens.weighted_loss` sum); what the
    strategy hands back to Lightning -- ``outputs["loss"]`` in ``on_train_batch_end`` -- is the step's
    global mean loss, the value plain data-parallel training would report (log it there; the shipped
    modules do, as ``train/loss``, through :class:`~lightning_dcp.step_loss.StepLossLogging`).

    Manual optimization (``automatic_optimization = False``, several optimizers): ``training_step`` runs once per
    step and loops over this rank's micro-batches with :func:`~lightning_dcp.micro_batches`, once per optimizer; each
    loop's end reduces the gradients, so ``opt.step()`` after it sees DDP's (:mod:`~lightning_dcp.runtime.manual`).

    Args:
        policy: planner policy name for :class:`lightning_dcp.planning.planner.Planner`
            (``"dcp"``, ``"bucket"``, ``"packed"``, ``"static"``...); ignored with ``planner=``.
        cost_model: a :class:`~lightning_dcp.planning.cost_model.CostModel`; else the one a
            profiler gives through :meth:`set_cost_model`; else :class:`~lightning_dcp.planning.default_cost.DefaultCostModel` (warned).
        planner: any object with ``plan_batch(samples, lengths, step=0)`` and
            ``one_step_per_batch``; overrides ``policy`` / ``cost_model``.
        profile: add ``lightning_dcp.profiling.DCPProfiler`` to the trainer's callbacks (measures
            the model at fit start). ``None``: only when no cost model or planner is given and
            the profiler is importable.
        global_batch_size: samples per optimizer step, over all ranks. Default: the train
            DataLoader's ``batch_size`` times the world size (what DDP would train on). Either is multiplied by
            ``Trainer(accumulate_grad_batches=N)`` (:mod:`~lightning_dcp.runtime.accumulation`).
        global_batch_tokens: alternatively, a token budget per step.
        loss_reduction: ``"token"`` (mean over all real tokens of the global batch) or
            ``"sample"`` (mean over samples of each sample's token mean); see
            :mod:`lightning_dcp.sp.tokens` for what ``training_step`` must return.
        sharding: which model states are sharded (the modes: :mod:`lightning_dcp.planning.sharding.registry`):
            ``"none"`` (full replicas, the default); ``"zero1"`` the optimizer state
            (``ZeroRedundancyOptimizer``); ``"zero2"`` the optimizer state and update, and gradients
            between steps (torch's ``fully_shard``; full weights kept); ``"fsdp"`` also the weights
            between steps. Every rank runs the same collectives whatever its micro-batch count: the
            weights are gathered once before the loop, the gradients reduce-scattered once after it.
            ``"hsdp"``: per-layer sharding inside the loop over shard groups of ``shard_group_size`` ranks
            (lockstep rounds, :mod:`~lightning_dcp.runtime.sharding.hsdp`; an SP group may span shard groups,
            whose rounds then meet). Checkpoints of ``"zero2"`` /
            ``"fsdp"`` / ``"hsdp"`` are directories of shards. ``"16-mixed"`` (a GradScaler) is refused with them.
        shard_group_size, offload: ``"hsdp"`` only: ranks the states are sharded over (the world: ZeRO-3;
            default the smallest power of two whose states fit, said at fit start:
            :mod:`~lightning_dcp.runtime.shard_group`), and the sharded states on the host (``CPUOffloadPolicy``).
        zero1: deprecated spelling of ``sharding="zero1"``.
        seed: data-order and planner seed (the epoch is added each epoch); the same on every rank. Default
            ``None``: Lightning's global seed (``seed_everything``, ``PL_GLOBAL_SEED``; else 0), as DDP's sampler
            (:func:`~lightning_dcp.planning.seed.data_seed`).
        plan_ahead: plan step ``k+1`` in a background thread while step ``k`` trains.
        max_sp_size: largest SP size: a divisor of the model's heads, or any size when the module runs ring
            attention (sizes past the heads' divisors as ring x Ulysses); default the world (or the shard
            group) with ring attention, else the largest divisor of the heads that fits it.
        lengths: sample lengths (a list, or a callable taking the dataset) when the dataset
            has no ``lengths`` attribute.
        shuffle, drop_last: data order per epoch, and whether to drop the last partial batch.
        planner_options: extra keyword arguments for the ``Planner``.
        log_metrics: log ``dcp/*`` step metrics through the LightningModule's logger.
        bucket_cap_mb: size of a gradient all-reduce bucket.
        support: what the module supports, ``"safe"``, ``"packed"`` or ``"sp"`` (see
            :mod:`lightning_dcp.runtime.support`); default the module's ``dcp_support`` attribute, else
            detected: a module without ``RecomputeLayers`` / ``dcp_repeated_layers()`` runs in
            safe mode (SP 1, its own ``collate_fn``, no packing across samples).
        timeout: seconds (or a ``timedelta``) a collective of the world or of any SP group may wait
            before it fails; default 300 (5 minutes). A stuck collective then ends the run with an
            error naming the step, the item and the group.
        max_oom_replans: how often one step may be re-planned after ``torch.OutOfMemoryError`` in an
            SP-1 item before the run stops (see :mod:`lightning_dcp.runtime.oom`).
        oom_checkpoint: after ``torch.OutOfMemoryError`` in an SP > 1 item (the step cannot be
            retried in process), the failing rank writes the state before the step to
            ``<default_root_dir>/dcp_oom/``; resuming from it re-plans that step with less memory.
        sigterm_grace_s: after SIGTERM, seconds before a rank still blocked in a collective exits
            (and kills the ranks it launched); ``None`` leaves SIGTERM to Lightning alone.
        layers_attr: dotted attribute path from the LightningModule to its repeated layers (a
            ``RecomputeLayers``, a ``ModuleList`` or a callable returning them), when it has several
            layer stacks (see :mod:`lightning_dcp.sp.contract`); default the module's ``dcp_layers_attr``,
            else its one stack. What the strategy read is :attr:`model_contract`.
        calibration: ``"adaptive"`` (time every micro-batch and step, refit the time scales, rank speeds
            and step overhead every ``calibrate_every`` steps (default 20), plan later steps with them),
            ``"fixed"`` (measure and log) or ``"off"`` (today's plans, bit for bit); see
            :mod:`~lightning_dcp.runtime.calibration`. Gradients are exact in every mode.
        **kwargs: :class:`~lightning.pytorch.strategies.DDPStrategy` arguments (``start_method``,
            ``process_group_backend``, ``cluster_environment``...). Arguments of the DDP *wrapper*
            (``find_unused_parameters``, ``static_graph``...) are ignored with a warning (there is no
            wrapper); any other name is a ``TypeError`` that names the closest valid argument.
    """

    strategy_name = "dcp"

    @override
    def __init__(
        self,
        *,
        policy: str = "dcp",
        cost_model: CostModel | None = None,
        planner: Any = None,
        profile: bool | None = None,
        global_batch_size: int | None = None,
        global_batch_tokens: int | None = None,
        loss_reduction: str = "token",
        zero1: bool = False,
        sharding: str = DEFAULT_MODE,
        seed: int | None = None,
        plan_ahead: bool = True,
        max_sp_size: int | None = None,
        lengths: Sequence[int] | Callable[[Any], Sequence[int]] | None = None,
        shuffle: bool = True,
        drop_last: bool = True,
        planner_options: Mapping[str, Any] | None = None,
        log_metrics: bool = True,
        bucket_cap_mb: float = 25.0,
        support: str | None = None,
        timeout: float | timedelta | None = DEFAULT_TIMEOUT_S,
        sigterm_grace_s: float | None = 30.0,
        max_oom_replans: int = 3,
        oom_checkpoint: bool = True,
        layers_attr: str | None = None,
        calibration: str = "adaptive",
        calibrate_every: int | None = None,
        shard_group_size: int | None = None,
        offload: bool = False,
        **kwargs: Any,
    ) -> None:
        ddp_kwargs, ignored = split_strategy_kwargs(kwargs)
        self.settings = DCPSettings(
            policy=policy, cost_model=cost_model, planner=planner, profile=profile, global_batch_size=global_batch_size,
            global_batch_tokens=global_batch_tokens, loss_reduction=loss_reduction, zero1=zero1, sharding=sharding,
            seed=seed,
            plan_ahead=plan_ahead, max_sp_size=max_sp_size, lengths=lengths, shuffle=shuffle, drop_last=drop_last,
            planner_options=planner_options or {}, log_metrics=log_metrics, bucket_cap_mb=bucket_cap_mb,
            support=support, timeout=timeout, sigterm_grace_s=sigterm_grace_s, max_oom_replans=max_oom_replans,
            oom_checkpoint=oom_checkpoint, layers_attr=layers_attr, calibration=calibration,
            calibrate_every=calibrate_every, shard_group_size=shard_group_size, offload=offload)
        if ignored:
            rank_zero_warn(f"DCPStrategy runs without the DDP wrapper; ignoring DDP wrapper arguments {ignored}")
        timeout = self.settings.timeout
        super().__init__(timeout=timeout if timeout is not None else default_pg_timeout, **ddp_kwargs)
        self._cost_model: CostModel | None = cost_model
        self._model_contract: ModelContract | None = None
        self.support: str | None = None
        self.num_heads: int | None = None
        self.sp_cap = SPCap(1)
        self.sp_groups: SPGroups | None = None
        self.fit_start_loader: DataLoader | None = None
        """The train DataLoader as the fit starts (checked against the global batch before profiling)."""
        self.batch_sampler: DCPBatchSampler | None = None
        self.oom: OOMRecovery | None = None
        """The fit's out-of-memory recovery (built with the train loader)."""
        self._oom_resume: Mapping[str, Any] | None = None  # a loaded out-of-memory checkpoint's entry
        self._calibration_resume: dict | None = None  # a loaded checkpoint's calibration state
        self.calibration: RunCalibration | None = None
        """The fit's calibration (predicted vs measured, refits; ``None`` with ``calibration="off"``)."""
        self.executor: StepExecutor | None = None
        self.accumulation = Accumulation()
        """``Trainer(accumulate_grad_batches=N)``, taken over at fit start
        (:mod:`~lightning_dcp.runtime.accumulation`)."""
        self.shards: Shards | None = None
        """The sharding mode's runtime (:class:`~lightning_dcp.runtime.sharding.protocol.Shards`), from setup on."""
        self._sharding = RunSharding(self.settings)
        self.last_step_metrics: StepMetrics | None = None
        """The last step's metrics (set by ``training_step`` from the executor's result)."""
        self.last_step_plan: dict | None = None
        """The plan the last step ran (after any out-of-memory re-plan), as ``StepPlan.to_dict()``."""
        self.metrics_tracker = StepMetricsTracker()
        self._watchdog: ShutdownWatchdog | None = None
        self._warned_sync = False

    @property
    def max_sp_size(self) -> int:
        """The largest SP size the runtime creates groups for (resolved at setup from the world, the heads
        and ``DCPStrategy(max_sp_size=...)``)."""
        return self.sp_cap.size

    @property
    def model_contract(self) -> ModelContract | None:
        """What the strategy read off the module at setup (:func:`~lightning_dcp.sp.contract.read_model`); ``None`` before."""
        return self._model_contract

    @property
    def oom_replans(self) -> int:
        """Steps re-planned after an out-of-memory error this fit (``dcp/oom_replans``)."""
        return self.oom.replans if self.oom is not None else 0

    @property
    def sharding(self) -> str:
        """The sharding mode this run uses (``DCPStrategy(sharding=...)``; full replicas on a single rank)."""
        return self._sharding.name(self.world_size)

    @property
    def shard_group_size(self) -> int | None:
        """The shard group ``K`` of a mode that has one (given, or picked at setup); else ``None``."""
        return self._sharding.shard_group_size(self.world_size)

    @property
    def mode(self) -> ShardingMode:
        """The sharding mode's pure counterpart on this world (:mod:`lightning_dcp.planning.sharding`)."""
        return self._sharding.mode(self.world_size)

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model the planner uses (given, measured by the profiler, or the fallback)."""
        return self._cost_model

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"dcp"`` (popen launcher, for scripts/CLIs) and ``"dcp_spawn"`` in ``strategy_registry``
        (what ``import lightning_dcp`` does for Lightning's registry; see :mod:`lightning_dcp._registry`).
        Names already there are left alone, and DDP's own names are never taken over."""
        from lightning_dcp._registry import register

        register(strategy_registry)

    # ------------------------------------------------------------------ environment and setup
    @override
    def setup_environment(self) -> None:
        import_group_defaults()  # before Lightning creates the default group (see runtime/exit.py)
        super().setup_environment()
        module = self.lightning_module
        with fit_start(self.global_rank):  # the same error on every rank: printed once
            contract = read_model(module, self.settings.layers_attr, self.settings.support) if module is not None else None
            self._model_contract = contract
            self.num_heads, self.support, self.sp_cap = resolve_model_setup(contract, self.settings, self.world_size)
        create = dist.is_available() and dist.is_initialized() and self.world_size > 1
        if dist.is_available() and dist.is_initialized():
            destroy_at_exit()
        self.sp_groups = SPGroups(self.world_size, self.global_rank, create=create, timeout=self._timeout,
                                  sizes=self.sp_cap.group_sizes)
        if create and self.settings.sigterm_grace_s is not None and self._watchdog is None:
            self._watchdog = rank_watchdog(self.launcher, self.cluster_environment, self.settings.sigterm_grace_s,
                                           self.global_rank)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._sharding.may_shard_weights() and self._start_method != "popen":
            self._launcher = ShardedSpawnLauncher(self, start_method=self._start_method)

    @override
    def setup(self, trainer: Any) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._before_fit_setup(trainer)
        elif self._evaluation_after_sharded_fit(trainer):
            return
        super().setup(trainer)
        self._shards_after_setup(fitting)

    def _before_fit_setup(self, trainer: Any) -> None:
        """A new fit: the checks (the train data against the global batch too), the support message, the progress
        bars, the profiler."""
        self.oom = None  # dcp/oom_replans counts this fit's re-plans
        with fit_start(self.global_rank):  # before the profiler (on_fit_start); printed once
            check_fit(trainer, self.lightning_module, self.sharding)
            self.accumulation.take_over(trainer)  # accumulate_grad_batches=N: a global batch N times larger
            self.fit_start_loader = train_dataset(trainer)  # the profiler reads its samples from it
            check_train_data(self.fit_start_loader, self.settings, self.world_size, self.accumulation.factor)
        message = support_message(self._model_contract)
        if message:
            rank_zero_info(message)
        mend_progress_bars(trainer)
        maybe_add_profiler(trainer, self.settings, self._cost_model, self.support)
        check_sharding(self.settings.sharding, self.world_size, self.precision_plugin)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper: broadcast rank 0's parameters and buffers instead, then build the sharding mode's
        runtime (the modes that shard the weights ``fully_shard`` them now, once: a later fit keeps the units)."""
        if self.world_size > 1 and dist.is_initialized():
            from lightning.pytorch.overrides.distributed import _sync_module_states

            if self._sharded_checkpoint and self.shards.module is self.model:  # a later fit keeps the units
                self.shards.reshard()  # the optimizer is built over the sharded parameters; setup() then unshards
                return
            _sync_module_states(self.model)
            trainer = self.lightning_module._trainer
            self._sharding.pick(self.model, self._model_contract, self.world_size, self.root_device, trainer=trainer,
                                cost_model=self._cost_model if self.settings.planner is None else None,
                                lengths=self.train_lengths, gpus_per_node=self.num_processes)
            check_sharding_agreement(self.settings.sharding, self.shard_group_size, self._world_gather)
            self.shards = build_shards(self.mode, self.model, self.root_device, **contract_units(self._model_contract))

    def set_cost_model(self, cost_model: CostModel) -> None:
        """Give the planner a cost model (the profiler calls this at fit start, before the sampler exists)."""
        self._cost_model = cost_model
        if self.batch_sampler is not None and self.settings.planner is None:
            rank_zero_warn("set_cost_model after the train dataloader was built: the new cost model applies from "
                           "the next time the dataloader is built (next fit or reload)")

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        if isinstance(dataloader, DCPDataLoader):
            return dataloader
        dataset = map_style_dataset(dataloader)
        lengths, names, per_rank = self.train_lengths(dataset), sample_namer(dataset), dataloader.batch_size or 1
        n = self.accumulation.factor
        gbs, gbt = global_batch(self.settings, per_rank, self.world_size, n)
        if self.accumulation.say_once():
            rank_zero_info(accumulation_message(n, global_batch_size=gbs, global_batch_tokens=gbt,
                                                source=global_batch_source(self.settings, per_rank, self.world_size)))
        planners = PlannerFactory(self.settings, self.world_size, self.sp_cap, self.num_heads, self.support,
                                  states=self.model_states(),
                                  prices=RunSharding.prices(self.root_device, self.num_processes), sample_name=names)
        if self.settings.planner is None:
            self._cost_model = planners.cost_model(self._cost_model, lengths, self._model_contract.num_layers, per_rank)
        planner = planners.planner(self._cost_model, lengths)
        resume, self._calibration_resume = self._calibration_resume, None
        planned_by, self.calibration = planner, None  # manual optimization: the fit-start cost model throughout
        if self.lightning_module.automatic_optimization:
            planned_by, self.calibration = build_calibration(self.settings, planners, planner, self._cost_model, lengths,
                                                             world_size=self.world_size, rank=self.global_rank,
                                                             device=self.root_device, resume=resume)
        self.batch_sampler = build_sampler(lengths, planned_by, self.settings, global_batch_size=gbs,
                                           global_batch_tokens=gbt, world_size=self.world_size, rank=self.global_rank)
        self._check_setup_agreement(lengths, planner, global_batch_size=gbs, global_batch_tokens=gbt)
        check_not_empty(self.batch_sampler, len(lengths), gbs, gbt)
        loader = build_loader(dataloader, self.batch_sampler, self.support)
        resume, self._oom_resume = self._oom_resume, None  # the entry moves to the fit's recovery
        self.oom = OOMRecovery(planners, max_replans=self.settings.max_oom_replans,
                               write_checkpoint=self.settings.oom_checkpoint, resume_entry=resume,
                               replans=self.oom_replans)
        self.executor = StepExecutor(self._rank_runtime(names), self.batch_sampler, loader.dataset, self._cost_model,
                                     self.oom, bounder=planners.bounder(self._cost_model), calibration=self.calibration)
        return loader

    def _rank_runtime(self, sample_name: Any = None) -> RankRuntime:
        """What the executor needs from this rank (it never holds the strategy); ``sample_name``: the dataset's."""
        return RankRuntime(
            module=self.lightning_module, settings=self.settings, support=self.support, device=self.root_device,
            backward=PrecisionBackward(self.precision_plugin, self.lightning_module,
                                       self.optimizers[0] if self.optimizers else None),
            world_size=self.world_size, rank=self.global_rank, sp_groups=self.sp_groups, num_heads=self.num_heads,
            shards=self.shards, to_device=BatchTransfer(self.lightning_module, self.root_device),
            convert_input=self.precision_plugin.convert_input,
            train_step_context=self.precision_plugin.train_step_context, checkpoint_io=self.checkpoint_io,
            contract=self._model_contract, sample_name=sample_name)

    def train_lengths(self, dataset: Any) -> list[int]:
        """Every train sample's length, without loading samples (safe mode: equal lengths when none are given)."""
        return train_lengths(dataset, self.settings, self.support)

    # ------------------------------------------------------------------ the step
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """A DCP step becomes this rank's prepared micro-batches on the host (the executor); only they move."""
        if isinstance(batch, LoadedStep) and self.executor is not None:
            return self.executor.ready(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, batch: Any = None, batch_idx: int = 0, *args: Any, **kwargs: Any) -> Any:
        """Run this rank's micro-batches of one optimizer step, log its metrics; return the step's global loss
        (detached). Manual optimization: the module's ``training_step`` once, driving the micro-batches
        (:mod:`~lightning_dcp.runtime.manual`); return what it returned."""
        if self.executor is None:
            raise RuntimeError("DCPStrategy.training_step ran before the train dataloader was built "
                               "(process_dataloader); train through Trainer.fit")
        self.accumulation.check_unchanged(self.lightning_module.trainer)
        manual = not self.lightning_module.automatic_optimization
        result = self.executor.run_manual_step(batch, batch_idx) if manual else self.executor.run_step(batch, batch_idx)
        self.batch_sampler.mark_consumed(result.step.epoch, result.step.index)  # the resume position
        self.last_step_metrics, self.last_step_plan = result.metrics, result.plan.to_dict()
        self.metrics_tracker.record(result.metrics)
        if self.settings.log_metrics:
            log_step_metrics(self.lightning_module, result.metrics, self.oom_replans)
        return result.output if manual else result.loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Skipped for the loss a DCP ``training_step`` returned (backward already ran per micro-batch). Manual
        optimization (``manual_backward`` inside a loop over ``micro_batches(batch)``): the micro-batch's loss as a
        sum over its loss units, then Lightning's backward."""
        if self.executor is not None and self.executor.grads_parked:
            return closure_loss
        manual = self.executor.manual if self.executor is not None else None
        if manual is not None:
            closure_loss = manual.scaled(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Reduce the parked gradients right after the closure, then ``on_after_backward`` once, on them (as DDP's
        after its all-reduce); then clipping and the step. (Manual optimization: each loop over
        ``micro_batches(batch)`` reduced its gradients when it ended.)"""
        if self.executor is not None and self.executor.manual is not None:
            self.executor.manual.check_step()

        def dcp_closure() -> Any:
            result = closure()
            if self.executor is not None and self.executor.reduce_gradients():
                self._after_backward(result)
            return result

        out = super().optimizer_step(optimizer, dcp_closure, model, **kwargs)
        self.shards.after_step()
        if self.calibration is not None:
            self.calibration.step_done()
        return out

    def _after_backward(self, loss: Any) -> None:
        """Lightning's ``on_after_backward`` hooks (the precision plugin's ``post_backward``) once per step, on the
        reduced gradients -- under ``"zero2"`` / ``"fsdp"`` / ``"hsdp"`` this rank's shards of them, as under
        Lightning's FSDP strategy (the micro-batches' backwards ran ``on_before_backward`` each)."""
        loss = loss if isinstance(loss, Tensor) else torch.zeros((), device=self.root_device)
        self.precision_plugin.post_backward(loss, self.lightning_module)

    # ------------------------------------------------------------------ checkpoints (the mode's: ShardedStateHooks)
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Lightning's file; where the mode shards the weights, a directory at ``filepath`` where every rank
        writes its shards (:mod:`~lightning_dcp.runtime.checkpoint`; all ranks call this)."""
        if self.calibration is not None:
            checkpoint[CALIBRATION_KEY] = self.calibration.state_dict()
        if not self._sharded_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError(f"sharding={self.sharding!r}: storage_options is not supported (torch.distributed.checkpoint)")
        self.shards.save_checkpoint(checkpoint, Path(self.broadcast(str(filepath))), rank=self.global_rank,
                                    barrier=self.barrier)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's checkpoint load (sharded: every rank reads its shards into the module and optimizers);
        an out-of-memory checkpoint's step is re-planned with its lowered limit."""
        if self._sharded_checkpoint:
            checkpoint = self.shards.load_checkpoint(Path(self.broadcast(str(checkpoint_path))), self.optimizers,
                                                     strict=self.lightning_module.strict_loading)
        else:
            checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._oom_resume = checkpoint.get(CHECKPOINT_KEY)  # its step is re-planned when it comes
        self._calibration_resume = checkpoint.get(CALIBRATION_KEY)  # the refitted model, for the next fit
        return checkpoint

    @override
    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self.batch_sampler is not None:
            self.batch_sampler.shutdown()
        self.executor = None
        self.accumulation.restore()
        self._oom_resume = None  # an out-of-memory checkpoint's entry lives for the one fit that loaded it
        if self.oom is not None:
            self.oom.clear()
        if self.sp_groups is not None:
            self.sp_groups.destroy()
        super().teardown()
