"""The one check of sample lengths (the planner, the sampler, the datasets' lengths, the commands, the budget):
positive integer token counts; a bad entry is refused by index and source (``MyDataset.lengths[17] is 152.7, not an
integer; ...``), never rounded or skipped. Ints, integer-valued floats and scalars with ``.item()`` (numpy
scalars, one-element tensors) pass. Pure Python.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from lightning_dcp.planning.errors import PlanningError

__all__ = ["check_lengths"]


def _as_length(value: Any, where: str) -> int:
    """``value`` as a positive int token count, or a :class:`PlanningError` naming ``where`` (``ds.lengths[17]``)."""
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, numbers.Number):  # numpy scalars, one-element tensors
        try:
            value = item()
        except (ValueError, RuntimeError, TypeError):  # more than one element
            pass
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PlanningError(f"{where} is {value!r} ({type(value).__name__}), not an integer; lengths are token counts "
                            "(ints >= 1)")
    if not isinstance(value, numbers.Integral) and (not math.isfinite(value) or not float(value).is_integer()):
        raise PlanningError(f"{where} is {value!r}, not an integer; lengths are token counts: round them where the "
                            "dataset computes them (e.g. frames*height*width after patchify is an int)")
    if value < 1:
        raise PlanningError(f"{where} is {value!r}; every sample needs >= 1 token (drop empty samples from the dataset)")
    return int(value)


def check_lengths(lengths: Any, source: str = "lengths", *, allow_empty: bool = False) -> list[int]:
    """``lengths`` as a list of positive ints; a :class:`PlanningError` (a ``ValueError``) names the first bad
    entry as ``source[i]`` with its value and the fix, or an empty list (unless ``allow_empty``)."""
    try:
        seq = list(lengths)
    except TypeError:
        raise PlanningError(f"{source} must be a sequence of ints (one token count per sample), got "
                            f"{type(lengths).__name__}") from None
    if not seq and not allow_empty:
        raise PlanningError(f"{source} is empty; give at least one sample length (tokens)")
    if all(type(n) is int and n > 0 for n in seq):  # the common case, fast
        return seq
    return [_as_length(n, f"{source}[{i}]") for i, n in enumerate(seq)]
