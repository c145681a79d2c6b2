"""Deprecated: its names moved to :mod:`lightning_dcp.runtime.support`, :mod:`lightning_dcp.planning.padded` in 0.2.0; this module is removed in 0.3.0."""

from lightning_dcp._moved import warn_moved
from lightning_dcp.runtime.support import SUPPORT_LEVELS, micro_batch_loss_units, resolve_support, safe_mode_message, uniform_lengths  # noqa: F401
from lightning_dcp.planning.padded import PaddedCostModel, PaddedPlanner  # noqa: F401

__all__ = ['PaddedCostModel', 'PaddedPlanner', 'SUPPORT_LEVELS', 'micro_batch_loss_units', 'resolve_support', 'safe_mode_message', 'uniform_lengths']

warn_moved(__name__, {"lightning_dcp.runtime.support": "SUPPORT_LEVELS, micro_batch_loss_units, resolve_support, safe_mode_message, uniform_lengths", "lightning_dcp.planning.padded": "PaddedCostModel, PaddedPlanner"})
