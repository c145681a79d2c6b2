"""The planner's objective: a step's makespan, and when one plan beats another.

Every policy minimizes the same thing: the time until the slowest rank finishes the step's
micro-batches (the all-reduce after it costs every plan of the step the same). A rank's time is the
sum of its items' times; in the nested schedules the policies build (a group runs its own
micro-batches, then its ranks split into smaller groups, to any depth) that is a root-to-leaf sum
of the tree of groups, and for groups that run side by side it is each group's load. So:

* :func:`makespan`: the largest of the loads (per rank, per group, per root-to-leaf path) --
  longest-first dispatch (``dispatch.py``), the buddy trees (``tree.py``, ``dcp_tree.py``), dcp's
  layout scheduler, Algorithm 1 and bucket's per-step time all call it;
* :func:`improves`: a candidate replaces the incumbent only when it is faster by more than a
  relative tolerance, so float noise never flips a deterministic choice.

Pure Python.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["RELATIVE_TOLERANCE", "improves", "makespan"]

RELATIVE_TOLERANCE = 1e-9
"""A plan must be this much (relatively) faster to replace another."""


def makespan(loads: Iterable[float]) -> float:
    """The step's compute makespan: the largest of ``loads`` (seconds per rank, group or root-to-leaf path),
    0 when there are none."""
    return max(loads, default=0.0)


def improves(new: float, old: float | None, tolerance: float = RELATIVE_TOLERANCE) -> bool:
    """Whether a plan of makespan ``new`` replaces one of ``old`` (None: there is none yet)."""
    return old is None or new < old * (1.0 - tolerance)
