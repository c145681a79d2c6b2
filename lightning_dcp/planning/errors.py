"""The planner's user-facing error: what was wrong with its input, the values involved and the fix (e.g. a sample
too long for any setting, naming it, its length and the longest that fits). A :class:`ValueError`, so callers that
catch bad input keep working; the CLI exits with code 2.
"""

from __future__ import annotations


class PlanningError(ValueError):
    """The planner cannot produce a valid plan for this input (bad lengths, world size, policy...)."""
