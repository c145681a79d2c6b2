"""What every rank measures for calibration, as fixed-width rows of floats for the step-end all-gather.

:class:`ItemMeasurement` (one per micro-batch a rank ran) and :class:`StepTiming` (a rank's whole
previous step) become floats (``to_floats``); :func:`pack_payload` puts one rank's timing and its
rows (padded by :func:`pack_rows` to a row count every rank knows from the plan) into one list;
:func:`unpack_payload` decodes every rank's payloads, padding skipped. Integers are exact below
2**53. The refit that reads them: :mod:`lightning_dcp.planning.calibration`. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

__all__ = ["NUM_FIELDS", "TIMING_FIELDS", "ItemMeasurement", "StepTiming", "pack_payload", "pack_rows",
           "unpack_payload", "unpack_rows"]

_UNKNOWN = -1.0
"""``wait_s`` when the all-to-all wait was not measured; ``rank`` of a padding row."""


@dataclass(frozen=True)
class ItemMeasurement:
    """What one rank measured for one micro-batch it executed (one row of floats on the all-gather).

    ``tokens`` and ``work`` (sum of the samples' attention work, ``sum(l**2)`` for 1-D models) are
    kept so later refits can fit the time terms themselves; the refit of this version uses
    ``predicted_s`` (the *uncalibrated* cost model's time of the item, the same on every member).
    """

    step: int
    """Optimizer step the item belongs to."""
    item: int
    """Index of the item in the step plan's ``items``."""
    rank: int
    """The rank that measured it."""
    sp: int
    """SP size of the item."""
    recompute: int
    """Recomputed layers."""
    samples: int
    """Samples packed in the micro-batch."""
    tokens: float
    """Sum of the samples' lengths."""
    work: float
    """Sum of the samples' attention work (``sum(l**2)`` for 1-D models)."""
    predicted_s: float
    """The uncalibrated cost model's time of the item (seconds)."""
    measured_s: float
    """Seconds this rank spent on the item (forward + backward, recompute included)."""
    wait_s: float = _UNKNOWN
    """Seconds of it this rank spent inside the item's SP all-to-alls, forward and backward: waiting for
    the group's slowest member, then the transfer (``-1``: not measured)."""

    def to_floats(self) -> list[float]:
        """The :data:`NUM_FIELDS` floats of this row, in field order (exact for integers below 2**53)."""
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_floats(cls, row: Sequence[float]) -> ItemMeasurement | None:
        """The measurement of ``row`` (:meth:`to_floats`), or None for a padding row (negative rank).

        Raises:
            ValueError: a row of another width, or non-finite values in a real row.
        """
        vals = [float(v) for v in row]
        if len(vals) != NUM_FIELDS:
            raise ValueError(f"a measurement row has {NUM_FIELDS} floats, got {len(vals)}; build rows with "
                             "ItemMeasurement.to_floats / pack_rows")
        if vals[2] < 0:
            return None
        if not all(math.isfinite(v) for v in vals):
            raise ValueError(f"measurement row {vals} has non-finite values")
        ints = {f.name for f in fields(cls) if f.type in ("int", int)}
        kw = {f.name: (int(v) if f.name in ints else v) for f, v in zip(fields(cls), vals)}
        return cls(**kw)

    def sort_key(self) -> tuple:
        return tuple(self.to_floats())


NUM_FIELDS = len(fields(ItemMeasurement))
"""Floats per measurement row."""


def pack_rows(measurements: Sequence[ItemMeasurement], rows: int) -> list[float]:
    """``measurements`` as ``rows x NUM_FIELDS`` floats (row-major), padded with padding rows (rank -1).

    The runtime puts this (as a float64 tensor of shape ``(rows, NUM_FIELDS)``) on its all-gather;
    ``rows`` must be the same on every rank (e.g. the step plan's largest per-rank item count).

    Raises:
        ValueError: more measurements than ``rows``.
    """
    if len(measurements) > rows:
        raise ValueError(f"{len(measurements)} measurements do not fit {rows} rows; pass rows >= the most items any "
                         "rank runs in the step")
    out: list[float] = []
    for m in measurements:
        out.extend(m.to_floats())
    pad = [0.0] * NUM_FIELDS
    pad[2] = _UNKNOWN
    for _ in range(rows - len(measurements)):
        out.extend(pad)
    return out


def unpack_rows(flat: Sequence[float]) -> list[ItemMeasurement]:
    """The measurements in ``flat`` (rows of :data:`NUM_FIELDS` floats, e.g. every rank's :func:`pack_rows`
    concatenated), padding rows skipped.

    Raises:
        ValueError: a length that is not a multiple of :data:`NUM_FIELDS`.
    """
    vals = list(flat)
    if len(vals) % NUM_FIELDS:
        raise ValueError(f"{len(vals)} floats are not whole rows of {NUM_FIELDS}")
    out = []
    for i in range(0, len(vals), NUM_FIELDS):
        m = ItemMeasurement.from_floats(vals[i:i + NUM_FIELDS])
        if m is not None:
            out.append(m)
    return out


@dataclass(frozen=True)
class StepTiming:
    """One rank's wall seconds of one whole step (reported with the next step's rows: the optimizer step
    ends after the step's all-gather)."""

    step: int
    """The step (its key)."""
    rank: int
    """The rank that measured it (``-1``: nothing to report)."""
    step_s: float
    """From the start of the step's micro-batch loop to the end of its optimizer step."""
    busy_s: float
    """Of it, the micro-batch loop."""

    def to_floats(self) -> list[float]:
        return [float(self.step), float(self.rank), float(self.step_s), float(self.busy_s)]

    @classmethod
    def from_floats(cls, row: Sequence[float]) -> StepTiming | None:
        step, rank, step_s, busy_s = (float(v) for v in row)
        if rank < 0 or not (math.isfinite(step_s) and math.isfinite(busy_s)) or step_s < busy_s or busy_s < 0:
            return None
        return cls(int(step), int(rank), step_s, busy_s)


TIMING_FIELDS = 4
"""Floats of a :class:`StepTiming`."""


def pack_payload(timing: StepTiming | None, measurements: Sequence[ItemMeasurement], rows: int) -> list[float]:
    """One rank's calibration payload: its previous step's timing (or a padding timing), then
    :func:`pack_rows` of ``measurements``."""
    head = timing.to_floats() if timing is not None else [0.0, _UNKNOWN, 0.0, 0.0]
    return head + pack_rows(measurements, rows)


def unpack_payload(flat: Sequence[float], ranks: int) -> tuple[list[StepTiming], list[ItemMeasurement]]:
    """The timings and measurements of ``ranks`` payloads (:func:`pack_payload`) concatenated in rank order.

    Raises:
        ValueError: a length that is not ``ranks`` equal payloads of whole rows.
    """
    vals = list(flat)
    if ranks < 1 or len(vals) % ranks or (len(vals) // ranks - TIMING_FIELDS) % NUM_FIELDS:
        raise ValueError(f"{len(vals)} floats are not {ranks} payloads of {TIMING_FIELDS} + k x {NUM_FIELDS} floats")
    width = len(vals) // ranks
    timings, rows = [], []
    for r in range(ranks):
        part = vals[r * width:(r + 1) * width]
        t = StepTiming.from_floats(part[:TIMING_FIELDS])
        if t is not None:
            timings.append(t)
        rows.extend(unpack_rows(part[TIMING_FIELDS:]))
    return timings, rows
