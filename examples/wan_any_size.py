"""Train a diffusers video transformer (Wan, CogVideoX or HunyuanVideo) with DCPStrategy on videos of any size:
mixed frame counts and resolutions packed into one micro-batch, per-step Ulysses SP groups, per-block
recompute -- the model's code unchanged.

CPU demo (default): a tiny random-config ``WanTransformer3DModel`` (4 blocks, 4 heads), no download,
2 CPU processes, images and videos of 1-5 latent frames at 8 resolutions, a few steps::

    python examples/wan_any_size.py
    python examples/wan_any_size.py --profile     # measure two Wan blocks at fit start, 5.25 MiB budget
    python examples/wan_any_size.py --family cogvideox   # a tiny CogVideoX (joint attention: text rows in the sequence)
    python examples/wan_any_size.py --family hunyuan     # a tiny HunyuanVideo (dual- and single-stream blocks)

For the joint-attention families (CogVideoX, HunyuanVideo) each sample's prompt tokens are rows of its
attention sequence, sharded with its video rows: the dataset's ``lengths`` are text + video tokens,
and samples come from ``lightning_dcp.diffusers.cogvideox_sample`` / ``hunyuan_sample``.

Real checkpoint on GPUs (fp32 weights, bf16-mixed, all visible GPUs; a diffusers repo id or local path)::

    python examples/wan_any_size.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --steps 100 --global-batch 32 --profile

With ``--model`` the script loads ``WanTransformer3DModel.from_pretrained(path, subfolder="transformer",
torch_dtype=float32)``, uses ``precision="bf16-mixed"`` (fp32 weights: with bf16 weights most AdamW updates
at lr 1e-5 round to no change) and trains on random latents of Wan's VAE shapes (16 channels, (frames - 1)/4 + 1
latent frames, pixels/8) with random 512 x 4096 "T5" embeddings: it shows the mechanics and the
throughput, not a useful fine-tune. For real training, encode your videos and captions with the
model's own VAE and T5 encoder (``lightning-dcp encode --videos clips/ --model REPO --out encoded/``)
and train on ``lightning_dcp.diffusers.EncodedVideoDataset("encoded/")`` instead of ``LatentVideos``:
its ``lengths`` (the video tokens ``(F/1) * (H/2) * (W/2)`` of each latent) come from the index
without loading a latent, and its items are ``video_sample(latent, embeds, patch, index=i)`` dicts.
"""

from __future__ import annotations

import argparse
import math
import random

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_dcp import DCPStrategy, DefaultCostModel
from lightning_dcp.commands.console import PlanPrinter, training_summary
from lightning_dcp.diffusers import FAMILIES, VideoDiffusionModule, cogvideox_sample, hunyuan_sample, video_sample
from lightning_dcp.profiling import DCPProfiler

#: Per-process memory budget of the CPU demo with ``--profile``: the tiny Wan's static memory (weights,
#: gradients, AdamW state) is 3.7 MiB, so under the measured profile SP 1 holds at most 106 video tokens
#: even with all 4 blocks recomputed: the longest videos (108-180 tokens) need SP 2 (214 at most there),
#: and from 30 tokens on SP 1 recomputes. (Without ``--profile`` the analytic model's ``max_tokens`` does
#: the same.) With the profiler's default CPU budget (8 GiB) nothing would need SP 2.
CPU_MEMORY_LIMIT_MIB = 5.25


