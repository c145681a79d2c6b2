"""Old module paths kept as deprecated aliases of their new homes.

A shim module at an old path calls :func:`alias`, which puts the *new* module object under the old
name in ``sys.modules``: ``import lightning_dcp.context`` then returns ``lightning_dcp.sp.context``
itself (the same globals, classes and state, not a copy), with one ``DeprecationWarning`` that
names the new path and the release that removes the alias.
"""

from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["REMOVAL_VERSION", "alias"]

#: The release in which the aliases created by :func:`alias` are removed.
REMOVAL_VERSION = "0.3.0"


def alias(old: str, new: str) -> None:
    """Make module ``old`` an alias of module ``new`` (called from the shim at ``old``)."""
    module = importlib.import_module(new)
    warnings.warn(f"{old} is deprecated: import from {new} (moved in 0.2.0; the alias is removed in {REMOVAL_VERSION})",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = module
