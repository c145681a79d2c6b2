"""``lightning-dcp train-video``: fine-tune a diffusers video transformer on an encode folder under DCPStrategy.

Offline on CPU (a tiny random Wan, 2 processes; encode first with ``lightning-dcp encode --model tiny-wan``)::

    lightning-dcp train-video --model tiny-wan --data encoded/ --out runs/tiny --steps 20 \\
        --prompt "a red ball" --validate-every 10

Settings come from ``--config FILE`` (YAML, see :mod:`lightning_dcp.diffusers.train_config`), then the flags, then
``--set section.key=value``; ``--print-config`` shows the result. A LoRA adapter (rank 16) trains unless
``--lora-rank 0``; EMA is on unless ``--no-ema``. See :mod:`lightning_dcp.diffusers.recipe`.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_dcp.cli import CLIError

HELP = "fine-tune a diffusers video model (LoRA or full, EMA, validation videos) on an encode folder under DCPStrategy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML settings file (the flags below override it)")
    parser.add_argument("--model", default=None, help="tiny-wan (tiny-ltx, tiny-cogvideox), a diffusers pipeline folder "
                                                      "or a Hub id")
    parser.add_argument("--family", default=None, help="check the model's family: wan, ltx, cogvideox or hunyuan")
    parser.add_argument("--data", default=None, help="the folder `lightning-dcp encode --out` wrote")
    parser.add_argument("--out", default=None, help="run folder: checkpoints/, logs/, validation videos (default "
                                                    "runs/video)")
    parser.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default 16); 0: full fine-tune")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200)")
    parser.add_argument("--global-batch-size", type=int, default=None, help="videos per optimizer step (default 8)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-4)")
    parser.add_argument("--budget", default=None,
                        help="per-device memory in MiB the planner may use, measured at fit start; auto (default): "
                             "the device's; none: no profile")
    parser.add_argument("--profile-seconds", type=float, default=None,
                        help="wall seconds for the whole profile at fit start (default 60); a profile that would take "
                             "longer skips its longest points and says which")
    parser.add_argument("--no-ema", action="store_true", help="no EMA of the trained weights")
    parser.add_argument("--ema-decay", type=float, default=None, help="EMA decay (default 0.999)")
    parser.add_argument("--prompt", action="append", default=None, help="a validation prompt (repeat for more)")
    parser.add_argument("--validate-every", type=int, default=None, help="validation videos every n steps (default 100)")
    parser.add_argument("--logger", default=None, help="csv (default), tensorboard, wandb or none")
    parser.add_argument("--devices", default=None, help="processes: auto (default: all GPUs, else 2 CPU processes) or n")
    parser.add_argument("--sharding", default=None, help="none (default), zero1, zero2, fsdp or hsdp")
    parser.add_argument("--precision", default=None, help="auto (default: bf16-mixed on GPUs, 32-true on CPU)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="any setting, e.g. --set validation.num_frames=9 --set train.checkpoint_every=50")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from, or `last`")
    parser.add_argument("--print-config", action="store_true", help="print the resolved settings as YAML and stop")
    parser.add_argument("--quiet-plans", action="store_true", help="do not print every step's plan")
    parser.add_argument("--progress-bar", action=argparse.BooleanOptionalAction, default=True,
                        help="Lightning's progress bar over the run's steps: done of --steps, loss, time left (default "
                             "on; --no-progress-bar: off)")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    budget = args.budget
    if budget is not None and budget not in ("auto", "none"):
        try:
            budget = float(budget)
        except ValueError:
            raise CLIError(f"--budget {budget!r}: MiB per device (a number), auto or none") from None
    flags = {"model": args.model, "family": args.family, "data": args.data, "out": args.out,
             "lora.rank": args.lora_rank, "train.steps": args.steps, "train.global_batch_size": args.global_batch_size,
             "train.lr": args.lr, "budget": budget, "profile_seconds": args.profile_seconds, "ema.decay": args.ema_decay, "validation.prompts": args.prompt,
             "validation.every_n_steps": args.validate_every, "logger": args.logger, "train.sharding": args.sharding,
             "train.precision": args.precision, "train.devices": args.devices}
    if args.no_ema:
        flags["ema.enabled"] = False
    return {k: v for k, v in flags.items() if v is not None}


def _rank_zero() -> bool:
    """Whether this process is the run's first (the command as typed, or rank 0 of the processes Lightning starts)."""
    import os

    return all(os.environ.get(v, "0") in ("", "0") for v in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def run(args: argparse.Namespace) -> int:
    from lightning_dcp.commands.train import _quiet_nonzero_rank
    from lightning_dcp.diffusers.train_config import load_config

    try:
        config = load_config(args.config, _overrides(args), args.sets)
    except (ValueError, OSError) as err:
        raise CLIError(str(err)) from None
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    _quiet_nonzero_rank()
    import warnings

    warnings.filterwarnings("ignore", message=".*`validation_step` but have no `val_dataloader`")
    from lightning_dcp.commands.console import LogDirPrinter, PlanPrinter, training_summary
    from lightning_dcp.diffusers.recipe import train_video

    try:  # a model that cannot be loaded (PretrainedError), data that does not fit the model: one message
        run_ = train_video(config, resume=args.resume, callbacks=[PlanPrinter(args.quiet_plans), LogDirPrinter()],
                           progress_bar=args.progress_bar)
    except (ValueError, FileNotFoundError) as err:
        if not _rank_zero():  # every rank meets it; rank 0 tells it
            return 2
        raise CLIError(str(err)) from None
    trainer = run_.trainer
    if trainer.is_global_zero:
        print(training_summary(trainer))
        last = run_.checkpoints / "last.ckpt"
        print(f"checkpoints: {run_.checkpoints}/ (last: {last})")
        videos = [c for c in trainer.callbacks if type(c).__name__ == "ValidationVideos"]
        if videos and videos[0].videos:
            print(f"validation videos: {videos[0].out_dir}/ ({len(videos[0].videos)} mp4 files, listed in videos.csv)")
        print(f"export: lightning-dcp export {last} --out {config.out}/export")
    return 0
