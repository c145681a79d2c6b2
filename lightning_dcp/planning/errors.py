"""The planner's user-facing error.

A :class:`PlanningError` says what was wrong with the planner's input, the values involved and
the fix (for example a sample too long for any setting on this world size, naming the sample,
its length and the longest length that fits). It subclasses :class:`ValueError` so callers that
already catch bad input keep working; the CLI turns it into exit code 2.
"""

from __future__ import annotations


class PlanningError(ValueError):
    """The planner cannot produce a valid plan for this input (bad lengths, world size, policy...)."""
