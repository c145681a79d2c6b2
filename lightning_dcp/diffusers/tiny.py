"""Tiny offline models for trying every step without a download: :data:`TINY_MODELS`.

``tiny-wan``, ``tiny-ltx``, ``tiny-cogvideox`` and ``tiny-hunyuan`` are each family's diffusers
transformer, VAE, text encoder(s), tokenizer(s) and scheduler -- the components its diffusers pipeline
takes -- at random weights and toy sizes, built locally from a fixed seed (the same bytes on every
call and machine with the same torch). Every transformer has 4 attention heads (SP up to 4) and 2
repeated blocks (HunyuanVideo: 2 dual-stream + 2 single-stream); every VAE has its family's strides
(Wan, CogVideoX, HunyuanVideo: 8 in space, 4 in time; LTX-Video: 32 and 8) and 4 (LTX: 8) latent
channels; the tokenizers are byte-level (every caption gets its own tokens, no vocabulary file).

What uses them: ``lightning-dcp encode --model tiny-wan`` (the VAE, text encoder and tokenizer) and
anything that takes a model name and calls :func:`tiny_components` / :func:`tiny_pipeline`. The
outputs are noise: they are for running the path, not for looking at.

Example::

    from lightning_dcp.diffusers.tiny import tiny_pipeline
    pipe = tiny_pipeline("tiny-wan")          # a diffusers WanPipeline, offline
    pipe.save_pretrained("tiny-wan/")         # a folder every from_pretrained(..., subfolder=...) reads
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["TINY_MODELS", "TinyModel", "is_tiny", "save_tiny", "tiny_components", "tiny_pipeline", "tiny_transformer"]

_SPECIALS = ("<pad>", "</s>", "<unk>", "<s>")  # ids 0, 1, 2, 3
TEXT_DIM = 32
POOLED_DIM = 16


def _seeded(seed: int, build: Callable[[], Any]) -> Any:
    """``build()`` under ``torch.manual_seed(seed)``, leaving the caller's global RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def tokenizer(max_length: int = 512, eos: bool = True) -> Any:
    """A byte-level tokenizer built offline (pad 0, eos 1, unk 2, bos 3; 260 ids), ``</s>`` appended when ``eos``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate([*_SPECIALS, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if eos:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   bos_token="<s>", model_max_length=max_length)


_VOCAB = len(_SPECIALS) + 256


def _t5(umt5: bool) -> Any:
    import transformers

    cls, config = ((transformers.UMT5EncoderModel, transformers.UMT5Config) if umt5 else
                   (transformers.T5EncoderModel, transformers.T5Config))
    return cls(config(vocab_size=_VOCAB, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                      relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaModel

    # 3 layers: HunyuanVideo's pipeline reads the hidden state 2 layers before the last
    return LlamaModel(LlamaConfig(vocab_size=_VOCAB, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                                  pad_token_id=0, bos_token_id=3, eos_token_id=1)).eval()


def _clip() -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(vocab_size=_VOCAB, hidden_size=POOLED_DIM, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
                                        projection_dim=POOLED_DIM, pad_token_id=0, bos_token_id=3,
                                        eos_token_id=1)).eval()


def _wan(seed: int) -> dict[str, Any]:
    import diffusers

    return {
        "transformer": _seeded(seed, lambda: diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2)),
        "vae": _seeded(seed + 1, lambda: diffusers.AutoencoderKLWan(
            base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, latents_mean=[0.1, -0.2, 0.0, 0.3],
            latents_std=[1.5, 0.8, 1.0, 2.0])),
        "text_encoder": _seeded(seed + 2, lambda: _t5(umt5=True)),
        "tokenizer": tokenizer(),
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
    }


def _ltx(seed: int) -> dict[str, Any]:
    import diffusers

    return {
        "transformer": _seeded(seed, lambda: diffusers.LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
            cross_attention_dim=32, num_layers=2, caption_channels=TEXT_DIM)),
        "vae": _seeded(seed + 1, lambda: diffusers.AutoencoderKLLTXVideo(
            latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1))),
        "text_encoder": _seeded(seed + 2, lambda: _t5(umt5=False)),
        "tokenizer": tokenizer(max_length=128),
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(),
    }


def _cogvideox(seed: int) -> dict[str, Any]:
    import diffusers

    return {
        "transformer": _seeded(seed, lambda: diffusers.CogVideoXTransformer3DModel(
            num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
            text_embed_dim=TEXT_DIM, num_layers=2, sample_width=16, sample_height=16, sample_frames=9, patch_size=2,
            max_text_seq_length=16, use_rotary_positional_embeddings=True)),
        "vae": _seeded(seed + 1, lambda: diffusers.AutoencoderKLCogVideoX(
            block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
            sample_height=64, sample_width=64)),
        "text_encoder": _seeded(seed + 2, lambda: _t5(umt5=False)),
        "tokenizer": tokenizer(max_length=16),
        "scheduler": diffusers.CogVideoXDDIMScheduler(),
    }


def _hunyuan(seed: int) -> dict[str, Any]:
    import diffusers

    return {
        "transformer": _seeded(seed, lambda: diffusers.HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
            num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
            text_embed_dim=TEXT_DIM, pooled_projection_dim=POOLED_DIM, rope_axes_dim=(4, 6, 6))),
        "vae": _seeded(seed + 1, lambda: diffusers.AutoencoderKLHunyuanVideo(
            latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=2,
            mid_block_add_attention=False)),
        "text_encoder": _seeded(seed + 2, _llama),
        "tokenizer": tokenizer(eos=False),
        "text_encoder_2": _seeded(seed + 3, _clip),
        "tokenizer_2": tokenizer(max_length=77),
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
    }


@dataclass(frozen=True)
class TinyModel:
    """One tiny model: its name, its family's diffusers transformer and pipeline classes, and its builder."""

    name: str
    transformer_class: str
    pipeline_class: str
    build: Callable[[int], dict[str, Any]]


