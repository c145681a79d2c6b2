"""``lightning-dcp budget --model`` for a diffusers video transformer: the profile behind the report.

The transformer (:func:`~lightning_dcp.diffusers.pretrained.load_transformer`: a tiny offline model, a
folder or a Hub id) is wrapped in :class:`~lightning_dcp.diffusers.VideoDiffusionModule` and profiled
as the :class:`~lightning_dcp.profiling.DCPProfiler` callback would at fit start: on the encoded
videos of ``--lengths encoded/`` when given (their real text lengths), else on random samples of
the family (:class:`~lightning_dcp.diffusers.synthetic.SyntheticVideos`) at ``--profile-lengths`` or
four of the dataset's lengths.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from lightning_dcp.cli import CLIError

__all__ = ["DEFAULT_LENGTHS", "measured_video"]

#: Grid lengths without a dataset: tiny models / real ones (tokens as the sampler counts them).
DEFAULT_LENGTHS = {"tiny": [64, 256, 1024, 2048], "real": [1024, 4096, 16384, 32768]}


def _data(args: argparse.Namespace, model: Any, mbs: list[int], lengths: list[int] | None,
          folder: Path | None) -> tuple[Any, list[int] | None, str]:
    """``(dataset, grid lengths or None to pick from it, how to describe it)``."""
    from lightning_dcp.commands.profile import _int_list
    from lightning_dcp.diffusers import EncodedVideoDataset, family_of
    from lightning_dcp.diffusers.synthetic import SyntheticVideos
    from lightning_dcp.diffusers.tiny import is_tiny
    from lightning_dcp.profiling.grid import select_lengths

    if folder is not None and not args.profile_lengths:
        family = family_of(model)
        if family.class_name != "WanTransformer3DModel":
            raise CLIError(f"--lengths {args.lengths}: encoded folders hold Wan samples (video_sample); {args.model} is "
                           f"{family.label}. Give --lengths as numbers to profile it on random samples")
        return EncodedVideoDataset(folder, text_len=args.text_len or 512), None, f"the encoded videos of {folder}"
    if args.profile_lengths:
        grid = _int_list(args.profile_lengths, "profile-lengths")
    elif lengths:
        grid = select_lengths(lengths, 4)
    else:
        grid = DEFAULT_LENGTHS["tiny" if is_tiny(args.model) else "real"]
    data = SyntheticVideos(model, grid, text_len=args.text_len, copies=max(mbs))
    return data, sorted(set(data.lengths)), f"random samples with {data.text_len} text tokens"


def measured_video(args: argparse.Namespace, limit: float | None, source: str | None, lengths: list[int] | None,
                   folder: Path | None) -> tuple[Any, dict, int]:
    """``(cost model at the budget, profile, rank)`` of the video transformer ``--model`` names, profiled on the
    encoded videos of ``folder`` or on random samples of (four of) the dataset's ``lengths``."""
    import torch

    from lightning_dcp.commands.profile import _PRECISION, _init_distributed, _int_list
    from lightning_dcp.diffusers import VideoDiffusionModule
    from lightning_dcp.diffusers.pretrained import PretrainedError, load_transformer
    from lightning_dcp.planning.profiled import ProfiledCostModel
    from lightning_dcp.profiling import profile_module
    from lightning_dcp.profiling.budget import resolve_budget

    if not (args.device == "cpu" or args.device.startswith("cuda")):
        raise CLIError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world = _init_distributed(args.device)
    device = torch.device(args.device if world == 1 or not args.device.startswith("cuda")
                          else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    try:
        model = load_transformer(args.model)
    except PretrainedError as err:
        raise CLIError(str(err)) from None
    module = VideoDiffusionModule(model).to(device)
    mbs = _int_list(args.micro_batch_sizes, "micro-batch-sizes")
    data, grid, described = _data(args, model, mbs, lengths, folder)
    precision, autocast = _PRECISION[args.dtype], None
    if precision != "32-true":
        half = torch.bfloat16 if args.dtype == "bfloat16" else torch.float16
        autocast = lambda: torch.autocast(device.type, dtype=half)  # noqa: E731
    try:
        profile = profile_module(module, data, device=device, precision=precision, autocast=autocast,
                                 optimizer=module.configure_optimizers(), lengths=grid, micro_batch_sizes=mbs,
                                 memory_limit_bytes=limit)
    except ValueError as err:
        raise CLIError(str(err)) from None
    profile["meta"].update(model_name=args.model, model_class=type(model).__name__, samples=described)
    limit, source = resolve_budget(device, limit, source)
    return ProfiledCostModel(profile, memory_limit=limit, memory_limit_source=source), profile, rank
