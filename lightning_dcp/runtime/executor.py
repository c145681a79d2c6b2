"""The step executor: runs one planned step on this rank and decides nothing.

Per optimizer step (one DataLoader item, see :mod:`lightning_dcp.runtime.sampler`):

1. **prepare** (:meth:`StepExecutor.prepare`, on the host, before the batch moves to the device):
   per item, the module's ``dcp_prepare_batch`` (e.g. a per-sample label shift), token weights and
   loss units, this rank's shard (the module's ``dcp_shard_batch`` or the contiguous rule) and its
   loss-token count -- everything the step needs from the data is counted here, so the micro-batch
   loop never syncs the device;
2. **micro-batch loop** (:meth:`StepExecutor.run_items`): for each of this rank's items in plan
   order, activate its SP group and recompute count (:func:`~lightning_dcp.sp.context.sp_context`),
   call the user's ``training_step``, turn its loss into a sum over its loss units and run backward;
   then park the gradients in flat buckets (:class:`~lightning_dcp.runtime.buckets.GradBuckets`);
3. **step-end gather** (:meth:`StepExecutor.gather`): one world all-gather of a
   :class:`~lightning_dcp.runtime.row.StepRow` per rank plus a has-gradient flag per parameter: the
   metrics, the exact global loss and its divisor, the plan hashes of this step and the next
   (:mod:`lightning_dcp.runtime.agreement`) and the out-of-memory flags
   (:class:`~lightning_dcp.runtime.oom.OOMRecovery`);
4. the strategy's ``optimizer_step`` then calls :meth:`StepExecutor.reduce_gradients`: one SUM
   all-reduce per bucket over the world, scaled by ``1 / global loss units``.

With sharded weights (``sharding="zero2"`` / ``"fsdp"``, :mod:`lightning_dcp.runtime.fsdp`) the step
starts with the weights' all-gather (before step 2; a no-op where they are already full) and step 4
is a SUM reduce-scatter per bucket into the sharded gradients.

Collectives: inside the loop only the active SP group's (Ulysses); before and after it, the
world-wide ones above, the same number on every rank whatever its item count.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dcp.planning.plan import WorkItem
from lightning_dcp.runtime.agreement import STEP_CAUSE, check_column, plan_fingerprint
from lightning_dcp.runtime.buckets import GradBuckets
from lightning_dcp.runtime.faults import collective_error, describe_item, is_collective_failure
from lightning_dcp.runtime.metrics import StepMetrics, StepMetricsTracker, step_metrics
from lightning_dcp.runtime.oom import OOM_ERRORS, OOMRecovery, StepOutOfMemoryError
from lightning_dcp.runtime.row import GatheredStep, StepRow
from lightning_dcp.sp.context import SPContext, sp_context
from lightning_dcp.sp.contract import local_batch
from lightning_dcp.sp.tokens import count_weighted_calls, is_weighted

__all__ = ["StepExecutor", "is_step_batch", "world_all_gather"]


def is_step_batch(batch: Any) -> bool:
    """Whether ``batch`` is a DCP step (``{"items": [...], "meta": descriptor}``)."""
    return isinstance(batch, Mapping) and "items" in batch and "meta" in batch


def world_all_gather(t: Tensor, *, world_size: int, device: torch.device, meta: Mapping[str, Any] | None = None,
                     what: str = "the step-end all-gather", timeout: timedelta | None = None) -> Tensor:
    """All-gather ``t`` over the world into ``[world, *t.shape]`` on the CPU (``[1, ...]`` without a world).

    A failed or timed-out collective during a step (``meta`` given) becomes a
    :class:`~lightning_dcp.runtime.faults.CollectiveError` naming the step and ``what``.
    """
    if world_size == 1 or not dist.is_initialized():
        return t.unsqueeze(0)
    t = t.to(device if dist.get_backend() == "nccl" else torch.device("cpu"))
    out = [torch.empty_like(t) for _ in range(world_size)]
    try:
        dist.all_gather(out, t)
    except Exception as err:
        if meta is None or not is_collective_failure(err):
            raise
        raise collective_error(err, epoch=meta["epoch"], step=meta["step"], what=what,
                               group=f"the world ({world_size} ranks)", timeout=timeout) from err
    return torch.stack(out).cpu()


class StepExecutor:
    """Runs the steps of one fit on this rank (built by the strategy when the train loader is).

    Args:
        strategy: the :class:`~lightning_dcp.DCPStrategy` (module, precision plugin, ranks, SP groups).
        sampler: the fit's :class:`~lightning_dcp.runtime.sampler.DCPBatchSampler`.
        step_dataset: loads a re-planned step's micro-batches (``dataset[descriptor]``).
        cost_model: what the fit plans with (the out-of-memory limits start from it).
        oom: the fit's :class:`~lightning_dcp.runtime.oom.OOMRecovery`.
        bounder: the per-step achievable bound for ``dcp/step_bound_fraction`` (``None``: not logged).
    """

    def __init__(self, strategy: Any, sampler: Any, step_dataset: Any, cost_model: Any, oom: OOMRecovery,
                 bounder: Any = None) -> None:
        self.strategy = strategy
        self.settings = strategy.settings
        self.sampler = sampler
        self.step_dataset = step_dataset
        self.cost_model = cost_model
        self.oom = oom
        self.bounder = bounder
        self.buckets: GradBuckets | None = None
        self.grads_parked = False
        self.in_micro_loop = False
        self.metrics_tracker: StepMetricsTracker = strategy.metrics_tracker
        self._world_has_grad: Tensor | None = None
        self._loss_divisor = 1.0
        self._verified_next: tuple[int, int] | None = None  # (epoch, step) whose plan all ranks already compared
        self._last_step_start: float | None = None
        self._tracker_epoch: int | None = None

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    def _gather(self, t: Tensor, meta: Mapping[str, Any] | None = None, what: str = "the step-end all-gather") -> Tensor:
        return world_all_gather(t, world_size=self.world_size, device=self.strategy.root_device, meta=meta, what=what,
                                timeout=self.strategy.settings.timeout)

    # ------------------------------------------------------------------ 1. prepare (host)
    def prepare(self, batch: dict) -> None:
        """Build this rank's micro-batches of ``batch`` on the host (see the module docstring):
        :func:`~lightning_dcp.sp.contract.local_batch` per item."""
        meta = batch["meta"]
        contract, reduction = self.strategy.model_contract, self.settings.loss_reduction
        local_items = []
        for mb, it in zip(batch["items"], meta["items"]):
            local = local_batch(contract, mb, it["sp_rank"], len(it["ranks"]), reduction, lengths=it["lengths"])
            it.update(loss_units=local.loss_units, local_loss_tokens=local.local_loss_tokens,
                      item_loss_tokens=local.item_loss_tokens, real_tokens=local.real_tokens)
            local_items.append(local.data)
        batch["items"] = local_items
        meta["prepared"] = True

    def validate(self, meta: Mapping[str, Any]) -> None:
        """The step fits this world: its world size, its groups, SP sizes that divide the heads."""
        strategy = self.strategy
        if int(meta.get("world_size", strategy.world_size)) != strategy.world_size:
            raise RuntimeError(f"the step was planned for {meta['world_size']} ranks but the world has {strategy.world_size}")
        heads = strategy.num_heads
        for idx, item in enumerate(meta["plan"]["items"]):
            ranks = item["ranks"]
            if heads is not None and heads % len(ranks):
                from lightning_dcp.runtime.model import largest_dividing_power_of_two

                raise ValueError(f"step {meta['step']} of epoch {meta['epoch']}: item {idx} (samples {item['samples']}) "
                                 f"uses SP size {len(ranks)}, which does not divide the model's {heads} attention heads; "
                                 f"cap the planner at max_sp_size={largest_dividing_power_of_two(heads)}")
            if not strategy.sp_groups.has(ranks):
                raise ValueError(f"step {meta['step']} of epoch {meta['epoch']}: item {idx} runs on ranks {ranks}, "
                                 f"which is not an SP group of this world ({strategy.sp_groups}); fix the plan or max_sp_size")

    # ------------------------------------------------------------------ the step
    def run_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Run this rank's micro-batches of one optimizer step; return the step's exact global loss."""
        if not is_step_batch(batch):
            raise TypeError("DCPStrategy.training_step expects the batches of its own train dataloader "
                            f"({{'items', 'meta'}}); got {type(batch).__name__}. Did a custom train dataloader bypass "
                            "process_dataloader (e.g. a CombinedLoader of several loaders)?")
        meta, items = batch["meta"], batch["items"]
        self.validate(meta)
        if not meta.get("prepared"):  # a batch that bypassed batch_to_device (e.g. a custom loop)
            self.prepare(batch)
            items = [self.strategy.batch_to_device(mb) for mb in batch["items"]]
        plan_hash = plan_fingerprint(meta["plan"], meta["epoch"], meta["step"])
        self.check_plan_before_loop(meta, plan_hash)
        self.oom.begin_step()
        if self.oom.resume_due(meta):
            meta, items, plan_hash = self.oom.replan_resumed(batch, self.cost_model, self._replan)
        now = time.perf_counter()
        step_s = now - self._last_step_start if self._last_step_start is not None else 0.0
        self._last_step_start = now
        shards = self.strategy.shards
        if shards is not None:  # full weights for the step: a world collective, before any micro-batch
            shards.begin_step()
        if self.buckets is None:
            if shards is not None:
                self.buckets = shards.grad_buckets(self.settings.bucket_cap_bytes)
            else:
                params = [p for p in self.strategy.lightning_module.parameters() if p.requires_grad]
                self.buckets = GradBuckets(params, self.settings.bucket_cap_bytes)
        for attempt in range(self.oom.max_replans + 1):
            busy, local_loss, failed = self.run_items(items, meta, batch_idx)
            gathered = self.gather(meta, busy, local_loss, len(items), plan_hash, failed)
            if not gathered.failed_items:
                break
            meta, items, plan_hash = self.oom.replan_failed(batch, gathered.failed_items, attempt, self.cost_model,
                                                            self._replan)
        return self._finish(gathered, meta, step_s)

    def _finish(self, gathered: GatheredStep, meta: Mapping[str, Any], step_s: float) -> Tensor:
        """Park the divisor and the has-gradient flags for the reduction, record metrics, return the loss."""
        self._world_has_grad = gathered.has_grad
        divisor = gathered.loss_units
        self._loss_divisor = divisor if divisor > 0 else 1.0  # no loss token in the step: zero gradients
        self.grads_parked = True
        if self.sampler is not None:
            self.sampler.mark_consumed(meta["epoch"], meta["step"])
        loss = float(sum(r.loss for r in gathered.rows)) / self._loss_divisor
        self._record_metrics(gathered.rows, meta, step_s, loss)
        return torch.tensor(loss, dtype=torch.float32, device=self.strategy.root_device)

    def _replan(self, batch: dict, planner: Any, seed_offset: int) -> tuple[dict, list, float]:
        """Plan ``batch``'s samples again with ``planner``; load and prepare the new items; return
        (meta, items, plan hash) and update ``batch`` in place."""
        epoch, step = batch["meta"]["epoch"], batch["meta"]["step"]
        new_plan = self.sampler.replan(epoch, step, batch["meta"]["plan"], planner, seed_offset=seed_offset)
        new = self.strategy.batch_to_device(self.step_dataset[self.sampler.describe(epoch, step, new_plan)])
        batch["items"], batch["meta"] = new["items"], new["meta"]
        return new["meta"], new["items"], plan_fingerprint(new["meta"]["plan"], epoch, step)

    # ------------------------------------------------------------------ 2. micro-batch loop
    def run_items(self, items: Sequence[Any], meta: Mapping[str, Any], batch_idx: int) -> tuple[float, float, int]:
        """Forward and backward of this rank's items. Returns (busy seconds, summed loss, 1 + the plan
        index of an SP-1 item that ran out of memory or 0; see :mod:`lightning_dcp.runtime.oom`)."""
        module = self.strategy.lightning_module
        self.buckets.begin()
        t0 = time.perf_counter()
        local_loss = torch.zeros((), dtype=torch.float64, device=self.strategy.root_device)  # no sync per item
        failed = 0
        self.in_micro_loop = True
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
                    group = f"SP group {list(it['ranks'])}" if len(it["ranks"]) > 1 else f"rank {self.strategy.global_rank}"
                    raise collective_error(err, epoch=meta["epoch"], step=meta["step"], what=describe_item(it),
                                           group=group, timeout=self.settings.timeout) from err
        finally:
            self.in_micro_loop = False
        if failed:  # free what the failed item left; every rank discards this attempt's gradients
            self._drop_grads()
            local_loss.zero_()
        self.buckets.park()
        loss = float(local_loss)  # the one host sync of the step: busy time includes all queued work
        return time.perf_counter() - t0, loss, failed

    def _drop_grads(self) -> None:
        for p in self.buckets.params:
            p.grad = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _sp_oom_stop(self, meta: Mapping[str, Any], it: Mapping[str, Any]) -> str:
        self._drop_grads()  # this step's partial gradients are discarded; free them first
        strategy = self.strategy
        timeout = self.settings.timeout.total_seconds() if self.settings.timeout is not None else None
        return self.oom.sp_stop_message(meta, it, rank=strategy.global_rank, timeout_s=timeout,
                                        cost_model=self.cost_model, trainer=strategy.lightning_module.trainer,
                                        checkpoint_io=strategy.checkpoint_io,
                                        no_checkpoint_reason=strategy.unsaveable_reason())

    def _run_item(self, module: Any, local: Any, it: Mapping[str, Any], batch_idx: int) -> Tensor:
        ranks, sp_rank = it["ranks"], it["sp_rank"]
        sp = len(ranks)
        group = self.strategy.sp_groups.group_for(ranks) if sp > 1 else None
        item = WorkItem(tuple(ranks), tuple(it["samples"]), tuple(it["lengths"]), it["recompute"])
        ctx = SPContext(group=group, size=sp, rank=sp_rank, recompute=int(it["recompute"]), item=item)
        results = module.trainer._results if module.trainer is not None else None
        if results is not None:  # what Lightning's self.log reads for the batch size
            results.batch, results.batch_size = local, len(it["samples"])
        with sp_context(ctx):
            count_weighted_calls(reset=True)
            with self.strategy.precision_plugin.train_step_context():
                out = module.training_step(local, batch_idx)
            loss = self._summed_loss(out, it, weighted=count_weighted_calls(reset=True) > 0)
            self.strategy.micro_backward(loss)
        value = loss.detach().double()
        if it["local_loss_tokens"] == 0:  # a shard without loss tokens: its (0-weighted) loss may be NaN
            value = torch.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0)
        return value

    def _summed_loss(self, out: Any, it: Mapping[str, Any], weighted: bool = False) -> Tensor:
        """The item's loss as a *sum* over its loss units (the divisor comes once, at the step's end):
        :func:`~lightning_dcp.sp.tokens.weighted_loss` -- or anything built from it (``weighted``: the
        step called it) -- as is; a plain mean times its local count."""
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            name = type(self.strategy.lightning_module).__name__
            shape = "" if not isinstance(loss, Tensor) else " of shape " + str(tuple(loss.shape))
            raise TypeError(f"{name}.training_step must return a scalar loss tensor (or a dict with 'loss') under "
                            f"DCPStrategy; got {type(loss).__name__}{shape}")
        if weighted or is_weighted(loss):
            return loss
        local = it["local_loss_tokens"]
        if local == 0:
            return loss * 0.0
        if self.strategy.support == "safe" or self.settings.loss_reduction == "token":
            return loss * float(local)
        if len(it["samples"]) == 1:
            return loss * (local / it["item_loss_tokens"])
        raise ValueError(
            f"loss_reduction='sample' with a micro-batch packing {len(it['samples'])} samples {it['samples']}: a plain "
            "mean cannot be re-weighted per sample; return lightning_dcp.weighted_loss(token_loss, batch) from "
            "training_step (token_loss = per-token loss with reduction='none')")

    # ------------------------------------------------------------------ 3. step-end gather
    def gather(self, meta: Mapping[str, Any], busy: float, local_loss: float, n_items: int, plan_hash: float,
               failed: int = 0) -> GatheredStep:
        """The step's one world all-gather (see the module docstring); checks the plan hashes."""
        epoch, step = meta["epoch"], meta["step"]
        nxt = self.sampler.next_plan(epoch, step + 1) if self.sampler is not None else None
        next_hash = plan_fingerprint(nxt.to_dict(), epoch, step + 1) if nxt is not None else 0.0
        row = StepRow(busy_s=busy, loss=local_loss, tokens=sum(it["real_tokens"] for it in meta["items"]), items=n_items,
                      loss_units=sum(it["loss_units"] for it in meta["items"]), plan_hash=plan_hash,
                      next_plan_hash=next_hash, oom_item=failed)
        gathered = GatheredStep(self._gather(row.to_tensor(self.buckets.has_grad), meta))
        where = f"at the end of step {step} of epoch {epoch}"
        check_column(gathered.column("plan_hash"), f"the plan of step {step} of epoch {epoch}", STEP_CAUSE, where)
        check_column(gathered.column("next_plan_hash"), f"the plan of step {step + 1} of epoch {epoch}", STEP_CAUSE,
                     where + ", one step before any rank runs it")
        self._verified_next = (epoch, step + 1) if next_hash else None
        return gathered

    def check_plan_before_loop(self, meta: Mapping[str, Any], plan_hash: float) -> None:
        """Compare this step's plan hash across ranks before its first micro-batch, unless the previous
        step's end already did (every step but a fit's, a resume's or an epoch's first)."""
        epoch, step = meta["epoch"], meta["step"]
        if self._verified_next == (epoch, step) or self.world_size == 1 or not dist.is_initialized():
            return
        gathered = self._gather(torch.tensor([plan_hash], dtype=torch.float64), meta,
                                "the plan comparison before the first micro-batch")
        check_column(gathered[:, 0].tolist(), f"the plan of step {step} of epoch {epoch}", STEP_CAUSE,
                     "before the step's first micro-batch")

    # ------------------------------------------------------------------ 4. the reduction
    def reduce_gradients(self) -> None:
        """SUM all-reduce the parked gradients over the world and restore them as ``.grad`` (once per step);
        with sharded weights, SUM reduce-scatter them into the sharded gradients instead."""
        if not self.grads_parked or self.buckets is None:
            return
        self.grads_parked = False
        self.buckets.reduce(self._world_has_grad, world=self.world_size if dist.is_initialized() else 1,
                            scale=1.0 / self._loss_divisor)
        if self.strategy.shards is not None:
            self.strategy.shards.after_reduce()

    # ------------------------------------------------------------------ metrics
    def _record_metrics(self, rows: list[StepRow], meta: Mapping[str, Any], step_s: float, loss: float) -> None:
        bound = float("nan")
        if self.bounder is not None:
            bound = self.bounder.seconds([n for it in meta["plan"]["items"] for n in it["lengths"]])
        m = step_metrics(rows, epoch=meta["epoch"], step=meta["step"], step_s=step_s, plan=meta["plan"],
                         global_tokens=meta["global_tokens"], loss=loss, step_bound_s=bound)
        self.strategy.last_step_metrics = m
        self.strategy.last_step_plan = meta["plan"]
        if self._tracker_epoch != m.epoch:
            self.metrics_tracker.reset()
            self._tracker_epoch = m.epoch
        self.metrics_tracker.update(m)
        if self.settings.log_metrics:
            self._log(m)

    def _log(self, m: StepMetrics) -> None:
        module = self.strategy.lightning_module
        if module is None or module._trainer is None:
            return
        has_logger = bool(module.trainer.loggers)
        values = dict(m.as_log_dict(), **{"dcp/oom_replans": float(self.oom.replans)})
        for key, value in values.items():
            if has_logger or key in ("dcp/imbalance", "dcp/oom_replans"):
                module.log(key, value, on_step=True, on_epoch=False, prog_bar=key == "dcp/imbalance",
                           logger=has_logger, batch_size=1, sync_dist=False)
