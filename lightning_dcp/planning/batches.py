"""A run's global batches: the one rule that cuts an order of samples into optimizer steps.

The sampler (training), ``Planner.plan`` / ``Planner.batches``, ``lightning-dcp plan`` / ``simulate`` and the
benchmarks all cut with :func:`cut_batches`, so the plan a command shows is the plan that trains. Samples are
taken in ``order`` (training: ``torch.randperm`` seeded ``seed + epoch``, torch's DistributedSampler's); a batch
closes at ``global_batch_size`` samples, or before the next sample would take it past ``global_batch_tokens``
(at least one sample per batch); ``drop_last`` drops an incomplete last batch (fewer samples or tokens than
that). Batch ``index`` of ``epoch`` is planned as step :func:`step_key` ``(epoch, index)``. Pure Python.
"""

from __future__ import annotations

import numbers
from typing import Iterable, Sequence

from lightning_dcp.planning.errors import PlanningError

__all__ = ["STEP_KEY_STRIDE", "check_batch_size", "cut_batches", "step_key"]

STEP_KEY_STRIDE = 1_000_003
"""Step keys of consecutive epochs are this far apart (what the planner gets as ``plan_batch(step=...)``)."""


def step_key(epoch: int, index: int) -> int:
    """The position of global batch ``index`` of ``epoch`` in the run: the ``step`` it is planned as."""
    return int(epoch) * STEP_KEY_STRIDE + int(index)


def check_batch_size(global_batch_tokens: int | None, global_batch_size: int | None) -> None:
    """Exactly one of the two, an integer >= 1; a :class:`PlanningError` naming them otherwise."""
    if (global_batch_size is None) == (global_batch_tokens is None):
        raise PlanningError("give exactly one of global_batch_size (samples per step) and global_batch_tokens "
                            f"(tokens per step); got {global_batch_size=} and {global_batch_tokens=}")
    name, value = ("global_batch_size", global_batch_size) if global_batch_size is not None else \
        ("global_batch_tokens", global_batch_tokens)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise PlanningError(f"{name} must be an integer >= 1, got {value!r}")


def cut_batches(lengths: Sequence[int], order: Iterable[int] | None = None, *, global_batch_tokens: int | None = None,
                global_batch_size: int | None = None, drop_last: bool = False) -> list[list[int]]:
    """The sample indices of each global batch: ``order`` (default index order; each sample at most once) cut by
    the module's rule. :class:`PlanningError` for bad sizes or an order that repeats or leaves the samples."""
    check_batch_size(global_batch_tokens, global_batch_size)
    n = len(lengths)
    order = list(range(n)) if order is None else [int(i) for i in order]
    if len(set(order)) != len(order) or (order and not 0 <= min(order) <= max(order) < n):
        raise PlanningError(f"the order of samples must name each of the {n} samples at most once (a permutation of "
                            f"range({n}), or part of one); got {order[:8]}{'...' if len(order) > 8 else ''}")
    if global_batch_size is not None:
        out = [order[i:i + global_batch_size] for i in range(0, len(order), global_batch_size)]
        return out[:-1] if out and drop_last and len(out[-1]) < global_batch_size else out
    out, cur, acc = [], [], 0
    for i in order:
        if cur and acc + lengths[i] > global_batch_tokens:
            out.append(cur)
            cur, acc = [], 0
        cur.append(i)
        acc += lengths[i]
    if cur and not (drop_last and acc < global_batch_tokens):
        out.append(cur)
    return out
