"""``lightning-dcp budget``: what memory budget a model and a dataset need, from a profile.

From a profile file (``--profile``) or a model profiled here (``--model``, as ``lightning-dcp
profile`` measures it: SP 1 in one process, every SP size under ``torchrun``), prints per SP size
up to ``--world-size`` the longest sample that fits the budget with no layer and with every layer
recomputed, and, for the dataset's ``--lengths``, the budgets below which it needs SP > 1 or
recompute (:func:`lightning_dcp.planning.budget.budget_report`). Every row says whether it is
measured or estimated from SP 1.

``--model`` is a reference model (``tiny-1d``, ``tiny-2d``, ``transformer-1d``, ``transformer-2d``)
or a diffusers video transformer: a tiny offline one (``tiny-wan``, ``tiny-ltx``, ``tiny-cogvideox``,
``tiny-hunyuan``), a local folder or a Hub id (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``; a GPU:
``--device cuda``), profiled through :class:`~lightning_dcp.diffusers.VideoDiffusionModule` on the
encoded videos of ``--lengths encoded/`` or on random samples of the lengths. ``--lengths`` takes an
encoded folder (``lightning-dcp encode --out``) or its ``index.jsonl`` too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_dcp.cli import CLIError

HELP = ("what memory budget a model and a dataset need: longest sample per SP size with and without recompute, "
        "and the budgets below which the lengths need SP > 1 or recompute")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a profile JSON (lightning-dcp profile / DCPProfiler's cache)")
    src.add_argument("--model", help="profile this model here first: tiny-1d, tiny-2d, transformer-1d, transformer-2d, "
                                      "or a diffusers video transformer: tiny-wan, tiny-ltx, tiny-cogvideox, "
                                      "tiny-hunyuan, a pipeline folder or a Hub id")
    parser.add_argument("--lengths", help="the dataset's lengths: a JSON file with a list (as for plan), comma-separated "
                                          "integers, or an encoded folder / its index.jsonl (lightning-dcp encode) "
                                          "(default: none, only the per-SP table)")
    parser.add_argument("--text-len", type=int, help="with a video --model and no encoded folder: text tokens per "
                                                     "sample (default: the family's, e.g. Wan 512)")
    parser.add_argument("--world-size", type=int, default=8, help="report SP sizes up to this (default 8)")
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--memory-limit-mib", type=float, help="the budget per device in MiB")
    limit.add_argument("--memory-limit-gib", type=float, help="the budget per device in GiB (default: the profile's "
                                                             "device limit; with --model, CUDA total x 0.9, CPU 8 GiB)")
    parser.add_argument("--device", default="cpu", help="with --model: cpu or cuda (cuda:N)")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"), help="with --model")
    parser.add_argument("--layers", type=int, default=2, help="with --model: layers to measure (min 2)")
    parser.add_argument("--profile-lengths", help="with --model: comma-separated lengths to measure (default: 4 per model)")
    parser.add_argument("--micro-batch-sizes", default="1,2", help="with --model: comma-separated (default 1,2)")
    parser.add_argument("--threads", type=int, help="with --model: torch CPU threads")


def _budget(args: argparse.Namespace) -> tuple[float | None, str | None]:
    for flag, value, unit in (("--memory-limit-mib", args.memory_limit_mib, 2**20),
                              ("--memory-limit-gib", args.memory_limit_gib, 2**30)):
        if value is not None:
            if not value > 0:
                raise CLIError(f"{flag} must be positive, got {value}")
            return value * unit, f"{flag} {value:g}"
    return None, None


def _encoded_folder(text: str) -> Path | None:
    """The encode output folder ``text`` names (the folder or its ``index.jsonl``), or ``None``."""
    path = Path(text)
    folder = path.parent if path.name == "index.jsonl" else path
    return folder if (folder / "index.jsonl").is_file() or (folder / "meta.json").is_file() else None


def _lengths(text: str | None) -> list[int] | None:
    if text is None:
        return None
    folder = _encoded_folder(text)
    if folder is not None:
        from lightning_dcp.diffusers.encoded import EncodedVideoDataset

        try:
            values = EncodedVideoDataset(folder).lengths
        except (OSError, ValueError) as err:
            raise CLIError(f"--lengths {text}: {err}") from None
        if not values:
            raise CLIError(f"--lengths {text}: the encode in {folder} has no samples yet")
        return values
    path = Path(text)
    if path.exists():
        from lightning_dcp.commands.plan import read_lengths

        return read_lengths(path)
    from lightning_dcp.planning.lengths import check_lengths

    try:
        values = [float(v) if "." in v else int(v) for v in (v.strip() for v in text.split(",")) if v]
        return check_lengths(values, "--lengths")
    except ValueError as err:
        raise CLIError(f"--lengths takes a JSON file with a list of positive integers, comma-separated positive "
                       f"integers or an encoded folder; {text!r}: {err}") from None


def _is_reference_model(name: str) -> bool:
    from lightning_dcp.planning.models import MODELS

    if name in MODELS and MODELS[name].kind == "3d":
        raise CLIError(f"--model {name} is a planning preset (an analytic shape: lightning-dcp plan / simulate --model "
                       f"{name}), not a model that runs here. To measure a video model's budget give the diffusers "
                       "transformer: --model tiny-wan (offline, CPU), or a pipeline folder or Hub id such as "
                       "Wan-AI/Wan2.1-T2V-1.3B-Diffusers (with --device cuda)")
    return name in MODELS


def _measured(args: argparse.Namespace, limit: float | None, source: str | None):
    import torch

    from lightning_dcp.commands.profile import _init_distributed, _int_list, checked_spec, default_lengths, measure_named
    from lightning_dcp.planning.profiled import ProfiledCostModel
    from lightning_dcp.profiling.budget import resolve_budget

    spec = checked_spec(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = _int_list(args.profile_lengths, "profile-lengths") if args.profile_lengths else default_lengths(spec)
    rank, world = _init_distributed(args.device)
    profile = measure_named(spec, lengths=lengths, micro_batch_sizes=_int_list(args.micro_batch_sizes, "micro-batch-sizes"),
                            device=args.device, dtype=args.dtype, layers=args.layers, world=world)
    limit, source = resolve_budget(args.device, limit, source)
    return ProfiledCostModel(profile, memory_limit=limit, memory_limit_source=source), profile, rank


def run(args: argparse.Namespace) -> int:
    from lightning_dcp.planning.budget import budget_report
    from lightning_dcp.planning.errors import PlanningError
    from lightning_dcp.planning.profile import ProfileError
    from lightning_dcp.planning.profiled import ProfiledCostModel

    limit, source = _budget(args)
    lengths = _lengths(args.lengths)
    rank = 0
    if args.profile is not None:
        try:
            cost_model = ProfiledCostModel.from_file(args.profile, memory_limit=limit, memory_limit_source=source)
        except (OSError, ProfileError, ValueError) as err:
            raise CLIError(f"cannot use profile {args.profile}: {err}") from None
        what = f"profile {args.profile}"
    elif not _is_reference_model(args.model):
        from lightning_dcp.commands.video_budget import measured_video

        folder = _encoded_folder(args.lengths) if args.lengths else None
        cost_model, profile, rank = measured_video(args, limit, source, lengths, folder)
        key = profile["key"]
        what = (f"{args.model} ({profile['meta']['model_class']}) measured on {key['device']} ({key['dtype']}, "
                f"{profile['meta']['grid']} grid points, lengths {profile['meta']['lengths']}, SP "
                f"{profile['meta']['sp_sizes']}, {profile['meta']['samples']})")
    else:
        cost_model, profile, rank = _measured(args, limit, source)
        key = profile["key"]
        what = (f"{args.model} measured on {key['device']} ({key['dtype']}, {profile['meta']['grid']} grid points, "
                f"lengths {profile['meta']['lengths']}, SP {profile['meta']['sp_sizes']})")
    try:
        report = budget_report(cost_model, args.world_size, lengths)
    except PlanningError as err:
        raise CLIError(str(err)) from None
    if rank == 0:  # under torchrun every rank measured; one prints
        print(what)
        print("\n".join(report.lines()))
    return 0
