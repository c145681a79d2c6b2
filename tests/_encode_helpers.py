"""Tiny random models and generated video files for tests/test_encode.py (no download)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

WORDS = ["a", "cat", "dog", "runs", "jumps", "on", "the", "grass", "red", "ball", "slowly", "video"]
TEXT_DIM = 16
Z_DIM = 4


def tiny_vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 0.8, 1.0, 2.0])


def tiny_text_encoder():
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(1)
    config = UMT5Config(vocab_size=len(WORDS) + 3, d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1)
    return UMT5EncoderModel(config).eval()


def tiny_tokenizer():
    """A WordLevel tokenizer built offline: pad 0, eos 1 appended (as T5's), unk 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_wan(text_dim: int = TEXT_DIM, in_channels: int = Z_DIM):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(2)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                 in_channels=in_channels, out_channels=Z_DIM, text_dim=text_dim, freq_dim=16, ffn_dim=32,
                                 num_layers=2, rope_max_seq_len=32)


def save_models(folder: Path) -> Path:
    """A diffusers-pipeline-like folder with vae/, text_encoder/ and tokenizer/."""
    tiny_vae().save_pretrained(folder / "vae")
    tiny_text_encoder().save_pretrained(folder / "text_encoder")
    tiny_tokenizer().save_pretrained(folder / "tokenizer")
    return folder


def write_video(path: Path, frames: int, height: int, width: int, seed: int = 0, rate: int = 8,
                codec: str = "ffv1") -> Path:
    """A clip of moving colour gradients, ``frames`` frames of ``width x height`` at ``rate`` fps (FFV1: lossless)."""
    import av

    rng = np.random.RandomState(seed)
    base = rng.randint(0, 256, size=(3,))
    y, x = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for t in range(frames):
            img = np.stack([(base[c] + 7 * x + 5 * y + 11 * t * (c + 1)) % 256 for c in range(3)], -1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


#: (file, frames, height, width): frame counts 1/5/7/9 (Wan keeps 4k + 1: 1, 5, 5, 9), sizes cropped to
#: multiples of 16 px (VAE stride 8 x patch 2).
VIDEOS = [("a.mkv", 5, 32, 48), ("b.mkv", 9, 36, 40), ("c.mkv", 1, 32, 32), ("d.mkv", 7, 32, 64), ("e.mkv", 5, 48, 32)]
#: Latent [C, F, H, W] each one encodes to.
LATENT_SHAPES = [(Z_DIM, 2, 4, 6), (Z_DIM, 3, 4, 4), (Z_DIM, 1, 4, 4), (Z_DIM, 2, 4, 8), (Z_DIM, 2, 6, 4)]


def make_videos(folder: Path) -> Path:
    """Five clips; a, b, c captioned by sidecar .txt files, d and e by captions.csv."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (name, f, h, w) in enumerate(VIDEOS):
        write_video(folder / name, f, h, w, seed=i)
    (folder / "a.txt").write_text("a cat runs on the grass")
    (folder / "b.txt").write_text("a dog jumps")
    (folder / "c.txt").write_text("")  # an empty caption: unconditional
    (folder / "captions.csv").write_text('video,caption\nd.mkv,the red ball\ne.mkv,"a video, slowly"\n')
    return folder
