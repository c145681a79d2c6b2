"""Deprecated alias of :mod:`lightning_dcp.profiling` (moved in 0.2; removed in a later release)."""

import warnings

from lightning_dcp.profiling import DCPProfiler, GridPoint, ProfileGrid, build_grid, make_sp_groups, profile_module, select_lengths

warnings.warn("lightning_dcp.profiler is deprecated: import from lightning_dcp.profiling (or lightning_dcp)",
              DeprecationWarning, stacklevel=2)

__all__ = ["DCPProfiler", "GridPoint", "ProfileGrid", "build_grid", "make_sp_groups", "profile_module", "select_lengths"]
