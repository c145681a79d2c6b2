"""Diffusers path: lightning_dcp.diffusers.adapt / packed_forward / VideoDiffusionModule against plain diffusers.

* a packed micro-batch of videos of different frame counts and resolutions through the adapted
  Wan == each video alone through diffusers' own forward (T2V; per-token timesteps, the 4-D temb
  path; I2V with image cross-attention; fused projections; temporal patch 2), fp32 within 1e-5;
* state_dict keys unchanged, the model's own forward unchanged, the recompute switch checkpoints
  exactly the first k blocks with the same gradients;
* flow matching: the module's loss and gradients == a per-sample diffusers reference (token and
  sample reductions), the same noise whatever the packing; a plain Trainer trains identically;
* SP 2 / SP 4 (spawned gloo processes, recompute on) == the single-process forward and backward;
  DCPStrategy on 2 and 4 processes (dcp / bucket / random plans mixing SP 1/2/4, recompute 0-3,
  token and sample reductions) == single-process per-sample training, weights within 1e-5;
* the profiler measures two blocks of an adapted Wan on the dataset's own samples (lengths =
  video tokens, the samples' text); bad input and unsupported models get errors that say what to do.
"""

from __future__ import annotations

import copy
import math
import os
import random

import pytest
import torch
import torch.distributed as dist

diffusers = pytest.importorskip("diffusers")

import lightning.pytorch as pl  # noqa: E402
from _video_helpers import PlanRecorder, SGDVideo  # noqa: E402

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
    unpack_output,
    unpatchify,
    video_sample,
)
from lightning_dcp.sp.context import POSITION_IDS, SPContext, sp_context  # noqa: E402
from lightning_dcp.sp.packing import pack_samples  # noqa: E402
from lightning_dcp.sp.tokens import shard_batch  # noqa: E402

try:
    from _dist import run_distributed
except ImportError:  # tests/ imported as a package
    from tests._dist import run_distributed

PATCH = (1, 2, 2)
TEXT_DIM = 8
FLOW_SEED = 4


def make_wan(seed: int = 0, layers: int = 2, patch=PATCH, i2v: bool = False, heads: int = 4):
    """A tiny random WanTransformer3DModel (fp32, no download): 4 heads of dim 12 (rotary split 4/4/4)."""
    cfg = dict(patch_size=patch, num_attention_heads=heads, attention_head_dim=12, in_channels=4, out_channels=4,
               text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=layers, cross_attn_norm=True, rope_max_seq_len=32)
    if i2v:
        cfg.update(in_channels=8, image_dim=6, added_kv_proj_dim=heads * 12)
    torch.manual_seed(seed)
    return diffusers.WanTransformer3DModel(**cfg)


