"""``lightning-dcp encode``: encode video files and captions into training latents with a model's own VAE and text encoder.

Example (Wan 2.1 T2V 1.3B, 480p, up to 81 frames, on a GPU)::

    lightning-dcp encode --videos clips/ --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --out encoded/ \\
        --max-frames 81 --max-area 399360 --device cuda

``--model`` is a diffusers pipeline folder or hub id with ``vae``, ``text_encoder`` and
``tokenizer`` subfolders (or name each with ``--vae``, ``--text-encoder``, ``--tokenizer``).
Captions come from ``--captions`` (CSV/JSON/JSONL) or a sidecar ``.txt`` per video. Rerun the same
command to resume a killed encode. Train on the result with
``lightning_dcp.diffusers.EncodedVideoDataset(out)``. Needs ``pip install "lightning-dcp[encode]"``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lightning_dcp.cli import CLIError

HELP = "encode video files and captions into latents and text embeddings (resumable shards) for VideoDiffusionModule"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--videos", required=True, help="a folder of videos (recursive) or a text file listing them")
    parser.add_argument("--out", required=True, help="output folder (an earlier run of the same encode is resumed)")
    parser.add_argument("--model", default=None,
                        help="diffusers pipeline folder or hub id with vae/, text_encoder/ and tokenizer/ subfolders")
    parser.add_argument("--vae", default=None, help="VAE folder or id (default: MODEL/vae)")
    parser.add_argument("--text-encoder", default=None, help="text encoder folder or id (default: MODEL/text_encoder)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: MODEL/tokenizer)")
    parser.add_argument("--captions", default=None, help="captions CSV/JSON/JSONL (default: a sidecar .txt per video)")
    parser.add_argument("--patch-size", default="1,2,2", help="the transformer's patch size t,h,w (default 1,2,2)")
    parser.add_argument("--max-frames", type=int, default=None, help="keep at most this many frames (default: all)")
    parser.add_argument("--frame-stride", type=int, default=1, help="keep every n-th frame (default 1)")
    parser.add_argument("--max-area", type=int, default=None,
                        help="scale frames down to at most this many pixels, aspect kept (e.g. 399360 = 480x832)")
    parser.add_argument("--text-len", type=int, default=512, help="truncate captions to this many tokens (default 512)")
    parser.add_argument("--samples-per-shard", type=int, default=64, help="videos per shard file (default 64)")
    parser.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                        help="a video that cannot be decoded or is too small: stop naming it (default), or skip it")
    parser.add_argument("--store-dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="dtype the VAE and text encoder run in (default float32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _where(explicit: str | None, model: str | None, sub: str, what: str) -> tuple[str, str | None]:
    if explicit:
        return explicit, None
    if model is None:
        raise CLIError(f"name the {what}: --model (with a {sub}/ subfolder) or --{what.replace(' ', '-')}")
    return model, sub


def load_models(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(vae, text_encoder, tokenizer)`` from ``--model`` / ``--vae`` / ``--text-encoder`` / ``--tokenizer``."""
    import diffusers
    import transformers

    def kw(sub: str | None) -> dict:
        return {} if sub is None else {"subfolder": sub}

    path, sub = _where(args.vae, args.model, "vae", "vae")
    config = diffusers.AutoencoderKLWan.load_config(path, **kw(sub))
    vae_class = getattr(diffusers, config.get("_class_name", "AutoencoderKLWan"), diffusers.AutoencoderKLWan)
    vae = vae_class.from_pretrained(path, **kw(sub))
    path, sub = _where(args.text_encoder, args.model, "text_encoder", "text encoder")
    te_config = transformers.AutoConfig.from_pretrained(path, **kw(sub))
    names = list(getattr(te_config, "architectures", None) or [])
    te_class = next((getattr(transformers, n) for n in names if hasattr(transformers, n)), transformers.AutoModel)
    text_encoder = te_class.from_pretrained(path, **kw(sub))
    path, sub = _where(args.tokenizer, args.model, "tokenizer", "tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, **kw(sub))
    return vae, text_encoder, tokenizer


def run(args: argparse.Namespace) -> int:
    from lightning_dcp.diffusers.encode import EncodeSettings, encode_videos
    from lightning_dcp.diffusers.video_io import VideoDecodeError

    try:
        patch = tuple(int(v) for v in args.patch_size.split(","))
        settings = EncodeSettings(patch_size=patch, max_frames=args.max_frames, frame_stride=args.frame_stride,
                                  max_area=args.max_area, text_len=args.text_len,
                                  samples_per_shard=args.samples_per_shard, on_error=args.on_error,
                                  store_dtype=args.store_dtype, compute_dtype=args.compute_dtype)
    except ValueError as err:
        raise CLIError(str(err)) from None
    try:
        import av  # noqa: F401
    except ImportError:
        raise CLIError('decoding videos needs PyAV: pip install "lightning-dcp[encode]" (or pip install av)') from None
    vae, text_encoder, tokenizer = load_models(args)
    try:
        result = encode_videos(Path(args.videos), Path(args.out), vae=vae, text_encoder=text_encoder,
                               tokenizer=tokenizer, captions=args.captions, settings=settings, device=args.device,
                               progress=not args.no_progress)
    except (VideoDecodeError, ValueError, FileNotFoundError) as err:
        raise CLIError(str(err)) from None
    resumed = f", {result.resumed_shards} resumed" if result.resumed_shards else ""
    skipped = f", {len(result.skipped)} skipped: {', '.join(n for n, _ in result.skipped)}" if result.skipped else ""
    print(f"wrote {result.out}: {result.samples} videos in {result.shards} shards{resumed}{skipped}")
    return 0