class LatentVideos(Dataset):
    """Random latent videos of the given ``(frames, height, width)`` latent shapes with random text
    embeddings, made on demand; ``lengths`` are their video tokens (plus, for a joint-attention family,
    their prompt tokens), computed from the shapes and prompt lengths alone."""

    def __init__(self, shapes: list[tuple[int, int, int]], channels: int, patch: tuple[int, int, int], text_dim: int,
                 text_len: int, seed: int = 0, family: str = "wan", pooled_dim: int = 0) -> None:
        self.shapes, self.channels, self.patch = list(shapes), channels, tuple(patch)
        self.text_dim, self.text_len, self.seed = text_dim, text_len, seed
        self.family, self.pooled_dim = family, pooled_dim
        self.lengths = [math.prod(n // p for n, p in zip(s, self.patch)) for s in self.shapes]
        if family != "wan":  # joint attention: the prompt's tokens are rows of the sample
            rng = random.Random(seed)
            self.prompt_lens = [1 + rng.randrange(text_len) for _ in self.shapes]
            self.lengths = [n + m for n, m in zip(self.lengths, self.prompt_lens)]

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        latent = torch.randn(self.channels, *self.shapes[i], generator=g)
        if self.family == "cogvideox":
            return cogvideox_sample(latent, torch.randn(self.prompt_lens[i], self.text_dim, generator=g), self.patch,
                                    index=i)
        if self.family == "hunyuan":
            return hunyuan_sample(latent, torch.randn(self.prompt_lens[i], self.text_dim, generator=g), self.patch,
                                  pooled_projections=torch.randn(self.pooled_dim, generator=g), guidance=6000.0, index=i)
        prompt_tokens = 1 + int(torch.randint(self.text_len, (1,), generator=g))
        text = torch.randn(prompt_tokens, self.text_dim, generator=g)
        return video_sample(latent, text, self.patch, text_len=self.text_len, index=i)


def cpu_shapes(n: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """Latent (frames, height, width): images (1 frame) and short clips at 8 small resolutions."""
    rng = random.Random(seed)
    sizes = [(4, 4), (4, 8), (8, 4), (6, 6), (8, 8), (8, 12), (12, 8), (12, 12)]
    return [(rng.choice([1, 1, 2, 3, 5]), *rng.choice(sizes)) for _ in range(n)]


def wan_shapes(n: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """Latent shapes of Wan 2.1's VAE (frames (f - 1)/4 + 1, pixels / 8; Wan 2.2 TI2V-5B's VAE divides pixels
    by 16) for images and 17-81 frame clips at 256p to 720p, several aspect ratios."""
    rng = random.Random(seed)
    resolutions = [(256, 256), (480, 480), (480, 832), (832, 480), (720, 1280), (1280, 720), (512, 768)]
    frames = [1, 1, 17, 33, 49, 81]
    return [((f - 1) // 4 + 1, h // 8, w // 8) for f, (h, w) in
            ((rng.choice(frames), rng.choice(resolutions)) for _ in range(n))]


def tiny_wan() -> torch.nn.Module:
    """A random-config Wan small enough for CPU: 4 blocks of 4 heads x 16, patch (1, 2, 2), 4 latent channels."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=4, rope_max_seq_len=64)


def tiny_model(family: str) -> torch.nn.Module:
    """The CPU demo's random-config model of ``family`` (4 repeated blocks of 4 heads, 4 latent channels, text width 32)."""
    import diffusers

    if family == "wan":
        return tiny_wan()
    torch.manual_seed(0)
    if family == "cogvideox":
        return diffusers.CogVideoXTransformer3DModel(
            num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
            text_embed_dim=32, num_layers=4, sample_width=24, sample_height=24, sample_frames=17, patch_size=2,
            max_text_seq_length=16, use_rotary_positional_embeddings=True)
    return diffusers.HunyuanVideoTransformer3DModel(  # 2 dual-stream + 2 single-stream blocks
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2, num_single_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1, text_embed_dim=32, pooled_projection_dim=16,
        rope_axes_dim=(4, 6, 6))


class PlanAndShapes(PlanPrinter):
    """:class:`~lightning_dcp.commands.console.PlanPrinter`'s step line, then the latent shapes the step trained on."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.quiet or getattr(trainer.strategy, "last_step_metrics", None) is None:
            return
        dataset = trainer.train_dataloader.dataset
        dataset = getattr(dataset, "dataset", dataset)
        shapes = sorted({dataset.shapes[s] for it in batch.step.plan.items for s in it.samples})
        pl_module.print(f"          {len(shapes)} latent shapes (frames, h, w), e.g. {shapes[:4]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="wan", choices=("wan", "cogvideox", "hunyuan"),
                        help="model family of the tiny CPU demo and of --model (default wan)")
    parser.add_argument("--model", default=None, help="diffusers repo id or path of --family (GPU path); default: a tiny "
                                                      "random model on CPU")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--profile", action="store_true", help="measure two Wan blocks at fit start (DCPProfiler)")
    parser.add_argument("--memory-limit-mib", type=float, default=None,
                        help=f"with --profile: per-process memory the planner may use (default: the GPU's; on CPU "
                             f"{CPU_MEMORY_LIMIT_MIB:g} MiB, so that long videos need SP 2 and recompute)")
    parser.add_argument("--cache-dir", default=None, help="profile cache (default ~/.cache/lightning-dcp/profiles)")
    args = parser.parse_args()
    if args.memory_limit_mib is not None and not args.profile:
        parser.error("--memory-limit-mib applies to the measured profile: add --profile")

    if args.model is None:
        model = tiny_model(args.family)
        patch = FAMILIES[type(model).__name__].patch_size(model.config)
        dataset = LatentVideos(cpu_shapes(16 * args.global_batch), 4, patch, text_dim=32, text_len=16,
                               family=args.family, pooled_dim=16)
        trainer_kw = dict(accelerator="cpu", devices=2, precision="32-true")
    else:
        import diffusers

        name = {"wan": "WanTransformer3DModel", "cogvideox": "CogVideoXTransformer3DModel",
                "hunyuan": "HunyuanVideoTransformer3DModel"}[args.family]
        model = getattr(diffusers, name).from_pretrained(args.model, subfolder="transformer", torch_dtype=torch.float32)
        config = model.config
        text_dim = config.text_dim if args.family == "wan" else config.text_embed_dim
        text_len = {"wan": 512, "cogvideox": 226, "hunyuan": 256}[args.family]
        dataset = LatentVideos(wan_shapes(16 * args.global_batch), config.in_channels,
                               FAMILIES[name].patch_size(config), text_dim=text_dim, text_len=text_len, family=args.family,
                               pooled_dim=getattr(config, "pooled_projection_dim", 0))
        # fp32 weights, bf16 matmuls under autocast: with bf16 weights most AdamW updates at small learning
        # rates round to no change
        trainer_kw = dict(accelerator="gpu", devices=-1, precision="bf16-mixed")
    module = VideoDiffusionModule(model, lr=args.lr)  # adapts the model in place (attention, recompute switch)
    callbacks = [PlanAndShapes()]
    if args.profile:
        # Measures two Wan blocks at fit start (SP 1 and 2, several lengths) and hands the strategy a cost model;
        # the planner then keeps every micro-batch within the memory budget.
        limit_mib = args.memory_limit_mib if args.memory_limit_mib is not None else (
            CPU_MEMORY_LIMIT_MIB if args.model is None else None)
        callbacks.append(DCPProfiler(memory_limit_bytes=None if limit_mib is None else limit_mib * 2**20,
                                     density="coarse", cache_dir=args.cache_dir))
        cost = None
    else:
        # The analytic fallback cost model. On the CPU demo its per-rank token budget is small, so the longest
        # videos need SP 2 (and recomputation) -- the demo exercises Ulysses.
        budget = {"max_tokens": 32} if args.model is None else {}
        cost = DefaultCostModel(num_layers=len(model.dcp_repeated_layers()), num_heads=model.dcp_num_heads, **budget)
    # The step size is global_batch_size samples over all ranks; the DataLoader's batch_size below does not set it.
    strategy = DCPStrategy(global_batch_size=args.global_batch, loss_reduction="token", cost_model=cost)
    trainer = pl.Trainer(strategy=strategy, max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=False, gradient_clip_val=1.0,
                         callbacks=callbacks, **trainer_kw)
    trainer.fit(module, DataLoader(dataset, batch_size=4, collate_fn=VideoDiffusionModule.collate))
    if trainer.is_global_zero:
        print(training_summary(trainer))


if __name__ == "__main__":
    main()
