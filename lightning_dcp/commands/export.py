"""``lightning-dcp export``: a diffusers folder from a VideoDiffusionModule checkpoint (file or sharded directory).

Examples::

    lightning-dcp export runs/last.ckpt --out exported/                  # LoRA file, or the transformer folder
    lightning-dcp export runs/last.ckpt --out pipe/ --pipeline tiny-wan  # the whole pipeline, ready to generate

See :mod:`lightning_dcp.diffusers.export`.
"""

from __future__ import annotations

import argparse

from lightning_dcp.cli import CLIError

HELP = "write a diffusers folder (transformer, LoRA weights or whole pipeline) from a video training checkpoint"

_DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a .ckpt file, or a sharded checkpoint directory (DCPStrategy(sharding=...))")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--weights", choices=("auto", "ema", "raw"), default="auto",
                        help="the EMA averages or the trained weights (default auto: the EMA's when the checkpoint has "
                             "them)")
    parser.add_argument("--pipeline", default=None,
                        help="also write the whole pipeline, its other components from this diffusers pipeline folder, "
                             "hub id or tiny model name (tiny-wan, ...); a LoRA is fused into its transformer")
    parser.add_argument("--dtype", choices=_DTYPES, default=None, help="cast the weights (default: as trained)")


def _how_to_load(result) -> str:
    from lightning_dcp.diffusers.family import FAMILIES

    pipe = FAMILIES[result.record.class_name].pipeline
    if result.kind == "pipeline":
        return f"pipe = diffusers.{pipe}.from_pretrained({str(result.out)!r})"
    if result.kind == "lora":
        return f"pipe = diffusers.{pipe}.from_pretrained(BASE); pipe.load_lora_weights({str(result.out)!r})"
    return (f"pipe = diffusers.{pipe}.from_pretrained(BASE, transformer=diffusers.{result.record.class_name}"
            f".from_pretrained({str(result.out)!r}))")


def run(args: argparse.Namespace) -> int:
    import torch

    from lightning_dcp.diffusers.export import export_checkpoint

    ema = {"auto": None, "ema": True, "raw": False}[args.weights]
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        result = export_checkpoint(args.checkpoint, args.out, ema=ema, pipeline=args.pipeline, dtype=dtype)
    except (ValueError, FileNotFoundError) as err:
        raise CLIError(str(err)) from None
    what = {"lora": "LoRA weights", "transformer": "transformer", "pipeline": "pipeline"}[result.kind]
    print(f"wrote {result.out}: {what} of {result.record.class_name} ({result.weights} weights, step {result.step})")
    print(f"load it: {_how_to_load(result)}")
    return 0