def raw_videos(grids, seed: int = 1, patch=PATCH, channels: int = 4, text_lens=None):
    """(latents [C, F, H, W], text [L, TEXT_DIM]) per patch grid."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (f, h, w) in enumerate(grids):
        lat = torch.randn(channels, f * patch[0], h * patch[1], w * patch[2], generator=g)
        n = text_lens[i] if text_lens else 2 + i % 4
        out.append((lat, torch.randn(n, TEXT_DIM, generator=g)))
    return out


def _with_inputs(batch, timesteps):
    """A packed batch whose model input is its latents, at ``timesteps`` (one per sample, or per token)."""
    total = batch[LATENTS].shape[0]
    tt = torch.zeros(total)
    if isinstance(timesteps, torch.Tensor):
        tt[: timesteps.numel()] = timesteps
    else:
        start = 0
        for grid, t in zip(batch[GRID], timesteps):
            n = math.prod(grid)
            tt[start:start + n] = t
            start += n
    return dict(batch, **{HIDDEN_STATES: batch[LATENTS], TIMESTEP: tt})


# ----------------------------------------------------------------------------- packed == per sample

GRIDS = [(3, 2, 3), (1, 4, 2), (2, 1, 1), (1, 3, 3)]  # 18 + 8 + 2 + 9 = 37 tokens, padded to 40


@pytest.mark.parametrize("variant", ["t2v", "per_token_t", "i2v", "fused", "patch_t2", "i2v_lora"])
def test_packed_equals_per_sample(variant):
    """Videos of different frame counts and resolutions packed (plus padding) through the adapted Wan ==
    each alone through diffusers' own WanTransformer3DModel.forward (``i2v_lora``: with a random LoRA adapter on
    every module peft can wrap, the image embedder and added key / value projections included)."""
    patch = (2, 2, 2) if variant == "patch_t2" else PATCH
    ref = make_wan(patch=patch, i2v=variant.startswith("i2v")).eval()
    if variant == "fused":
        ref.fuse_qkv_projections()
    if variant == "i2v_lora":
        pytest.importorskip("peft")
        from lightning_dcp.diffusers.lora import add_lora, lora_config

        targets = [n for n, m in ref.named_modules() if type(m) in (torch.nn.Linear, torch.nn.Conv3d)]
        assert "condition_embedder.image_embedder.ff.net.0.proj" in targets and "blocks.0.attn2.add_k_proj" in targets
        torch.manual_seed(3)
        add_lora(ref, lora_config(ref, rank=2, target_modules=targets, init_lora_weights=False))
    model = adapt(copy.deepcopy(ref)).eval()
    assert model.state_dict().keys() == ref.state_dict().keys()
    assert model.dcp_num_heads == 4 and len(model.dcp_repeated_layers()) == 2
    i2v = variant.startswith("i2v")
    text_len = 512 if i2v else None  # diffusers' Wan I2V processor assumes 512 text tokens
    g = torch.Generator().manual_seed(9)
    samples, refs = [], []
    for i, (lat, text) in enumerate(raw_videos(GRIDS, patch=patch)):
        kw = {}
        if i2v:
            kw = dict(encoder_hidden_states_image=torch.randn(3, 6, generator=g),
                      condition_latents=torch.randn(4, *lat.shape[1:], generator=g))
        samples.append(video_sample(lat, text, patch, text_len=text_len, index=10 + i, **kw))
        refs.append((lat, kw))
    batch = pack_samples(samples, pad_to_multiple=8)
    timesteps = [999.0, 420.5, 3.0, 700.0]
    per_token = None
    if variant == "per_token_t":  # Wan 2.2 TI2V style: a timestep per token (first frame clean)
        per_token = torch.cat([torch.where(torch.arange(math.prod(gr)) < gr[1] * gr[2], 0.0, t)
                               for gr, t in zip(GRIDS, timesteps)])
    inp = _with_inputs(batch, per_token if per_token is not None else timesteps)
    if i2v:
        inp[HIDDEN_STATES] = torch.cat([batch[LATENTS], batch["condition_latents"]], dim=-1)
    with torch.no_grad():
        got = unpack_output(packed_forward(model, inp), batch, patch)
        worst = 0.0
        start = 0
        for i, ((lat, kw), sample) in enumerate(zip(refs, samples)):
            n = math.prod(GRIDS[i])
            x = lat if not i2v else torch.cat([lat, kw["condition_latents"]])
            t = per_token[start:start + n][None] if per_token is not None else torch.tensor([timesteps[i]])
            extra = {"encoder_hidden_states_image": kw["encoder_hidden_states_image"][None]} if i2v else {}
            want = ref(x[None], t, per_sample_embeds(sample[TEXT]), **extra).sample[0]
            own = model(x[None], t, per_sample_embeds(sample[TEXT]), **extra).sample[0]
            assert torch.equal(own, want)  # the adapted model's own forward is unchanged
            worst = max(worst, (got[i] - want).abs().max().item())
            start += n
    print(f"{variant}: packed vs per-sample max abs err {worst:.2e}")
    assert worst < 1e-5, worst


def test_text_stays_per_sample():
    """Cross-attention sees each sample's own text only: changing one sample's text changes only its output."""
    model = adapt(make_wan()).eval()
    samples = [video_sample(lat, text, PATCH, text_len=None) for lat, text in raw_videos(GRIDS)]
    batch = _with_inputs(pack_samples(samples), [500.0] * 4)
    with torch.no_grad():
        base = unpack_output(packed_forward(model, batch), batch, PATCH)
        batch[TEXT] = list(batch[TEXT])
        batch[TEXT][1] = (batch[TEXT][1][0] + 1.0,)
        moved = unpack_output(packed_forward(model, batch), batch, PATCH)
    changed = [not torch.equal(a, b) for a, b in zip(base, moved)]
    assert changed == [False, True, False, False], changed


def _attn_calls(model):
    counts = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        block.attn1.register_forward_hook(lambda *a, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def test_recompute_first_k_blocks_same_grads_and_pickle():
    """recompute = k: blocks 0..k-1 run twice (forward + recompute); grads equal; the model pickles and deep-copies."""
    import pickle

    model = adapt(make_wan(layers=3)).train()
    batch = _with_inputs(pack_samples([video_sample(lat, t, PATCH, text_len=None) for lat, t in raw_videos(GRIDS)]),
                         [100.0, 200.0, 300.0, 400.0])
    gout = torch.randn(batch[LATENTS].shape[0], 16, generator=torch.Generator().manual_seed(5))
    results = {}
    for k in (0, 1, 3, 7):
        for block in model.blocks:
            block.attn1._forward_hooks.clear()
        counts = _attn_calls(model)
        model.zero_grad(set_to_none=True)
        with sp_context(SPContext(recompute=k)):
            out = packed_forward(model, batch)
        (out * gout).sum().backward()  # outside the context, as the strategy's backward may be
        assert counts == [2 if i < k else 1 for i in range(3)], (k, counts)
        results[k] = (out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    for block in model.blocks:
        block.attn1._forward_hooks.clear()
    for k, (out, grads) in results.items():
        assert torch.equal(out, results[0][0])
        for n, g in grads.items():
            torch.testing.assert_close(g, results[0][1][n], atol=1e-6, rtol=1e-5, msg=lambda m: f"k={k} {n}: {m}")
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert clone.dcp_repeated_layers()[0] is clone.blocks[0]
        clone.dcp_recompute.recompute_override = 2
        torch.testing.assert_close(packed_forward(clone, batch), results[0][0], atol=0, rtol=0)


# ----------------------------------------------------------------------------- bad input and unsupported models

def test_bad_input_names_the_sample_and_the_fix():
    lat = torch.randn(4, 3, 5, 4)
    with pytest.raises(ValueError, match=r"sample 7: latent height 5 is not a positive multiple of the patch height 2.*"
                                         r"the VAE's spatial stride x the patch, e.g. 8 x 2 = 16 .* 16 x 2 = 32"):
        video_sample(lat, torch.randn(3, TEXT_DIM), PATCH, index=7)
    with pytest.raises(ValueError, match=r"sample 3 has no encoder_hidden_states .*empty prompt"):
        video_sample(torch.randn(4, 1, 2, 2), None, PATCH, index=3)
    with pytest.raises(ValueError, match=r"sample 2: encoder_hidden_states has 9 tokens, more than text_len=8"):
        video_sample(torch.randn(4, 1, 2, 2), torch.randn(9, TEXT_DIM), PATCH, index=2, text_len=8)
    with pytest.raises(ValueError, match=r"sample 1: latents must be \[channels, frames, height, width\]"):
        video_sample(torch.randn(1, 4, 1, 2, 2), torch.randn(2, TEXT_DIM), PATCH, index=1)
    model = adapt(make_wan())
    samples = [video_sample(lat, t, PATCH, text_len=None, index=20 + i) for i, (lat, t) in enumerate(raw_videos(GRIDS))]
    batch = _with_inputs(pack_samples(samples), [1.0] * 4)
    batch[TEXT] = [batch[TEXT][0], None, batch[TEXT][2], batch[TEXT][3]]
    with pytest.raises(ValueError, match=r"sample 21: no text embeddings"):
        packed_forward(model, batch)
    big = [video_sample(torch.randn(4, 1, 2, 70), torch.randn(2, TEXT_DIM), PATCH, index=5)]
    with pytest.raises(ValueError, match=r"sample 5: patch grid .* = \(1, 1, 35\) is longer than the model's rotary "
                                         r"table \(rope_max_seq_len=32 positions per axis\)"):
        packed_forward(model, _with_inputs(pack_samples(big), [1.0]))
    i2v = adapt(make_wan(i2v=True))
    no_image = _with_inputs(pack_samples(samples), [1.0] * 4)
    no_image[HIDDEN_STATES] = no_image[HIDDEN_STATES].repeat(1, 2)  # noisy + condition channels
    with pytest.raises(ValueError, match="image-conditioned .* pass encoder_hidden_states_image"):
        packed_forward(i2v, no_image)
    with pytest.raises(ValueError, match=r"'hidden_states' has shape \(37, 32\), but the model takes .* 4 x 4"):
        packed_forward(model, no_image)
    with pytest.raises(ValueError, match="prepared by lightning_dcp.diffusers.adapt"):
        packed_forward(make_wan(), batch)


def test_grid_at_the_rotary_limit():
    """A grid side equal to rope_max_seq_len (positions 0..limit-1) runs, and equals diffusers' own forward,
    which accepts it; one more is refused, naming the sample."""
    ref = make_wan(layers=1).eval()
    model = adapt(copy.deepcopy(ref)).eval()
    limit = int(ref.rope.max_seq_len)
    (lat, text), = raw_videos([(1, 1, limit)])
    sample = video_sample(lat, text, PATCH, text_len=None, index=3)
    batch = pack_samples([sample])
    with torch.no_grad():
        got = unpack_output(packed_forward(model, _with_inputs(batch, [500.0])), batch, PATCH)[0]
        want = ref(lat[None], torch.tensor([500.0]), per_sample_embeds(sample[TEXT])).sample[0]
    assert (got - want).abs().max().item() < 1e-5
    (lat, text), = raw_videos([(1, 1, limit + 1)])
    over = pack_samples([video_sample(lat, text, PATCH, text_len=None, index=4)])
    with pytest.raises(ValueError, match=rf"sample 4: patch grid .* = \(1, 1, {limit + 1}\) is longer"):
        packed_forward(model, _with_inputs(over, [500.0]))


def test_unsupported_models_raise():
    with pytest.raises(TypeError, match="supports WanTransformer3DModel .*CogVideoXTransformer3DModel"):
        adapt(torch.nn.Linear(2, 2))
    flf2v = diffusers.WanTransformer3DModel(num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                                            text_dim=8, freq_dim=16, ffn_dim=16, num_layers=1, image_dim=6,
                                            added_kv_proj_dim=24, pos_embed_seq_len=6)
    with pytest.raises(NotImplementedError, match="FLF2V"):
        adapt(flf2v)


def test_missing_diffusers_names_the_extra(monkeypatch):
    import sys

    for name in [m for m in sys.modules if m == "lightning_dcp.diffusers" or m.startswith("lightning_dcp.diffusers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "diffusers", None)
    with pytest.raises(ImportError, match=r'pip install "lightning-dcp\[diffusers\]"'):
        import lightning_dcp.diffusers  # noqa: F401


# ----------------------------------------------------------------------------- flow matching loss

def reference_loss(ref, flow, items, reduction: str, epoch: int = 0):
    """Plain diffusers: per sample x_t = (1-s) x0 + s noise, MSE against noise - x0 over all latent values,
    then the token-weighted mean (``"token"``) or the mean over samples (``"sample"``)."""
    tokens = sum(math.prod(s[GRID]) for _, s in items)
    total = 0.0
    for index, s in items:
        grid = s[GRID]
        n = math.prod(grid)
        sigma, t, w, noise = flow.draw(index, epoch, n, s[LATENTS].shape[1])
        x0, eps = unpatchify(s[LATENTS], grid, PATCH, "input"), unpatchify(noise, grid, PATCH, "input")
        pred = ref((1 - sigma) * x0[None] + sigma * eps[None], torch.tensor([t]), per_sample_embeds(s[TEXT])).sample[0]
        mse = (pred - (eps - x0)).pow(2).mean() * w
        total = total + (mse * n / tokens if reduction == "token" else mse / len(items))
    return total


@pytest.mark.parametrize("reduction,scheme", [("token", "none"), ("sample", "logit_normal"), ("token", "sigma_sqrt")])
def test_module_loss_and_grads_match_reference(reduction, scheme):
    ref = make_wan()
    module = VideoDiffusionModule(copy.deepcopy(ref), seed=FLOW_SEED, weighting_scheme=scheme, loss_reduction=reduction)
    samples = [video_sample(lat, t, PATCH, text_len=None, index=30 + i) for i, (lat, t) in enumerate(raw_videos(GRIDS))]
    want = reference_loss(ref, module.flow, [(30 + i, s) for i, s in enumerate(samples)], reduction)
    want.backward()
    loss = module.training_step(VideoDiffusionModule.collate(samples), 0)
    loss.backward()
    ref_grads = dict(ref.named_parameters())
    worst = max(float((p.grad - ref_grads[n].grad).abs().max() / ref_grads[n].grad.abs().max().clamp_min(1e-12))
                for n, p in module.model.named_parameters())
    print(f"{reduction}/{scheme}: loss {loss.item():.6f} vs reference {want.item():.6f}, max rel grad err {worst:.2e}")
    assert abs(loss.item() - want.item()) < 1e-5 * max(1.0, abs(want.item()))
    assert worst < 1e-5


def test_module_refuses_unprepared_dcp_batches_and_a_second_reduction():
    """A DCP micro-batch the strategy did not pass through dcp_prepare_batch is refused (its noise must be drawn
    before sharding); a module reduction that differs from the strategy's is refused at setup."""
    from types import SimpleNamespace

    from lightning_dcp.sp.context import TOKEN_WEIGHT

    module = VideoDiffusionModule(make_wan())
    samples = [video_sample(lat, t, PATCH, text_len=None) for lat, t in raw_videos(GRIDS)]
    batch = pack_samples(samples, pad_to_multiple=2)
    with pytest.raises(RuntimeError, match="dcp_prepare_batch"):
        module.training_step(shard_batch(batch, 0, 2), 0)
    with pytest.raises(RuntimeError, match="dcp_prepare_batch"):
        module.training_step(dict(batch, **{TOKEN_WEIGHT: batch["loss_mask"].float()}), 0)
    module = VideoDiffusionModule(make_wan(), loss_reduction="sample")
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(loss_reduction="token"))
    with pytest.raises(ValueError, match="loss_reduction='sample'.* the strategy reduces by 'token'"):
        module.setup("fit")


