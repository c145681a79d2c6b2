"""DCPStrategy: Data-Centric Parallel training as a Lightning strategy.

How it hooks into Lightning (automatic optimization is kept; the user's module runs unchanged):

- ``setup_environment``: after DDP's process-group setup, create the SP groups of every aligned
  power-of-two block (:class:`~lightning_dcp.groups.SPGroups`), once, in the same order on
  every rank.
- ``setup``: no DDP wrapper (``configure_ddp`` only broadcasts rank 0's weights); checks the
  SP sizes against the model's attention heads; optional ZeRO-1
  (``torch.distributed.optim.ZeroRedundancyOptimizer``).
- ``process_dataloader`` (train only): replaces the train DataLoader with a
  :class:`~lightning_dcp.sampler.DCPDataLoader` whose :class:`~lightning_dcp.sampler.DCPBatchSampler`
  yields one item per optimizer step: this rank's packed micro-batches. Validation, test and
  predict loaders keep Lightning's distributed sampling (SP size 1).
- ``batch_to_device``: on the host, before the step's batch moves, each item gets the module's
  ``dcp_prepare_batch`` (if any), its token weights and loss-unit count, and is cut to this
  rank's shard (:mod:`lightning_dcp.sp.sharding`); only the shards move to the device.
- ``training_step`` (called by Lightning's closure once per optimizer step): for each of this
  rank's work items, in plan order, activate the item's SP group and recompute count
  (:func:`~lightning_dcp.sp.context.sp_context`), call the user's
  ``training_step(micro_batch, batch_idx)``, turn its loss into a sum over its loss units and
  run backward through the precision plugin. Then one all-gather of a few numbers per rank (metrics, exact global loss,
  which parameters got gradients), and the gradients are copied into flat buckets. It returns
  the exact global loss, detached.
- Lightning's closure then zeroes gradients (nothing to zero: they are parked in the buckets)
  and calls ``backward`` on the returned loss, which this strategy skips.
- ``optimizer_step`` wraps the closure: right after it, the buckets are SUM all-reduced over the
  world (one collective per bucket) and become the parameters' ``.grad``. Only then does the
  precision plugin call ``on_before_optimizer_step`` and clip gradients, and the optimizer step.

Why the SUM is exact: each item's loss is a sum over its loss tokens (or samples), so the world
sum of all ranks' losses divided by the global count of loss units -- counted on the host per
item and summed by the step-end all-gather -- is the global loss of plain data-parallel training
on the step's global batch (see :mod:`lightning_dcp.sp.sharding`); the Ulysses all-to-all's backward
routes gradients between the ranks of an SP group, so the world sum of local gradients, scaled
once by that count, is the global gradient.

Agreement (:mod:`lightning_dcp.agreement`): no plan is broadcast, every rank plans from its own
inputs, so the strategy checks that they agree and stops every rank with one error naming the
ranks, what differs and the likely cause -- never a silently wrong run (SP 1) or a hang (SP > 1):

- at setup (``process_dataloader``), one world all-gather of the sample count, token total, a
  hash of all lengths, of the planner's settings and of the cost model;
- every step's step-end all-gather carries the hash of the plan the step ran and of the *next*
  step's plan (planned ahead anyway): ranks that would run different plans are stopped one step
  before they could wait on each other inside an SP collective;
- a step whose plan no previous step compared -- the first step of a fit, of a resume, of each
  epoch -- compares its plan hash in one extra world all-gather before its first micro-batch (at
  most once per epoch; a world collective before the loop, never inside it).

Time-outs and signals: the world group and every SP group use ``DCPStrategy(timeout=...)``
(default 5 minutes). A collective that fails or times out inside the micro-batch loop, the
step-end all-gather or the plan comparison ends the run with a
:class:`~lightning_dcp.faults.CollectiveError` naming the step, the item (samples, lengths, SP
size) and the group. SIGTERM ends every process within ``sigterm_grace_s`` even when they are
blocked in a collective, and a launched rank exits when its launcher is gone
(:mod:`lightning_dcp.watchdog`).

Out of memory (:mod:`lightning_dcp.oom`): ``torch.OutOfMemoryError`` in an SP-1 item is flagged on
the step-end all-gather (a column, no new collective); every rank discards the attempt's
gradients, re-plans the same samples with the memory limit just below the failed item's estimate
and runs the step again (``dcp/oom_replans``; at most ``max_oom_replans`` times). In an SP > 1
item a partner may wait inside a collective, so the rank stops the run with
:class:`~lightning_dcp.oom.StepOutOfMemoryError`, after writing the state before the step to
``<default_root_dir>/dcp_oom/``; resuming from that file re-plans the step with less memory.

Collectives: inside the micro-batch loop only the active SP group's (Ulysses); after it, the
world-wide ones above, the same number on every rank whatever its item count (a rank with no
item in a step still joins them). ``self.log(..., sync_dist=True)`` inside the user's
``training_step`` would be a world collective inside the loop: while the loop runs,
:meth:`DCPStrategy.reduce` returns the local value (warning once); epoch-level syncing still
happens at epoch end.
"""

from __future__ import annotations

import inspect
import os
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dcp.agreement import STEP_CAUSE, check_column, check_setup, planner_settings, plan_fingerprint, setup_row
from lightning_dcp.sp.context import SEGMENT_IDS, SPContext, sp_context
from lightning_dcp.faults import collective_error, describe_item, is_collective_failure
from lightning_dcp.groups import SPGroups, largest_power_of_two
from lightning_dcp.metrics import StepMetrics, StepMetricsTracker, step_metrics
from lightning_dcp.oom import CHECKPOINT_KEY as OOM_CHECKPOINT_KEY
from lightning_dcp.oom import OOM_ERRORS, LoweredMemory, StepOutOfMemoryError, lowered_limit, sp_oom_message
from lightning_dcp.planning.cost_model import CostModel, ItemCost
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.plan import WorkItem
from lightning_dcp.planning.planner import Planner
from lightning_dcp.sp.recompute import find_recompute_layers
from lightning_dcp.sampler import DCPBatchSampler, DCPDataLoader, resolve_lengths
from lightning_dcp.sp.sharding import LOSS_REDUCTIONS, add_token_weights, is_weighted, local_loss_tokens, shard_batch
from lightning_dcp.support import (PaddedCostModel, PaddedPlanner, micro_batch_loss_units, resolve_support, safe_mode_message,
                                   uniform_lengths)
from lightning_dcp.watchdog import ShutdownWatchdog

__all__ = ["DCPStrategy", "DefaultCostModel", "find_num_heads"]

_DDP_INIT_ARGS = {
    "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin", "ddp_comm_state",
    "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period", "process_group_backend", "start_method",
}

DEFAULT_TIMEOUT_S = 300.0
"""Default time-out of every process group the strategy uses (world and SP groups): 5 minutes."""


