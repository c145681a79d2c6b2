"""Reference models for DCP: Transformer-1D (decoder LM) and Transformer-2D (video DiT-like),
and :class:`DCPTransformerModule`, a LightningModule that trains either.

Built from :class:`~lightning_dcp.planning.models.ModelSpec` (``get_model("tiny-1d")`` etc.), on
the model-side helpers :func:`~lightning_dcp.sp.ulysses.ulysses_attention`,
:func:`~lightning_dcp.sp.ulysses.seq_all_to_all`, :func:`~lightning_dcp.sp.attention.varlen_attention`
and :class:`~lightning_dcp.sp.recompute.RecomputeLayers`.

``DCPTransformerModule`` is imported on first use, so the plain models load without Lightning
(cheaper start-up for spawned workers and the profiler).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from torch import nn

from lightning_dcp.models.transformer1d import Transformer1D
from lightning_dcp.models.transformer2d import FRAME_LAYOUT, FrameLayout, Transformer2D, frame_layout, shard_video_batch
from lightning_dcp.planning.models import ModelSpec, get_model

__all__ = [
    "DCPTransformerModule", "FRAME_LAYOUT", "FrameLayout", "Transformer1D", "Transformer2D", "build_model",
    "frame_layout", "resolve_spec", "shard_video_batch",
]


def resolve_spec(model: str | ModelSpec | Mapping[str, Any]) -> ModelSpec:
    """A :class:`ModelSpec` from its registry name, itself, or its ``to_dict()`` form."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return get_model(model)
    if isinstance(model, Mapping):
        known = {f.name for f in fields(ModelSpec)}
        unknown = sorted(set(model) - known)
        if unknown:
            raise ValueError(f"model dict has unknown field(s) {unknown}; ModelSpec fields are {sorted(known)}")
        return ModelSpec(**model)
    raise TypeError(f"model must be a registry name, a ModelSpec or its dict, got {type(model).__name__}")


def build_model(model: str | ModelSpec | Mapping[str, Any]) -> nn.Module:
    """``Transformer1D`` or ``Transformer2D`` for a spec name / :class:`ModelSpec` / its dict, by ``spec.kind``."""
    spec = resolve_spec(model)
    if spec.kind == "1d":
        return Transformer1D(spec)
    if spec.kind == "2d":
        return Transformer2D(spec)
    if spec.kind == "3d":
        raise ValueError(f"model {spec.name!r} is a '3d' (Wan-like) shape for planning and simulation only; train it "
                         "with diffusers' WanTransformer3DModel (and profile that module for a measured cost model)")
    raise ValueError(f"model {spec.name!r} has kind {spec.kind!r}; expected '1d' or '2d'")


def __getattr__(name: str) -> Any:
    if name == "DCPTransformerModule":
        from lightning_dcp.models.module import DCPTransformerModule

        return DCPTransformerModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
