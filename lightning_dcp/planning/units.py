"""Memory figures in messages, one rule for every planning and profiling error: bytes as GiB, MiB or KiB
(``5.25 MiB``, never ``5.50502e+06``), and a budget with where it came from, so an error names the budget it checked
against and how to change it. Pure Python.
"""

from __future__ import annotations

from typing import Any

__all__ = ["describe_limit", "format_bytes", "limit_text"]

_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit it reaches, two decimals: ``1.50 GiB``, ``5.25 MiB``, ``4.77 KiB``, ``12 B``."""
    n = float(nbytes)
    if n != n or n in (float("inf"), float("-inf")):
        return f"{n} B"
    for size, unit in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def limit_text(limit: float, source: str = "") -> str:
    """A bytes budget and its source: ``"5.25 MiB per device (DCPProfiler(memory_limit_bytes=...))"``."""
    text = f"{format_bytes(limit)} per device"
    return f"{text} ({source})" if source else text


def describe_limit(cost_model: Any) -> str:
    """The cost model's memory budget with its source: its ``describe_limit()``, else :func:`limit_text` of its
    ``memory_limit`` and ``memory_limit_source``."""
    own = getattr(cost_model, "describe_limit", None)
    if callable(own):
        return str(own())
    limit = getattr(cost_model, "memory_limit", None)
    if not isinstance(limit, (int, float)):
        return "an unknown memory limit"
    return limit_text(limit, str(getattr(cost_model, "memory_limit_source", "") or ""))