class DefaultCostModel(CostModel):
    """Fallback cost model when neither ``cost_model=`` nor a profiler supplied one.

    Time of a micro-batch: ``sum(l^2) * 1e-9 + sum(l) * 1e-6`` (attention + linear work,
    arbitrary units) split over the SP size, plus ``1e-4`` per micro-batch and ``1e-5 * l / sp``
    of communication per SP rank when ``sp > 1``. Memory (arbitrary units): ``tokens / sp *
    (1 + num_layers - recompute)`` against a limit that holds ``max_tokens`` tokens on one rank
    without recomputation, so samples up to ``max_tokens`` (the strategy uses 4x the longest
    sample) run at SP size 1 and ranks are balanced by gradient accumulation (DCP-inter only).
    Measure the model (``DCPProfiler``) or pass a cost model to get SP and recompute choices.
    """

    def __init__(self, num_layers: int = 0, num_heads: int = 1, max_tokens: int = 1 << 16) -> None:
        self.num_layers = int(num_layers)
        self.num_heads = max(1, int(num_heads))
        self.max_tokens = int(max_tokens)
        self.memory_limit = float(self.max_tokens * (1 + self.num_layers))

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int) -> ItemCost:
        lin = sum(lengths) * 1e-6
        sq = sum(n * n for n in lengths) * 1e-9
        per_layer = (lin + sq) / max(1, self.num_layers or 1)
        comm = 1e-5 * sum(lengths) / sp if sp > 1 else 0.0
        return ItemCost(compute=(lin + sq) / sp, recompute=per_layer * recompute / sp, comm=comm, overhead=1e-4,
                        ideal=(lin + sq) / sp)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int) -> float:
        return sum(lengths) / sp * (1 + self.num_layers - recompute)

    def step_overhead(self, world_size: int) -> float:
        return 1e-3

    def signature(self) -> dict:
        return {"kind": "default", "num_layers": self.num_layers, "num_heads": self.num_heads,
                "max_tokens": self.max_tokens}


