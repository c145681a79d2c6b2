"""Deprecated: its names moved to :mod:`lightning_dcp.runtime.oom`, :mod:`lightning_dcp.planning.lowered` in 0.2.0; this module is removed in 0.3.0."""

from lightning_dcp._moved import warn_moved
from lightning_dcp.runtime.oom import CHECKPOINT_KEY, OOM_ERRORS, StepOutOfMemoryError, sp_oom_message  # noqa: F401
from lightning_dcp.planning.lowered import LoweredMemory, lowered_limit, MARGIN  # noqa: F401

__all__ = ['CHECKPOINT_KEY', 'LoweredMemory', 'MARGIN', 'OOM_ERRORS', 'StepOutOfMemoryError', 'lowered_limit', 'sp_oom_message']

warn_moved(__name__, {"lightning_dcp.runtime.oom": "CHECKPOINT_KEY, OOM_ERRORS, StepOutOfMemoryError, sp_oom_message", "lightning_dcp.planning.lowered": "LoweredMemory, lowered_limit, MARGIN"})
