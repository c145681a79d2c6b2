"""Hugging Face diffusers support: train a video DiT (Wan 2.1 / 2.2, LTX-Video, CogVideoX, HunyuanVideo) on any-size
videos under DCP.

* :func:`adapt` prepares a ``WanTransformer3DModel``, ``LTXVideoTransformer3DModel``,
  ``CogVideoXTransformer3DModel`` or ``HunyuanVideoTransformer3DModel`` in place (the family table
  :data:`~lightning_dcp.diffusers.family.FAMILIES` says how for each): a packed, sequence-parallel
  attention (Ulysses self-attention within each sample; for Wan and LTX-Video cross-attention of each
  sample to its own text), the per-block recompute switch, ``dcp_num_heads`` and ``dcp_repeated_layers()``;
  ``state_dict`` keys and the model's own ``forward`` are unchanged.
* :func:`packed_forward` runs it on a packed micro-batch of videos of different frame counts and
  resolutions (or on this rank's SP shard of one).
* :func:`video_sample` (Wan) and :func:`ltx_video_sample` (LTX-Video: unpadded text, rotary scale) turn a
  latent ``[C, F, H, W]`` and its text embeddings into the token-first sample DCP packs;
  :func:`unpatchify` / :func:`unpack_output` go back.
* CogVideoX and HunyuanVideo are *joint-attention* DiTs: each sample's text tokens are rows of its
  attention sequence, sharded with its video rows (:mod:`~lightning_dcp.diffusers.joint`); build
  their samples with :func:`cogvideox_sample` / :func:`hunyuan_sample` (the dataset's ``lengths``
  then count text + video rows) and unpack outputs with :func:`unpack_joint_output`.
* :class:`VideoDiffusionModule` trains any of them with flow matching (``dcp_support = "sp"``) and
  checks the train dataset against the model config at fit start (:mod:`~lightning_dcp.diffusers.checks`).
* :func:`encode_videos` (``lightning-dcp encode``) encodes your own video files and captions with the
  model's VAE and text encoder into resumable shards; :class:`EncodedVideoDataset` trains on them
  (``pip install "lightning-dcp[encode]"`` for PyAV).
* Fine-tuning as teams do it: a LoRA adapter (``VideoDiffusionModule(model, lora=16)``,
  :mod:`~lightning_dcp.diffusers.lora`), the EMA (:class:`lightning_dcp.EMA`), validation videos
  (:class:`~lightning_dcp.diffusers.validation.ValidationVideos`, :func:`write_mp4`), export to a diffusers
  folder (:mod:`~lightning_dcp.diffusers.export`), and all of it from a config (``lightning-dcp train-video``,
  :mod:`~lightning_dcp.diffusers.recipe`).

Which class runs how is one :class:`~lightning_dcp.diffusers.family.VideoFamily` per model in :data:`FAMILIES`;
each family's adapter, attention processor and packed forward is its module in
:mod:`lightning_dcp.diffusers.families` (``wan``, ``ltx``, ``cogvideox``, ``hunyuan``).

Needs ``diffusers>=0.35`` (``pip install "lightning-dcp[diffusers]"``); importing this package
without it raises an ImportError saying so. ``import lightning_dcp`` never imports it, and this package imports
each name above only when it is first used (``from lightning_dcp.diffusers import VideoDiffusionModule`` imports
diffusers' model code then): ``lightning-dcp encode`` probes every clip before diffusers is imported.
"""

from __future__ import annotations

import importlib
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

if find_spec("diffusers") is None:  # found without importing it (importing diffusers takes seconds)
    raise ImportError(
        "lightning_dcp.diffusers needs Hugging Face diffusers>=0.35, which is not installed; install it with "
        '`pip install "lightning-dcp[diffusers]"` (or `pip install "diffusers>=0.35"`).'
    )

