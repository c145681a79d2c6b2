"""The diffusers video transformer families :mod:`lightning_dcp.diffusers` supports: :data:`FAMILIES`.

One :class:`VideoFamily` per diffusers model class says how that family is adapted, run packed,
patched, sampled and trained: :func:`~lightning_dcp.diffusers.adapt`,
:func:`~lightning_dcp.diffusers.packed_forward` and
:class:`~lightning_dcp.diffusers.VideoDiffusionModule` look the model up here
(:func:`family_of`) and do the rest the same way for every family. Wan and LTX-Video attend to
their text by cross-attention; CogVideoX and HunyuanVideo are joint-attention DiTs, whose text
tokens are rows of the attention sequence (:mod:`lightning_dcp.diffusers.joint`). A new family
is one entry here and its own module in :mod:`lightning_dcp.diffusers.families`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from lightning_dcp.diffusers.families import cogvideox, hunyuan, ltx, wan
from lightning_dcp.diffusers.samples import video_sample

__all__ = ["FAMILIES", "OUTPUT_LAYOUTS", "SUPPORTED_MODELS", "VideoFamily", "family_of", "find_family"]

#: Per-token feature orders of a model's prediction: ``"output"`` (``pt x ph x pw x C``, Wan's
#: ``proj_out``) or ``"input"`` (``C x pt x ph x pw``, the order :func:`~lightning_dcp.diffusers.patchify` makes).
OUTPUT_LAYOUTS = ("output", "input")


@dataclass(frozen=True)
class VideoFamily:
    """How one diffusers video transformer class is trained under DCP.

    Args:
        class_name: the diffusers model class (subclasses match too).
        label: the model versions it covers, for messages (``"Wan 2.1 / 2.2"``).
        patch_size: ``config -> (pt, ph, pw)``, the patch of the family's samples.
        text_dim: ``config -> int``, the width of the text embeddings the model takes (checked at fit start,
            :mod:`~lightning_dcp.diffusers.checks`).
        adapt: ``adapt(model, *, recompute_override)``: prepares the model in place and returns it.
        is_adapted: whether ``adapt`` has prepared a model.
        packed_forward: ``(model, batch) -> [local rows, features]``: the prediction of a packed
            (possibly SP-sharded) micro-batch.
        output_layout: the prediction's per-token feature order, one of :data:`OUTPUT_LAYOUTS`; the
            flow-matching target is put in it and :func:`~lightning_dcp.diffusers.unpack_output` reads it.
        blocks: ``model -> [blocks]``: the repeated blocks, in call order (HunyuanVideo: dual-stream, then
            single-stream).
        sample: builds one training sample, ``sample(latents, encoder_hidden_states, patch_size, index=..., ...)``:
            :func:`~lightning_dcp.diffusers.video_sample`, :func:`~lightning_dcp.diffusers.ltx_video_sample`,
            :func:`~lightning_dcp.diffusers.cogvideox_sample` or :func:`~lightning_dcp.diffusers.hunyuan_sample`.
        joint: whether text tokens are rows of the attention sequence (joint attention): a sample's length
            then counts its text rows, which carry no loss, and outputs are unpacked with
            :func:`~lightning_dcp.diffusers.unpack_joint_output`.
        pipeline: the diffusers pipeline class that runs the model for text-to-video (``"WanPipeline"``): its
            ``save_lora_weights`` / ``load_lora_weights`` read and write the family's LoRA files, and
            validation videos are generated with it.
        lora_targets: the modules a LoRA adapter targets by default (:func:`~lightning_dcp.diffusers.lora.lora_config`).
    """

    class_name: str
    label: str
    patch_size: Callable[[Any], tuple[int, int, int]]
    text_dim: Callable[[Any], int]
    adapt: Callable[..., nn.Module]
    is_adapted: Callable[[nn.Module], bool]
    packed_forward: Callable[[nn.Module, Mapping[str, Any]], torch.Tensor]
    output_layout: str
    blocks: Callable[[nn.Module], Sequence[nn.Module]]
    sample: Callable[..., dict]
    joint: bool = False
    pipeline: str = ""
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")

    def __post_init__(self) -> None:
        if self.output_layout not in OUTPUT_LAYOUTS:
            raise ValueError(f"VideoFamily {self.class_name}: output_layout must be one of {OUTPUT_LAYOUTS}, got "
                             f"{self.output_layout!r}")


def _config_int(key: str) -> Callable[[Any], int]:
    return lambda config: int(getattr(config, key))


#: The supported families, keyed by diffusers class name.
FAMILIES: dict[str, VideoFamily] = {
    "WanTransformer3DModel": VideoFamily(
        class_name="WanTransformer3DModel", label="Wan 2.1 / 2.2", patch_size=wan.wan_patch_size,
        text_dim=_config_int("text_dim"), adapt=wan.adapt_wan, is_adapted=wan.is_wan_adapted,
        packed_forward=wan.wan_packed_forward, output_layout="output", blocks=lambda model: model.blocks,
        sample=video_sample, pipeline="WanPipeline"),
    "LTXVideoTransformer3DModel": VideoFamily(
        class_name="LTXVideoTransformer3DModel", label="LTX-Video", patch_size=ltx.ltx_patch_size,
        text_dim=_config_int("caption_channels"), adapt=ltx.adapt_ltx, is_adapted=ltx.is_ltx_adapted,
        packed_forward=ltx.ltx_packed_forward, output_layout="input", blocks=lambda model: model.transformer_blocks,
        sample=ltx.ltx_video_sample, pipeline="LTXPipeline"),
    "CogVideoXTransformer3DModel": VideoFamily(
        class_name="CogVideoXTransformer3DModel", label="CogVideoX 1.0 / 1.5", patch_size=cogvideox.cogvideox_patch_size,
        text_dim=_config_int("text_embed_dim"), adapt=cogvideox.adapt_cogvideox,
        is_adapted=cogvideox.is_cogvideox_adapted, packed_forward=cogvideox.cogvideox_packed_forward,
        output_layout="input", blocks=lambda model: model.transformer_blocks, sample=cogvideox.cogvideox_sample,
        joint=True, pipeline="CogVideoXPipeline"),
    "HunyuanVideoTransformer3DModel": VideoFamily(
        class_name="HunyuanVideoTransformer3DModel", label="HunyuanVideo", patch_size=hunyuan.hunyuan_patch_size,
        text_dim=_config_int("text_embed_dim"), adapt=hunyuan.adapt_hunyuan, is_adapted=hunyuan.is_hunyuan_adapted,
        packed_forward=hunyuan.hunyuan_packed_forward, output_layout="input",
        blocks=lambda model: [*model.transformer_blocks, *model.single_transformer_blocks],
        sample=hunyuan.hunyuan_sample, joint=True, pipeline="HunyuanVideoPipeline"),
}

#: Model classes :func:`~lightning_dcp.diffusers.adapt` supports.
SUPPORTED_MODELS = tuple(FAMILIES)


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
    """The family of ``model``.

    Raises:
        TypeError: any other model, naming every supported class.
    """
    family = find_family(model)
    if family is not None:
        return family
    raise TypeError(f"lightning_dcp.diffusers.adapt supports {_supported()}, got {type(model).__name__}; for your own "
                    "nn.Module use lightning_dcp.ulysses_attention and RecomputeLayers.")
