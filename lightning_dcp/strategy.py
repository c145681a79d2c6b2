"""Deprecated: its names moved to :mod:`lightning_dcp.runtime.strategy`, :mod:`lightning_dcp.runtime.settings`, :mod:`lightning_dcp.planning.default_cost`, :mod:`lightning_dcp.runtime.model` in 0.2.0; this module is removed in 0.3.0."""

from lightning_dcp._moved import warn_moved
from lightning_dcp.runtime.strategy import DCPStrategy  # noqa: F401
from lightning_dcp.runtime.settings import DEFAULT_TIMEOUT_S  # noqa: F401
from lightning_dcp.planning.default_cost import DefaultCostModel  # noqa: F401
from lightning_dcp.runtime.model import find_num_heads  # noqa: F401

__all__ = ['DCPStrategy', 'DEFAULT_TIMEOUT_S', 'DefaultCostModel', 'find_num_heads']

warn_moved(__name__, {"lightning_dcp.runtime.strategy": "DCPStrategy", "lightning_dcp.runtime.settings": "DEFAULT_TIMEOUT_S", "lightning_dcp.planning.default_cost": "DefaultCostModel", "lightning_dcp.runtime.model": "find_num_heads"})
