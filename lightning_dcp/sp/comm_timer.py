"""Time spent inside the SP all-to-alls of one micro-batch, forward and backward.

Calibration (:mod:`lightning_dcp.runtime.calibration`) needs to know, per SP micro-batch, how long
each member sat in the group's all-to-alls: the member that arrives last waits least, so the least
time inside the collectives marks the member that set the item's pace. :func:`set_active` installs an
:class:`AllToAllTimer` for the duration of one micro-batch (forward and backward);
:func:`~lightning_dcp.sp.ulysses.seq_all_to_all` then marks each forward all-to-all and, through the autograd node's pre-hook and hook, its backward
all-to-all (recomputed forwards included). What a span holds: the wait for the group's slowest
member plus the transfer.

On a GPU the marks are CUDA events on the current stream (no synchronisation; read after the step's
one host sync, :meth:`AllToAllTimer.seconds`); on the CPU they are ``time.perf_counter`` readings
(gloo's all-to-all is synchronous). With no timer active (calibration off, SP 1) nothing is marked.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["AllToAllTimer", "active_timer", "set_active", "time_mark"]


def time_mark(cuda: bool) -> Any:
    """A point in time: a CUDA event recorded on the current stream (``cuda``), or ``time.perf_counter()``."""
    if cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


class AllToAllTimer:
    """The all-to-all spans of one micro-batch on this rank.

    Args:
        cuda: mark with CUDA events (else ``time.perf_counter``).
    """

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = bool(cuda)
        self.spans: list[tuple[Any, Any]] = []
        self._open: list[Any] = []

    def mark(self) -> Any:
        return time_mark(self.cuda)

    def add(self, start: Any, end: Any) -> None:
        self.spans.append((start, end))

    def seconds(self) -> float:
        """Total seconds inside the marked all-to-alls (on a GPU: call after the events completed)."""
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.spans) / 1000.0
        return float(sum(b - a for a, b in self.spans))

    def wrap_backward(self, out: torch.Tensor) -> None:
        """Mark the backward all-to-all of ``out``'s autograd node (the node's pre-hook and hook)."""
        node = out.grad_fn
        if node is None:
            return
        opened: list[Any] = []
        node.register_prehook(lambda grads: opened.append(self.mark()))
        node.register_hook(lambda grad_in, grad_out: self.add(opened.pop(), self.mark()) if opened else None)


_ACTIVE: AllToAllTimer | None = None


def active_timer() -> AllToAllTimer | None:
    """The timer of the micro-batch running now (``None``: nothing is timed)."""
    return _ACTIVE


def set_active(timer: AllToAllTimer | None) -> None:
    """Mark the all-to-alls from now on into ``timer`` (``None``: stop marking)."""
    global _ACTIVE
    _ACTIVE = timer