def test_noise_is_a_function_of_seed_epoch_and_index():
    """The same sample gets the same noise and timestep in any packing; another epoch or seed changes them."""
    flow = FlowMatching(PATCH, seed=3)
    samples = [video_sample(lat, t, PATCH, text_len=None) for lat, t in raw_videos(GRIDS)]
    a = flow.prepare(pack_samples(samples, sample_indices=[5, 6, 7, 8]), epoch=2)
    b = flow.prepare(pack_samples([samples[2], samples[0]], pad_to_multiple=4, sample_indices=[7, 5]), epoch=2)
    n0, n2 = math.prod(GRIDS[0]), math.prod(GRIDS[2])
    s2 = sum(math.prod(g) for g in GRIDS[:2])
    assert torch.equal(a[HIDDEN_STATES][s2:s2 + n2], b[HIDDEN_STATES][:n2])
    assert torch.equal(a[HIDDEN_STATES][:n0], b[HIDDEN_STATES][n2:n2 + n0])
    assert torch.equal(a[TIMESTEP][:n0], b[TIMESTEP][n2:n2 + n0])
    assert (b[TIMESTEP][n2 + n0:] == 0).all() and (b["loss_scale"][n2 + n0:] == 0).all()  # padding
    c = flow.prepare(pack_samples(samples, sample_indices=[5, 6, 7, 8]), epoch=3)
    assert not torch.equal(a[HIDDEN_STATES], c[HIDDEN_STATES])
    sig = [flow.draw(i, 0, 1, 1)[0] for i in range(200)]
    assert 0 < min(sig) and max(sig) <= 1 and len(set(sig)) > 100


