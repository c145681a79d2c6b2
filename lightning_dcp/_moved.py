"""Old module paths kept as deprecated aliases of their new homes.

A shim module at an old path calls :func:`alias`, which puts the *new* module object under the old
name in ``sys.modules``: ``import lightning_dcp.context`` then returns ``lightning_dcp.sp.context``
itself (the same globals, classes and state, not a copy), with one ``DeprecationWarning`` that
names the new path and the release that removes the alias. A module whose names went to several new
homes re-exports them instead and calls :func:`warn_moved`.
"""

from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["REMOVAL_VERSION", "alias", "warn_moved"]

#: The release in which the aliases created by :func:`alias` are removed.
REMOVAL_VERSION = "0.3.0"


def warn_moved(old: str, new: str) -> None:
    """The one ``DeprecationWarning`` of a shim at ``old`` whose names now live in ``new``."""
    warnings.warn(f"{old} is deprecated: import from {new} (moved in 0.2.0; the alias is removed in {REMOVAL_VERSION})",
                  DeprecationWarning, stacklevel=3)


def alias(old: str, new: str) -> None:
    """Make module ``old`` an alias of module ``new`` (called from the shim at ``old``)."""
    module = importlib.import_module(new)
    warn_moved(old, new)
    sys.modules[old] = module
