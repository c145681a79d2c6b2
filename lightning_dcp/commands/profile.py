"""``lightning-dcp profile``: measure a dual-layer profile outside a fit and write it as JSON.

Builds :class:`~lightning_dcp.models.DCPTransformerModule` for a named model with its layer count
cut to ``--layers`` (at least 2: one warms up, one is measured; the profile is per layer, so the
file records the *full* model's ``num_layers`` and the full model's signature in its key),
synthetic data of the requested lengths, and runs :func:`lightning_dcp.profiling.profile_module`
(the same core the :class:`~lightning_dcp.DCPProfiler` callback runs).

One process measures SP size 1 only. Started by ``torchrun --nproc-per-node N`` it initialises
``torch.distributed`` (nccl on CUDA, gloo on CPU) and measures every SP size up to N on real
groups; rank 0 writes the file.

2d models: a requested length ``l`` becomes a clip of ``round(l / (h*w))`` frames (at least 1) of
``h x w`` latent tokens, ``h*w`` the spec's ``spatial_tokens`` (square when it is a square), so the
lengths actually profiled are multiples of ``spatial_tokens``; the file records those.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_dcp.cli import CLIError

if TYPE_CHECKING:
    from lightning_dcp.planning.models import ModelSpec

HELP = "measure a dual-layer profile of a named model (SP 1 in one process; all SP sizes under torchrun) and write it as JSON"

_PRECISION = {"float32": "32-true", "bfloat16": "bf16-mixed", "float16": "16-mixed"}


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CLIError(f"--{what} takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise CLIError(f"--{what} takes comma-separated positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="tiny-1d, tiny-2d, transformer-1d or transformer-2d")
    parser.add_argument("--out", required=True, help="profile JSON to write (e.g. benchmarks/profiles/h100.json)")
    parser.add_argument("--layers", type=int, default=2,
                        help="layers to build (min 2; the profile is per layer and records the full model's count)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument("--dtype", default="float32", choices=sorted(_PRECISION),
                        help="float32, or bfloat16/float16 autocast over float32 weights (bf16-mixed / 16-mixed)")
    parser.add_argument("--lengths", help="comma-separated sequence lengths (default: 4 per model size)")
    parser.add_argument("--micro-batch-sizes", default="1,2", help="comma-separated micro-batch sizes (default 1,2)")
    parser.add_argument("--sp-sizes", help="comma-separated SP sizes under torchrun (default: all that fit)")
    parser.add_argument("--time-budget", type=float, default=600.0,
                        help="seconds after which optional grid points are skipped (default 600)")
    parser.add_argument("--memory-limit-gib", type=float,
                        help="usable memory per device in GiB (default: CUDA total x 0.9, CPU 8)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")


def default_lengths(spec) -> list[int]:
    """Four lengths spanning what the named model trains on (smaller for the tiny CPU models)."""
    tiny = spec.hidden_size <= 256
    if spec.kind == "2d":
        return [spec.spatial_tokens * f for f in ((1, 4, 16, 32) if tiny else (1, 4, 16, 64))]
    return [32, 128, 256, 512] if tiny else [512, 2048, 8192, 32768]


def synthetic_data(spec, lengths: list[int], copies: int):
    """A synthetic dataset holding ``copies`` samples of each requested length (see the module docstring)."""
    from lightning_dcp.data import SyntheticTokenDataset, SyntheticVideoDataset

    if spec.kind == "2d":
        s = max(1, spec.spatial_tokens)
        side = math.isqrt(s)
        h, w = (side, side) if side * side == s else (s, 1)
        shapes = [(max(1, round(n / (h * w))), h, w) for n in lengths for _ in range(copies)]
        return SyntheticVideoDataset(shapes, in_channels=spec.in_channels)
    return SyntheticTokenDataset([n for n in lengths for _ in range(copies)], vocab_size=spec.vocab_size)


def measure_named(spec, *, lengths: list[int], micro_batch_sizes: list[int], device: str, dtype: str = "float32",
                  layers: int = 2, time_budget_s: float = 600.0, sp_sizes: list[int] | None = None, world: int = 1,
                  memory_limit_bytes: float | None = None) -> dict:
    """Profile the named model ``spec`` cut to ``layers`` layers on synthetic data of ``lengths``
    (see the module docstring); the profile records the full model's layer count and signature."""
    import dataclasses

    import torch

    from lightning_dcp._version import __version__
    from lightning_dcp.models.module import DCPTransformerModule
    from lightning_dcp.profiling import profile_module
    from lightning_dcp.profiling.cache import ProfileKey, device_name, model_signature

    torch_device = torch.device(device if world == 1 or not device.startswith("cuda")
                                else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    precision = _PRECISION[dtype]
    # the full model's signature, without allocating it
    with torch.device("meta"):
        full_module = DCPTransformerModule(spec)
    small = dataclasses.replace(spec, num_layers=min(layers, spec.num_layers) if spec.num_layers >= 2 else layers)
    torch.manual_seed(0)
    module = DCPTransformerModule(small).to(torch_device)
    autocast = None
    if precision != "32-true":
        half = torch.bfloat16 if dtype == "bfloat16" else torch.float16
        autocast = lambda: torch.autocast(torch_device.type, dtype=half)  # noqa: E731
    key = ProfileKey(model_signature(full_module), device_name(torch_device), precision, world, __version__).to_dict()
    data = synthetic_data(spec, lengths, max(micro_batch_sizes))
    try:
        profile = profile_module(
            module, data, device=torch_device, precision=precision, autocast=autocast,
            optimizer=module.configure_optimizers(), lengths=sorted(set(data.lengths)),
            micro_batch_sizes=micro_batch_sizes, sp_sizes=sp_sizes, time_budget_s=time_budget_s,
            memory_limit_bytes=memory_limit_bytes, num_layers=spec.num_layers, num_heads=spec.num_heads, key=key,
            states_module=full_module,
        )
    except ValueError as err:
        raise CLIError(str(err)) from None
    profile["meta"]["model_name"] = spec.name
    profile["meta"]["profiled_layers"] = small.num_layers
    return profile


def _init_distributed(device: str) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        from lightning_dcp.runtime.exit import destroy_at_exit, import_group_defaults

        import_group_defaults()  # no default argument may hold the group past its destruction
        dist.init_process_group(backend)
        destroy_at_exit()
    return dist.get_rank(), dist.get_world_size()


def checked_spec(args: argparse.Namespace) -> "ModelSpec":
    """The model spec ``--model`` names, after checking ``--layers`` and ``--device`` (``CLIError`` naming the fix);
    shared by ``profile`` and ``budget``."""
    import torch

    from lightning_dcp.models.module import resolve_spec

    try:
        spec = resolve_spec(args.model)
    except (ValueError, TypeError) as err:
        raise CLIError(str(err)) from None
    if args.layers < 2:
        raise CLIError(f"--layers must be >= 2 (one layer warms up, the next is measured), got {args.layers}")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        raise CLIError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    return spec


def run(args: argparse.Namespace) -> int:
    import torch

    from lightning_dcp.planning.profile import save_profile

    spec = checked_spec(args)
    if args.time_budget < 0:
        raise CLIError(f"--time-budget must be >= 0 seconds, got {args.time_budget}")
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = _int_list(args.lengths, "lengths") if args.lengths else default_lengths(spec)
    mbs = _int_list(args.micro_batch_sizes, "micro-batch-sizes")
    rank, world = _init_distributed(args.device)
    sp_sizes = _int_list(args.sp_sizes, "sp-sizes") if args.sp_sizes else None
    if world == 1 and sp_sizes and sp_sizes != [1]:
        raise CLIError(f"--sp-sizes {args.sp_sizes} needs that many processes: run under torchrun --nproc-per-node N")
    profile = measure_named(spec, lengths=lengths, micro_batch_sizes=mbs, device=args.device, dtype=args.dtype,
                            layers=args.layers, time_budget_s=args.time_budget, sp_sizes=sp_sizes, world=world,
                            memory_limit_bytes=args.memory_limit_gib * 2**30 if args.memory_limit_gib else None)
    key, precision = profile["key"], profile["key"]["dtype"]
    if rank == 0:
        out = save_profile(profile, Path(args.out))
        meta = profile["meta"]
        print(f"wrote {out}: {meta['grid']} grid points ({meta['skipped']} skipped) in {meta['profiling_s']:.1f} s on "
              f"{key['device']} ({precision}, world {world}); lengths {meta['lengths']}")
        from lightning_dcp.profiling.deadline import skipped_line

        line = skipped_line(meta, "--time-budget SECONDS")
        if line:
            print(line)
    return 0