def test_sample_index_must_match_the_sampler_index():
    """Under DCPStrategy the batch has both the samples' own index= and the sampler's true indices: equal, the
    noise is keyed on them; different (e.g. two datasets in a ConcatDataset each passing index=i), an error names
    the sample and the fix. A plain DataLoader (no sampler indices) keys the noise on index=."""
    from lightning_dcp.diffusers.flow import check_sample_indices

    flow = FlowMatching(PATCH, seed=3)
    raw = raw_videos(GRIDS[:2])
    own = [video_sample(lat, t, PATCH, text_len=None, index=i) for i, (lat, t) in enumerate(raw)]
    bare = [video_sample(lat, t, PATCH, text_len=None) for lat, t in raw]
    want = flow.prepare(pack_samples(bare, sample_indices=[0, 1]), epoch=1)
    for batch in (pack_samples(own, sample_indices=[0, 1]), pack_samples(own)):  # DCP, plain DataLoader
        assert torch.equal(flow.prepare(batch, epoch=1)[HIDDEN_STATES], want[HIDDEN_STATES])
    assert check_sample_indices(pack_samples(bare)) is None
    collide = pack_samples(own, sample_indices=[7, 1])  # dataset index 7 built with index=0
    with pytest.raises(ValueError, match=r"the sample at dataset index 7 was made with index=0\..*index must be the "
                                         r"sample's index in the dataset the DataLoader reads.*ConcatDataset"):
        flow.prepare(collide, epoch=1)


