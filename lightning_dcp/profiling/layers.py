"""Where a model keeps its repeated layers, and how the profiler drives them.

The layers are the model contract's (:func:`lightning_dcp.sp.contract.read_model`: ``layers_attr``,
else the module's one :class:`~lightning_dcp.sp.recompute.RecomputeLayers` or
``dcp_repeated_layers()`` list), the same ones the strategy recomputes and shards. Two kinds:

* layers run by a :class:`~lightning_dcp.sp.recompute.RecomputeLayers` (the stack runs them; the
  strategy switches its recomputation per micro-batch);
* layers a model loops over itself (Hugging Face decoders, listed by ``dcp_repeated_layers()``). The
  profiler then captures the *first layer's* call and checkpoints with
  :func:`torch.utils.checkpoint.checkpoint` (``use_reentrant=False``) under the SP context of the
  measurement.

A :class:`LayerStack` hides the difference from the measuring code. A module with neither raises
:class:`NoRepeatedLayersError`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

from torch import nn

from lightning_dcp.sp.contract import REPEATED_LAYERS_METHOD, ModelContract, read_model
from lightning_dcp.sp.recompute import LayerRecompute, RecomputeLayers

__all__ = ["LayerStack", "NoRepeatedLayersError", "find_layer_stack", "layer_stack"]


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
            return RecomputeLayers(nn.ModuleList([layer]), recompute_override=1)
        return functools.partial(LayerRecompute(1, recompute_override=1).call, 0, layer)

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


def layer_stack(contract: ModelContract) -> LayerStack:
    """The profiler's view of ``contract``'s repeated layers. Raises :class:`NoRepeatedLayersError` when
    it has none."""
    if not contract.layers:
        raise NoRepeatedLayersError(
            f"no repeated layers found in {contract.name}: the profiler measures two of the model's repeated "
            "layers; wrap them in lightning_dcp.RecomputeLayers (self.layers = RecomputeLayers(nn.ModuleList([...]))) "
            f"or define {REPEATED_LAYERS_METHOD}() returning them in call order")
    recompute = contract.recompute_layers
    if recompute is not None and tuple(recompute) != contract.layers:
        recompute = None  # a part of a RecomputeLayers' layers: hook and bypass the layers themselves
    return LayerStack(list(contract.layers), recompute if recompute is not None else contract.layers[0],
                      contract.layers_source, recompute=recompute)


def find_layer_stack(module: nn.Module, layers_attr: str | None = None) -> LayerStack:
    """The repeated layers of ``module`` as :func:`~lightning_dcp.sp.contract.read_model` finds them
    (``layers_attr`` names them when it has several stacks). Raises :class:`NoRepeatedLayersError`
    when it has none, :class:`~lightning_dcp.sp.contract.AmbiguousLayersError` when it has several."""
    return layer_stack(read_model(module, layers_attr))
