"""What user code may not do inside the micro-batch loop: world collectives (ranks run different numbers
of micro-batches there, so a world collective would hang). A mixin of :class:`~lightning_dcp.DCPStrategy`
before Lightning's ``DDPStrategy``: it reads the strategy's ``executor``. The ``torch.distributed`` calls
themselves are guarded by :mod:`~lightning_dcp.runtime.collective_guard`, which also stops every rank. ``self.log(...,
sync_dist=True)`` goes through ``reduce``: its values are reduced once, at the step end
(:mod:`~lightning_dcp.runtime.step_logs`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from lightning_dcp.runtime.collective_guard import strategy_call_error

__all__ = ["MicroLoopGuards"]


class MicroLoopGuards:
    """``reduce`` inside the loop defers the value to the step end (``self.log(..., sync_dist=True)``:
    :class:`~lightning_dcp.runtime.step_logs.StepLogs`) and returns it unchanged; ``barrier``, ``all_gather``,
    ``broadcast`` and ``reduce_boolean_decision`` raise
    :class:`~lightning_dcp.runtime.collective_guard.CollectiveInLoopError` there, naming the fix (every rank
    stops at the step's end). Outside the loop they are DDP's."""

    executor: Any = None

    @property
    def _in_micro_loop(self) -> bool:
        return self.executor is not None and self.executor.in_micro_loop

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """As DDP's, except inside the micro-batch loop: there ranks run different item counts, so a world
        collective would hang; the value is kept for the step's one reduction at its end and returned unchanged
        (:meth:`~lightning_dcp.runtime.step_logs.StepLogs.defer`)."""
        if self._in_micro_loop:
            return self.executor.step_logs.defer(tensor, reduce_op=reduce_op, group=group)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._in_micro_loop:
            raise strategy_call_error("barrier")
        super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._in_micro_loop:
            raise strategy_call_error("broadcast")
        return super().broadcast(obj, src)

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        if self._in_micro_loop:
            raise strategy_call_error("self.all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self._in_micro_loop:
            raise strategy_call_error("reduce_boolean_decision")
        return super().reduce_boolean_decision(decision, all=all)
