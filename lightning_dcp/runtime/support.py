"""What a LightningModule supports under DCP, and the safe mode for modules that declare nothing.

Three levels, each a superset of the one before:

- ``"safe"``: the module is unchanged. Every micro-batch is built by the train DataLoader's own
  ``collate_fn`` from whole samples (no packing across samples, the user's own padding), SP size 1,
  no recomputation; the planner still balances ranks by choosing how many micro-batches each
  rank accumulates and which samples go together (similar lengths pad less).
- ``"packed"``: the model attends within samples of a packed micro-batch (it reads
  ``cu_seqlens`` / ``segment_ids`` / ``position_ids``): samples are packed with
  :func:`~lightning_dcp.sp.packing.pack_samples`; SP size 1.
- ``"sp"``: also sequence parallel: attention through :func:`~lightning_dcp.ulysses_attention`
  (or a Hugging Face model prepared by :func:`lightning_dcp.hf.adapt`), repeated layers in
  :class:`~lightning_dcp.RecomputeLayers` or exposed by ``dcp_repeated_layers()``.

A module declares its level with a ``dcp_support`` attribute. Without one, a module that holds a
:class:`~lightning_dcp.RecomputeLayers` or defines ``dcp_repeated_layers`` is taken as ``"sp"``
(the documented recipe); any other module runs in safe mode, never silently wrong.

Safe mode's planning (padded costs, split micro-batches) is in :mod:`lightning_dcp.planning.padded`.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["SUPPORT_LEVELS", "micro_batch_loss_units", "resolve_support", "safe_mode_message", "support_message",
           "uniform_lengths"]

SUPPORT_LEVELS = ("safe", "packed", "sp")


def _has_layer_stack(module: Any) -> bool:
    from lightning_dcp.sp.recompute import find_recompute_layers

    if find_recompute_layers(module):
        return True
    return any(callable(getattr(m, "dcp_repeated_layers", None)) for m in module.modules())


def resolve_support(module: Any, requested: str | None = None) -> str:
    """The level the strategy runs ``module`` at: ``requested`` (``DCPStrategy(support=...)``),
    else the module's ``dcp_support``, else detected (see the module docstring).

    Raises:
        ValueError: an unknown level.
    """
    level = requested if requested is not None else getattr(module, "dcp_support", None)
    if level is None:
        level = "sp" if _has_layer_stack(module) else "safe"
    if level not in SUPPORT_LEVELS:
        source = "DCPStrategy(support=...)" if requested is not None else f"{type(module).__name__}.dcp_support"
        raise ValueError(f"{source} is {level!r}; use one of {SUPPORT_LEVELS}")
    return level


def safe_mode_message(module: Any) -> str:
    """The one line the strategy prints at fit start for a module in safe mode."""
    name = type(module).__name__
    return (f"DCPStrategy: {name} declares no DCP support (no RecomputeLayers, no dcp_repeated_layers(), no "
            "dcp_support attribute), so it runs in safe mode: SP size 1, every micro-batch built by your DataLoader's "
            "collate_fn from whole samples (no packing across samples), per-rank accumulation balanced by the planner, "
            "no recomputation. To pack samples, make the model attend only within each sample (read cu_seqlens / "
            f"segment_ids / position_ids) and set {name}.dcp_support = 'packed'; for sequence parallelism too, use "
            "lightning_dcp.ulysses_attention and RecomputeLayers (Hugging Face models: lightning_dcp.hf.adapt) and set "
            "dcp_support = 'sp'. See the README, 'Using it'.")


def support_message(module: Any, level: str) -> str | None:
    """The one line the strategy prints at fit start about ``module`` at support ``level``: the module's
    own ``dcp_support_message(level)`` when it has one and it says something (e.g.
    :class:`~lightning_dcp.hf.CausalLMModule`), else the safe-mode explanation in safe mode, else
    ``None`` (nothing to say)."""
    own = getattr(module, "dcp_support_message", None)
    message = own(level) if callable(own) else None
    if message:
        return message
    return safe_mode_message(module) if level == "safe" else None


def micro_batch_loss_units(module: Any, batch: Any, num_samples: int, reduction: str) -> int:
    """How many units a safe-mode micro-batch's mean loss averages over (counted on the host).

    ``module.dcp_loss_units(batch)`` when defined; else, in token mode, the ``labels`` entries
    other than -100 when the batch is a mapping with an integer ``labels`` tensor; else the
    number of samples (a per-sample mean, e.g. MSE over a ``TensorDataset`` batch).
    """
    hook = getattr(module, "dcp_loss_units", None)
    if callable(hook):
        return int(hook(batch))
    if reduction == "token" and isinstance(batch, Mapping):
        labels = batch.get("labels")
        if labels is not None and hasattr(labels, "is_floating_point") and not labels.is_floating_point():
            return int((labels != -100).sum())
    return int(num_samples)


def uniform_lengths(dataset: Any) -> list[int]:
    """Safe mode's lengths when the dataset gives none: every sample as long as the first
    tensor's second dimension of a ``TensorDataset`` (1 when it has none), else 1: ranks are then
    balanced by sample count."""
    tensors = getattr(dataset, "tensors", None)
    size = len(dataset)
    if tensors and getattr(tensors[0], "dim", lambda: 0)() >= 2:
        return [int(tensors[0].shape[1])] * size
    return [1] * size
