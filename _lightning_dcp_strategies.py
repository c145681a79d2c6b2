"""Run when the interpreter starts, by ``lightning_dcp_strategies.pth`` (installed with the wheel).

It makes ``Trainer(strategy="dcp")`` work in a script that never imports lightning_dcp. Only
``lightning_dcp/_registry.py`` is loaded (a one-shot import hook; no torch, no Lightning), from the
installed files and without importing the ``lightning_dcp`` package itself, so a source checkout on
``sys.path`` still provides the package that a script or a test run imports.
"""

from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["install"]

_NAME = "lightning_dcp._registry"


def install() -> None:
    """Load the registry module under its own name and install its hook (idempotent; never raises)."""
    if _NAME in sys.modules:
        return
    try:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_dcp", "_registry.py")
        spec = importlib.util.spec_from_file_location(_NAME, path)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module  # ``lightning_dcp/__init__`` imports this same module later
        spec.loader.exec_module(module)
        module.install()
    except Exception:  # noqa: BLE001 - a start-up hook must never break the interpreter
        sys.modules.pop(_NAME, None)
