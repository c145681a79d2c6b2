"""Random latent videos for the tiny offline models (lightning_dcp.diffusers.tiny): what their encoder would give,
without encoding anything. Import after ``pytest.importorskip("diffusers")``."""

from __future__ import annotations

import math
import random

import torch

from lightning_dcp.diffusers import family_of
from lightning_dcp.diffusers.tiny import tiny_transformer


class TinyVideos(torch.utils.data.Dataset):
    """``n`` random latent videos (1-3 latent frames, 2-6 latent pixels a side, multiples of the patch) with random
    prompt embeddings of 2-6 tokens, as the family's samples; ``lengths`` = the samples' rows."""

    def __init__(self, name: str = "tiny-wan", n: int = 8, seed: int = 0):
        model = tiny_transformer(name)
        family, config = family_of(model), model.config
        self.patch = family.patch_size(config)
        channels = int(getattr(config, "out_channels", None) or config.in_channels)
        if family.class_name.startswith("LTX"):
            channels = int(config.in_channels) // math.prod(self.patch)
        text_dim = family.text_dim(config)
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        self.samples = []
        for i in range(n):
            f, h, w = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 3)
            lat = torch.randn(channels, f * self.patch[0], h * self.patch[1], w * self.patch[2], generator=g)
            text = torch.randn(rng.randint(2, 6), text_dim, generator=g)
            kw = {}
            if family.class_name.startswith("Hunyuan"):
                kw = dict(pooled_projections=torch.randn(int(config.pooled_projection_dim), generator=g), guidance=6000.0)
            elif family.class_name.startswith("Wan"):
                kw = dict(text_len=None)
            self.samples.append(family.sample(lat, text, self.patch, index=i, **kw))
        self.lengths = [int(s["latents"].shape[0]) for s in self.samples]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]
