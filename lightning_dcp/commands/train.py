"""``lightning-dcp train``: train a small model with DCPStrategy on synthetic any-size data.

Defaults: the ``tiny-1d`` model on heavy-tailed token lengths (16..1024), 2 CPU processes (all
GPUs when present), a few dozen steps, progress bar on. Prints each step's plan (SP group sizes,
micro-batches per rank, recompute) and the imbalance ratio at the end. Nothing to download.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

HELP = "train a small model with DCPStrategy on synthetic any-size data (2 CPU processes, or all GPUs)"

#: What the per-step line means (``lightning-dcp train --help``).
STEP_LINE_HELP = """\
Each optimizer step prints one line (rank 0), for example

  step   4: items=9 sp={1:7, 2:2} mb/rank=[7, 4] recompute=[0, 2, 3, 4] imbalance=0.029 time=0.81s loss=5.4206

  items       micro-batches in the step's plan, all ranks together (a micro-batch of an SP
              group counts once)
  sp={p:n}    n micro-batches ran on SP groups of p ranks (p=1: one rank alone)
  mb/rank     micro-batches each rank accumulated, by global rank: DCP balances the ranks' work
              by giving them different counts
  recompute   the distinct numbers of layers recomputed (activation checkpointing) in the step's
              micro-batches: [0, 3, 4] means some micro-batches recomputed no layer, some 3 and
              some 4; long samples recompute more to fit the memory limit
  imbalance   mean idle time of the ranks / the busiest rank's time, at the step-end gradient
              reduction (0 = perfectly balanced)
  time        wall seconds of the step (start to next start: data loading, optimizer included)
  loss        the step's loss over the whole global batch (all ranks; a token mean by default)

At the end: the SP sizes used, the mean imbalance over the steps after the first, tokens/s."""

#: Default per-process memory budget on CPU, per model: a little above the model's static memory
#: (weights, gradients, AdamW state: ~3.6 MiB for tiny-1d, ~9.4 MiB for tiny-2d) so that the
#: longest synthetic samples (1024 tokens) need an SP group of 2 or recomputation.
CPU_MEMORY_LIMIT_MIB = {"tiny-1d": 10.0, "tiny-2d": 20.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-1d", choices=["tiny-1d", "tiny-2d"], help="model (default tiny-1d)")
    parser.add_argument("--devices", type=int, default=None, help="processes: default all GPUs, else 2 CPU processes")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--policy", default="dcp", help="planner policy: dcp, bucket, packed, static... (default dcp)")
    parser.add_argument("--global-batch-size", type=int, default=16, help="samples per optimizer step (default 16)")
    parser.add_argument("--num-samples", type=int, default=1024, help="synthetic dataset size (default 1024)")
    parser.add_argument("--max-len", type=int, default=1024, help="longest synthetic sample in tokens (default 1024)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective may wait before the run stops with an error naming the step, item "
                             "and group (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    from lightning_dcp.planning.sharding.registry import DEFAULT_MODE, MODES

    parser.add_argument("--sharding", choices=tuple(MODES), default=DEFAULT_MODE,
                        help="how the model states are sharded over the processes (DCPStrategy(sharding=...); default "
                             f"{DEFAULT_MODE}; hsdp picks the smallest shard group that fits)")
    parser.add_argument("--ckpt-path", default=None,
                        help="resume from this Lightning checkpoint, e.g. the dcp_oom/ file an out-of-memory stop names")
    parser.add_argument("--default-root-dir", default=None,
                        help="Lightning's default_root_dir (where an out-of-memory stop writes dcp_oom/; default: cwd)")
    parser.add_argument("--precision", default="32-true", help="Lightning precision, e.g. 32-true, bf16-mixed")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the dual-layer profile at fit start and plan with the default cost model")
    parser.add_argument("--memory-limit-mib", type=float, default=None,
                        help="per-device memory the planner may use (default: the device's on GPU; on CPU 10 MiB for "
                             "tiny-1d, 20 MiB for tiny-2d, a tight budget so that long samples need SP groups or "
                             "recompute)")
    parser.add_argument("--no-progress-bar", action="store_true")
    parser.add_argument("--quiet-plans", action="store_true", help="do not print every step's plan")
    parser.epilog = STEP_LINE_HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def _quiet_nonzero_rank() -> None:
    """On ranks other than 0 (Lightning re-runs this command with ``LOCAL_RANK``/``NODE_RANK`` set),
    drop deprecation and future warnings of the libraries: rank 0 shows each once."""
    import warnings

    if any(os.environ.get(v, "0") not in ("", "0") for v in ("RANK", "LOCAL_RANK", "NODE_RANK")):
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category)


def _progress_bar() -> Any:
    """Lightning's default bar (Rich when installed); DCPStrategy shows its epoch as ``Epoch 0``, not
    ``Epoch 0/-2``, in this step-bounded run (:mod:`lightning_dcp.runtime.progress`)."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    return RichProgressBar() if _RICH_AVAILABLE else TQDMProgressBar()


