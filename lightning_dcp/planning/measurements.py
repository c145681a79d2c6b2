"""What every rank measures for calibration, as fixed-width rows of floats for the step-end all-gather.

One rank's payload (:func:`pack_payload`) is its previous step's :class:`StepTiming`, then an
:class:`ItemMeasurement` per micro-batch it ran, padded to a row count every rank knows from the plan. Integers are
exact below 2**53. The refit that reads them: :mod:`lightning_dcp.planning.calibration`. Pure Python.
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

    ``tokens`` and ``work`` (``sum(l**2)`` for 1-D models) are kept for refits that fit the time terms themselves;
    this one uses ``predicted_s``, the *uncalibrated* cost model's seconds (the same on every member).
    """

    step: int
    item: int
    """Index of the item in the step plan's ``items``."""
    rank: int
    sp: int
    recompute: int
    samples: int
    tokens: float
    work: float
    predicted_s: float
    measured_s: float
    """Seconds this rank spent on the item (forward + backward, recompute included)."""
    wait_s: float = _UNKNOWN
    """Of it, seconds inside the item's SP all-to-alls (waiting for the slowest member, then the transfer)."""

    def to_floats(self) -> list[float]:
        """The :data:`NUM_FIELDS` floats of this row, in field order."""
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_floats(cls, row: Sequence[float]) -> ItemMeasurement | None:
        """The measurement of ``row``, or None for a padding row; ``ValueError`` for a row of another width, or
        non-finite values in a real row."""
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


def pack_rows(measurements: Sequence[ItemMeasurement], rows: int) -> list[float]:
    """``measurements`` as ``rows x NUM_FIELDS`` floats (row-major), padded with rank -1 rows; ``rows`` the same on
    every rank (e.g. the plan's largest per-rank item count)."""
    if len(measurements) > rows:
        raise ValueError(f"{len(measurements)} measurements do not fit {rows} rows; pass rows >= the most items any "
                         "rank runs in the step")
    pad = [0.0, 0.0, _UNKNOWN] + [0.0] * (NUM_FIELDS - 3)  # rank -1
    return [x for m in measurements for x in m.to_floats()] + pad * (rows - len(measurements))


def unpack_rows(flat: Sequence[float]) -> list[ItemMeasurement]:
    """The measurements in ``flat`` (whole rows, e.g. every rank's :func:`pack_rows` concatenated), padding skipped."""
    vals = list(flat)
    if len(vals) % NUM_FIELDS:
        raise ValueError(f"{len(vals)} floats are not whole rows of {NUM_FIELDS}")
    rows = (ItemMeasurement.from_floats(vals[i:i + NUM_FIELDS]) for i in range(0, len(vals), NUM_FIELDS))
    return [m for m in rows if m is not None]


@dataclass(frozen=True)
class StepTiming:
    """One rank's wall seconds of one whole step, from its micro-batch loop's start to its optimizer step's end
    (``busy_s``: the loop); reported with the next step's rows (the optimizer step ends after the all-gather)."""

    step: int
    rank: int
    """``-1``: nothing to report."""
    step_s: float
    busy_s: float

    def to_floats(self) -> list[float]:
        return [float(self.step), float(self.rank), float(self.step_s), float(self.busy_s)]

    @classmethod
    def from_floats(cls, row: Sequence[float]) -> StepTiming | None:
        step, rank, step_s, busy_s = (float(v) for v in row)
        if rank < 0 or not (math.isfinite(step_s) and math.isfinite(busy_s)) or step_s < busy_s or busy_s < 0:
            return None
        return cls(int(step), int(rank), step_s, busy_s)


TIMING_FIELDS = 4


def pack_payload(timing: StepTiming | None, measurements: Sequence[ItemMeasurement], rows: int) -> list[float]:
    """One rank's payload: its previous step's timing (or a padding one), then :func:`pack_rows`."""
    head = timing.to_floats() if timing is not None else [0.0, _UNKNOWN, 0.0, 0.0]
    return head + pack_rows(measurements, rows)


def unpack_payload(flat: Sequence[float], ranks: int) -> tuple[list[StepTiming], list[ItemMeasurement]]:
    """The timings and measurements of ``ranks`` payloads concatenated in rank order."""
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
