"""The public entry points that look a model's family up: :func:`adapt`, :func:`is_adapted`, :func:`packed_forward`.

They stand above the family table (:data:`~lightning_dcp.diffusers.family.FAMILIES`), which stands
above each family's own module (:mod:`lightning_dcp.diffusers.families`: ``wan``, ``ltx``,
``cogvideox``, ``hunyuan``): a family's module never imports the table.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from lightning_dcp.diffusers.family import family_of, find_family

__all__ = ["adapt", "is_adapted", "packed_forward"]


def adapt(model: nn.Module, *, recompute_override: int | None = None) -> nn.Module:
    """Prepare a diffusers video transformer for DCP, in place: the adapter of its family
    (:data:`~lightning_dcp.diffusers.family.FAMILIES`): :func:`~lightning_dcp.diffusers.families.wan.adapt_wan` for
    ``WanTransformer3DModel``, :func:`~lightning_dcp.diffusers.families.ltx.adapt_ltx` for
    ``LTXVideoTransformer3DModel``, and for the joint-attention DiTs (:mod:`lightning_dcp.diffusers.joint`)
    :func:`~lightning_dcp.diffusers.families.cogvideox.adapt_cogvideox` for ``CogVideoXTransformer3DModel`` and
    :func:`~lightning_dcp.diffusers.families.hunyuan.adapt_hunyuan` for ``HunyuanVideoTransformer3DModel``.

    Every family gets the packed, sequence-parallel attention, ``model.dcp_recompute``,
    ``model.dcp_num_heads`` and ``model.dcp_repeated_layers()``, with ``state_dict`` keys and the
    model's own ``forward`` unchanged.

    Raises:
        NotImplementedError: variants not supported yet (Wan FLF2V, CogVideoX-5b-I2V, HunyuanVideo
            token-replace I2V, ...) -- the message says what is missing.
        TypeError: any other model, naming the supported ones.
        ValueError: a model with a custom attention processor.
    """
    return family_of(model).adapt(model, recompute_override=recompute_override)


def is_adapted(model: nn.Module) -> bool:
    """Whether :func:`adapt` has prepared ``model`` (False for a model of no supported family)."""
    family = find_family(model)
    return family is not None and family.is_adapted(model)


def packed_forward(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The prediction ``[local_tokens, features]`` of a model prepared by :func:`~lightning_dcp.diffusers.adapt` on a
    packed micro-batch (whole or this SP rank's shard): the packed forward of its family
    (:data:`~lightning_dcp.diffusers.family.FAMILIES`; :func:`~lightning_dcp.diffusers.families.wan.wan_packed_forward`
    for Wan, :func:`~lightning_dcp.diffusers.families.ltx.ltx_packed_forward` for LTX-Video; the joint-attention
    families' -- :func:`~lightning_dcp.diffusers.families.cogvideox.cogvideox_packed_forward`,
    :func:`~lightning_dcp.diffusers.families.hunyuan.hunyuan_packed_forward` -- return one row per text or video
    row, zeros on text rows)."""
    family = find_family(model)
    if family is None or not family.is_adapted(model):
        raise ValueError(f"packed_forward needs a model prepared by lightning_dcp.diffusers.adapt; {type(model).__name__} "
                         "is not (call adapt(model) once, before training)")
    return family.packed_forward(model, batch)