def test_timestep_range_draws_one_experts_timesteps():
    """timestep_range=(lo, hi) draws only timesteps t with lo <= t/1000 < hi, as Wan 2.2's pipeline splits its
    experts at boundary_ratio (transformer: t >= 875, transformer_2: below), spread over the whole block; the
    default draws exactly as before (index int(u * 1000) of the full schedule)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from lightning_dcp.diffusers.flow import sample_seed

    full = FlowMatching(PATCH, seed=3, weighting_scheme="logit_normal")
    for i in range(20):
        g = torch.Generator().manual_seed(sample_seed(3, 0, i))
        u = compute_density_for_timestep_sampling("logit_normal", 1, logit_mean=0.0, logit_std=1.0, generator=g)
        assert full.draw(i, 0, 1, 1)[1] == float(full.timesteps[min(int(u.item() * 1000), 999)])
    high = FlowMatching(PATCH, seed=3, timestep_range=(0.875, 1.0))
    low = FlowMatching(PATCH, seed=3, timestep_range=(0.0, 0.875))
    t_high = [high.draw(i, 0, 1, 1)[1] for i in range(300)]
    t_low = [low.draw(i, 0, 1, 1)[1] for i in range(300)]
    assert min(t_high) >= 875 and max(t_low) < 875
    assert max(t_high) > 990 and min(t_high) < 885 and min(t_low) < 50 and max(t_low) > 860  # the whole block
    blocks = [(high._first, high._count), (low._first, low._count)]
    assert blocks[0][0] == 0 and blocks[0][1] == blocks[1][0] and sum(c for _, c in blocks) == 1000  # a partition
    module = VideoDiffusionModule(make_wan(), timestep_range=(0.875, 1.0))
    assert module.flow.timestep_range == (0.875, 1.0)
    for bad, match in [((0.9, 0.5), r"0 <= lo < hi <= 1.*got \(0\.9, 0\.5\)"), ((0.0, 1.5), "got \\(0.0, 1.5\\)"),
                       (0.5, r"\(lo, hi\).*got 0\.5"), ((0.99991, 0.99995), "holds none of the schedule's 1000 timesteps")]:
        with pytest.raises(ValueError, match=match):
            FlowMatching(PATCH, timestep_range=bad)


@pytest.mark.parametrize("kwargs,match", [
    (dict(shift=0.0), r"shift must be a positive number .*got 0\.0"),
    (dict(shift=-3.0), r"shift must be a positive number .*got -3\.0"),
    (dict(shift=float("nan")), r"shift must be a positive number .*got nan"),
    (dict(num_train_timesteps=0), r"num_train_timesteps must be an int >= 1 .*got 0"),
    (dict(num_train_timesteps=1000.0), r"num_train_timesteps must be an int >= 1 .*got 1000\.0"),
])
def test_flow_matching_refuses_a_bad_schedule(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlowMatching(PATCH, **kwargs)


class _Videos(torch.utils.data.Dataset):
    """Any-size latent videos (patch grids up to 3 x 4 x 4 = 48 tokens) with variable-length text, as video_sample dicts."""

    def __init__(self, n: int = 32, seed: int = 11):
        rng = random.Random(seed)
        grids = [(rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4)) for _ in range(n)]
        raw = raw_videos(grids, seed=seed, text_lens=[rng.randint(2, 6) for _ in range(n)])
        self.samples = [video_sample(lat, text, PATCH, text_len=None, index=i) for i, (lat, text) in enumerate(raw)]
        self.lengths = [int(s[LATENTS].shape[0]) for s in self.samples]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


_LR = 0.5


def _reference_weights(plans, dataset, reduction: str, heads: int = 4) -> dict:
    """Single process, plain diffusers, each sample alone: the global batch's flow-matching loss, torch.optim.SGD."""
    ref = make_wan(seed=3, heads=heads)
    flow = FlowMatching(PATCH, seed=FLOW_SEED)
    opt = torch.optim.SGD(ref.parameters(), lr=_LR)
    for plan in plans:
        items = [(i, dataset[i]) for it in plan["items"] for i in it["samples"]]
        opt.zero_grad(set_to_none=True)
        reference_loss(ref, flow, items, reduction).backward()
        opt.step()
    return ref.state_dict()


