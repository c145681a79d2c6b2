"""Activation recomputation for a stack of repeated layers, switched per micro-batch.

DCP-intra trades recomputation for sequence parallelism: a short micro-batch on a large SP group
fits in memory with fewer checkpointed layers. :class:`RecomputeLayers` wraps the model's repeated
blocks and checkpoints the first ``n`` of them, ``n`` read from the active
:class:`~lightning_dcp.context.SPContext` (``recompute``) at every forward, so the strategy
changes it per micro-batch without touching the model.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_dcp.context import SPContext, active_context, sp_context

__all__ = ["RecomputeLayers", "find_recompute_layers"]


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
    same mask), and their recomputation runs under the :class:`~lightning_dcp.context.SPContext`
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
