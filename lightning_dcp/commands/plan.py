"""``lightning-dcp plan``: write the step plan for a list of sample lengths.

Example::

    lightning-dcp plan --lengths lengths.json --world-size 32 --model transformer-1d \\
        --hardware h100 --policy dcp --out plan.json

``lengths.json`` is a JSON list of positive integers (sample ``i`` has length ``lengths[i]``).
The plan (schema ``lightning-dcp/plan/v1``) is the one a ``DCPStrategy`` fit on that dataset executes,
step for step, given the fit's settings: each epoch's order (``--seed``, ``--shuffle``), its global
batches (``--global-batch-tokens`` or ``--global-batch-size``, ``--drop-last``; cut by the sampler's
rule, :mod:`~lightning_dcp.planning.batches`), ``--epochs``, the world, ``--policy``, ``--max-sp-size``
and the cost model (``--profile FILE``: the fit's measured profile; else the analytic model).
Bad input exits with code 2 and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_dcp.cli import CLIError

HELP = "plan the steps (SP groups, micro-batches, recompute) for a list of sample lengths"


def add_cost_model_arguments(parser: argparse.ArgumentParser, *, world_size_default: int | None = None) -> None:
    """Options shared by ``plan`` and ``simulate``: how to build the cost model, and the seed.

    ``--world-size`` is required unless ``world_size_default`` is given; the option then
    defaults to ``None`` and the command fills the default in (so it can say it did).
    """
    if world_size_default is None:
        parser.add_argument("--world-size", type=int, required=True, help="number of GPUs (ranks)")
    else:
        parser.add_argument("--world-size", type=int, default=None,
                            help=f"number of GPUs (ranks) (default {world_size_default})")
    parser.add_argument("--model", default=None,
                        help="model name (default transformer-1d; with --profile, checked against the profile's model)")
    parser.add_argument("--num-heads", type=int, default=None, metavar="H",
                        help="attention heads of the --model preset instead of its own (e.g. 28 for a Qwen2.5-7B-like "
                             "llama-7b): the SP sizes the planner may use follow them (every divisor, rings past them)")
    parser.add_argument("--no-ring", dest="ring", action="store_false", default=True,
                        help="plan without ring attention: Ulysses SP sizes (divisors of the heads) only")
    parser.add_argument("--hardware", default="h100", help="hardware name for the analytic cost model (default h100)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="a measured profile JSON (lightning-dcp profile); used instead of the analytic model")
    parser.add_argument("--memory-limit-gib", type=float, default=None, help="usable memory per GPU in GiB (default: the hardware's)")
    from lightning_dcp.planning.sharding.registry import MODES

    modes = "; ".join(f"{name}: {mode.summary}" for name, mode in MODES.items())
    parser.add_argument("--sharding", choices=tuple(MODES), default=None,
                        help=f"how the model states are sharded, as DCPStrategy(sharding=...) ({modes}). Default: zero1 "
                             "for the analytic model (the DCP paper's setting), none (as measured) with --profile")
    parser.add_argument("--shard-group-size", default=None,
                        help="hsdp: ranks the states are sharded over (a divisor of --world-size; the world size is plain "
                             "ZeRO-3). Default: the smallest power of two, at least one node's GPUs, whose states fit "
                             "and that holds the longest sample, as DCPStrategy picks it. simulate also takes 'auto': try every power-of-two size "
                             "and keep the fastest")
    parser.add_argument("--offload", action="store_true",
                        help="hsdp: keep the sharded states on the host (FSDP2's CPU offload), priced as host copies "
                             "per round and a CPU optimizer step")
    parser.add_argument("--seed", type=int, default=None,
                        help="planner seed; plan: also the data order's, as DCPStrategy(seed=...). Default: as "
                             "DCPStrategy's, Lightning's global seed ($PL_GLOBAL_SEED, which seed_everything sets), else 0")
    parser.add_argument("--force", action="store_true",
                        help="use a --profile made for another model or a smaller world anyway (warns instead of failing)")
    parser.add_argument("--global-batch-tokens", type=int, default=None,
                        help="tokens per global batch = optimizer step (default: at least 65536 per GPU and 4x the longest sample, "
                             "and enough that mean per-GPU work covers the longest sample's best-case time)")


def build_cost_model(args: argparse.Namespace, lengths: list[int] | None = None) -> Any:
    """The cost model the arguments name; :class:`CLIError` for unknown names or a bad profile. A mode with a
    shard group and no ``--shard-group-size`` gets the smallest that fits ``lengths`` (printed, with why)."""
    from lightning_dcp.planning.sharding.registry import MODES

    if not isinstance(args.world_size, int) or args.world_size <= 0:
        raise CLIError(f"--world-size must be a positive integer, got {args.world_size}")
    limit = None if args.memory_limit_gib is None else args.memory_limit_gib * 2**30
    if limit is not None and limit <= 0:
        raise CLIError(f"--memory-limit-gib must be positive, got {args.memory_limit_gib}")
    sharding = args.sharding
    grouped = sharding is not None and bool(MODES[sharding].options)
    if (getattr(args, "shard_group_size", None) is not None or getattr(args, "offload", False)) and not grouped:
        with_options = ", ".join(name for name, mode in MODES.items() if mode.options)
        raise CLIError(f"--shard-group-size and --offload apply to --sharding {with_options} only")
    source = None if limit is None else f"--memory-limit-gib {args.memory_limit_gib:g}"
    heads = getattr(args, "num_heads", None)
    if heads is not None and (isinstance(heads, bool) or heads < 1):
        raise CLIError(f"--num-heads must be a positive integer, got {heads}")
    if args.profile is not None and heads is not None:
        raise CLIError("--num-heads changes a model preset; a --profile is measured on its own model: leave one out")
    if args.profile is not None:
        if grouped:
            raise CLIError(f"--sharding {sharding} plans with the analytic model for now (it needs the layers' weight "
                           "bytes); leave out --profile")
        from lightning_dcp.planning.profile import ProfileError
        from lightning_dcp.planning.profiled import ProfiledCostModel
        try:
            cost_model = ProfiledCostModel.from_file(args.profile, memory_limit=limit, sharding=sharding,
                                                     memory_limit_source=source, world_size=args.world_size)
        except (OSError, ProfileError, ValueError) as err:
            raise CLIError(f"cannot use profile {args.profile}: {err}") from None
        _check_profile_fits(args, json.loads(Path(args.profile).read_text()))
        return cost_model
    from lightning_dcp.planning.analytic import AnalyticCostModel
    from lightning_dcp.planning.hardware import get_hardware
    from lightning_dcp.planning.models import get_model
    try:
        model = with_heads(get_model(args.model or "transformer-1d"), heads)
        hardware = get_hardware(args.hardware)
        if grouped:
            base = AnalyticCostModel(model, hardware, args.world_size, memory_limit=limit, sharding="none",
                                     memory_limit_source=source)
            return grouped_view(args, base, lengths)
        return AnalyticCostModel(model, hardware, args.world_size, memory_limit=limit, sharding=sharding,
                                 memory_limit_source=source)
    except ValueError as err:
        raise CLIError(str(err)) from None


def with_heads(model: Any, heads: int | None) -> Any:
    """``model`` (a :class:`~lightning_dcp.planning.models.ModelSpec`) with ``heads`` attention heads (unchanged
    for None); :class:`CLIError` when its grouped-query key/value heads do not divide them."""
    if heads is None or heads == model.num_heads:
        return model
    from dataclasses import replace

    kv = model.num_kv_heads
    if kv and heads % kv:
        raise CLIError(f"--num-heads {heads}: model {model.name!r} has {kv} key/value heads, which must divide the "
                       f"attention heads; give a multiple of {kv}")
    return replace(model, num_heads=heads)


def grouped_view(args: argparse.Namespace, base: Any, lengths: list[int] | None) -> Any:
    """``base`` (one replica) under ``--sharding`` with its shard group: ``--shard-group-size`` if a number,
    else the smallest that fits the states and ``lengths`` (:mod:`~lightning_dcp.planning.sharding.shard_group_size`)."""
    from lightning_dcp.planning.sharding.shard_group_size import NoShardGroupFits, choose_shard_group_size

    k = shard_group_size(args)
    if k is None:
        def holds(size: int) -> int:
            view = mode_view(args, base, size)
            return max((view.max_length(p) for p in view.sp_sizes(args.world_size)), default=0)

        try:
            choice = choose_shard_group_size(args.world_size, parts_of(base), base.memory_limit, mode=args.sharding,
                                             gpus_per_node=base.gpus_per_node, offload=args.offload, workspace_bytes=base.workspace_bytes,
                                             longest=max(lengths) if lengths else None,
                                             longest_fitting=holds if lengths else None,
                                             limit_source=base.memory_limit_source)
        except NoShardGroupFits as err:
            raise CLIError(str(err)) from None
        k = choice.size
        print(f"shard group size {k}: {choice.reason}")
    return mode_view(args, base, k)


def mode_view(args: argparse.Namespace, base: Any, k: int) -> Any:
    """The analytic one-replica ``base`` planned for ``--sharding`` over shard groups of ``k``."""
    from lightning_dcp.planning.sharding.registry import get_mode

    return get_mode(args.sharding, args.world_size, shard_group_size=k, offload=args.offload).plan_with(base, parts_of(base))


def parts_of(analytic: Any) -> Any:
    from lightning_dcp.planning.analytic import replica_parts

    return replica_parts(analytic)


def shard_group_size(args: argparse.Namespace) -> int | None:
    """``--shard-group-size`` as a number (``None``: pick one; ``'auto'`` is ``simulate``'s search)."""
    given = getattr(args, "shard_group_size", None)
    if given in (None, "auto"):
        return None
    try:
        k = int(given)
    except ValueError:
        raise CLIError(f"--shard-group-size must be a number of ranks (or 'auto' for simulate), got {given!r}") from None
    if k < 1 or args.world_size % k:
        raise CLIError(f"--shard-group-size {k} must divide --world-size {args.world_size}")
    return k


def _check_profile_fits(args: argparse.Namespace, profile: dict) -> None:
    """A profile holds one model on one world size: :class:`CLIError` (a warning with ``--force``)
    when ``--world-size`` is larger than the world it was made on (its SP sizes stop there) or an
    explicit ``--model`` differs from the profiled model's shape."""
    problems = []
    made_on = int(profile.get("key", {}).get("world_size", 0) or 0)
    if made_on and args.world_size > made_on:
        problems.append(f"it was measured on {made_on} rank(s), so it has no SP size above {made_on}, but "
                        f"--world-size is {args.world_size}; profile on {args.world_size} ranks")
    if args.model is not None:
        from lightning_dcp.planning.models import get_model

        try:
            spec = get_model(args.model)
        except ValueError as err:
            raise CLIError(str(err)) from None
        shape = profile.get("model", {})
        diff = [f"{f} {shape[f]} (profile) vs {getattr(spec, f)} ({args.model})" for f in ("num_layers", "num_heads", "hidden_size")
                if f in shape and shape[f] != getattr(spec, f)]
        if diff:
            problems.append(f"its model differs from --model {args.model}: {', '.join(diff)}; drop --model (the profile "
                            "is the model) or profile that model")
    if not problems:
        return
    message = f"profile {args.profile} does not fit this plan: " + "; ".join(problems)
    if not args.force:
        raise CLIError(message + " (or pass --force to use it anyway)")
    print(f"lightning-dcp: warning: {message}", file=sys.stderr)


def resolve_seed(args: argparse.Namespace) -> int:
    """``--seed``, else the seed ``DCPStrategy(seed=None)`` trains with (:func:`~lightning_dcp.planning.seed.data_seed`)."""
    from lightning_dcp.planning.seed import data_seed

    try:
        args.seed = data_seed(args.seed)
    except ValueError as err:
        raise CLIError(str(err)) from None
    return args.seed


def check_policy(name: str) -> None:
    from lightning_dcp.planning.planner import POLICIES
    if name not in POLICIES:
        raise CLIError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}")


