"""Where a model keeps its repeated layers, and how the profiler drives them.

Two ways for a model to show its layer stack to the profiler:

* a :class:`~lightning_dcp.sp.recompute.RecomputeLayers` anywhere in the module (the stack runs the
  layers; the strategy switches its recomputation per micro-batch);
* a method ``dcp_repeated_layers()`` on the LightningModule or any submodule, returning the
  repeated layers in call order, for models that loop over their layers themselves (Hugging Face
  decoders). The profiler then captures the *first layer's* call and checkpoints with
  :func:`torch.utils.checkpoint.checkpoint` (``use_reentrant=False``) under the SP context of the
  measurement.

A :class:`LayerStack` hides the difference from the measuring code. A module with neither raises
:class:`NoRepeatedLayersError`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator

from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_dcp.sp.context import active_context, sp_context

log = logging.getLogger(__name__)

__all__ = ["LayerStack", "NoRepeatedLayersError", "find_layer_stack"]

#: Name of the method a module may define to expose its repeated layers.
REPEATED_LAYERS_METHOD = "dcp_repeated_layers"


class NoRepeatedLayersError(ValueError):
    """The module has neither a RecomputeLayers nor a ``dcp_repeated_layers()`` method."""


class LayerStack:
    """The repeated layers of a model, as the profiler sees them.

    Attributes:
        layers: the layers in call order (at least one).
        hook_target: the module whose forward pre-hook sees the first layer's ``(args, kwargs)``:
            the RecomputeLayers itself, or ``layers[0]``.
        name: a readable name for logs and errors.
        recompute: the RecomputeLayers when there is one, else ``None``.
    """

    def __init__(self, layers: list[nn.Module], hook_target: nn.Module, name: str, recompute: nn.Module | None = None):
        if not layers:
            raise NoRepeatedLayersError(f"{name} holds no layers; the profiler needs at least one repeated layer")
        self.layers = list(layers)
        self.hook_target = hook_target
        self.name = name
        self.recompute = recompute
        self.returns_tuple = False  # set by the measurement: what a bypassed layer must return

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def warmup_layer(self) -> nn.Module:
        return self.layers[0]

    @property
    def measured_layer(self) -> nn.Module:
        """``layers[1]`` (``layers[0]`` when the stack has one layer)."""
        return self.layers[1] if len(self.layers) > 1 else self.layers[0]

    def parameters(self) -> Iterator[nn.Parameter]:
        seen: set[int] = set()
        for layer in self.layers:
            for p in layer.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def checkpointed(self, layer: nn.Module) -> Callable[..., Any]:
        """``fn(x, *args, **kwargs)`` running ``layer`` the way a recomputed layer runs in training."""
        if self.recompute is not None:
            from lightning_dcp.sp.recompute import RecomputeLayers

            return RecomputeLayers(nn.ModuleList([layer]), recompute_override=1)

        def run(x: Any, *args: Any, **kwargs: Any) -> Any:
            ctx = active_context()
            fn = functools.partial(_run_in_context, layer, ctx, **kwargs)
            return checkpoint(fn, x, *args, use_reentrant=False, preserve_rng_state=True)

        return run

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Every layer (or the RecomputeLayers) returns its input while the context is open."""
        targets = [self.recompute] if self.recompute is not None else self.layers
        wrap = self.returns_tuple and self.recompute is None
        for m in targets:
            m.forward = (lambda x, *a, **k: (x,)) if wrap else (lambda x, *a, **k: x)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for m in targets:
                m.__dict__.pop("forward", None)


def _run_in_context(layer: nn.Module, ctx: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    # The recomputation in backward must see the SP context of the forward (same all-to-all group).
    with sp_context(ctx):
        return layer(x, *args, **kwargs)


def _module_name(module: nn.Module, target: nn.Module) -> str:
    for name, m in module.named_modules():
        if m is target:
            return f"{type(module).__name__}.{name}" if name else type(module).__name__
    return type(target).__name__


def _from_recompute_layers(module: nn.Module, layers_attr: str | None) -> LayerStack | None:
    from lightning_dcp.sp.recompute import RecomputeLayers, find_recompute_layers

    if layers_attr is not None:
        try:
            target = module.get_submodule(layers_attr)
        except AttributeError:
            raise ValueError(f"layers_attr={layers_attr!r}: {type(module).__name__} has no submodule of that name") from None
        if not isinstance(target, RecomputeLayers):
            raise TypeError(f"layers_attr={layers_attr!r} is a {type(target).__name__}; it must name the model's "
                            "RecomputeLayers (wrap the repeated layers' ModuleList in lightning_dcp.RecomputeLayers)")
        return LayerStack(list(target), target, _module_name(module, target), recompute=target)
    found = find_recompute_layers(module)
    if not found:
        return None
    target = found[0]
    if len(found) > 1:
        names = {id(m): n for n, m in module.named_modules()}
        target = max(found, key=lambda m: sum(p.numel() for p in m.parameters()))
        log.warning("%s has %d RecomputeLayers (%s); profiling the largest, %r. Pass layers_attr=... to choose.",
                    type(module).__name__, len(found), [names.get(id(m)) for m in found], names.get(id(target)))
    return LayerStack(list(target), target, _module_name(module, target), recompute=target)


def _from_method(module: nn.Module) -> LayerStack | None:
    for holder in module.modules():
        method = getattr(holder, REPEATED_LAYERS_METHOD, None)
        if not callable(method):
            continue
        layers = list(method())
        owner = _module_name(module, holder)
        bad = [type(m).__name__ for m in layers if not isinstance(m, nn.Module)]
        if bad:
            raise TypeError(f"{owner}.{REPEATED_LAYERS_METHOD}() returned non-modules {bad}; return the list of "
                            "repeated layers (nn.Module) in call order")
        if not layers:
            raise NoRepeatedLayersError(f"{owner}.{REPEATED_LAYERS_METHOD}() returned no layers; return the repeated "
                                        "layers in call order")
        return LayerStack(layers, layers[0], f"{owner}.{REPEATED_LAYERS_METHOD}()")
    return None


def find_layer_stack(module: nn.Module, layers_attr: str | None = None) -> LayerStack:
    """The repeated layers of ``module``: its RecomputeLayers (``layers_attr`` names one when it has
    several), else the list a ``dcp_repeated_layers()`` method returns (on the module or any
    submodule, first in ``modules()`` order). Raises :class:`NoRepeatedLayersError` when neither."""
    stack = _from_recompute_layers(module, layers_attr)
    if stack is None:
        stack = _from_method(module)
    if stack is None:
        raise NoRepeatedLayersError(
            f"no repeated layers found in {type(module).__name__}: the profiler measures two of the model's repeated "
            "layers; wrap them in lightning_dcp.RecomputeLayers (self.layers = RecomputeLayers(nn.ModuleList([...]))) "
            f"or define {REPEATED_LAYERS_METHOD}() returning them in call order"
        )
    return stack
