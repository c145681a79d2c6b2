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
from typing import Mapping

__all__ = ["REMOVAL_VERSION", "alias", "warn_moved"]

#: The release in which the aliases created by :func:`alias` are removed.
REMOVAL_VERSION = "0.3.0"


def warn_moved(old: str, homes: str | Mapping[str, str], stacklevel: int = 3) -> None:
    """The one ``DeprecationWarning`` of the shim at ``old``, pointing at the line that imported it.

    ``homes``: the new module of all its names, or ``{new module: "Name, Name"}`` when they went to several.
    ``stacklevel``: 3 when the shim calls this directly (this function, the shim, the importer).
    """
    where = homes if isinstance(homes, str) else "; ".join(f"{names} from {module}" for module, names in homes.items())
    warnings.warn(f"{old} is deprecated: import {'from ' if isinstance(homes, str) else ''}{where} (moved in 0.2.0; "
                  f"{old} is removed in {REMOVAL_VERSION})", DeprecationWarning, stacklevel=stacklevel)


def alias(old: str, new: str) -> None:
    """Make module ``old`` an alias of module ``new`` (called from the shim at ``old``)."""
    module = importlib.import_module(new)
    warn_moved(old, new, stacklevel=4)  # this function, warn_moved's caller and the shim come first
    sys.modules[old] = module
