"""Activation recomputation for a stack of repeated layers, switched per micro-batch.

DCP-intra trades recomputation for sequence parallelism: a short micro-batch on a large SP group
fits in memory with fewer checkpointed layers. :class:`RecomputeLayers` wraps the model's repeated
blocks and checkpoints the first ``n`` of them, ``n`` read from the active
:class:`~lightning_dcp.sp.context.SPContext` (``recompute``) at every forward, so the strategy
changes it per micro-batch without touching the model.

Models that already route each layer through a checkpoint function of their own (Hugging Face's
``GradientCheckpointingLayer`` calls ``self._gradient_checkpointing_func(forward, *args)``) keep
their layers where they are: :func:`install_layer_recompute` gives every layer a per-call
function that checkpoints layer ``i`` iff ``i < n``, with ``n`` read at each call, so module
paths and ``state_dict`` keys stay unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_dcp.sp.context import SPContext, active_context, sp_context

__all__ = ["LayerRecompute", "RecomputeLayers", "RepeatedLayers", "find_recompute_layers", "install_layer_recompute"]


def _run_in_context(layer: nn.Module, ctx: SPContext, x: Any, *args: Any, **kwargs: Any) -> Any:
    # Runs in forward and again in the backward-time recomputation; by then the strategy may have
    # switched to another micro-batch's context (or left the step), so re-enter the one captured
    # at forward: collectives inside the layer (the Ulysses all-to-all) must use the same group.
    with sp_context(ctx):
        return layer(x, *args, **kwargs)


class RecomputeLayers(nn.Module):
    """Runs layers in sequence, checkpointing the first ``n``: ``x = layer(x, *args, **kwargs)``.

    ``n`` is :attr:`recompute_override` when set, else ``active_context().recompute``, clamped to
    ``[0, len(self)]``. Checkpointed layers use non-reentrant
    :func:`torch.utils.checkpoint.checkpoint` with the RNG state preserved (dropout recomputes the
    same mask), and their recomputation runs under the :class:`~lightning_dcp.sp.context.SPContext`
    that was active in forward. Nothing is checkpointed while gradients are disabled.

    Args:
        layers: the repeated blocks (an :class:`~torch.nn.ModuleList` is used as is).
        recompute_override: fixed ``n`` that ignores the context (``None``: follow the context);
            also settable later, e.g. by the profiler.

    Each layer is called as ``layer(x, *args, **kwargs)`` and must return the next ``x`` (one
    tensor, or whatever the next layer takes as its first argument).
    """

    def __init__(self, layers: Iterable[nn.Module] | nn.ModuleList, recompute_override: int | None = None) -> None:
        super().__init__()
        self.layers = layers if isinstance(layers, nn.ModuleList) else nn.ModuleList(layers)
        self.recompute_override = recompute_override

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, idx: int) -> nn.Module:
        return self.layers[idx]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.layers)

    def num_recompute(self) -> int:
        """How many layers the next forward checkpoints (override or context, clamped)."""
        n = self.recompute_override if self.recompute_override is not None else active_context().recompute
        return max(0, min(int(n), len(self.layers)))

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply every layer in order; the first :meth:`num_recompute` ones under checkpointing."""
        n = self.num_recompute() if torch.is_grad_enabled() else 0
        ctx = active_context()
        for i, layer in enumerate(self.layers):
            if i < n:
                # kwargs bound by partial so none can clash with checkpoint's own keyword arguments.
                fn = functools.partial(_run_in_context, layer, ctx, **kwargs)
                x = checkpoint(fn, x, *args, use_reentrant=False, preserve_rng_state=True)
            else:
                x = layer(x, *args, **kwargs)
        return x

    @classmethod
    def find(cls, module: nn.Module) -> list["RecomputeLayers"]:
        """Every :class:`RecomputeLayers` inside ``module`` (itself included), in ``modules()`` order."""
        return find_recompute_layers(module)

    def extra_repr(self) -> str:
        return f"recompute_override={self.recompute_override}"


def find_recompute_layers(module: nn.Module) -> list[RecomputeLayers]:
    """Every :class:`RecomputeLayers` inside ``module`` (itself included), in ``modules()`` order."""
    return [m for m in module.modules() if isinstance(m, RecomputeLayers)]


