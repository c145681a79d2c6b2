"""``lightning-dcp budget``: what memory budget a model and a dataset need, from a profile.

From a profile file (``--profile``) or a named model profiled here (``--model``, as ``lightning-dcp
profile`` measures it: SP 1 in one process, every SP size under ``torchrun``), prints per SP size
up to ``--world-size`` the longest sample that fits the budget with no layer and with every layer
recomputed, and, for the dataset's ``--lengths``, the budgets below which it needs SP > 1 or
recompute (:func:`lightning_dcp.planning.budget.budget_report`). SP sizes the profile did not
measure are estimated from SP 1 and marked so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning_dcp.cli import CLIError

HELP = ("what memory budget a model and a dataset need: longest sample per SP size with and without recompute, "
        "and the budgets below which the lengths need SP > 1 or recompute")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a profile JSON (lightning-dcp profile / DCPProfiler's cache)")
    src.add_argument("--model", help="profile this named model here first: tiny-1d, tiny-2d, transformer-1d, transformer-2d")
    parser.add_argument("--lengths", help="the dataset's lengths: a JSON file with a list (as for plan) or comma-separated "
                                          "integers (default: none, only the per-SP table)")
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


def _lengths(text: str | None) -> list[int] | None:
    if text is None:
        return None
    path = Path(text)
    try:
        values = json.loads(path.read_text()) if path.exists() else [int(v) for v in text.split(",") if v.strip()]
    except (OSError, ValueError) as err:
        raise CLIError(f"--lengths takes a JSON file with a list of positive integers or comma-separated integers; "
                       f"{text!r}: {err}") from None
    if not isinstance(values, list) or not values or not all(type(v) is int and v > 0 for v in values):
        raise CLIError(f"--lengths {text!r} must be a non-empty list of positive integers (tokens per sample)")
    return values


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