def test_plain_trainer_matches_reference():
    """VideoDiffusionModule under an ordinary single-device Trainer and DataLoader == plain diffusers + torch.optim."""
    data = _Videos(n=6)
    module = SGDVideo(make_wan(seed=3), lr=_LR, seed=FLOW_SEED)
    loader = torch.utils.data.DataLoader(data, batch_size=3, collate_fn=VideoDiffusionModule.collate)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    plans = [{"items": [{"samples": [0, 1, 2]}]}, {"items": [{"samples": [3, 4, 5]}]}]
    want = _reference_weights(plans, data, "token")
    worst = max(float((w - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12))
                for n, w in module.model.state_dict().items())
    print(f"plain Trainer: max rel weight err {worst:.2e}")
    assert worst < 1e-5


def test_val_loss_uses_the_same_noise_every_epoch():
    """validation_step draws noise and timesteps for epoch VideoDiffusionModule.validation_epoch (0), not the
    current one: with unchanged weights (lr 0), val_loss is the same in every epoch and equals the epoch-0
    reference."""
    val = _Videos(n=3, seed=12)
    module = SGDVideo(make_wan(seed=3), lr=0.0, seed=FLOW_SEED)
    ref = copy.deepcopy(module.model)
    losses = []

    class _Record(pl.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            losses.append((trainer.current_epoch, float(trainer.callback_metrics["val_loss"])))

    collate = VideoDiffusionModule.collate
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[_Record()])
    trainer.fit(module, torch.utils.data.DataLoader(_Videos(n=2), batch_size=2, collate_fn=collate),
                torch.utils.data.DataLoader(val, batch_size=3, collate_fn=collate))
    assert [e for e, _ in losses] == [0, 1]
    assert losses[0][1] == losses[1][1], losses
    with torch.no_grad():
        want = reference_loss(ref, module.flow, [(i, val[i]) for i in range(3)], "token", epoch=0).item()
    assert abs(losses[0][1] - want) < 1e-5 * max(1.0, abs(want)), (losses, want)