class LayerRecompute:
    """Per-call recompute decision for ``num_layers`` layers that checkpoint through a function.

    The same rule as :class:`RecomputeLayers`: layer ``i`` is checkpointed iff
    ``i < num_recompute()``, where ``num_recompute()`` is :attr:`recompute_override` when set,
    else ``active_context().recompute``, clamped to ``[0, num_layers]``, and nothing is
    checkpointed while gradients are disabled. Checkpointing is non-reentrant with the RNG state
    preserved, and the recomputation re-enters the :class:`~lightning_dcp.sp.context.SPContext`
    active at forward (the Ulysses all-to-all runs again in it).

    Args:
        num_layers: how many layers the decision covers (indices ``0 .. num_layers - 1``).
        recompute_override: fixed ``n`` that ignores the context (``None``: follow it); also
            settable later, e.g. by the profiler.
    """

    def __init__(self, num_layers: int, recompute_override: int | None = None) -> None:
        if num_layers < 0:
            raise ValueError(f"LayerRecompute needs num_layers >= 0, got {num_layers}")
        self.num_layers = int(num_layers)
        self.recompute_override = recompute_override

    def __len__(self) -> int:
        return self.num_layers

    def num_recompute(self) -> int:
        """How many layers the next forward checkpoints (override or context, clamped)."""
        n = self.recompute_override if self.recompute_override is not None else active_context().recompute
        return max(0, min(int(n), self.num_layers))

    def call(self, index: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` for layer ``index``: under checkpointing iff ``index < num_recompute()``."""
        if not torch.is_grad_enabled() or index >= self.num_recompute():
            return fn(*args, **kwargs)
        if not args:
            raise TypeError(f"LayerRecompute.call(layer {index}) needs at least one positional argument (the layer's "
                            "input tensor) to checkpoint; pass the hidden states positionally")
        fn_in_ctx = functools.partial(_run_in_context, fn, active_context(), **kwargs)
        return checkpoint(fn_in_ctx, *args, use_reentrant=False, preserve_rng_state=True)

    def layer_function(self, index: int) -> "_LayerCheckpointFunction":
        """A picklable ``f(fn, *args, **kwargs)`` bound to layer ``index`` (a checkpoint function for that layer)."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer index {index} is outside 0..{self.num_layers - 1}")
        return _LayerCheckpointFunction(self, index)

    def __repr__(self) -> str:
        return f"LayerRecompute(num_layers={self.num_layers}, recompute_override={self.recompute_override})"


class _LayerCheckpointFunction:
    """``f(fn, *args, **kwargs)`` = ``switch.call(index, fn, *args, **kwargs)``; a class, not a closure, so it pickles."""

    def __init__(self, switch: LayerRecompute, index: int) -> None:
        self.switch, self.index = switch, index

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.switch.call(self.index, fn, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<layer {self.index} of {self.switch!r}>"


class RepeatedLayers:
    """A model's ``dcp_repeated_layers()`` for layers it loops over itself: the layers in call order.

    Takes one or more ``ModuleList`` s (HunyuanVideo: its dual-stream, then its single-stream blocks)
    and lists their layers in that order. An object holding the lists rather than a bound method or
    closure, so the model still pickles (spawned processes) and deep-copies. Installed by
    :func:`~lightning_dcp.sp.contract.install_contract` (:func:`lightning_dcp.hf.adapt`,
    :func:`lightning_dcp.diffusers.adapt`); the profiler and the strategy find the layers through it.
    """

    def __init__(self, *lists: nn.ModuleList) -> None:
        if not lists:
            raise ValueError("RepeatedLayers needs at least one ModuleList of layers")
        self.lists = lists

    def __call__(self) -> list[nn.Module]:
        return [layer for layers in self.lists for layer in layers]


def install_layer_recompute(layers: Sequence[nn.Module], *, flag_attr: str = "gradient_checkpointing",
                            func_attr: str = "_gradient_checkpointing_func",
                            recompute_override: int | None = None) -> LayerRecompute:
    """Give each of ``layers`` the per-call recompute decision of one shared :class:`LayerRecompute`.

    For every layer ``i``, sets ``layer.<flag_attr> = True`` and ``layer.<func_attr>`` to a
    function that checkpoints iff ``i < n`` (see :class:`LayerRecompute`). The defaults are Hugging
    Face's ``GradientCheckpointingLayer`` attributes: in training mode it calls
    ``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)`` on every forward.
    No module is wrapped or moved, so ``state_dict`` keys are unchanged.

    Returns:
        The shared :class:`LayerRecompute` (set its ``recompute_override`` to pin ``n``).
    """
    layers = list(layers)
    switch = LayerRecompute(len(layers), recompute_override=recompute_override)
    for i, layer in enumerate(layers):
        setattr(layer, flag_attr, True)
        setattr(layer, func_attr, switch.layer_function(i))
    return switch
