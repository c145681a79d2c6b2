"""Registration of the strategy names ``"dcp"`` and ``"dcp_spawn"`` with Lightning, without
importing Lightning (or torch) when ``lightning_dcp`` is imported.

Lightning resolves ``Trainer(strategy="dcp")`` through ``lightning.pytorch.strategies.StrategyRegistry``
and offers no entry-point group for strategies (only ``lightning.pytorch.callbacks_factory``,
for callbacks), so a plugin must put its names in the registry itself, before the Trainer is
built. :func:`install` does it at the cheapest moment:

* Lightning already imported: the names are registered at once;
* otherwise: a one-shot import hook on ``sys.meta_path`` waits for
  ``lightning.pytorch.strategies`` to be imported and registers right after it has run.

What is registered is a small factory, not the class: ``StrategyRegistry.get("dcp")`` calls it,
and only then is the strategy imported (never while Lightning is still half initialised), through
the package's lazy ``lightning_dcp.DCPStrategy``: this module names no runtime module, so it and the
strategy (whose ``register_strategies`` calls :func:`register`) do not import each other.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from typing import Any

#: The module whose import the hook waits for, and the registry name inside it.
_TARGET = "lightning.pytorch.strategies"
#: Strategy names and the start method each selects.
_NAMES = (("dcp", "popen"), ("dcp_spawn", "spawn"))


def _make_strategy(start_method: str, **kwargs: Any) -> Any:
    import lightning_dcp

    return lightning_dcp.DCPStrategy(start_method=start_method, **kwargs)


def register(registry: Any) -> None:
    """Put ``"dcp"`` (popen launcher, for scripts and CLIs) and ``"dcp_spawn"`` into ``registry``
    (a Lightning ``StrategyRegistry``); names already there are left alone."""
    for name, start_method in _NAMES:
        if name not in registry:
            registry.register(name, functools.partial(_make_strategy, start_method),
                              description=f"Data-Centric Parallel strategy (start_method={start_method!r})")


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when :data:`_TARGET` is being imported it removes itself, lets the
    other finders find the module, and wraps the loader so that :func:`register` runs after the
    module body (which creates ``StrategyRegistry``)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):  # the finders after this one, as the import system would ask them
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module: Any) -> None:
            exec_module(module)
            registry = getattr(module, "StrategyRegistry", None)
            if registry is not None:
                register(registry)

        spec.loader.exec_module = exec_and_register  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Register now if Lightning's strategies are imported, else once they are (idempotent)."""
    module = sys.modules.get(_TARGET)
    if module is not None and hasattr(module, "StrategyRegistry"):
        register(module.StrategyRegistry)
        return
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