def test_bf16_mixed_trains_fp32_weights():
    """The README's recipe: fp32 weights under precision="bf16-mixed". The forward runs under bf16 autocast
    (a linear layer's output is bf16), the weights stay fp32, and AdamW at lr 1e-5 moves every one of them
    (bf16 weights would lose most such updates to rounding)."""
    module = VideoDiffusionModule(make_wan(seed=3), lr=1e-5, seed=FLOW_SEED)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    seen = []
    module.model.blocks[0].ffn.net[2].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    loader = torch.utils.data.DataLoader(_Videos(n=4), batch_size=4, collate_fn=VideoDiffusionModule.collate)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, precision="bf16-mixed", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    assert seen == [torch.bfloat16]
    for n, p in module.model.named_parameters():
        assert p.dtype == torch.float32 and torch.isfinite(p).all(), n
        assert (p != before[n]).float().mean() > 0.5, f"{n}: most weights did not move"


def test_profiler_measures_an_adapted_wan():
    """The dual-layer profiler drives VideoDiffusionModule as the strategy does (dcp_prepare_batch, then two Wan
    blocks from dcp_repeated_layers()) on the dataset's own samples: lengths are video tokens, text as in the data."""
    from lightning_dcp.planning.profiled import ProfiledCostModel
    from lightning_dcp.profiling import profile_module

    data = _Videos(n=12, seed=5)
    module = VideoDiffusionModule(make_wan(layers=3))
    module.train()
    seen = []
    hook = module.model.blocks[1].register_forward_pre_hook(
        lambda m, args: seen.append((args[0].shape[1], args[1].text.shape[1], len(args[1].segments))))
    profile = profile_module(module, data, time_budget_s=10, micro_batch_sizes=[1, 2])
    hook.remove()
    assert profile["entries"] and all(e["forward_s"] > 0 and e["activation_bytes"] > 0 for e in profile["entries"])
    assert {e["seq_len"] for e in profile["entries"]} <= set(data.lengths)  # lengths are video tokens
    assert profile["model"]["per_sample_cost"] is True  # each sample's text: a per-sample term in the fit
    text_lens = {n: {int(data[i][TEXT][0].shape[0]) for i in range(len(data)) if data.lengths[i] == n} for n in data.lengths}
    single = [(tokens, text) for tokens, text, samples in seen if samples == 1]  # micro-batch 1: one sample
    assert single and all(text in text_lens[tokens] for tokens, text in single), (seen, text_lens)
    cm = ProfiledCostModel(profile)
    assert cm.num_layers == 3
    top = max(data.lengths)
    assert cm.item_time([top], 1, 3) > cm.item_time([top], 1, 0) > cm.item_time([min(data.lengths)], 1, 0)


# ----------------------------------------------------------------------------- SP and DCPStrategy (spawned gloo)

_SP_GRIDS = [(2, 3, 2), (1, 2, 1), (3, 2, 2), (1, 1, 1), (1, 2, 3)]  # 12 + 2 + 12 + 1 + 6 = 33 tokens -> 36