def read_lengths(path: Path) -> list[int]:
    """A JSON list of positive integers; :class:`CLIError` naming the problem otherwise."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise CLIError(f"cannot read lengths file {path}: {err.strerror or err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CLIError(f"lengths file {path} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                       f"it must be a JSON list of positive integers, e.g. [2048, 4096]") from None
    if not isinstance(data, list):
        raise CLIError(f"lengths file {path} holds a JSON {type(data).__name__}; it must be a JSON list of positive integers, "
                       f"e.g. [2048, 4096]")
    from lightning_dcp.planning.lengths import check_lengths

    try:
        return check_lengths(data, f"lengths file {path}")
    except ValueError as err:
        raise CLIError(str(err)) from None


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it back at once
    os.umask(mask)
    return mask


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a failure leaves nothing behind.

    The file gets the mode a plain ``open(path, "w")`` would give it (``0o666`` minus the umask,
    usually ``0o644``), not the ``0o600`` of the temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lightning_dcp.planning.planner import POLICIES

    parser.add_argument("--lengths", type=Path, required=True, help="JSON list of sample lengths (tokens); sample i = index i")
    parser.add_argument("--out", type=Path, required=True, help="where to write the plan JSON")
    parser.add_argument("--policy", default="dcp", help=f"one of {', '.join(POLICIES)} (default dcp), as DCPStrategy(policy=...)")
    add_cost_model_arguments(parser)
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="samples per global batch instead of --global-batch-tokens, as DCPStrategy(global_batch_size=...)")
    parser.add_argument("--max-sp-size", type=int, default=None, help="largest SP size, as DCPStrategy(max_sp_size=...)")
    parser.add_argument("--epochs", type=int, default=1, help="plan this many epochs, one after the other (default 1)")
    parser.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True,
                        help="draw each epoch's order as DCPStrategy(shuffle=True) does (torch.randperm seeded seed + epoch; "
                             "default); --no-shuffle: dataset order")
    parser.add_argument("--drop-last", action=argparse.BooleanOptionalAction, default=True,
                        help="drop each epoch's incomplete last global batch, as DCPStrategy(drop_last=True) (default); "
                             "--no-drop-last plans it too")
    parser.add_argument("--indent", type=int, default=None, help="pretty-print the JSON with this indent")


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise CLIError(f"{flag} must be positive, got {value}")


def run(args: argparse.Namespace) -> int:
    from lightning_dcp.planning.errors import PlanningError
    from lightning_dcp.planning.plan import Plan
    from lightning_dcp.planning.checks import validate_plan
    from lightning_dcp.planning.planner import Planner

    check_policy(args.policy)
    resolve_seed(args)
    gbt, gbs = args.global_batch_tokens, args.global_batch_size
    if gbt is not None and gbs is not None:
        raise CLIError("give one of --global-batch-tokens and --global-batch-size, as DCPStrategy takes one")
    for flag, value in (("--global-batch-tokens", gbt), ("--global-batch-size", gbs), ("--epochs", args.epochs),
                        ("--max-sp-size", args.max_sp_size)):
        _positive(flag, value)
    lengths = read_lengths(args.lengths)
    cost_model = build_cost_model(args, lengths)
    if args.shuffle:
        from lightning_dcp.runtime.sampler import epoch_order  # torch.randperm: the sampler's own permutation
    else:
        epoch_order = None
    steps, epoch_steps, left_out = [], [], 0
    try:
        planner = Planner(args.world_size, cost_model, args.policy, seed=args.seed, dataset_lengths=lengths, ring=args.ring,
                          max_sp_size=args.max_sp_size)
        for epoch in range(args.epochs):
            order = None if epoch_order is None else epoch_order(len(lengths), args.seed, epoch)
            cut = dict(global_batch_tokens=gbt, global_batch_size=gbs, order=order, drop_last=args.drop_last)
            planned = [i for batch in planner.batches(lengths, **cut) for i in batch]
            if not planned:
                size = f"{gbs} samples" if gbs is not None else f"{gbt or 'the default'} tokens"
                raise CLIError(f"the {len(lengths)} samples ({sum(lengths)} tokens) give no full global batch of {size}: "
                               f"lower --global-batch-tokens / --global-batch-size, or plan the incomplete batch with "
                               f"--no-drop-last (DCPStrategy(drop_last=False))")
            plan = planner.plan(lengths, epoch=epoch, **cut)
            validate_plan(plan, lengths, cost_model, samples=planned)
            steps.extend(plan.steps)
            epoch_steps.append(len(plan.steps))
            left_out += len(lengths) - len(planned)
    except PlanningError as err:
        raise CLIError(str(err)) from None
    extra = {"seed": args.seed, "shuffle": args.shuffle, "drop_last": args.drop_last, "epoch_steps": epoch_steps,
             **({"global_batch_size": gbs} if gbs is not None else {"global_batch_tokens": gbt} if gbt else {})}
    plan = Plan(args.policy, args.world_size, tuple(steps), extra)
    write_atomic(args.out, plan.to_json(indent=args.indent) + "\n")
    print(f"wrote {args.out}: policy {args.policy}, {len(lengths)} samples, {sum(lengths)} tokens, {args.epochs} "
          f"epoch(s), {len(plan.steps)} steps on {args.world_size} GPUs"
          + (f" ({left_out} samples in incomplete last batches dropped; --no-drop-last plans them)" if left_out else ""))
    return 0
