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
(the documented recipe); any other module runs in safe mode, never silently wrong. The level is
resolved once, with the rest of the module's contract, by :func:`lightning_dcp.sp.contract.read_model`;
a safe-mode micro-batch's loss units are counted by :func:`lightning_dcp.sp.contract.local_batch`.

Safe mode's planning (padded costs, split micro-batches) is in :mod:`lightning_dcp.planning.padded`.
"""

from __future__ import annotations

from typing import Any

from lightning_dcp.sp.contract import ModelContract

__all__ = ["safe_mode_message", "support_message", "uniform_lengths"]


def safe_mode_message(name: str) -> str:
    """The one line the strategy prints at fit start for a module (class ``name``) in safe mode."""
    return (f"DCPStrategy: {name} declares no DCP support (no RecomputeLayers, no dcp_repeated_layers(), no "
            "dcp_support attribute), so it runs in safe mode: SP size 1, every micro-batch built by your DataLoader's "
            "collate_fn from whole samples (no packing across samples), per-rank accumulation balanced by the planner, "
            "no recomputation. To pack samples, make the model attend only within each sample (read cu_seqlens / "
            f"segment_ids / position_ids) and set {name}.dcp_support = 'packed'; for sequence parallelism too, use "
            "lightning_dcp.ulysses_attention and RecomputeLayers (Hugging Face models: lightning_dcp.hf.adapt) and set "
            "dcp_support = 'sp'. See docs/strategy.md, 'What each level needs'.")


def support_message(contract: ModelContract) -> str | None:
    """The one line the strategy prints at fit start about the module of ``contract`` at its support level:
    the module's own ``dcp_support_message(level)`` when it has one and it says something (e.g.
    :class:`~lightning_dcp.hf.CausalLMModule`), else the safe-mode explanation in safe mode, else
    ``None`` (nothing to say)."""
    own = contract.support_message
    message = own(contract.support) if own is not None else None
    if message:
        return message
    return safe_mode_message(contract.name) if contract.support == "safe" else None


def uniform_lengths(dataset: Any) -> list[int]:
    """Safe mode's lengths when the dataset gives none: every sample as long as the first
    tensor's second dimension of a ``TensorDataset`` (1 when it has none), else 1: ranks are then
    balanced by sample count."""
    tensors = getattr(dataset, "tensors", None)
    size = len(dataset)
    if tensors and getattr(tensors[0], "dim", lambda: 0)() >= 2:
        return [int(tensors[0].shape[1])] * size
    return [1] * size
