"""Deprecated alias of :mod:`lightning_dcp.runtime.watchdog` (moved in 0.2.0; removed in 0.3.0)."""

from lightning_dcp._moved import alias

alias(__name__, "lightning_dcp.runtime.watchdog")
