"""Random samples of given lengths for any supported video family: :class:`SyntheticVideos`.

What the profiler and ``lightning-dcp budget --model`` measure when there is no encoded data yet:
for each length, one random latent whose patch grid has that many tokens (cross-attention
families: Wan, LTX-Video) or that many rows with the text (joint families: CogVideoX, HunyuanVideo,
whose text tokens are rows of the sequence), and random text embeddings of the family's usual
prompt length, built with the family's own sample function -- so the measured costs include the
text the model attends to. Values are random: only the shapes matter to a profile.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

__all__ = ["SyntheticVideos", "default_text_len", "video_grid"]


def default_text_len(model: Any) -> int:
    """Text tokens per sample the family's pipeline uses: Wan 512, LTX-Video 128, CogVideoX its
    ``max_text_seq_length``, HunyuanVideo 256."""
    from lightning_dcp.diffusers import family_of

    name, config = family_of(model).class_name, model.config
    if name.startswith("CogVideoX"):
        return int(config.max_text_seq_length)
    return {"WanTransformer3DModel": 512, "LTXVideoTransformer3DModel": 128}.get(name, 256)


def video_grid(tokens: int, side: int = 256) -> tuple[int, int, int]:
    """A ``(frames, height, width)`` patch grid of exactly ``tokens`` patches, each side at most ``side`` when a
    factorisation allows (few frames, height <= width)."""
    for f in range(1, tokens + 1):
        if tokens % f:
            continue
        rest = tokens // f
        h = max(d for d in range(1, math.isqrt(rest) + 1) if rest % d == 0)
        if rest // h <= side:
            return f, h, rest // h
    return 1, 1, tokens


class SyntheticVideos(Dataset):
    """``copies`` random samples of each of ``lengths`` for ``model``'s family (see the module docstring).

    Args:
        model: a supported diffusers video transformer (its config gives channels, patch and text width).
        lengths: tokens per sample as the sampler counts them (joint families: text + video rows).
        text_len: text tokens per sample (default :func:`default_text_len`).
        copies: samples of each length (the profiler measures micro-batches of up to this many).
    """

    def __init__(self, model: Any, lengths: Sequence[int], *, text_len: int | None = None, copies: int = 2) -> None:
        from lightning_dcp.diffusers import family_of

        family = family_of(model)
        self.text_len = int(text_len or default_text_len(model))
        config, patch = model.config, family.patch_size(model.config)
        channels = int(config.out_channels or config.in_channels)
        if family.class_name.startswith("LTX"):
            channels //= math.prod(patch)  # LTX's channels are the patch's features
        text_dim = family.text_dim(config)
        g = torch.Generator().manual_seed(0)
        self.samples, self.lengths = [], []
        for n in (int(n) for n in lengths for _ in range(copies)):
            video = max(1, n - self.text_len) if family.joint else n
            f, h, w = video_grid(video)
            latent = torch.randn(channels, f * patch[0], h * patch[1], w * patch[2], generator=g)
            text = torch.randn(self.text_len, text_dim, generator=g)
            sample = family.sample(latent, text, patch, index=len(self.samples), **self._extras(model, family))
            self.samples.append(sample)
            self.lengths.append(video + self.text_len if family.joint else video)

    def _extras(self, model: Any, family: Any) -> dict[str, Any]:
        config, name = model.config, family.class_name
        if name == "WanTransformer3DModel":
            return {"text_len": self.text_len}
        if name.startswith("Hunyuan"):
            return {"pooled_projections": torch.zeros(int(config.pooled_projection_dim)),
                    "guidance": 6.0 if config.guidance_embeds else None}
        return {}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]
