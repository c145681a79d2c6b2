"""Train a diffusers LTX-Video transformer with DCPStrategy on videos of any size: mixed frame counts,
resolutions, prompt lengths and frame rates packed into one micro-batch, per-step Ulysses SP groups,
per-block recompute -- the model's code unchanged.

CPU demo (default): a tiny random-config ``LTXVideoTransformer3DModel`` (4 blocks, 4 heads), no download,
2 CPU processes, images and clips of 1-5 latent frames at 8 resolutions, a few steps::

    python examples/ltx_any_size.py

Real checkpoint on GPUs (fp32 weights, bf16-mixed, all visible GPUs; a diffusers repo id or local path)::

    python examples/ltx_any_size.py --model Lightricks/LTX-Video --steps 100 --global-batch 32

With ``--model`` the script loads ``LTXVideoTransformer3DModel.from_pretrained(path, subfolder="transformer",
torch_dtype=float32)`` and trains on random latents of LTX-Video's VAE shapes (128 channels, (frames - 1)/8 + 1
latent frames, pixels/32) with random T5 embeddings (128 x 4096, a random number of them kept by the
attention mask): it shows the mechanics and the throughput, not a useful fine-tune. For real training,
precompute each video's latent with the pipeline's VAE (``AutoencoderKLLTXVideo``, normalised as the
pipeline's ``_normalize_latents`` does) and its prompt's T5 embeddings and attention mask, and return
``lightning_dcp.diffusers.ltx_video_sample(latent, embeds, encoder_attention_mask=mask,
rope_interpolation_scale=(8 / fps, 32, 32), index=i)`` from ``__getitem__``; the dataset's ``lengths``
are the video tokens ``F * H * W`` of each latent, known without loading it.
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
from lightning_dcp.diffusers import VideoDiffusionModule, ltx_video_sample


class LatentVideos(Dataset):
    """Random latent videos of the given ``(frames, height, width)`` latent shapes with random masked T5
    embeddings and frame rates, made on demand; ``lengths`` are their video tokens, from the shapes alone."""

    def __init__(self, shapes: list[tuple[int, int, int]], channels: int, text_dim: int, text_len: int,
                 seed: int = 0) -> None:
        self.shapes, self.channels, self.text_dim, self.text_len, self.seed = list(shapes), channels, text_dim, text_len, seed
        self.lengths = [math.prod(s) for s in self.shapes]

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        latent = torch.randn(self.channels, *self.shapes[i], generator=g)
        text = torch.randn(self.text_len, self.text_dim, generator=g)
        mask = torch.arange(self.text_len) <= int(torch.randint(self.text_len, (1,), generator=g))
        fps = (24, 25, 30)[i % 3]
        return ltx_video_sample(latent, text, encoder_attention_mask=mask, rope_interpolation_scale=(8 / fps, 32, 32),
                                index=i)


def cpu_shapes(n: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """Latent (frames, height, width): images (1 frame) and short clips at 8 small resolutions."""
    rng = random.Random(seed)
    sizes = [(2, 2), (2, 4), (4, 2), (3, 3), (4, 4), (4, 6), (6, 4), (6, 6)]
    return [(rng.choice([1, 1, 2, 3, 5]), *rng.choice(sizes)) for _ in range(n)]


def ltx_shapes(n: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """Latent shapes of LTX-Video's VAE (frames (f - 1)/8 + 1, pixels / 32) for images and 25-161 frame clips."""
    rng = random.Random(seed)
    resolutions = [(512, 512), (480, 704), (704, 480), (512, 768), (768, 512), (704, 1216), (1216, 704)]
    frames = [1, 1, 25, 49, 97, 161]
    return [((f - 1) // 8 + 1, h // 32, w // 32) for f, (h, w) in
            ((rng.choice(frames), rng.choice(resolutions)) for _ in range(n))]


def tiny_ltx() -> torch.nn.Module:
    """A random-config LTX-Video small enough for CPU: 4 blocks of 4 heads x 16, patch 1, 4 latent channels."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    return LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16,
                                      cross_attention_dim=64, num_layers=4, caption_channels=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="diffusers LTX-Video repo id or path (GPU path); default: tiny LTX on CPU")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()

    if args.model is None:
        model = tiny_ltx()
        dataset = LatentVideos(cpu_shapes(16 * args.global_batch), 4, text_dim=32, text_len=16)
        trainer_kw = dict(accelerator="cpu", devices=2, precision="32-true")
    else:
        from diffusers import LTXVideoTransformer3DModel

        model = LTXVideoTransformer3DModel.from_pretrained(args.model, subfolder="transformer", torch_dtype=torch.float32)
        config = model.config
        dataset = LatentVideos(ltx_shapes(16 * args.global_batch), config.in_channels, text_dim=config.caption_channels,
                               text_len=128)
        trainer_kw = dict(accelerator="gpu", devices=-1, precision="bf16-mixed")  # fp32 weights, bf16 matmuls
    module = VideoDiffusionModule(model, lr=args.lr)  # adapts the model in place (attention, recompute switch)
    # The analytic cost model; on the CPU demo its per-rank token budget is small, so the longest videos need SP 2
    # (and recomputation) -- the demo exercises Ulysses.
    budget = {"max_tokens": 32} if args.model is None else {}
    cost = DefaultCostModel(num_layers=model.config.num_layers, num_heads=model.config.num_attention_heads, **budget)
    # The step size is global_batch_size samples over all ranks; the DataLoader's batch_size below does not set it.
    strategy = DCPStrategy(global_batch_size=args.global_batch, loss_reduction="token", cost_model=cost)
    trainer = pl.Trainer(strategy=strategy, max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=False, gradient_clip_val=1.0,
                         callbacks=[PlanPrinter()], **trainer_kw)
    trainer.fit(module, DataLoader(dataset, batch_size=4, collate_fn=VideoDiffusionModule.collate))
    if trainer.is_global_zero:
        print(training_summary(trainer))


if __name__ == "__main__":
    main()
