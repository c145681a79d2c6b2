"""``lightning-dcp encode``: encode video files and captions into training latents with a model's own VAE and text encoder.

Example (Wan 2.1 T2V 1.3B, 480p, up to 81 frames, on a GPU)::

    lightning-dcp encode --videos clips/ --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --out encoded/ \\
        --max-frames 81 --max-area 399360 --device cuda

Offline, on CPU, with a tiny random Wan (no download; the latents are for trying the path)::

    lightning-dcp encode --videos clips/ --model tiny-wan --out encoded/ --max-frames 17 --fps 8

``--model`` is a diffusers pipeline folder or hub id with ``vae``, ``text_encoder`` and
``tokenizer`` subfolders (or name each with ``--vae``, ``--text-encoder``, ``--tokenizer``), or a
tiny offline model (``tiny-wan``; :mod:`lightning_dcp.diffusers.tiny`). Captions come from
``--captions`` (CSV/JSON/JSONL) or a sidecar ``.txt`` per video. Before any model loads, every
file is probed and every caption found, and every problem is listed at once (``--on-error skip``:
recorded and left out). Rerun the same command to resume a killed encode. Train on the result
with ``lightning_dcp.diffusers.EncodedVideoDataset(out)``. Needs ``pip install "lightning-dcp[encode]"``.
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
                        help="diffusers pipeline folder or hub id with vae/, text_encoder/ and tokenizer/ subfolders, or "
                             "a tiny offline model: tiny-wan (random weights, no download)")
    parser.add_argument("--vae", default=None, help="VAE folder or id (default: MODEL/vae)")
    parser.add_argument("--text-encoder", default=None, help="text encoder folder or id (default: MODEL/text_encoder)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: MODEL/tokenizer)")
    parser.add_argument("--captions", default=None, help="captions CSV/JSON/JSONL (default: a sidecar .txt per video)")
    parser.add_argument("--patch-size", default="1,2,2", help="the transformer's patch size t,h,w (default 1,2,2)")
    parser.add_argument("--max-frames", type=int, default=None,
                        help="frames per sample, before the VAE's cut (Wan: 4k+1) (default: all)")
    parser.add_argument("--fps", type=float, default=None,
                        help="resample every clip to this frame rate by timestamp (default: the clip's own frames)")
    parser.add_argument("--frame-stride", type=int, default=1, help="keep every n-th frame, without --fps (default 1)")
    parser.add_argument("--frame-offset", type=int, default=0,
                        help="skip this many frames (at the output rate) at the start of each clip (default 0)")
    parser.add_argument("--segments", type=int, default=1,
                        help="up to this many samples per clip: windows of --max-frames one after another (default 1)")
    parser.add_argument("--crops", default="center",
                        help="one sample per crop, comma-separated: center, start (top/left), end (bottom/right) of the "
                             "axis that is cut (default center)")
    parser.add_argument("--max-area", type=int, default=None,
                        help="scale frames down to at most this many pixels, aspect kept (e.g. 399360 = 480x832)")
    parser.add_argument("--text-len", type=int, default=512, help="truncate captions to this many tokens (default 512)")
    parser.add_argument("--samples-per-shard", type=int, default=64, help="videos per shard file (default 64)")
    parser.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                        help="videos without a caption, that cannot be decoded, or too small or short: list them all and "
                             "stop before encoding (default), or record them and encode the rest")
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


def _load(what: str, path: str, sub: str | None, load):
    """``load()``, or a :class:`CLIError` saying what could not be loaded from where, and what to do."""
    try:
        return load()
    except Exception as err:  # noqa: BLE001 - diffusers / transformers / huggingface_hub raise many types
        where = f"{path!r}" + (f" (subfolder {sub}/)" if sub else "")
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if Path(path).exists():
            hint = f"check that the folder holds a diffusers {what}"
        else:
            hint = ("it is not a local folder, so it was looked up on the Hugging Face Hub: check the id and the "
                    "network (offline: HF_HUB_OFFLINE=1 reads the local cache only; gated models need "
                    "`huggingface-cli login`), or pass a local pipeline folder")
        raise CLIError(f"cannot load the {what} from {where}: {type(err).__name__}: {first}\n  {hint}; to try the "
                       f"path offline use --model {', '.join(_tiny_names())}") from None


def _tiny_names() -> list[str]:
    """The tiny models encode takes: those whose samples EncodedVideoDataset builds (Wan's video_sample)."""
    return ["tiny-wan"]


def load_models(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(vae, text_encoder, tokenizer)`` from ``--model`` / ``--vae`` / ``--text-encoder`` / ``--tokenizer``."""
    from lightning_dcp.diffusers.pretrained import hub_problem
    from lightning_dcp.diffusers.tiny import is_tiny, tiny_components

    if is_tiny(args.model):
        if args.model not in _tiny_names():
            raise CLIError(f"--model {args.model}: encode writes the samples EncodedVideoDataset reads (Wan's "
                           f"video_sample); its tiny model is {', '.join(_tiny_names())}")
        if args.vae or args.text_encoder or args.tokenizer:
            raise CLIError(f"--model {args.model} brings its own VAE, text encoder and tokenizer: drop --vae, "
                           "--text-encoder and --tokenizer")
        parts = tiny_components(args.model)
        return parts["vae"], parts["text_encoder"], parts["tokenizer"]
    import diffusers
    import transformers

    def kw(sub: str | None) -> dict:
        return {} if sub is None else {"subfolder": sub}

    for explicit, sub in ((args.vae, "vae"), (args.text_encoder, "text_encoder"), (args.tokenizer, "tokenizer")):
        path, sub = _where(explicit, args.model, sub, sub.replace("_", " "))
        problem = hub_problem(path, sub)
        if problem:
            raise CLIError(f"cannot load the {sub.replace('_', ' ')}: {problem}; to try the path offline use "
                           f"--model {', '.join(_tiny_names())}")
    path, sub = _where(args.vae, args.model, "vae", "vae")
    config = _load("VAE", path, sub, lambda: diffusers.AutoencoderKLWan.load_config(path, **kw(sub)))
    vae_class = getattr(diffusers, config.get("_class_name", "AutoencoderKLWan"), diffusers.AutoencoderKLWan)
    vae = _load("VAE", path, sub, lambda: vae_class.from_pretrained(path, **kw(sub)))
    path, sub = _where(args.text_encoder, args.model, "text_encoder", "text encoder")
    te_config = _load("text encoder", path, sub, lambda: transformers.AutoConfig.from_pretrained(path, **kw(sub)))
    names = list(getattr(te_config, "architectures", None) or [])
    te_class = next((getattr(transformers, n) for n in names if hasattr(transformers, n)), transformers.AutoModel)
    text_encoder = _load("text encoder", path, sub, lambda: te_class.from_pretrained(path, **kw(sub)))
    path, sub = _where(args.tokenizer, args.model, "tokenizer", "tokenizer")
    tokenizer = _load("tokenizer", path, sub, lambda: transformers.AutoTokenizer.from_pretrained(path, **kw(sub)))
    return vae, text_encoder, tokenizer


def _settings(args: argparse.Namespace):
    from lightning_dcp.diffusers.encode import EncodeSettings

    try:
        patch = tuple(int(v) for v in args.patch_size.split(","))
        crops = tuple(c.strip() for c in args.crops.split(",") if c.strip())
        return EncodeSettings(patch_size=patch, max_frames=args.max_frames, frame_stride=args.frame_stride,
                              max_area=args.max_area, text_len=args.text_len, samples_per_shard=args.samples_per_shard,
                              on_error=args.on_error, store_dtype=args.store_dtype, compute_dtype=args.compute_dtype,
                              fps=args.fps, frame_offset=args.frame_offset, segments=args.segments, crops=crops)
    except ValueError as err:
        raise CLIError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    settings = _settings(args)
    try:
        import av  # noqa: F401
    except ImportError:
        raise CLIError('decoding videos needs PyAV: pip install "lightning-dcp[encode]" (or pip install av)') from None
    from lightning_dcp.diffusers.encode import encode_videos, stop_for_problems
    from lightning_dcp.diffusers.preflight import probe_sources
    from lightning_dcp.diffusers.video_io import VideoDecodeError

    try:
        pre = probe_sources(args.videos, args.captions, progress=not args.no_progress)
        print(f"probed {len(pre.names)} videos: {len(pre.probed)} readable with a caption"
              + (f", {len(pre.problems)} not" if pre.problems else ""))
        stop_for_problems(pre.problems, len(pre.names), settings, args.out, complete=False)  # before any model loads
        vae, text_encoder, tokenizer = load_models(args)
        result = encode_videos(Path(args.videos), Path(args.out), vae=vae, text_encoder=text_encoder,
                               tokenizer=tokenizer, captions=args.captions, settings=settings, device=args.device,
                               progress=not args.no_progress, preflight=pre, report=print)
    except (VideoDecodeError, ValueError, FileNotFoundError) as err:
        raise CLIError(str(err)) from None
    resumed = f", {result.resumed_shards} resumed" if result.resumed_shards else ""
    skipped = f", {len(result.skipped)} videos skipped" if result.skipped else ""
    print(f"wrote {result.out}: {result.samples} samples in {result.shards} shards{resumed}{skipped}")
    for _, reason in result.skipped:
        print(f"  skipped {reason}")
    return 0