def run(args: argparse.Namespace) -> int:
    from lightning_dcp.cli import CLIError

    if args.steps < 1 or args.global_batch_size < 1 or args.num_samples < args.global_batch_size:
        raise CLIError(f"need --steps >= 1 and --num-samples ({args.num_samples}) >= --global-batch-size "
                       f"({args.global_batch_size}) >= 1")
    _quiet_nonzero_rank()
    import warnings

    # the demo module has a validation_step; this command trains without validation on purpose
    warnings.filterwarnings("ignore", message=".*`validation_step` but have no `val_dataloader`")
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_dcp.commands.console import PlanPrinter, training_summary
    from lightning_dcp.data import SyntheticTokenDataset, SyntheticVideoDataset, plain_collate, tiny_lengths
    from lightning_dcp.models.module import DCPTransformerModule
    from lightning_dcp.runtime.strategy import DCPStrategy

    cuda = torch.cuda.is_available()
    devices = args.devices or (torch.cuda.device_count() if cuda else 2)
    if not cuda:
        torch.set_num_threads(max(1, (torch.get_num_threads() or 2) // devices))
    if args.model == "tiny-1d":
        dataset = SyntheticTokenDataset(tiny_lengths(args.num_samples, args.seed, 16, args.max_len), seed=args.seed)
    else:
        dataset = SyntheticVideoDataset(num_samples=args.num_samples, seed=args.seed)
    pl.seed_everything(args.seed, verbose=False)
    module = DCPTransformerModule(model=args.model)
    try:
        strategy = DCPStrategy(policy=args.policy, global_batch_size=args.global_batch_size, seed=args.seed,
                               profile=args.profile, timeout=args.timeout, sharding=args.sharding)
    except ValueError as err:
        raise CLIError(str(err)) from None
    callbacks = [PlanPrinter(args.quiet_plans)] + ([] if args.no_progress_bar else [_progress_bar()])
    if args.profile:
        from lightning_dcp.profiling import DCPProfiler

        limit_mib = args.memory_limit_mib if args.memory_limit_mib is not None else (None if cuda else CPU_MEMORY_LIMIT_MIB[args.model])
        source = (f"--memory-limit-mib {args.memory_limit_mib:g}" if args.memory_limit_mib is not None else
                  f"lightning-dcp train's CPU default for {args.model}; change it with --memory-limit-mib")
        callbacks.append(DCPProfiler(memory_limit_bytes=None if limit_mib is None else limit_mib * 2**20,
                                     memory_limit_source=None if limit_mib is None else source))
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=devices, strategy=strategy, max_steps=args.steps,
        precision=args.precision, logger=False, enable_checkpointing=False, enable_model_summary=False,
        enable_progress_bar=not args.no_progress_bar, callbacks=callbacks,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=args.default_root_dir,
    )
    loader = DataLoader(dataset, batch_size=1, collate_fn=plain_collate)
    from lightning_dcp import AgreementError, CollectiveError, StepOutOfMemoryError
    from lightning_dcp.planning.errors import PlanningError

    try:
        trainer.fit(module, loader, ckpt_path=args.ckpt_path)
    except (PlanningError, AgreementError, CollectiveError, StepOutOfMemoryError) as err:
        # a user-facing failure (data vs memory, ranks that disagree, a stuck collective): one message, no traceback per
        # rank; an out-of-memory stop is told by the rank that hit it (it names the checkpoint it wrote)
        if trainer.is_global_zero or getattr(err, "this_rank_only", False):
            raise CLIError(str(err)) from None
        return 2
    if trainer.is_global_zero:
        print(training_summary(trainer))
    return 0