def _sp_case(rank, layout, groups, recompute, grids=_SP_GRIDS):
    """Forward + backward of this rank's SP shard (gathered, grads summed over the group) == the whole batch at SP 1."""
    (gi,) = [i for i, ranks in enumerate(layout) if rank in ranks]
    ranks, group = layout[gi], groups[gi]
    sp, sp_rank = len(ranks), ranks.index(rank)
    model = adapt(make_wan(seed=gi, i2v=gi == 1)).train()  # the second group runs the I2V variant
    g = torch.Generator().manual_seed(gi)
    kw = (lambda lat: dict(encoder_hidden_states_image=torch.randn(3, 6, generator=g),
                           condition_latents=torch.randn(4, *lat.shape[1:], generator=g))) if gi == 1 else (lambda lat: {})
    samples = [video_sample(lat, t, PATCH, text_len=None, **kw(lat)) for lat, t in raw_videos(grids, seed=gi)]
    batch = _with_inputs(pack_samples(samples, pad_to_multiple=4), [900.0, 10.0, 500.0, 1.0, 250.0][:len(grids)])
    if gi == 1:
        batch[HIDDEN_STATES] = torch.cat([batch[LATENTS], batch["condition_latents"]], dim=-1)
    T = batch[POSITION_IDS].shape[0]
    gout = torch.randn(T, 16, generator=torch.Generator().manual_seed(7 + gi))
    want = packed_forward(model, batch)
    (want * gout).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with sp_context(SPContext(group=group, size=sp, rank=sp_rank, recompute=recompute)):
        out = packed_forward(model, shard_batch(batch, sp_rank, sp))
    lo = sp_rank * (T // sp)
    (out * gout[lo:lo + T // sp]).sum().backward()  # outside the context: recompute must re-enter it
    parts = [torch.empty_like(out) for _ in range(sp)]
    dist.all_gather(parts, out.detach().contiguous(), group=group)
    errs = {"output": ((torch.cat(parts) - want).abs().max().item(), want.abs().max().item())}
    for n, p in model.named_parameters():
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=group)
        errs[n] = ((grad - ref_grads[n]).abs().max().item(), ref_grads[n].abs().max().item())
    worst = max(e / max(m, 1e-12) for e, m in errs.values())
    if sp_rank == 0:
        print(f"SP {sp} ({'i2v' if gi == 1 else 't2v'}, {T} tokens, recompute {recompute}): max rel err output/grads "
              f"{worst:.2e}", flush=True)
    bad = {n: e for n, (e, m) in errs.items() if e > 1e-5 * max(1.0, m)}
    assert not bad, f"rank {rank} SP {sp}: errors {bad}"


_STEPS = 3


def _fit(world, out_dir, name, reduction, heads: int = 4, **kw):
    """One DCPStrategy fit inside the already-running processes; rank 0 checks it against the reference."""
    from lightning_dcp import DCPStrategy

    dataset = _Videos()
    strategy = DCPStrategy(global_batch_size=8, loss_reduction=reduction, seed=1, log_metrics=False, profile=False, **kw)
    plans = PlanRecorder()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=_STEPS, callbacks=[plans],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    module = SGDVideo(make_wan(seed=3, heads=heads), lr=_LR, seed=FLOW_SEED)
    trainer.fit(module, torch.utils.data.DataLoader(dataset, batch_size=4, collate_fn=VideoDiffusionModule.collate))
    weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, weights)
    if dist.get_rank() != 0:
        return
    sizes = sorted({len(it["ranks"]) for p in plans.plans for it in p["items"]})
    recompute = sorted({it["recompute"] for p in plans.plans for it in p["items"]})
    assert len(plans.plans) == _STEPS and max(sizes) > 1, f"{name}: the plans never used SP > 1: {plans.plans}"
    want = _reference_weights(plans.plans, dataset, reduction, heads)
    worst = 0.0
    for r, got in enumerate(gathered):
        for n, w in got.items():
            rel = float((w - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12))
            worst = max(worst, rel)
            assert rel < 1e-5, f"{name}: rank {r} weight {n} after {_STEPS} steps: relative error {rel:.2e}"
        moved = max(float((w - want[n]).abs().max()) for n, w in make_wan(seed=3, heads=heads).state_dict().items())
        assert moved > 1e-3  # training changed the weights
    print(f"world {world} {name} ({reduction}; SP sizes {sizes}, recompute {recompute}): max rel weight err {worst:.2e}",
          flush=True)
    with open(os.path.join(out_dir, f"{name}.done"), "w") as f:
        f.write(f"{sizes} {recompute} {worst}")


def _world_worker(rank, world, out_dir):
    from lightning_dcp import DefaultCostModel

    layouts = [[[0, 1]]] if world == 2 else [[[0, 1, 2, 3]], [[0, 1], [2, 3]]]
    for layout in layouts:
        groups = [dist.new_group(r) for r in layout]
        _sp_case(rank, layout, groups, recompute=1)
        _sp_case(rank, layout, groups, recompute=0, grids=[(1, 1, 1), (1, 1, 2)])  # 3 tokens: a shard of padding only
    from _dcp_helpers import RandomPlanner

    # a cost model under which the longer samples need SP > 1 and recomputation (2 blocks, 8 tokens per rank)
    tight = dict(cost_model=DefaultCostModel(num_layers=2, num_heads=4, max_tokens=8))
    if world == 2:
        _fit(world, out_dir, "dcp", "token", policy="dcp", **tight)
        _fit(world, out_dir, "bucket", "sample", policy="bucket", **tight)
    else:
        _fit(world, out_dir, "random", "token", planner=RandomPlanner(world, seed=2, force_mix=True))
        _fit(world, out_dir, "dcp-intra", "sample", policy="dcp-intra", **tight)


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_strategy_equals_single_process_training(tmp_path, world):
    """SP 2/4 shards == SP 1 (T2V and I2V, recompute on), then DCPStrategy fits on ``world`` CPU processes
    (dcp, bucket, dcp-intra and random plans mixing SP 1/2/4, recompute 0-3, token and sample reduction)
    == single-process per-sample diffusers training: weights within 1e-5 after 3 steps."""
    run_distributed(_world_worker, world, str(tmp_path), timeout=600)
    done = sorted(p for p in os.listdir(tmp_path) if p.endswith(".done"))
    assert len(done) == 2, done
