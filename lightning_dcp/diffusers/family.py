"""The diffusers video transformers :mod:`lightning_dcp.diffusers` supports: one :class:`VideoFamily` each.

:func:`~lightning_dcp.diffusers.adapt`, :func:`~lightning_dcp.diffusers.packed_forward` and
:class:`~lightning_dcp.diffusers.VideoDiffusionModule` look the model's class name up in
:data:`FAMILIES` (:func:`family_of`); a new family is one entry here and its own module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lightning_dcp.diffusers.adapt import adapt_wan, is_adapted_wan
from lightning_dcp.diffusers import cogvideox, hunyuan
from lightning_dcp.diffusers.forward import wan_packed_forward
from lightning_dcp.diffusers.samples import video_sample

__all__ = ["FAMILIES", "VideoFamily", "family_of", "supported_names"]


@dataclass(frozen=True)
class VideoFamily:
    """How DCP runs one diffusers video transformer class."""

    class_name: str  #: the diffusers class, e.g. ``"WanTransformer3DModel"``
    label: str  #: readable name for messages, e.g. ``"Wan 2.1 / 2.2"``
    patch_size: Callable[[Any], tuple[int, int, int]]  #: ``(pt, ph, pw)`` from the model's config
    adapt: Callable[[nn.Module, "int | None"], nn.Module]  #: prepares a model in place
    is_adapted: Callable[[nn.Module], bool]
    packed_forward: Callable[[nn.Module, Any], torch.Tensor]  #: ``[local rows, out features]``
    #: per-token order of the output features, the flow target's: ``"output"`` (``pt x ph x pw x C``)
    #: or ``"input"`` (``C x pt x ph x pw``, as :func:`~lightning_dcp.diffusers.samples.patchify` makes them)
    output_layout: str
    #: builds one training sample: ``sample(latents, encoder_hidden_states, patch_size, index=..., ...)``
    sample: Callable[..., dict]
    #: whether text tokens are rows of the sequence (joint attention): the sample's length counts them
    joint: bool


def _wan_patch(config: Any) -> tuple[int, int, int]:
    return tuple(int(v) for v in config.patch_size)  # type: ignore[return-value]


#: Supported families by diffusers class name (a plain dict: a new family adds its entry).
FAMILIES: dict[str, VideoFamily] = {f.class_name: f for f in (
    VideoFamily("WanTransformer3DModel", "Wan 2.1 / 2.2", _wan_patch, adapt_wan, is_adapted_wan,
                wan_packed_forward, "output", video_sample, joint=False),
    VideoFamily("CogVideoXTransformer3DModel", "CogVideoX 1.0 / 1.5", cogvideox.cogvideox_patch_size,
                cogvideox.adapt_cogvideox, cogvideox.is_adapted_cogvideox, cogvideox.cogvideox_packed_forward,
                "input", cogvideox.cogvideox_sample, joint=True),
    VideoFamily("HunyuanVideoTransformer3DModel", "HunyuanVideo", hunyuan.hunyuan_patch_size, hunyuan.adapt_hunyuan,
                hunyuan.is_adapted_hunyuan, hunyuan.hunyuan_packed_forward, "input", hunyuan.hunyuan_sample,
                joint=True),
)}


def supported_names() -> str:
    """``"WanTransformer3DModel (Wan 2.1 / 2.2), ..."`` for messages."""
    return ", ".join(f"{f.class_name} ({f.label})" for f in FAMILIES.values())


def family_of(model: nn.Module) -> VideoFamily:
    """The family of ``model`` (its class or a base class by name in :data:`FAMILIES`).

    Raises:
        TypeError: any other model, naming the supported classes.
    """
    for cls in type(model).__mro__:
        family = FAMILIES.get(cls.__name__)
        if family is not None:
            return family
    raise TypeError(f"lightning_dcp.diffusers supports {supported_names()}; got {type(model).__name__}. For your own "
                    "nn.Module use lightning_dcp.ulysses_attention and RecomputeLayers.")
