"""Joint-attention DiTs (CogVideoX, HunyuanVideo) under lightning_dcp.diffusers, against plain diffusers.

* a packed micro-batch of videos of different frame counts, resolutions and text lengths through
  the adapted model == each video alone through diffusers' own forward, fp32 within 1e-6
  (CogVideoX 1.0 rotary, 1.5 with a temporal patch, sin-cos positions, fused projections;
  HunyuanVideo with masked prompt padding in the reference, guidance-distilled);
* state_dict keys, the model's own forward and pickling unchanged; the recompute switch covers every
  block (HunyuanVideo: dual- and single-stream) with the same gradients; the family table dispatches
  and names the supported models for any other;
* flow matching over joint rows: the module's loss and gradients == a per-sample diffusers reference,
  noise the same as for the video alone; lengths count text + video rows;
* SP 2 / SP 4 (spawned gloo, text and video rows sharded together) == SP 1, forward and gradients;
  DCPStrategy on 2 and 4 processes with SP and recompute == single-process per-sample training.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import random

import pytest
import torch
import torch.distributed as dist

diffusers = pytest.importorskip("diffusers")

import lightning.pytorch as pl  # noqa: E402

from lightning_dcp.diffusers import (  # noqa: E402
    GRID,
    HIDDEN_STATES,
    LATENTS,
    TEXT,
    TIMESTEP,
    FlowMatching,
    VideoDiffusionModule,
    adapt,
    packed_forward,
    per_sample_embeds,
    unpatchify,
)
from lightning_dcp.diffusers.cogvideox import cogvideox_rotary  # noqa: E402
from lightning_dcp.diffusers.family import FAMILIES, family_of  # noqa: E402
from lightning_dcp.diffusers.hunyuan import GUIDANCE, POOLED  # noqa: E402
from lightning_dcp.diffusers.joint import JOINT_TEXT, unpack_joint_output  # noqa: E402
from lightning_dcp.sp.context import CU_SEQLENS, LOSS_MASK, SPContext, sp_context  # noqa: E402
from lightning_dcp.sp.packing import pack_samples  # noqa: E402
from lightning_dcp.sp.tokens import shard_batch  # noqa: E402

try:
    from _dist import run_distributed
except ImportError:  # tests/ imported as a package
    from tests._dist import run_distributed

TEXT_DIM = 8
POOLED_DIM = 6
FLOW_SEED = 4


def make_cog(seed: int = 0, layers: int = 2, variant: str = "rotary"):
    """A tiny random CogVideoXTransformer3DModel: 4 heads of dim 16 (rotary split 4/6/6)."""
    cfg = dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
               text_embed_dim=TEXT_DIM, num_layers=layers, sample_width=16, sample_height=16, sample_frames=9,
               patch_size=2, max_text_seq_length=6, use_rotary_positional_embeddings=variant != "sincos")
    if variant == "patch_t2":  # CogVideoX 1.5
        cfg.update(patch_size_t=2)
    torch.manual_seed(seed)
    model = diffusers.CogVideoXTransformer3DModel(**cfg)
    if variant == "fused":
        model.fuse_qkv_projections()
    return model


def make_hunyuan(seed: int = 0, layers: int = 2, single: int = 2, guidance: bool = True):
    """A tiny random HunyuanVideoTransformer3DModel: 4 heads of dim 8 (rotary 2/2/4), a 1-layer token refiner."""
    torch.manual_seed(seed)
    return diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=layers,
        num_single_layers=single, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        text_embed_dim=TEXT_DIM, pooled_projection_dim=POOLED_DIM, rope_axes_dim=(2, 2, 4), guidance_embeds=guidance)


def make(family: str, seed: int = 0, **kw):
    return make_cog(seed, **kw) if family == "cog" else make_hunyuan(seed, **kw)


def patch_of(model):
    return family_of(model).patch_size(model.config)


class Raw:
    """One video: latent [C, F, H, W], text [L, TEXT_DIM], pooled [POOLED_DIM], guidance, timestep."""

    def __init__(self, lat, text, pooled, guidance, t):
        self.lat, self.text, self.pooled, self.guidance, self.t = lat, text, pooled, guidance, t


def raw_videos(grids, patch, seed: int = 1, text_lens=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (f, h, w) in enumerate(grids):
        lat = torch.randn(4, f * patch[0], h * patch[1], w * patch[2], generator=g)
        n = text_lens[i] if text_lens else 2 + i % 4
        out.append(Raw(lat, torch.randn(n, TEXT_DIM, generator=g), torch.randn(POOLED_DIM, generator=g),
                       float(1000 * (1 + i)), float(torch.randint(1, 1000, (1,), generator=g))))
    return out


def sample_of(model, raw: Raw, index=None):
    family = family_of(model)
    kw = dict(pooled_projections=raw.pooled, guidance=raw.guidance) if "Hunyuan" in family.class_name else {}
    return family.sample(raw.lat, raw.text, patch_of(model), index=index, **kw)


def with_inputs(batch, timesteps):
    """The packed batch with its latents as the model input, every row of sample j at timesteps[j]."""
    tt = torch.zeros(batch[LATENTS].shape[0])
    cu = batch[CU_SEQLENS].tolist()
    for j, t in enumerate(timesteps):
        tt[cu[j]:cu[j + 1]] = t
    return dict(batch, **{HIDDEN_STATES: batch[LATENTS], TIMESTEP: tt})


def reference(model, raw: Raw, x=None, pad_text: int = 3):
    """diffusers' own forward of one video: ``[C, F, H, W]``. HunyuanVideo gets its text padded by ``pad_text``
    random rows masked out with encoder_attention_mask, as its pipeline pads prompts."""
    x = raw.lat if x is None else x
    t = torch.tensor([raw.t])
    if "Hunyuan" in type(model).__name__:
        text = torch.cat([raw.text, torch.randn(pad_text, TEXT_DIM)])
        mask = torch.cat([torch.ones(raw.text.shape[0]), torch.zeros(pad_text)])[None]
        return model(x[None], t, text[None], mask, raw.pooled[None], guidance=torch.tensor([raw.guidance])).sample[0]
    grid = tuple(s // p for s, p in zip(x.shape[1:], patch_of(model)))
    rotary = cogvideox_rotary(model, grid) if model.config.use_rotary_positional_embeddings else None
    out = model(x.permute(1, 0, 2, 3)[None], raw.text[None], t, image_rotary_emb=rotary).sample[0]
    return out.permute(1, 0, 2, 3)


GRIDS = [(3, 2, 3), (1, 4, 2), (2, 1, 1), (1, 3, 3)]
CASES = [("cog", "rotary"), ("cog", "patch_t2"), ("cog", "sincos"), ("cog", "fused"), ("hunyuan", None)]


@pytest.mark.parametrize("family,variant", CASES)
def test_packed_equals_per_sample(family, variant):
    """Videos of different sizes and text lengths, packed with padding, through the adapted model == each alone
    through diffusers' forward (fp32, 1e-6); state_dict keys and the model's own forward unchanged."""
    ref = make(family, **({"variant": variant} if variant else {})).eval()
    model = adapt(copy.deepcopy(ref)).eval()
    assert model.state_dict().keys() == ref.state_dict().keys()
    patch = patch_of(model)
    grids = GRIDS  # patch grids: CogVideoX 1.5's latents have twice the frames
    text_lens = [6] * 4 if variant == "sincos" else None  # diffusers' sin-cos path needs max_text_seq_length tokens
    raws = raw_videos(grids, patch, text_lens=text_lens)
    samples = [sample_of(model, r, index=10 + i) for i, r in enumerate(raws)]
    batch = pack_samples(samples, pad_to_multiple=16)
    assert batch[CU_SEQLENS][-1] > sum(math.prod(g) for g in grids) + sum(r.text.shape[0] for r in raws)  # padded
    with torch.no_grad():
        got = unpack_joint_output(packed_forward(model, with_inputs(batch, [r.t for r in raws])), batch, patch)
        worst = 0.0
        for i, r in enumerate(raws):
            torch.manual_seed(i)
            want = reference(ref, r)
            torch.manual_seed(i)
            assert torch.equal(reference(model, r), want)  # the adapted model's own forward is unchanged
            worst = max(worst, (got[i] - want).abs().max().item())
    print(f"{family}/{variant}: packed vs per-sample max abs err {worst:.2e}")
    assert worst < 1e-6, worst
