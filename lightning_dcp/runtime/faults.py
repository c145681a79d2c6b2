"""A collective that fails or times out inside a step: one error naming the step, the item and the group.

A stuck collective (a peer that crashed, hangs, or runs a different plan) fails after the
strategy's ``timeout`` (gloo raises; NCCL's watchdog aborts the process). The raw message names
neither the step nor the micro-batch; :func:`collective_error` adds them, what to look at and how
to resume. Errors that are not from a collective (a user's ``TypeError``...) pass unchanged.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_dcp.planning.sample_names import SampleNamer, name_samples

__all__ = ["CollectiveError", "collective_error", "describe_item", "is_collective_failure"]

_MARKERS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "gloo", "nccl",
            "socket", "peer", "aborted")


class CollectiveError(RuntimeError):
    """A collective of the step failed or timed out; the message names the step, the item and the group."""


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` came from a collective (torch.distributed errors, gloo/NCCL runtime errors)."""
    if isinstance(err, CollectiveError):
        return False
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _MARKERS)


def collective_error(err: BaseException, *, epoch: int, step: int, what: str, group: str,
                     timeout: timedelta | None) -> CollectiveError:
    """A :class:`CollectiveError` for ``err``, raised while running ``what`` on ``group``."""
    limit = f"{timeout.total_seconds():g} s" if timeout is not None else "the backend's default"
    return CollectiveError(
        f"step {step} of epoch {epoch}: {what} failed in a collective of {group} (time-out {limit}): "
        f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}. Likely cause: another rank of "
        "that group stopped (look for its own error above), is stuck (a data loader, a deadlock in user code), or ran a "
        "different plan. Raise DCPStrategy(timeout=...) if the group is only slow; a checkpoint resumes the run from "
        "the last saved step")


def describe_item(item: Any, index: int | None = None, sample_name: SampleNamer | None = None) -> str:
    """``item 3 (samples [4, 9], lengths [120, 33], SP 2, recompute 1)`` for a plan's
    :class:`~lightning_dcp.planning.plan.WorkItem` at ``index`` or a
    :class:`~lightning_dcp.runtime.step.RankItem` (which knows its index); with the dataset's ``sample_name``,
    ``samples [4 (clips/a.mp4), 9 (clips/b.mp4)]``."""
    index = getattr(item, "index", index)
    return (f"item {'?' if index is None else index} (samples {name_samples(item.samples, sample_name)}, lengths "
            f"{list(item.lengths)}, SP {len(item.ranks)}, recompute {item.recompute})")