#: The tiny models by name.
TINY_MODELS: dict[str, TinyModel] = {m.name: m for m in (
    TinyModel("tiny-wan", "WanTransformer3DModel", "WanPipeline", _wan),
    TinyModel("tiny-ltx", "LTXVideoTransformer3DModel", "LTXPipeline", _ltx),
    TinyModel("tiny-cogvideox", "CogVideoXTransformer3DModel", "CogVideoXPipeline", _cogvideox),
    TinyModel("tiny-hunyuan", "HunyuanVideoTransformer3DModel", "HunyuanVideoPipeline", _hunyuan),
)}


def is_tiny(name: str | Path | None) -> bool:
    """Whether ``name`` names a tiny model (``tiny-wan``, ...)."""
    return isinstance(name, str) and name in TINY_MODELS


def _spec(name: str) -> TinyModel:
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; the tiny models are {', '.join(TINY_MODELS)}")
    return TINY_MODELS[name]


def tiny_components(name: str, seed: int = 0) -> dict[str, Any]:
    """The keyword arguments of the family's diffusers pipeline: ``transformer``, ``vae``, ``text_encoder``,
    ``tokenizer``, ``scheduler`` (HunyuanVideo also ``text_encoder_2``, ``tokenizer_2``), fp32, random weights
    from ``seed``. The global RNG is left as it was."""
    return _spec(name).build(seed)


def tiny_transformer(name: str, seed: int = 0) -> torch.nn.Module:
    """Only the transformer of :func:`tiny_components` (the same weights)."""
    return tiny_components(name, seed)["transformer"]


def tiny_pipeline(name: str, seed: int = 0) -> Any:
    """The family's diffusers pipeline (``WanPipeline``, ``LTXPipeline``, ``CogVideoXPipeline``,
    ``HunyuanVideoPipeline``) over :func:`tiny_components`."""
    import diffusers

    return getattr(diffusers, _spec(name).pipeline_class)(**tiny_components(name, seed))


def save_tiny(name: str, folder: str | Path, seed: int = 0) -> Path:
    """Write :func:`tiny_pipeline` as a diffusers pipeline folder (``vae/``, ``text_encoder/``, ``tokenizer/``, ...)."""
    folder = Path(folder)
    tiny_pipeline(name, seed).save_pretrained(folder)
    return folder
