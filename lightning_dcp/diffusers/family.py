"""The diffusers video transformer families :mod:`lightning_dcp.diffusers` supports: :data:`FAMILIES`.

One :class:`VideoFamily` per diffusers model class says how that family is adapted, run packed,
patched and trained: :func:`~lightning_dcp.diffusers.adapt`,
:func:`~lightning_dcp.diffusers.packed_forward` and
:class:`~lightning_dcp.diffusers.VideoDiffusionModule` look the model up here
(:func:`family_of`) and do the rest the same way for every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from lightning_dcp.diffusers.adapt import adapt_wan, is_wan_adapted
from lightning_dcp.diffusers.forward import wan_packed_forward
from lightning_dcp.diffusers.ltx import adapt_ltx, is_ltx_adapted, ltx_patch_size
from lightning_dcp.diffusers.ltx_forward import ltx_packed_forward

__all__ = ["FAMILIES", "NOT_YET", "OUTPUT_LAYOUTS", "SUPPORTED_MODELS", "VideoFamily", "family_of", "find_family"]

#: Per-token feature orders of a model's prediction: ``"output"`` (``pt x ph x pw x C``, Wan's
#: ``proj_out``) or ``"input"`` (``C x pt x ph x pw``, the order :func:`~lightning_dcp.diffusers.patchify` makes).
OUTPUT_LAYOUTS = ("output", "input")


@dataclass(frozen=True)
class VideoFamily:
    """How one diffusers video transformer class is trained under DCP.

    Args:
        class_name: the diffusers model class (subclasses match too).
        label: the model versions it covers, for messages (``"Wan 2.1 / 2.2"``).
        patch_size: ``config -> (pt, ph, pw)``, the patch of :func:`~lightning_dcp.diffusers.video_sample`.
        adapt: ``adapt(model, *, recompute_override)``: prepares the model in place and returns it.
        is_adapted: whether ``adapt`` has prepared a model.
        packed_forward: ``(model, batch) -> [local_tokens, features]``: the prediction of a packed
            (possibly SP-sharded) micro-batch.
        output_layout: the prediction's per-token feature order, one of :data:`OUTPUT_LAYOUTS`; the
            flow-matching target is put in it and :func:`~lightning_dcp.diffusers.unpack_output` reads it.
        blocks: ``model -> nn.ModuleList``: the repeated blocks, in call order.
    """

    class_name: str
    label: str
    patch_size: Callable[[Any], tuple[int, int, int]]
    adapt: Callable[..., nn.Module]
    is_adapted: Callable[[nn.Module], bool]
    packed_forward: Callable[[nn.Module, Mapping[str, Any]], torch.Tensor]
    output_layout: str
    blocks: Callable[[nn.Module], nn.ModuleList]

    def __post_init__(self) -> None:
        if self.output_layout not in OUTPUT_LAYOUTS:
            raise ValueError(f"VideoFamily {self.class_name}: output_layout must be one of {OUTPUT_LAYOUTS}, got "
                             f"{self.output_layout!r}")


def _wan_patch(config: Any) -> tuple[int, int, int]:
    pt, ph, pw = (int(v) for v in config.patch_size)
    return pt, ph, pw


#: The supported families, keyed by diffusers class name.
FAMILIES: dict[str, VideoFamily] = {
    "WanTransformer3DModel": VideoFamily(
        class_name="WanTransformer3DModel", label="Wan 2.1 / 2.2", patch_size=_wan_patch, adapt=adapt_wan,
        is_adapted=is_wan_adapted, packed_forward=wan_packed_forward, output_layout="output",
        blocks=lambda model: model.blocks),
    "LTXVideoTransformer3DModel": VideoFamily(
        class_name="LTXVideoTransformer3DModel", label="LTX-Video", patch_size=ltx_patch_size, adapt=adapt_ltx,
        is_adapted=is_ltx_adapted, packed_forward=ltx_packed_forward, output_layout="input",
        blocks=lambda model: model.transformer_blocks),
}

#: Model classes :func:`~lightning_dcp.diffusers.adapt` supports.
SUPPORTED_MODELS = tuple(FAMILIES)

#: Diffusers video transformers that are not supported yet, and what is missing for each.
NOT_YET = {
    "CogVideoXTransformer3DModel": (
        "its blocks attend jointly over [text tokens; video tokens] of each sample (text prepended per sample, "
        "learned or 3-D rotary positions computed for one grid per batch), so packing needs a joint-attention "
        "processor whose segments interleave each sample's text with its video tokens, and SP sharding that keeps "
        "the text per sample"),
    "HunyuanVideoTransformer3DModel": (
        "its dual-stream blocks process text and video separately and its single-stream blocks attend over "
        "[video; text] with a per-batch attention mask and token refiner, so packing needs per-sample joint "
        "segments in both block types, per-sample text masks and per-sample guidance/timestep modulation"),
}


def _supported() -> str:
    return ", ".join(f"{name} ({family.label})" for name, family in FAMILIES.items())


def find_family(model: nn.Module) -> VideoFamily | None:
    """The family of ``model`` (its class or a base class is in :data:`FAMILIES`), or None."""
    for cls in type(model).__mro__:
        family = FAMILIES.get(cls.__name__)
        if family is not None:
            return family
    return None


def family_of(model: nn.Module) -> VideoFamily:
    """The family of ``model``; raises naming what is supported (and, for a known family, what is missing)."""
    family = find_family(model)
    if family is not None:
        return family
    name = type(model).__name__
    if name in NOT_YET:
        raise NotImplementedError(f"lightning_dcp.diffusers.adapt does not support {name} yet: {NOT_YET[name]}. "
                                  f"Supported: {_supported()}.")
    raise TypeError(f"lightning_dcp.diffusers.adapt supports {_supported()}, got {name}; for your own nn.Module use "
                    "lightning_dcp.ulysses_attention and RecomputeLayers.")
