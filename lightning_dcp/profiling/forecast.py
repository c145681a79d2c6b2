"""How long a grid point will take to measure, from the points measured so far: :class:`PointForecast`.

A point's wall time (every pass of :func:`~lightning_dcp.profiling.measure.measure_point` on one rank) is fitted
as ``a * b l^2 / p + c * b l / p + d`` over the measured points (non-negative least squares, the cost model's own
fit), so the profiler can skip, before starting it, a point that would not end within its budget
(:class:`~lightning_dcp.profiling.deadline.ProfileDeadline`). After a point's first pass the remaining passes are
forecast from that pass alone (:data:`PASSES_AFTER_WARMUP`). Pure Python + numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PASSES_AFTER_WARMUP", "PointForecast"]

#: Forward + backward passes of one layer that follow a point's warm-up pass: the activation count (1), at least
#: three timed, the checkpointed warm-up and at least three checkpointed (each about 4/3 of a pass).
PASSES_AFTER_WARMUP = 9.0


def _features(seq_len: int, micro_batch: int, sp: int) -> list[float]:
    tokens = float(micro_batch * seq_len) / sp
    return [tokens * seq_len, tokens, 1.0]


class PointForecast:
    """Seconds a ``(seq_len, micro_batch, sp)`` point or the constant parts at a length will take, from the ones
    measured (every rank records the same agreed durations, so every rank forecasts the same)."""

    def __init__(self) -> None:
        self._rows: list[list[float]] = []
        self._times: list[float] = []
        self._constant: tuple[int, float] | None = None

    def record(self, seq_len: int, micro_batch: int, sp: int, seconds: float) -> None:
        self._rows.append(_features(seq_len, micro_batch, sp))
        self._times.append(max(0.0, float(seconds)))

    def record_constant(self, seq_len: int, seconds: float) -> None:
        self._constant = (int(seq_len), max(0.0, float(seconds)))

    def point(self, seq_len: int, micro_batch: int, sp: int) -> float | None:
        """The forecast seconds of a point (``None`` before any point was measured)."""
        if not self._rows:
            return None
        from lightning_dcp.planning.profiled import nonneg_fit

        coef = nonneg_fit(np.array(self._rows), np.array(self._times))
        return float(np.array(_features(seq_len, micro_batch, sp)) @ coef)

    def constant(self, seq_len: int) -> float:
        """The forecast seconds of the constant parts at ``seq_len`` tokens: the measured ones scaled by the tokens
        (0 before they were measured)."""
        if self._constant is None:
            return 0.0
        n, t = self._constant
        return t * max(1.0, seq_len / max(1, n))

    def __len__(self) -> int:
        return len(self._times)

    def summary(self) -> dict[str, Any]:
        return {"points": len(self._times), "seconds": round(sum(self._times), 3)}