def find_num_heads(module: torch.nn.Module) -> int | None:
    """The attention head count SP sizes must divide: ``dcp_num_heads`` or ``num_heads`` on the
    module or (first found) on a submodule or its ``spec``; ``None`` when nothing says."""
    for attr in ("dcp_num_heads", "num_heads"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    spec = getattr(module, "spec", None)
    if isinstance(getattr(spec, "num_heads", None), int):
        return spec.num_heads
    for sub in module.modules():
        if sub is module:
            continue
        for attr in ("dcp_num_heads", "num_heads"):
            value = getattr(sub, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _count_recompute_layers(module: torch.nn.Module) -> int:
    """Repeated layers: the longest RecomputeLayers, or a ``dcp_repeated_layers()`` list (HF models)."""
    stacks = [len(r) for r in find_recompute_layers(module)]
    stacks += [len(m.dcp_repeated_layers()) for m in module.modules() if callable(getattr(m, "dcp_repeated_layers", None))]
    return max(stacks, default=0)


class _GradBuckets:
    """Flat gradient buckets for one SUM all-reduce per bucket.

    ``park`` copies the parameters' gradients into the buckets (zeros where a rank has none)
    and drops ``.grad``; ``reduce`` all-reduces and hands each parameter a view of its slice
    (``None`` when no rank produced a gradient for it, like single-process training).
    """

    def __init__(self, params: list[torch.nn.Parameter], cap_bytes: int) -> None:
        self.params = params
        self.slots: list[tuple[int, int, int]] = []  # (bucket, offset, numel) per param
        self.buffers: list[Tensor] = []
        sizes: list[int] = []
        keys: list[tuple[torch.dtype, torch.device]] = []
        for p in params:
            key = (p.dtype, p.device)
            n = p.numel()
            b = next((i for i in range(len(keys)) if keys[i] == key and sizes[i] * p.element_size() + n * p.element_size() <= cap_bytes), None)
            if b is None:
                keys.append(key)
                sizes.append(0)
                b = len(keys) - 1
            self.slots.append((b, sizes[b], n))
            sizes[b] += n
        self.buffers = [torch.zeros(n, dtype=k[0], device=k[1]) for n, k in zip(sizes, keys)]
        self.has_grad = torch.zeros(len(params), dtype=torch.float64)

    def park(self) -> None:
        for i, (p, (b, off, n)) in enumerate(zip(self.params, self.slots)):
            dst = self.buffers[b][off:off + n]
            g = p.grad
            if g is None:
                dst.zero_()
                self.has_grad[i] = 0.0
            else:
                if g.data_ptr() != dst.data_ptr():
                    dst.copy_(g.reshape(-1))
                self.has_grad[i] = 1.0
                p.grad = None

    def reduce(self, world_has_grad: Tensor | None, group: Any = None, world: int = 1, scale: float = 1.0) -> None:
        if world > 1:
            handles = [dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True) for buf in self.buffers]
            for h in handles:
                h.wait()
        if scale != 1.0:
            for buf in self.buffers:
                buf.mul_(scale)
        has = world_has_grad if world_has_grad is not None else self.has_grad
        for i, (p, (b, off, n)) in enumerate(zip(self.params, self.slots)):
            p.grad = self.buffers[b][off:off + n].view_as(p) if has[i] > 0 else None


# Columns of the step-end all-gather (one row per rank), then one has-gradient flag per parameter.
_BUSY, _LOSS, _TOKENS, _ITEMS, _LOSS_UNITS, _PLAN, _NEXT_PLAN, _OOM = range(8)
_N_STATS = 8


def _is_step_batch(batch: Any) -> bool:
    return isinstance(batch, Mapping) and "items" in batch and "meta" in batch


class DCPStrategy(DDPStrategy):
    """Data-Centric Parallel: per step, the data chooses SP groups, micro-batches per rank and recomputation.

    Gradients equal those of plain data-parallel training on the same global batch (fp32, up
    to summation order). Subclasses Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`
    (launchers, cluster environments, rank setup) without the DDP wrapper.

    Args:
        policy: planner policy name for :class:`lightning_dcp.planning.planner.Planner`
            (``"dcp"``, ``"bucket"``, ``"packed"``, ``"static"``...); ignored with ``planner=``.
        cost_model: a :class:`~lightning_dcp.planning.cost_model.CostModel`; else the one a
            profiler gives through :meth:`set_cost_model`; else :class:`DefaultCostModel` (warned).
        planner: any object with ``plan_batch(samples, lengths, step=0)`` and
            ``one_step_per_batch``; overrides ``policy`` / ``cost_model``.
        profile: add ``lightning_dcp.profiling.DCPProfiler`` to the trainer's callbacks (measures
            the model at fit start). ``None``: only when no cost model or planner is given and
            the profiler is importable.
        global_batch_size: samples per optimizer step, over all ranks. Default: the train
            DataLoader's ``batch_size`` times the world size (what DDP would train on).
        global_batch_tokens: alternatively, a token budget per step.
        loss_reduction: ``"token"`` (mean over all real tokens of the global batch) or
            ``"sample"`` (mean over samples of each sample's token mean); see
            :mod:`lightning_dcp.sp.sharding` for what ``training_step`` must return.
        zero1: shard optimizer state over the world (``ZeroRedundancyOptimizer``).
        seed: data-order seed (the epoch is added each epoch); the same on every rank.
        plan_ahead: plan step ``k+1`` in a background thread while step ``k`` trains.
        max_sp_size: largest SP size (a power of two) to create groups for; default the largest
            power of two that fits the world and divides the model's head count.
        lengths: sample lengths (a list, or a callable taking the dataset) when the dataset
            has no ``lengths`` attribute.
        shuffle, drop_last: data order per epoch, and whether to drop the last partial batch.
        planner_options: extra keyword arguments for the ``Planner``.
        log_metrics: log ``dcp/*`` step metrics through the LightningModule's logger.
        bucket_cap_mb: size of a gradient all-reduce bucket.
        support: what the module supports, ``"safe"``, ``"packed"`` or ``"sp"`` (see
            :mod:`lightning_dcp.support`); default the module's ``dcp_support`` attribute, else
            detected: a module without ``RecomputeLayers`` / ``dcp_repeated_layers()`` runs in
            safe mode (SP 1, its own ``collate_fn``, no packing across samples).
        timeout: seconds (or a ``timedelta``) a collective of the world or of any SP group may wait
            before it fails; default 300 (5 minutes). A stuck collective then ends the run with an
            error naming the step, the item and the group.
        max_oom_replans: how often one step may be re-planned after ``torch.OutOfMemoryError`` in an
            SP-1 item before the run stops (see :mod:`lightning_dcp.oom`).
        oom_checkpoint: after ``torch.OutOfMemoryError`` in an SP > 1 item (the step cannot be
            retried in process), the failing rank writes the state before the step to
            ``<default_root_dir>/dcp_oom/``; resuming from it re-plans that step with less memory.
        sigterm_grace_s: after SIGTERM, seconds before a rank still blocked in a collective exits
            (and kills the ranks it launched); ``None`` leaves SIGTERM to Lightning alone.
        **kwargs: :class:`~lightning.pytorch.strategies.DDPStrategy` arguments
            (``start_method``, ``process_group_backend``, ``cluster_environment``...).
    """

    strategy_name = "dcp"

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
        seed: int = 0,
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
        **kwargs: Any,
    ) -> None:
        unsupported = sorted(set(kwargs) - _DDP_INIT_ARGS)
        if unsupported:
            rank_zero_warn(f"DCPStrategy runs without the DDP wrapper; ignoring DDP wrapper arguments {unsupported}")
            kwargs = {k: v for k, v in kwargs.items() if k in _DDP_INIT_ARGS}
        if timeout is not None and not isinstance(timeout, timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                raise ValueError(f"timeout must be seconds > 0 or a datetime.timedelta, got {timeout!r}")
            timeout = timedelta(seconds=float(timeout))
        super().__init__(timeout=timeout if timeout is not None else default_pg_timeout, **kwargs)
        self.sigterm_grace_s = sigterm_grace_s
        self.max_oom_replans = int(max_oom_replans)
        self.oom_checkpoint = bool(oom_checkpoint)
        self._resume_oom: dict | None = None  # an out-of-memory checkpoint's entry, until its step is re-planned
        self._oom_attempts = 0
        self.oom_replans = 0  # steps re-planned after an out-of-memory error, this fit (logged as dcp/oom_replans)
        self._oom_cost_model: CostModel | None = None
        self._step_dataset: Any = None
        self._watchdog: ShutdownWatchdog | None = None
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        if max_sp_size is not None and (max_sp_size < 1 or max_sp_size & (max_sp_size - 1)):
            raise ValueError(f"max_sp_size must be a power of two >= 1, got {max_sp_size}")
        if global_batch_size is not None and global_batch_tokens is not None:
            raise ValueError(f"give global_batch_size ({global_batch_size}) or global_batch_tokens "
                             f"({global_batch_tokens}), not both")
        self.policy = policy
        self._cost_model = cost_model
        self._planner = planner
        self.profile = profile
        self.global_batch_size = global_batch_size
        self.global_batch_tokens = global_batch_tokens
        self.loss_reduction = loss_reduction
        self.zero1 = zero1
        self.seed = seed
        self.plan_ahead = plan_ahead
        self.max_sp_size = max_sp_size
        self._lengths = lengths
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.planner_options = dict(planner_options or {})
        self.log_metrics = log_metrics
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        if support is not None:
            from lightning_dcp.support import SUPPORT_LEVELS

            if support not in SUPPORT_LEVELS:
                raise ValueError(f"support must be one of {SUPPORT_LEVELS} (or None to detect), got {support!r}")
        self.requested_support = support
        self.support: str | None = None
        self._bounder: Any = None
        self._loss_divisor = 1.0
        self.sp_groups: SPGroups | None = None
        self.num_heads: int | None = None
        self.batch_sampler: DCPBatchSampler | None = None
        self.last_step_metrics: StepMetrics | None = None
        self.last_step_plan: dict | None = None
        self.metrics_tracker = StepMetricsTracker()
        self._buckets: _GradBuckets | None = None
        self._grads_parked = False
        self._world_has_grad: Tensor | None = None
        self._in_micro_loop = False
        self._warned_sync = False
        self._warned_default_cost = False
        self._last_step_start: float | None = None
        self._tracker_epoch: int | None = None
        self._verified_next: tuple[int, int] | None = None  # (epoch, step) whose plan all ranks already compared
        self._heads_cap: int | None = None  # set when the head count (not the world or the user) caps SP

    # ------------------------------------------------------------------ registration
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"dcp"`` (popen launcher, for scripts/CLIs) and ``"dcp_spawn"`` (see :mod:`lightning_dcp._registry`)."""
        from lightning_dcp._registry import register

        register(strategy_registry)

    # ------------------------------------------------------------------ environment and setup
    def setup_environment(self) -> None:
        super().setup_environment()
        module = self.lightning_module
        self.num_heads = find_num_heads(module) if module is not None else None
        self.support = resolve_support(module, self.requested_support) if module is not None else "sp"
        if self.support != "sp":
            if self.max_sp_size not in (None, 1):
                rank_zero_warn(f"max_sp_size={self.max_sp_size} ignored: the module runs at support level "
                               f"{self.support!r}, which has no sequence parallelism (SP size 1)")
            self.max_sp_size = 1
        self._resolve_max_sp()
        create = dist.is_available() and dist.is_initialized() and self.world_size > 1
        self.sp_groups = SPGroups(self.world_size, self.global_rank, self.max_sp_size, create=create, timeout=self._timeout)
        if create and self.sigterm_grace_s is not None and self._watchdog is None:
            self._start_watchdog()

    def _start_watchdog(self) -> None:
        """SIGTERM ends this rank (and the ranks it launched) within ``sigterm_grace_s`` even when it is
        blocked in a collective; a launched rank exits when its launcher is gone (:mod:`lightning_dcp.watchdog`)."""
        launcher = self.launcher
        is_launcher = isinstance(launcher, _SubprocessScriptLauncher) and not self.cluster_environment.creates_processes_externally
        children = (lambda: list(launcher.procs)) if is_launcher else (lambda: ())
        self._watchdog = ShutdownWatchdog(self.sigterm_grace_s, watch_parent=not is_launcher, children=children,
                                          name=f"rank {self.global_rank}").start()

    def _resolve_max_sp(self, world_size: int | None = None) -> None:
        world_size = self.world_size if world_size is None else world_size
        world_cap = largest_power_of_two(world_size)
        heads = self.num_heads
        if self.max_sp_size is not None:
            if heads is not None:
                p = 2
                while p <= self.max_sp_size:
                    if heads % p:
                        raise ValueError(
                            f"max_sp_size={self.max_sp_size} allows SP size {p}, which does not divide the model's "
                            f"{heads} attention heads; use max_sp_size <= {self._largest_dividing(heads)} or a head "
                            f"count divisible by {self.max_sp_size}")
                    p *= 2
            if self.max_sp_size > world_cap:
                rank_zero_warn(f"max_sp_size={self.max_sp_size} exceeds the world ({world_size} ranks); "
                               f"using {world_cap}")
            self.max_sp_size = min(self.max_sp_size, world_cap)
        else:
            self.max_sp_size = min(world_cap, self._largest_dividing(heads)) if heads else world_cap
            if heads and self.max_sp_size < world_cap:
                self._heads_cap = self.max_sp_size
                fix = ("; use a head count with a power-of-two factor (e.g. 4 or 8) for sequence parallelism"
                       if self.max_sp_size == 1 else "")
                rank_zero_warn(f"the model has {heads} attention heads: SP sizes must divide it, so SP is capped at "
                               f"{self.max_sp_size} on this world of {world_size} ranks{fix}")

    @staticmethod
    def _largest_dividing(heads: int | None) -> int:
        if not heads:
            return 1 << 30
        return heads & -heads  # largest power of two dividing heads

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING:
            if not module.automatic_optimization:
                raise ValueError(
                    "DCPStrategy runs the micro-batch accumulation loop itself and needs automatic optimization; "
                    f"{type(module).__name__}.automatic_optimization is False. Let training_step return the loss "
                    "(the strategy does backward, gradient reduction and the optimizer step)")
            if trainer.accumulate_grad_batches != 1:
                raise ValueError(
                    f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) with DCPStrategy: the "
                    "strategy accumulates per rank as the plan says; set accumulate_grad_batches=1 and make the "
                    "global batch larger instead (DCPStrategy(global_batch_size=...))")
            if self.support == "safe":
                rank_zero_info(safe_mode_message(module))
            elif callable(getattr(module, "dcp_support_message", None)) and module.dcp_support_message(self.support):
                rank_zero_info(module.dcp_support_message(self.support))  # e.g. lightning_dcp.hf.CausalLMModule
            self._maybe_add_profiler(trainer)
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.zero1 and self.world_size > 1:
            self._wrap_zero1()

    def _maybe_add_profiler(self, trainer: Any) -> None:
        """Append a :class:`~lightning_dcp.profiling.DCPProfiler` unless the trainer has one, ``profile=False``,
        or (``profile=None``) a cost model or planner was given."""
        if self.profile is False or (self.profile is None and (self._cost_model is not None or self._planner is not None)):
            return
        if self.support == "safe":  # nothing to profile: no repeated layers to measure
            return
        from lightning_dcp.profiling import DCPProfiler

        if not any(isinstance(cb, DCPProfiler) for cb in trainer.callbacks):
            trainer.callbacks.append(DCPProfiler())

    def _wrap_zero1(self) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        new = []
        for opt in self.optimizers:
            if isinstance(opt, ZeroRedundancyOptimizer):
                new.append(opt)
                continue
            groups = [dict(g) for g in opt.param_groups]
            # ``defaults`` can hold keys the constructor does not take (torch's AdamW records
            # ``decoupled_weight_decay``); the param groups keep every per-group value anyway.
            accepted = inspect.signature(type(opt).__init__).parameters
            defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
            zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(opt), **defaults)
            for cfg in self.lr_scheduler_configs:
                if getattr(cfg.scheduler, "optimizer", None) is opt:
                    cfg.scheduler.optimizer = zero
            new.append(zero)
        self.optimizers = new

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def configure_ddp(self) -> None:
        """No DDP wrapper: broadcast rank 0's parameters and buffers instead."""
        if self.world_size > 1 and dist.is_initialized():
            from lightning.pytorch.overrides.distributed import _sync_module_states

            _sync_module_states(self.model)

    def set_cost_model(self, cost_model: CostModel) -> None:
        """Give the planner a cost model (the profiler calls this at fit start, before the sampler exists)."""
        self._cost_model = cost_model
        if self.batch_sampler is not None and self._planner is None:
            rank_zero_warn("set_cost_model after the train dataloader was built: the new cost model applies from "
                           "the next time the dataloader is built (next fit or reload)")

    @property
    def cost_model(self) -> CostModel | None:
        return self._cost_model

    # ------------------------------------------------------------------ data
    def _make_planner(self, lengths: list[int], micro_batch_size: int = 1) -> Any:
        if self._planner is not None:
            return self._planner
        cost_model = self._cost_model
        if self.support == "safe":
            base = cost_model if cost_model is not None else DefaultCostModel(0, 1, 4 * max(lengths))
            cost_model = base if isinstance(base, PaddedCostModel) else PaddedCostModel(base, micro_batch_size * max(lengths))
            self._cost_model = cost_model
        if cost_model is None:
            module = self.lightning_module
            cost_model = DefaultCostModel(_count_recompute_layers(module), self.num_heads or 1, 4 * max(lengths))
            if not self._warned_default_cost:
                self._warned_default_cost = True
                rank_zero_warn("DCPStrategy has no cost model (pass cost_model=, or add lightning_dcp's DCPProfiler); "
                               "using DefaultCostModel: SP size 1 for every sample, ranks balanced by gradient "
                               "accumulation only")
            self._cost_model = cost_model
        return self._build_planner(cost_model, lengths)

    def _build_planner(self, cost_model: CostModel, lengths: list[int]) -> Any:
        opts = dict(self.planner_options)
        opts.setdefault("max_sp_size", self.max_sp_size)
        if self._heads_cap is not None and opts["max_sp_size"] == self._heads_cap:
            opts.setdefault("sp_cap_reason", f"the model's {self.num_heads} attention heads (SP sizes must divide them)")
        planner = Planner(self.world_size, cost_model, policy=self.policy, seed=self.seed, dataset_lengths=lengths, **opts)
        return PaddedPlanner(planner, cost_model) if isinstance(cost_model, PaddedCostModel) else planner

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        if isinstance(dataloader, DCPDataLoader):
            return dataloader
        dataset = dataloader.dataset
        if not hasattr(dataset, "__getitem__") or isinstance(dataset, torch.utils.data.IterableDataset):
            raise ValueError(f"DCPStrategy needs a map-style train dataset (random access by index); got "
                             f"{type(dataset).__name__}")
        lengths = self._train_lengths(dataset)
        if not lengths:
            raise ValueError(f"the train dataset {type(dataset).__name__} is empty (0 samples): nothing to train on; "
                             "check the data path and any filtering")
        gbs, gbt = self.global_batch_size, self.global_batch_tokens
        per_rank = dataloader.batch_size or 1
        if gbs is None and gbt is None:
            gbs = per_rank * self.world_size
        planner = self._make_planner(lengths, per_rank)
        self._bounder = self._make_bounder()
        self.batch_sampler = DCPBatchSampler(
            lengths, planner=planner, global_batch_size=gbs, global_batch_tokens=gbt, num_replicas=self.world_size,
            rank=self.global_rank, seed=self.seed, shuffle=self.shuffle, drop_last=self.drop_last,
            plan_ahead=self.plan_ahead,
        )
        self._verified_next = None
        self._check_setup_agreement(lengths, planner, global_batch_size=gbs, global_batch_tokens=gbt)
        if len(self.batch_sampler) == 0:
            raise ValueError(f"the train dataset ({len(lengths)} samples) gives no full global batch of "
                             f"{gbs if gbs is not None else str(gbt) + ' tokens'}; lower the global batch or set drop_last=False")
        kwargs: dict[str, Any] = {}
        if dataloader.num_workers > 0:
            kwargs.update(prefetch_factor=dataloader.prefetch_factor, persistent_workers=dataloader.persistent_workers,
                          multiprocessing_context=dataloader.multiprocessing_context)
        collate_fn = None
        if self.support == "safe":
            from torch.utils.data import default_collate

            collate_fn = dataloader.collate_fn or default_collate
        loader = DCPDataLoader(dataset, self.batch_sampler, collate_fn=collate_fn, num_workers=dataloader.num_workers,
                               pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
                               worker_init_fn=dataloader.worker_init_fn, **kwargs)
        self._step_dataset = loader.dataset  # loads a re-planned step (out-of-memory recovery)
        return loader

    def _check_setup_agreement(self, lengths: list[int], planner: Any, **settings: Any) -> None:
        """One world all-gather at setup: every rank must have the same lengths, planner settings and
        cost model (:mod:`lightning_dcp.agreement`); else every rank raises the same error."""
        if self.world_size == 1 or not dist.is_initialized():
            return
        settings.update(world_size=self.world_size, seed=self.seed, shuffle=self.shuffle, drop_last=self.drop_last,
                        max_sp_size=self.max_sp_size, support=self.support, loss_reduction=self.loss_reduction,
                        policy=self.policy if self._planner is None else None)
        cost_model = self._cost_model if self._planner is None else getattr(planner, "cost_model", None)
        row = setup_row(lengths, planner_settings(planner, **settings), cost_model)
        check_setup(self._all_gather(torch.tensor(row, dtype=torch.float64)).tolist())

    def _make_bounder(self) -> Any:
        """The per-step achievable bound (``dcp/step_bound_fraction``), for measured cost models only:
        its seconds mean nothing beside wall time for an analytic or default model."""
        from lightning_dcp.planning.profiled import ProfiledCostModel

        if not isinstance(self._cost_model, ProfiledCostModel):
            return None
        from lightning_dcp.planning.bound import StepBounder

        return StepBounder(self._cost_model, self.world_size, self.max_sp_size)

    def _train_lengths(self, dataset: Any) -> list[int]:
        if self.support != "safe" or self._lengths is not None or getattr(dataset, "lengths", None) is not None:
            return resolve_lengths(dataset, self._lengths)
        rank_zero_info(f"DCPStrategy (safe mode): {type(dataset).__name__} gives no sample lengths; treating samples as "
                       "equally long (ranks balanced by sample count). Give the dataset a `lengths` attribute or pass "
                       "DCPStrategy(lengths=...) to balance by length")
        return uniform_lengths(dataset)

    # ------------------------------------------------------------------ the step
    def _grad_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    def _validate_step(self, meta: Mapping[str, Any]) -> None:
        if int(meta.get("world_size", self.world_size)) != self.world_size:
            raise RuntimeError(f"the step was planned for {meta['world_size']} ranks but the world has {self.world_size}")
        assert self.sp_groups is not None
        for idx, item in enumerate(meta["plan"]["items"]):
            ranks = item["ranks"]
            sp = len(ranks)
            if self.num_heads is not None and self.num_heads % sp:
                raise ValueError(f"step {meta['step']} of epoch {meta['epoch']}: item {idx} (samples {item['samples']}) "
                                 f"uses SP size {sp}, which does not divide the model's {self.num_heads} attention "
                                 f"heads; cap the planner at max_sp_size={self._largest_dividing(self.num_heads)}")
            if not self.sp_groups.has(ranks):
                raise ValueError(f"step {meta['step']} of epoch {meta['epoch']}: item {idx} runs on ranks {ranks}, "
                                 f"which is not an SP group of this world ({self.sp_groups}); fix the plan or max_sp_size")

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Before a DCP step batch moves to the device, build this rank's micro-batches on the host
        (:meth:`_prepare_step`); only the local shards move."""
        if _is_step_batch(batch) and not batch["meta"].get("prepared"):
            self._prepare_step(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    def _prepare_step(self, batch: dict) -> None:
        """Per item, on the host: the module's ``dcp_prepare_batch`` (e.g. per-sample label shift),
        token weights and loss units, this rank's shard (the module's ``dcp_shard_batch`` or the
        contiguous rule) and its loss-token count. Everything the step needs from the data is
        counted here, so the micro-batch loop never syncs the device."""
        module = self.lightning_module
        meta = batch["meta"]
        prepare = getattr(module, "dcp_prepare_batch", None)
        shard_fn = getattr(module, "dcp_shard_batch", None)
        local_items = []
        for mb, it in zip(batch["items"], meta["items"]):
            if self.support == "safe":
                units = micro_batch_loss_units(module, mb, len(it["samples"]), self.loss_reduction)
                it.update(loss_units=units, local_loss_tokens=units, item_loss_tokens=units,
                          real_tokens=sum(it["lengths"]))
                local_items.append(mb)
                continue
            if callable(prepare):
                mb = prepare(mb)
            units = add_token_weights(mb, self.loss_reduction)
            sp, sp_rank = len(it["ranks"]), it["sp_rank"]
            item_tokens = units if self.loss_reduction == "token" else local_loss_tokens(mb)  # token mode: the same count
            local = shard_fn(mb, sp_rank, sp) if callable(shard_fn) else shard_batch(mb, sp_rank, sp)
            real = int((local[SEGMENT_IDS] >= 0).sum()) if SEGMENT_IDS in local else local_loss_tokens(local)
            # the divisor counts each item once (its first SP rank), whatever its SP size
            it.update(loss_units=units if sp_rank == 0 else 0, local_loss_tokens=local_loss_tokens(local),
                      item_loss_tokens=item_tokens, real_tokens=real)
            local_items.append(local)
        batch["items"] = local_items
        meta["prepared"] = True

    def training_step(self, batch: Any = None, batch_idx: int = 0, *args: Any, **kwargs: Any) -> Any:
        """Run this rank's micro-batches of one optimizer step (see the module docstring)."""
        if not _is_step_batch(batch):
            raise TypeError("DCPStrategy.training_step expects the batches of its own train dataloader "
                            f"({{'items', 'meta'}}); got {type(batch).__name__}. Did a custom train dataloader bypass "
                            "process_dataloader (e.g. a CombinedLoader of several loaders)?")
        meta, items = batch["meta"], batch["items"]
        self._validate_step(meta)
        if not meta.get("prepared"):  # a batch that bypassed batch_to_device (e.g. a custom loop)
            self._prepare_step(batch)
            items = [self.batch_to_device(mb) for mb in batch["items"]]
        plan_hash = plan_fingerprint(meta["plan"], meta["epoch"], meta["step"])
        self._check_plan_before_loop(meta, plan_hash)
        self._oom_cost_model = None  # a lowered memory limit applies to the re-plans of one step
        self._oom_attempts = 0  # earlier out-of-memory stops of this step (from a resumed checkpoint)
        if (self._resume_oom is not None and self.batch_sampler is not None and self._step_dataset is not None
                and (self._resume_oom["epoch"], self._resume_oom["step"]) == (meta["epoch"], meta["step"])):
            meta, items, plan_hash = self._replan_resumed_oom(batch)
        now = time.perf_counter()
        step_s = now - self._last_step_start if self._last_step_start is not None else 0.0
        self._last_step_start = now
        if self._buckets is None:
            self._buckets = _GradBuckets(self._grad_params(), self.bucket_cap_bytes)
        for attempt in range(self.max_oom_replans + 1):
            busy, local_loss, failed = self._run_items(items, meta, batch_idx)
            gathered = self._step_end_gather(meta, busy, local_loss, len(items), plan_hash, failed)
            failed_items = sorted({int(v) - 1 for v in gathered[:, _OOM].tolist() if v > 0})
            if not failed_items:
                break
            meta, items, plan_hash = self._replan_after_oom(batch, failed_items, attempt)
        self._world_has_grad = gathered[:, _N_STATS:].sum(0)
        divisor = float(gathered[:, _LOSS_UNITS].sum())
        self._loss_divisor = divisor if divisor > 0 else 1.0  # no loss token in the step: zero gradients
        self._grads_parked = True
        if self.batch_sampler is not None:
            self.batch_sampler.mark_consumed(meta["epoch"], meta["step"])
        gathered[:, _LOSS] /= self._loss_divisor  # each rank's share of the global mean loss
        self._record_metrics(gathered[:, :4], meta, step_s)
        return torch.tensor(float(gathered[:, _LOSS].sum()), dtype=torch.float32, device=self.root_device)

    def _run_items(self, items: Sequence[Any], meta: Mapping[str, Any], batch_idx: int) -> tuple[float, float, int]:
        """The micro-batch loop: forward and backward of this rank's items. Returns (busy seconds, summed
        loss, 1 + the plan index of an SP-1 item that ran out of memory or 0; see :mod:`lightning_dcp.oom`)."""
        module = self.lightning_module
        for p in self._buckets.params:
            p.grad = None
        t0 = time.perf_counter()
        local_loss = torch.zeros((), dtype=torch.float64, device=self.root_device)  # summed on device: no sync per item
        failed = 0
        self._in_micro_loop = True
        try:
            for mb, it in zip(items, meta["items"]):
                if failed and len(it["ranks"]) == 1:
                    continue  # the step is re-run; SP > 1 items still run, their partners need this rank
                try:
                    local_loss += self._run_item(module, mb, it, batch_idx)
                except OOM_ERRORS as err:
                    if len(it["ranks"]) > 1:
                        raise StepOutOfMemoryError(self._sp_oom_stop(meta, it), this_rank_only=True) from err
                    failed = int(it.get("index", 0)) + 1
                except Exception as err:
                    if not is_collective_failure(err):
                        raise
                    group = f"SP group {list(it['ranks'])}" if len(it["ranks"]) > 1 else "rank " + str(self.global_rank)
                    raise collective_error(err, epoch=meta["epoch"], step=meta["step"], what=describe_item(it),
                                           group=group, timeout=self._timeout) from err
        finally:
            self._in_micro_loop = False
        if failed:  # free what the failed item left; every rank discards this attempt's gradients
            for p in self._buckets.params:
                p.grad = None
            local_loss.zero_()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self._buckets.park()
        loss = float(local_loss)  # the one host sync of the step: busy time includes all queued work
        return time.perf_counter() - t0, loss, failed

    def _sp_oom_stop(self, meta: Mapping[str, Any], it: Mapping[str, Any]) -> str:
        """Out of memory in an SP > 1 item: write the state before the step (unless ZeRO-1 or
        ``oom_checkpoint=False``) and return the error message (see :mod:`lightning_dcp.oom`)."""
        for p in self._buckets.params:  # this step's partial gradients are discarded; free them first
            p.grad = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        where = f"step {meta['step']} of epoch {meta['epoch']}"
        timeout = self._timeout.total_seconds() if self._timeout is not None else None
        args = (where, describe_item(it), self.global_rank, timeout)
        if not self.oom_checkpoint:
            return sp_oom_message(*args, no_checkpoint="DCPStrategy(oom_checkpoint=False)")
        if self.zero1 and self.world_size > 1:
            return sp_oom_message(*args, no_checkpoint="zero1=True shards the optimizer state; gathering it needs every rank")
        attempts = self._oom_attempts + 1
        if attempts > self.max_oom_replans:
            return sp_oom_message(*args, no_checkpoint=f"this step ran out of memory {attempts} times, across resumes; "
                                  f"max_oom_replans is {self.max_oom_replans}")
        limit = None
        if self._planner is None:
            cost_model = self._oom_cost_model if self._oom_cost_model is not None else self._cost_model
            limit = lowered_limit(cost_model, [it])
        trainer = self.lightning_module.trainer
        path = os.path.join(trainer.default_root_dir, "dcp_oom",
                            f"epoch={meta['epoch']}-step={meta['step']}-rank={self.global_rank}.ckpt")
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            checkpoint[OOM_CHECKPOINT_KEY] = {"epoch": int(meta["epoch"]), "step": int(meta["step"]),
                                              "memory_limit": limit, "item": describe_item(it), "attempts": attempts}
            # Lightning counts a restart as if saved at a batch's end (+1 logger step); this step did not end
            epoch_loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict")
            if isinstance(epoch_loop, dict) and epoch_loop.get("_batches_that_stepped", 0) > 0:
                epoch_loop["_batches_that_stepped"] -= 1
            self.checkpoint_io.save_checkpoint(checkpoint, path)
        except Exception as save_err:  # never hide the out-of-memory error behind a failed save
            return sp_oom_message(*args, no_checkpoint=f"saving {path} failed: {type(save_err).__name__}: {save_err}")
        return sp_oom_message(*args, checkpoint=path, memory_limit=limit)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's checkpoint load; an out-of-memory checkpoint's step is re-planned with its lowered limit."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._resume_oom = checkpoint.get(OOM_CHECKPOINT_KEY)
        return checkpoint

    def _replan_resumed_oom(self, batch: dict) -> tuple[dict, list, float]:
        """The step that ran out of memory in an SP > 1 item before the resume, planned again with the
        checkpoint's lowered memory limit (a user's planner: with another step seed)."""
        entry, self._resume_oom = self._resume_oom, None
        meta = batch["meta"]
        self._oom_attempts = int(entry.get("attempts", 1))
        self.oom_replans += 1
        rank_zero_info(f"resuming after an out-of-memory error in step {meta['step']} of epoch {meta['epoch']} "
                       f"({entry['item']}): re-planning the step with less memory")
        lengths = [n for it in meta["plan"]["items"] for n in it["lengths"]]
        try:
            if self._planner is not None or entry.get("memory_limit") is None:
                planner = self._planner if self._planner is not None else self._build_planner(self._cost_model, lengths)
                return self._replan_step(batch, planner, self._seed_offset(0))
            limit = min(float(entry["memory_limit"]), float(self._cost_model.memory_limit))
            self._oom_cost_model = LoweredMemory(self._cost_model, limit)
            return self._replan_step(batch, self._build_planner(self._oom_cost_model, lengths), 0)
        except PlanningError as err:
            raise StepOutOfMemoryError(f"step {meta['step']} of epoch {meta['epoch']} ran out of memory before the "
                                       f"resume ({entry['item']}), and cannot be re-planned with less memory: {err}. "
                                       "Resume from an earlier checkpoint with a smaller memory limit or more ranks, or "
                                       "split or drop the longest samples") from err

    def _seed_offset(self, attempt: int) -> int:
        """Step-seed offset for a user planner's re-plan: a new one for every attempt, across resumes."""
        return 7919 * (self._oom_attempts + attempt + 1)

    def _replan_step(self, batch: dict, planner: Any, seed_offset: int) -> tuple[dict, list, float]:
        """Plan ``batch``'s samples again with ``planner``; load and prepare the new items; return
        (meta, items, plan hash) and update ``batch`` in place."""
        epoch, step = batch["meta"]["epoch"], batch["meta"]["step"]
        new_plan = self.batch_sampler.replan(epoch, step, batch["meta"]["plan"], planner, seed_offset=seed_offset)
        new = self.batch_to_device(self._step_dataset[self.batch_sampler.describe(epoch, step, new_plan)])
        batch["items"], batch["meta"] = new["items"], new["meta"]
        return new["meta"], new["items"], plan_fingerprint(new["meta"]["plan"], epoch, step)

    def _replan_after_oom(self, batch: dict, failed_items: list[int], attempt: int) -> tuple[dict, list, float]:
        """Every rank saw these plan items run out of memory at SP 1: re-plan the step's samples with the
        memory limit just below the failed items' estimate, load and prepare the new items, and return
        (meta, items, plan hash) for the step's next attempt (see :mod:`lightning_dcp.oom`)."""
        meta = batch["meta"]
        epoch, step, plan = meta["epoch"], meta["step"], meta["plan"]
        failed = [dict(plan["items"][i], index=i) for i in failed_items]
        what = "; ".join(describe_item(it) for it in failed)
        self.oom_replans += 1
        if attempt >= self.max_oom_replans or self.batch_sampler is None or self._step_dataset is None:
            raise StepOutOfMemoryError(
                f"step {step} of epoch {epoch} ran out of memory {attempt + 1} time(s) at SP 1 ({what}) and was re-planned "
                f"{attempt} time(s) with less memory; stopping. Lower the cost model's memory limit (profile with "
                "DCPProfiler(memory_limit_bytes=...)), split or drop long samples, or raise max_oom_replans")
        rank_zero_warn(f"step {step} of epoch {epoch}: {what} ran out of memory; re-planning the step with less memory "
                       f"(attempt {attempt + 1} of {self.max_oom_replans}); no sample is skipped or trained twice")
        try:
            planner, offset = self._oom_planner(plan, failed, attempt)
            return self._replan_step(batch, planner, offset)
        except PlanningError as err:
            raise StepOutOfMemoryError(f"step {step} of epoch {epoch}: {what} ran out of memory, and the step cannot be "
                                       f"re-planned with less memory: {err}") from err

    def _oom_planner(self, plan: Mapping[str, Any], failed: list[dict], attempt: int) -> tuple[Any, int]:
        """(planner, step-seed offset) for a re-plan: the strategy's own planner over a cost model whose
        limit sits below the failed items; a user's planner is asked again with another step seed."""
        if self._planner is not None:
            return self._planner, self._seed_offset(attempt + 1 if self._oom_attempts else attempt)
        cost_model = self._oom_cost_model if self._oom_cost_model is not None else self._cost_model
        batch_lengths = [n for it in plan["items"] for n in it["lengths"]]
        if isinstance(cost_model, PaddedCostModel):
            limit = min(cost_model.max_padded_tokens, min(PaddedCostModel.padded_tokens(it["lengths"]) for it in failed) - 1)
            lowered: CostModel = PaddedCostModel(cost_model.base, max(1, limit))
        else:
            lowered = LoweredMemory(cost_model, lowered_limit(cost_model, failed))
        self._oom_cost_model = lowered
        return self._build_planner(lowered, batch_lengths), 0

    def _step_end_gather(self, meta: Mapping[str, Any], busy: float, local_loss: float, n_items: int,
                         plan_hash: float, failed: int = 0) -> Tensor:
        """The step's one world all-gather: metrics, loss, loss units, the plan hashes (this step's and
        the next's, see the module docstring) and which parameters got gradients."""
        epoch, step = meta["epoch"], meta["step"]
        nxt = self.batch_sampler.next_plan(epoch, step + 1) if self.batch_sampler is not None else None
        next_hash = plan_fingerprint(nxt.to_dict(), epoch, step + 1) if nxt is not None else 0.0
        stats = torch.zeros(_N_STATS, dtype=torch.float64)
        stats[_BUSY], stats[_LOSS], stats[_TOKENS], stats[_ITEMS] = busy, local_loss, float(
            sum(it["real_tokens"] for it in meta["items"])), float(n_items)
        stats[_LOSS_UNITS] = float(sum(it["loss_units"] for it in meta["items"]))
        stats[_PLAN], stats[_NEXT_PLAN], stats[_OOM] = plan_hash, next_hash, float(failed)
        gathered = self._all_gather(torch.cat([stats, self._buckets.has_grad]), meta)
        where = f"at the end of step {step} of epoch {epoch}"
        check_column(gathered[:, _PLAN].tolist(), f"the plan of step {step} of epoch {epoch}", STEP_CAUSE, where)
        check_column(gathered[:, _NEXT_PLAN].tolist(), f"the plan of step {step + 1} of epoch {epoch}", STEP_CAUSE,
                     where + ", one step before any rank runs it")
        self._verified_next = (epoch, step + 1) if next_hash else None
        return gathered

    def _check_plan_before_loop(self, meta: Mapping[str, Any], plan_hash: float) -> None:
        """Compare this step's plan hash across ranks before its first micro-batch, unless the previous
        step's end already did (every step but a fit's, a resume's or an epoch's first)."""
        epoch, step = meta["epoch"], meta["step"]
        if self._verified_next == (epoch, step) or self.world_size == 1 or not dist.is_initialized():
            return
        gathered = self._all_gather(torch.tensor([plan_hash], dtype=torch.float64), meta,
                                    "the plan comparison before the first micro-batch")
        check_column(gathered[:, 0].tolist(), f"the plan of step {step} of epoch {epoch}", STEP_CAUSE,
                     "before the step's first micro-batch")

    def _run_item(self, module: Any, local: Any, it: Mapping[str, Any], batch_idx: int) -> Tensor:
        ranks, sp_rank = it["ranks"], it["sp_rank"]
        sp = len(ranks)
        group = self.sp_groups.group_for(ranks) if sp > 1 else None
        item = WorkItem(tuple(ranks), tuple(it["samples"]), tuple(it["lengths"]), it["recompute"])
        ctx = SPContext(group=group, size=sp, rank=sp_rank, recompute=int(it["recompute"]), item=item)
        results = module.trainer._results if module.trainer is not None else None
        if results is not None:
            results.batch, results.batch_size = local, len(it["samples"])
        with sp_context(ctx):
            with self.precision_plugin.train_step_context():
                out = module.training_step(local, batch_idx)
            loss = self._summed_loss(out, it)
            self._micro_backward(loss)
        value = loss.detach().double()
        if it["local_loss_tokens"] == 0:  # a shard without loss tokens: its (0-weighted) loss may be NaN
            value = torch.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0)
        return value

    def _summed_loss(self, out: Any, it: Mapping[str, Any]) -> Tensor:
        """The item's loss as a *sum* over its loss units (the strategy divides by the global count
        once, at the step's end): :func:`weighted_loss` as is; a plain mean times its local count."""
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise TypeError(f"{type(self.lightning_module).__name__}.training_step must return a scalar loss tensor (or a "
                            f"dict with 'loss') under DCPStrategy; got {type(loss).__name__}"
                            f"{'' if not isinstance(loss, Tensor) else ' of shape ' + str(tuple(loss.shape))}")
        if is_weighted(loss):
            return loss
        local = it["local_loss_tokens"]
        if local == 0:
            return loss * 0.0
        if self.support == "safe" or self.loss_reduction == "token":
            return loss * float(local)
        if len(it["samples"]) == 1:
            return loss * (local / it["item_loss_tokens"])
        raise ValueError(
            f"loss_reduction='sample' with a micro-batch packing {len(it['samples'])} samples {it['samples']}: a plain "
            "mean cannot be re-weighted per sample; return lightning_dcp.weighted_loss(token_loss, batch) from "
            "training_step (token_loss = per-token loss with reduction='none')")

    def _micro_backward(self, loss: Tensor) -> None:
        optimizer = self.optimizers[0] if self.optimizers else None
        super().backward(loss, optimizer)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Skipped for the loss a DCP ``training_step`` returned (backward already ran per micro-batch)."""
        if self._grads_parked:
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Reduce the parked gradients right after the closure, before clipping and the step."""

        def dcp_closure() -> Any:
            result = closure()
            self.reduce_gradients()
            return result

        return super().optimizer_step(optimizer, dcp_closure, model, **kwargs)

    def reduce_gradients(self) -> None:
        """SUM all-reduce the parked gradients over the world and restore them as ``.grad`` (once per step)."""
        if not self._grads_parked or self._buckets is None:
            return
        self._grads_parked = False
        self._buckets.reduce(self._world_has_grad, world=self.world_size if dist.is_initialized() else 1,
                             scale=1.0 / self._loss_divisor)

    def _all_gather(self, t: Tensor, meta: Mapping[str, Any] | None = None, what: str = "the step-end all-gather") -> Tensor:
        if self.world_size == 1 or not dist.is_initialized():
            return t.unsqueeze(0)
        device = self.root_device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = t.to(device)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        try:
            dist.all_gather(out, t)
        except Exception as err:
            if meta is None or not is_collective_failure(err):
                raise
            raise collective_error(err, epoch=meta["epoch"], step=meta["step"], what=what,
                                   group=f"the world ({self.world_size} ranks)", timeout=self._timeout) from err
        return torch.stack(out).cpu()

    def _record_metrics(self, gathered: Tensor, meta: Mapping[str, Any], step_s: float) -> None:
        bound = float("nan")
        if self._bounder is not None:
            bound = self._bounder.seconds([n for it in meta["plan"]["items"] for n in it["lengths"]])
        m = step_metrics(gathered, epoch=meta["epoch"], step=meta["step"], step_s=step_s, plan=meta["plan"],
                         global_tokens=meta["global_tokens"], step_bound_s=bound)
        self.last_step_metrics = m
        self.last_step_plan = meta["plan"]
        if self._tracker_epoch != m.epoch:
            self.metrics_tracker.reset()
            self._tracker_epoch = m.epoch
        self.metrics_tracker.update(m)
        module = self.lightning_module
        if self.log_metrics and module is not None and module._trainer is not None:
            has_logger = bool(module.trainer.loggers)
            values = dict(m.as_log_dict(), **{"dcp/oom_replans": float(self.oom_replans)})
            for key, value in values.items():
                if has_logger or key in ("dcp/imbalance", "dcp/oom_replans"):
                    module.log(key, value, on_step=True, on_epoch=False, prog_bar=key == "dcp/imbalance",
                               logger=has_logger, batch_size=1, sync_dist=False)

    # ------------------------------------------------------------------ collectives from user code
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """As DDP's, except inside the micro-batch loop: there ranks run different item counts, so a
        world collective would hang; return the local value (on-step sync is deferred, epoch-end sync still happens)."""
        if self._in_micro_loop:
            if not self._warned_sync:
                self._warned_sync = True
                rank_zero_warn("self.log(..., sync_dist=True) inside training_step under DCPStrategy: ranks run "
                               "different numbers of micro-batches, so on-step values are not synced (each rank logs "
                               "its own); epoch-level values are still synced at epoch end")
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._in_micro_loop:
            raise RuntimeError("a world barrier inside training_step under DCPStrategy would hang (ranks run different "
                               "numbers of micro-batches); move it to a hook outside training_step")
        super().barrier(*args, **kwargs)

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        if self._in_micro_loop:
            raise RuntimeError("self.all_gather inside training_step under DCPStrategy would hang (ranks run different "
                               "numbers of micro-batches); gather in on_train_batch_end or an epoch-end hook instead")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self._in_micro_loop:
            raise RuntimeError("reduce_boolean_decision inside training_step under DCPStrategy would hang; call it "
                               "outside training_step")
        return super().reduce_boolean_decision(decision, all=all)

    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self.batch_sampler is not None:
            self.batch_sampler.shutdown()
        self._buckets = None
        self._resume_oom = None  # an out-of-memory checkpoint's entry lives for the one fit that loaded it
        super().teardown()

