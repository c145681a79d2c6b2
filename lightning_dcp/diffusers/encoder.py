"""A model's own VAE and text encoder, applied to one video and its caption: :class:`VideoEncoder`.

* Latents: the VAE's posterior mode (its mean: deterministic, as the Wan training recipes store
  it), normalised as the model's pipeline expects them: ``(z - latents_mean) / latents_std`` per
  channel when the VAE config has them (Wan's ``AutoencoderKLWan``), else
  ``(z - shift_factor) * scaling_factor`` (image VAEs such as ``AutoencoderKL``, applied frame by frame).
* Text: the tokenizer pads/truncates to ``text_len`` tokens with an attention mask, the encoder
  (e.g. transformers' ``UMT5EncoderModel``) runs on them, and the embeddings of the real tokens are
  kept, ``[text_tokens, text_dim]`` -- what Wan's pipeline computes before zero-padding to 512
  (:func:`~lightning_dcp.diffusers.video_sample` pads them back).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["VAEInfo", "VideoEncoder", "config_hash", "vae_info"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class VAEInfo:
    """What the encoder needs to know about a VAE."""

    spatial_stride: int
    temporal_stride: int
    video: bool  # takes [B, C, F, H, W] (a video VAE) or [B, C, H, W] (an image VAE, applied per frame)
    normalization: str  # "mean_std" or "scale_shift"


def _config(module: Any) -> Any:
    return getattr(module, "config", None) or {}


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def vae_info(vae: nn.Module) -> VAEInfo:
    """Strides and normalisation of a diffusers VAE (``AutoencoderKLWan``, or any with ``encode``)."""
    if not callable(getattr(vae, "encode", None)):
        raise TypeError(f"{type(vae).__name__} has no encode(); pass the model's diffusers VAE (e.g. AutoencoderKLWan)")
    config = _config(vae)
    spatial = getattr(vae, "spatial_compression_ratio", None) or _get(config, "scale_factor_spatial")
    if spatial is None:
        blocks = _get(config, "block_out_channels")
        spatial = 2 ** (len(blocks) - 1) if blocks else None
    if spatial is None:
        raise ValueError(f"cannot tell the spatial stride of {type(vae).__name__} (no spatial_compression_ratio, "
                         "scale_factor_spatial or block_out_channels)")
    temporal = (getattr(vae, "temporal_compression_ratio", None) or _get(config, "scale_factor_temporal")
                or _get(config, "temporal_compression_ratio"))
    if temporal is None and _get(config, "temperal_downsample") is not None:
        temporal = 2 ** sum(bool(v) for v in _get(config, "temperal_downsample"))
    video = temporal is not None
    has_stats = _get(config, "latents_mean") is not None and _get(config, "latents_std") is not None
    return VAEInfo(int(spatial), int(temporal or 1), video, "mean_std" if has_stats else "scale_shift")


def config_hash(module: Any) -> str:
    """A short hash of a model's config (its class and settings, not its weights), for resume checks."""
    config = _config(module)
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    data = {k: v for k, v in data.items() if not str(k).startswith("_") and k not in ("transformers_version",)}
    text = json.dumps([type(module).__name__, data], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _to(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``module`` on ``device``, cast to ``dtype`` only when its floating parameters are not already in it."""
    module = module.to(device)
    if any(p.is_floating_point() and p.dtype != dtype for p in module.parameters()):
        module = module.to(dtype)
    return module


class VideoEncoder:
    """Encodes pixels with ``vae`` and captions with ``text_encoder`` + ``tokenizer`` (see the module docstring).

    Args:
        vae: a diffusers VAE with ``encode`` (``AutoencoderKLWan`` for Wan).
        text_encoder: a transformers encoder returning ``last_hidden_state`` (``UMT5EncoderModel`` for Wan).
        tokenizer: its tokenizer (a transformers tokenizer: called with padding, truncation and masks).
        text_len: pad/truncate captions to this many tokens (512 for Wan).
        device: where the models run.
        dtype: the models' compute dtype name (``float32``, ``bfloat16``, ``float16``).
    """

    def __init__(self, vae: nn.Module, text_encoder: nn.Module, tokenizer: Any, *, text_len: int = 512,
                 device: str | torch.device = "cpu", dtype: str = "float32") -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if text_len < 1:
            raise ValueError(f"text_len must be >= 1, got {text_len}")
        self.info = vae_info(vae)
        self.device, self.dtype = torch.device(device), _DTYPES[dtype]
        self.vae = _to(vae, self.device, self.dtype).eval()
        self.text_encoder = _to(text_encoder, self.device, self.dtype).eval()
        self.tokenizer, self.text_len = tokenizer, int(text_len)

    def _normalize(self, z: torch.Tensor) -> torch.Tensor:
        """``z`` ``[C, F, H, W]`` normalised as the pipeline expects the transformer's input."""
        config, c = _config(self.vae), z.shape[0]
        if self.info.normalization == "mean_std":
            mean, std = (torch.tensor(_get(config, k), dtype=torch.float32) for k in ("latents_mean", "latents_std"))
            if mean.numel() != c or std.numel() != c:
                raise ValueError(f"{type(self.vae).__name__}: latents_mean/latents_std have {mean.numel()}/{std.numel()} "
                                 f"values but the latents have {c} channels; fix the VAE config")
            return (z - mean.view(c, 1, 1, 1)) / std.view(c, 1, 1, 1)
        scale = float(_get(config, "scaling_factor", 1.0) or 1.0)
        shift = float(_get(config, "shift_factor", 0.0) or 0.0)
        return (z - shift) * scale

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Float32 latents ``[C, F', H', W']`` of pixels ``[3, F, H, W]`` in ``[-1, 1]``."""
        x = pixels.to(self.device, self.dtype)
        if self.info.video:
            out = self.vae.encode(x.unsqueeze(0))
        else:
            out = self.vae.encode(x.permute(1, 0, 2, 3))  # frames as the batch
        dist = getattr(out, "latent_dist", None)
        z = dist.mode() if dist is not None else (getattr(out, "latents", None) if hasattr(out, "latents") else out[0])
        z = z.float().cpu()
        z = z[0] if self.info.video else z.permute(1, 0, 2, 3)
        return self._normalize(z).contiguous()

    @torch.no_grad()
    def encode_text(self, caption: str) -> torch.Tensor:
        """Float32 embeddings ``[text_tokens, text_dim]`` of the caption's real tokens (at most ``text_len``)."""
        enc = self.tokenizer(caption, padding="max_length", max_length=self.text_len, truncation=True,
                             add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        n = max(1, int(mask[0].sum()))
        return hidden[0, :n].float().cpu().contiguous()