#: Each public name -> the submodule that defines it (imported on first use, :func:`__getattr__`).
_WHERE = {
    **dict.fromkeys(("ModelInputs", "VideoShape", "check_video_shapes"), "checks"),
    **dict.fromkeys(("adapt", "is_adapted", "packed_forward"), "dispatch"),
    **dict.fromkeys(("EncodeResult", "EncodeSettings", "encode_videos"), "encode"),
    "EncodedVideoDataset": "encoded",
    "cogvideox_sample": "families.cogvideox",
    "hunyuan_sample": "families.hunyuan",
    **dict.fromkeys(("LTX_PIPELINE_ROPE_SCALE", "ROPE_SCALE", "DCPLTXAttnProcessor", "ltx_video_sample"),
                    "families.ltx"),
    "DCPWanAttnProcessor": "families.wan",
    **dict.fromkeys(("JOINT_TEXT", "unpack_joint_output"), "joint"),
    "VideoDecodeError": "video_io",
    **dict.fromkeys(("PackedSelfAttention", "PackedText"), "attention"),
    **dict.fromkeys(("LOSS_SCALE", "TARGET", "WEIGHTING_SCHEMES", "FlowMatching", "sample_seed"), "flow"),
    **dict.fromkeys(("FAMILIES", "SUPPORTED_MODELS", "VideoFamily", "family_of"), "family"),
    **dict.fromkeys(("HIDDEN_STATES", "TIMESTEP"), "forward"),
    "VideoDiffusionModule": "module",
    "write_mp4": "mp4",
    **dict.fromkeys(("PretrainedError", "load_transformer"), "pretrained"),
    **dict.fromkeys(("add_lora", "lora_config", "lora_state_dict", "save_lora"), "lora"),
    "ValidationVideos": "validation",
    **dict.fromkeys(("ExportResult", "export_checkpoint"), "export"),
    **dict.fromkeys(("CONDITION", "GRID", "IMAGE", "LATENTS", "SAMPLE_INDEX", "TEXT", "VIDEO_POS", "check_latent_shape",
                     "collate_video", "grid_positions", "input_to_output_layout", "patchify", "per_sample_embeds",
                     "unpack_output", "unpatchify", "video_sample"), "samples"),
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """``lightning_dcp.diffusers.NAME``: imported from its submodule on first use, then kept here."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs read
    from lightning_dcp.diffusers.attention import PackedSelfAttention, PackedText
    from lightning_dcp.diffusers.checks import ModelInputs, VideoShape, check_video_shapes
    from lightning_dcp.diffusers.dispatch import adapt, is_adapted, packed_forward
    from lightning_dcp.diffusers.encode import EncodeResult, EncodeSettings, encode_videos
    from lightning_dcp.diffusers.pretrained import PretrainedError, load_transformer
    from lightning_dcp.diffusers.encoded import EncodedVideoDataset
    from lightning_dcp.diffusers.export import ExportResult, export_checkpoint
    from lightning_dcp.diffusers.families.cogvideox import cogvideox_sample
    from lightning_dcp.diffusers.families.hunyuan import hunyuan_sample
    from lightning_dcp.diffusers.families.ltx import (LTX_PIPELINE_ROPE_SCALE, ROPE_SCALE, DCPLTXAttnProcessor,
                                                      ltx_video_sample)
    from lightning_dcp.diffusers.families.wan import DCPWanAttnProcessor
    from lightning_dcp.diffusers.family import FAMILIES, SUPPORTED_MODELS, VideoFamily, family_of
    from lightning_dcp.diffusers.flow import LOSS_SCALE, TARGET, WEIGHTING_SCHEMES, FlowMatching, sample_seed
    from lightning_dcp.diffusers.forward import HIDDEN_STATES, TIMESTEP
    from lightning_dcp.diffusers.joint import JOINT_TEXT, unpack_joint_output
    from lightning_dcp.diffusers.lora import add_lora, lora_config, lora_state_dict, save_lora
    from lightning_dcp.diffusers.module import VideoDiffusionModule
    from lightning_dcp.diffusers.mp4 import write_mp4
    from lightning_dcp.diffusers.samples import (CONDITION, GRID, IMAGE, LATENTS, SAMPLE_INDEX, TEXT, VIDEO_POS,
                                                 check_latent_shape, collate_video, grid_positions,
                                                 input_to_output_layout, patchify, per_sample_embeds, unpack_output,
                                                 unpatchify, video_sample)
    from lightning_dcp.diffusers.validation import ValidationVideos
    from lightning_dcp.diffusers.video_io import VideoDecodeError
