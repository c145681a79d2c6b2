"""The step-end row: what each rank tells every other rank once per step, in one all-gather.

After its last micro-batch every rank contributes one :class:`StepRow` (a few float64 numbers) plus
one has-gradient flag per parameter; the gathered table (:class:`GatheredStep`) is what the rest of
the step reads: the global loss divisor, which plan items ran out of memory, the plan-agreement
columns, and the per-rank busy time and tokens that :mod:`lightning_dcp.runtime.metrics` turns into
``dcp/*`` metrics. One typed row, so the executor, the agreement check and the metrics never index
columns by hand.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["GatheredStep", "StepRow"]


@dataclass(frozen=True)
class StepRow:
    """One rank's numbers for one step (every field travels as a float64)."""

    busy_s: float
    """Wall seconds inside this rank's micro-batch loop (forward and backward of all its items)."""
    loss: float
    """This rank's summed loss (a sum over its loss units, before the global divisor)."""
    tokens: int
    """Real (non-padding) tokens this rank ran."""
    items: int
    """Micro-batches this rank ran."""
    loss_units: int
    """Loss units this rank counts toward the global divisor (each item counted by its first SP rank)."""
    plan_hash: float
    """Fingerprint of the plan this rank ran (:func:`~lightning_dcp.runtime.agreement.plan_fingerprint`)."""
    next_plan_hash: float
    """Fingerprint of the plan this rank will run next step (0 at an epoch's end)."""
    oom_item: int = 0
    """1 + the plan index of an SP-1 item that ran out of memory on this rank, else 0."""
    planned_upto: int = -1
    """The largest step key this rank's sampler has handed to the planner (where a refit may take effect,
    :mod:`lightning_dcp.runtime.calibration`)."""
    loop_collective: int = 0
    """1 when this rank's loop refused a world collective from user code this step
    (:mod:`~lightning_dcp.runtime.collective_guard`): every rank then stops with its message."""
    sync_logs: int = 0
    """How many names this rank logged with ``self.log(..., sync_dist=True)`` inside the loop this step
    (:mod:`~lightning_dcp.runtime.step_logs`: reduced over the world once, after this gather)."""
    sync_logs_hash: float = 0.0
    """Fingerprint of those names and their reductions (0: none)."""

    @classmethod
    def width(cls) -> int:
        return len(fields(cls))

    def to_tensor(self, flags: Tensor | None = None, measurements: Tensor | None = None) -> Tensor:
        """The row as float64, then ``measurements`` (this rank's packed calibration rows, flat), then
        ``flags`` (the per-parameter has-gradient flags)."""
        parts = [torch.tensor([float(v) for v in astuple(self)], dtype=torch.float64)]
        if measurements is not None:
            parts.append(measurements.reshape(-1).to(torch.float64))
        if flags is not None:
            parts.append(flags.to(torch.float64))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @classmethod
    def from_values(cls, values: Sequence[float]) -> "StepRow":
        kinds = [f.type for f in fields(cls)]
        return cls(*(int(v) if kind == "int" else float(v) for v, kind in zip(values, kinds)))


class GatheredStep:
    """The all-gathered ``[world, StepRow.width() + measurements + params]`` table of one step, read by field.

    Args:
        table: what the step-end all-gather returned (one row per rank, in rank order).
        measurement_width: floats of calibration rows per rank after the :class:`StepRow` (0: none).
    """

    def __init__(self, table: Tensor, measurement_width: int = 0) -> None:
        width = StepRow.width()
        table = table.double().cpu()
        self.rows = [StepRow.from_values(r) for r in table[:, :width].tolist()]
        end = width + int(measurement_width)
        self.measurements: list[float] = table[:, width:end].reshape(-1).tolist()
        """Every rank's packed calibration rows, concatenated in rank order (empty without calibration)."""
        self.has_grad = table[:, end:].sum(0)
        """Per parameter: how many ranks produced a gradient for it (0: none did, its ``.grad`` stays ``None``)."""

    def column(self, name: str) -> list[float]:
        return [float(getattr(r, name)) for r in self.rows]

    @property
    def loss_units(self) -> float:
        """The step's global loss divisor: loss units over every rank."""
        return float(sum(r.loss_units for r in self.rows))

    @property
    def failed_items(self) -> list[int]:
        """Plan indices of SP-1 items that ran out of memory on some rank this attempt."""
        return sorted({r.oom_item - 1 for r in self.rows if r.oom_item > 0})
