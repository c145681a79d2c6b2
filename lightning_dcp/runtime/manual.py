"""Manual optimization under :class:`~lightning_dcp.DCPStrategy`: the user's ``training_step`` drives the step's
planned micro-batches (several optimizers: GAN-style critics, distillation with a generator and a critic).

With ``automatic_optimization = False`` the strategy calls the module's ``training_step`` once per step (one
loader item = one step, as in automatic optimization) with a :class:`ManualStep` as the batch. The module loops
over this rank's planned micro-batches with :func:`micro_batches`, once per optimizer::

    from lightning_dcp import micro_batches

    def training_step(self, batch, batch_idx):
        g_opt, d_opt = self.optimizers()
        for x, z in micro_batches(batch):          # the critic
            self.manual_backward(critic_loss(self, x, z))
        d_opt.step()
        d_opt.zero_grad()
        for x, z in micro_batches(batch):          # the generator
            self.manual_backward(generator_loss(self, z))
        g_opt.step()
        g_opt.zero_grad()

What each piece does (:class:`ManualDriver`, built by the executor per step):

- **a loop** (:meth:`ManualDriver.loop`): each of this rank's micro-batches in plan order, with its SP group and
  recompute count active (:func:`~lightning_dcp.sp.context.sp_context`), world collectives refused inside
  (:mod:`~lightning_dcp.runtime.collective_guard`), ``self.log`` reading the micro-batch's sample count. The
  gradients accumulate into the executor's flat buckets (:class:`~lightning_dcp.runtime.buckets.GradBuckets`) on top
  of nothing: what the parameters held before the loop is set aside.
- **manual_backward** inside a loop (the strategy's ``backward``, :meth:`ManualDriver.scaled`): the loss -- a mean
  over the micro-batch's loss tokens (or samples), or a :func:`~lightning_dcp.sp.tokens.weighted_loss` -- becomes
  its sum over them, as in automatic optimization. Outside a loop it raises.
- **the loop's end** (when the ``for`` statement finishes, on every rank): one world all-gather of the loop
  count, the loss units and the has-gradient flags, then the buckets' SUM all-reduce scaled by ``1 / global loss
  units``, and the set-aside gradients added back. So after the loop ``.grad`` holds exactly what DDP's would
  after the same ``manual_backward`` calls on the same global batch (DDP reduces in every backward; the sum is
  linear), before ``clip_gradients``, a gradient norm, ``on_before_optimizer_step`` and ``opt.step()``.
- **opt.step()** goes through the strategy's ``optimizer_step`` as under DDP; inside a loop it raises (step after
  the loop: the gradients are reduced when it ends).

Every rank must run the same loops (as under DDP, where every backward is a collective): a different loop count
is an :class:`~lightning_dcp.runtime.agreement.AgreementError` at the loop's end. A loop left early (``break``,
``return`` inside it) raises at the next ``manual_backward``, ``opt.step()``, loop or the step's end: the rank ran
only part of its micro-batches. The sharding modes that shard the weights (their gathers and reduce-scatter belong
to the strategy's own step) are refused at fit start (:func:`~lightning_dcp.runtime.checks.check_fit`); with
manual optimization the calibration does not refit (plans use the fit-start cost model), and an out-of-memory
error stops the run (no re-plan: the user's step may have stepped an optimizer already).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dcp.runtime.agreement import check_column
from lightning_dcp.runtime.collective_guard import CollectiveInLoopError
from lightning_dcp.runtime.step import LoadedStep, MicroBatch, PreparedStep, Step
from lightning_dcp.sp.context import sp_context
from lightning_dcp.sp.tokens import count_weighted_calls

if TYPE_CHECKING:  # pragma: no cover
    from lightning_dcp.runtime.executor import StepExecutor
    from lightning_dcp.runtime.metrics import StepMetrics
    from lightning_dcp.planning.plan import StepPlan

__all__ = ["ManualDriver", "ManualResult", "ManualStep", "micro_batches"]

_LOOP_CAUSE = ("training_step loops over micro_batches(batch) a rank-dependent number of times (every rank must run "
               "the same loops, in the same order, as every backward under DDP is a collective)")


def micro_batches(batch: Any) -> Iterator[Any]:
    """Yield each of this rank's planned micro-batches of the step, for ``training_step`` under manual optimization.

    Call it with the ``batch`` DCPStrategy passed to ``training_step`` (``automatic_optimization = False``), once
    per optimizer, and call ``self.manual_backward(loss)`` on each micro-batch's loss (its mean, as for a plain
    batch); the gradients are reduced over the world when the loop ends, exactly as DDP's would be on the same
    global batch, so ``opt.step()`` (and ``clip_gradients``) come after the loop. Each micro-batch runs with its SP
    group and recompute count active. See :mod:`lightning_dcp.runtime.manual`.

    Any other batch (the same module under ``DDPStrategy``, or outside a fit) is yielded once, as it is: the loop
    is then the plain ``manual_backward`` / ``opt.step()`` of Lightning's manual optimization.

    Raises:
        TypeError: ``batch`` is a DCP step under automatic optimization (the strategy runs the loop itself there).
        RuntimeError: a loop inside another loop, or after the step ended.
    """
    if isinstance(batch, ManualStep):
        return batch.driver.loop()
    if isinstance(batch, (PreparedStep, LoadedStep)):
        raise TypeError("micro_batches(batch) got a DCP step under automatic optimization, where the strategy runs the "
                        "micro-batch loop itself and training_step gets one micro-batch; set "
                        "self.automatic_optimization = False to drive the micro-batches with micro_batches(batch)")
    return iter((batch,))


@dataclass(frozen=True)
class ManualStep:
    """The batch ``training_step`` gets under manual optimization: loop over it with :func:`micro_batches`.

    ``step``: the step (its plan, this rank's items); ``micro_batches``: this rank's prepared micro-batches (read
    their ``data`` through :func:`micro_batches`, which activates each one's SP group).
    """

    prepared: PreparedStep
    driver: "ManualDriver"

    @property
    def step(self) -> Step:
        return self.prepared.step

    @property
    def micro_batches(self) -> tuple[MicroBatch, ...]:
        return self.prepared.micro_batches

    def __repr__(self) -> str:
        return f"ManualStep({self.step.where()}, {len(self.micro_batches)} micro-batches on this rank)"


@dataclass(frozen=True)
class ManualResult:
    """What one manual-optimization step did: ``training_step``'s own output, the metrics row, the step."""

    output: Any
    metrics: "StepMetrics"
    step: Step

    @property
    def plan(self) -> "StepPlan":
        return self.step.plan


class ManualDriver:
    """One manual-optimization step on this rank: the loops over its micro-batches (see the module docstring).

    Args:
        executor: the fit's :class:`~lightning_dcp.runtime.executor.StepExecutor` (its buckets, guard, gather).
        prepared: this rank's prepared step, on the device.
    """

    def __init__(self, executor: "StepExecutor", prepared: PreparedStep) -> None:
        self.executor = executor
        self.prepared = prepared
        self.current: MicroBatch | None = None
        """The micro-batch the running loop is at (``None``: outside a loop)."""
        self.loops = 0
        self.busy_s = 0.0
        self.broken: str | None = None
        self.ended = False
        self.batch_size = max(1, sum(len(mb.item.samples) for mb in prepared.micro_batches))
        """What ``self.log`` reads outside the loops: this rank's samples of the step (at least 1)."""
        self._active: weakref.ref | None = None  # the running loop (weak: a loop left by `break` is closed at once)

    @property
    def step(self) -> Step:
        return self.prepared.step

    @property
    def in_loop(self) -> bool:
        return self._active is not None and self._active() is not None

    # ------------------------------------------------------------------ the loop
    def loop(self) -> Iterator[Any]:
        """A loop over this rank's micro-batches (:func:`micro_batches`)."""
        self.check_usable("micro_batches(batch)")
        if self.in_loop:
            raise RuntimeError(f"micro_batches(batch) inside another loop over micro_batches(batch) "
                               f"({self.step.where()}) under DCPStrategy; finish one loop (one optimizer's backward passes) before the next")
        gen = self._run()
        self._active = weakref.ref(gen)
        return gen

    def _run(self) -> Iterator[Any]:
        ex = self.executor
        runtime, guard, buckets, step = ex.runtime, ex.guard, ex.buckets, self.step
        kept = buckets.set_aside()
        buckets.begin()
        results = getattr(runtime.trainer, "_results", None)
        layout = ex._ring_layout() or "contiguous"
        done = False
        t0 = time.perf_counter()
        ex.in_micro_loop = True
        try:
            with guard.loop():
                for rnd in runtime.shards.rounds(step.plan, runtime.rank):
                    mb = self.prepared.micro_batches[rnd.position]
                    with guard.round(ex._round_name(step, mb), ex._round_groups(rnd)):
                        with sp_context(mb.item.sp_context(runtime.sp_groups, layout)):
                            if results is not None:  # what Lightning's self.log reads for the batch size
                                results.batch, results.batch_size = mb.data, len(mb.item.samples)
                            ex.step_logs.weight = mb.log_weight  # a sync_dist value's weight in the step's value
                            count_weighted_calls(reset=True)
                            self.current = mb
                            try:
                                yield mb.data
                            finally:
                                self.current = None
            done = True
        finally:
            ex.in_micro_loop = False
            if results is not None:  # self.log after the loop: this rank's samples of the step again
                results.batch, results.batch_size = None, self.batch_size
            self.busy_s += time.perf_counter() - t0
            self._active = None
            if not done:
                self.broken = (f"a loop over micro_batches(batch) in {step.where()} stopped before this rank's last "
                               f"micro-batch (a break, a return or an error inside it)")
        self.loops += 1
        self._reduce(kept)

    def _reduce(self, kept: list[Tensor | None], tripped: bool = False) -> None:
        """The loop's end on every rank: the gather, the checks, the reduction, the set-aside gradients back."""
        ex, step = self.executor, self.step
        buckets = ex.buckets
        if not tripped:
            buckets.park()
        head = torch.tensor([float(self.loops), float(self.prepared.loss_units), float(ex.guard.flag)],
                            dtype=torch.float64)
        table = ex._gather(torch.cat([head, buckets.has_grad.to(torch.float64)]), step,
                                "the gradient reduction at the end of a loop over micro_batches(batch)")
        where = f"at the end of loop {self.loops} over micro_batches(batch) in {step.where()}"
        check_column(table[:, 0].tolist(), "how many loops over micro_batches(batch) training_step ran", _LOOP_CAUSE,
                     where, show_values=True)
        try:
            ex.guard.stop_if_tripped(table[:, 2].tolist(), lambda t: ex._gather(
                t, step, "the report of a collective inside a loop over micro_batches(batch)"))
        except CollectiveInLoopError as err:
            err.dcp_reported = True  # type: ignore[attr-defined]
            raise
        divisor = float(table[:, 1].sum())
        buckets.reduce(table[:, 3:].sum(0), world=ex.world_size if dist.is_initialized() else 1,
                       scale=1.0 / divisor if divisor > 0 else 1.0)  # no loss token in the step: zero gradients
        ex.runtime.shards.after_reduce()
        buckets.add_back(kept)

    def report_trip(self, err: CollectiveInLoopError) -> None:
        """A world collective inside a loop raised out of ``training_step`` on this rank: the other ranks meet
        this loop's end; join it with the flag set, so every rank raises the same error there."""
        if getattr(err, "dcp_reported", False):
            return
        self.abort()
        self.executor.guard.trip(err)
        self.loops += 1
        self._reduce([], tripped=True)

    def abort(self) -> None:
        """Close a loop left suspended (an error in its body): its guard and SP context end now."""
        active, self._active = self._active, None
        gen = active() if active is not None else None
        if gen is not None:
            gen.close()

    # ------------------------------------------------------------------ backward and the optimizer step
    def scaled(self, loss: Tensor) -> Tensor:
        """``manual_backward``'s loss as a sum over the current micro-batch's loss units (as automatic
        optimization's ``training_step`` loss)."""
        self.check_usable("self.manual_backward(loss)")
        mb = self.current
        if mb is None:
            raise RuntimeError(
                f"self.manual_backward(loss) outside a loop over micro_batches(batch) ({self.step.where()}) under "
                "DCPStrategy with manual optimization: every backward must belong to one planned micro-batch (the "
                "strategy weights it by the micro-batch's loss tokens and reduces the gradients when the loop ends). "
                "Compute the loss inside `for mb in micro_batches(batch):` from `mb` and call manual_backward there")
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = "" if not isinstance(loss, Tensor) else " of shape " + str(tuple(loss.shape))
            raise TypeError(f"self.manual_backward takes a scalar loss under DCPStrategy (a micro-batch's mean, or "
                            f"lightning_dcp.weighted_loss(token_loss, mb)); got {type(loss).__name__}{shape}")
        return self.executor._summed_loss(loss, mb, weighted=count_weighted_calls(reset=True) > 0)

    def check_step(self) -> None:
        """``opt.step()``: never inside a loop (its gradients are reduced when it ends)."""
        self.check_usable("opt.step()")
        if self.in_loop:
            raise RuntimeError(
                f"opt.step() inside a loop over micro_batches(batch) ({self.step.where()}) under DCPStrategy: the "
                "gradients are reduced over the ranks when the loop ends (ranks run different numbers of "
                "micro-batches), so step the optimizer after the loop")

    def check_usable(self, what: str) -> None:
        if self.broken is not None:
            raise RuntimeError(f"{what} after {self.broken}: this rank ran only part of its micro-batches, so the "
                               "gradients are not the global batch's. Let every loop over micro_batches(batch) run "
                               "to its end")
        if self.ended:
            raise RuntimeError(f"{what} after {self.step.where()} ended: a ManualStep is valid inside its "
                               "training_step only")

    def end(self) -> None:
        """The step's ``training_step`` returned: a loop still open or left early is an error."""
        self.abort()
        self.check_usable("the end of training_step")
        self.ended = True
