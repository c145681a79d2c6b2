""":func:`profile_module`: run the grid, fit the constant parts, assemble a v1 profile.

The measuring recipe (what one grid point and the constant section measure) is described in
:mod:`lightning_dcp.profiling`; this module sequences it: set up (layers, samples, grid) →
measure every grid point → measure the constant parts at SP 1 → assemble and validate the
``lightning-dcp/profile/v1`` dict, identical on every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_dcp.sp.context import SPContext, sp_context
from lightning_dcp.planning.profile import PROFILE_SCHEMA, validate_profile
from lightning_dcp.profiling import harness, measure
from lightning_dcp.profiling.deadline import ProfileDeadline, Skip, skipped_line
from lightning_dcp.profiling.forecast import PASSES_AFTER_WARMUP, PointForecast
from lightning_dcp.profiling.grid import (DENSITIES, GridPoint, ProfileGrid, Samples, build_grid, check_sp_sizes,
                                          default_sp_sizes, select_lengths)
from lightning_dcp.profiling.layers import LayerStack, layer_stack
from lightning_dcp.sp.contract import ModelContract, local_batch, read_model

log = logging.getLogger(__name__)

__all__ = ["CPU_MEMORY_LIMIT", "profile_module"]

CPU_MEMORY_LIMIT = 8 * 2**30


@dataclass
class _Run:
    """What every stage of one profiling run shares."""

    module: nn.Module
    contract: ModelContract
    device: torch.device
    autocast: Callable[[], ContextManager]
    step_fn: Callable[[nn.Module, Any], torch.Tensor]
    world_size: int
    rank: int
    stack: LayerStack
    heads: int | None
    samples: Samples
    exclude: set[int]


def _prepare(module: nn.Module, data: Any, device: Any, autocast: Any, step_fn: Any, contract: ModelContract,
             num_heads: int | None) -> _Run:
    distributed = dist.is_available() and dist.is_initialized()
    params = list(module.parameters())
    exclude = {p.untyped_storage().data_ptr() for p in params} | {b.untyped_storage().data_ptr() for b in module.buffers()}
    return _Run(
        module=module,
        contract=contract,
        device=torch.device(device) if device is not None else params[0].device,
        autocast=autocast or contextlib.nullcontext,
        step_fn=step_fn or harness.default_step,
        world_size=dist.get_world_size() if distributed else 1,
        rank=dist.get_rank() if distributed else 0,
        stack=layer_stack(contract),
        heads=num_heads or contract.num_heads,
        samples=Samples(data),
        exclude=exclude,
    )


def _plan_grid(run: _Run, lengths: Sequence[int] | None, micro_batch_sizes: Sequence[int] | None,
               sp_sizes: Sequence[int] | None, density: str) -> ProfileGrid:
    """Rank 0's grid, broadcast: lengths the data has (nearest to those asked), sizes checked."""
    count, default_mbs = DENSITIES[density]
    sps = check_sp_sizes(sp_sizes if sp_sizes is not None else default_sp_sizes(run.world_size, run.heads),
                         run.world_size, run.heads)
    wanted = list(lengths) if lengths is not None else select_lengths(run.samples.lengths, count)
    actual = sorted({run.samples.pick(n, 1)[0] for n in wanted})
    if lengths is not None and actual != sorted(set(int(n) for n in wanted)):
        log.info("profile lengths %s not all in the data; using the nearest lengths it has: %s", sorted(wanted), actual)
    return measure.broadcast(build_grid(actual, micro_batch_sizes or default_mbs, sps))


#: What one grid point measures (see :func:`lightning_dcp.profiling.measure.measure_point`).
_MEASURED = ("forward_s", "backward_s", "recompute_s", "activation_bytes", "input_bytes", "peak_bytes")


def _measure_one(run: _Run, point: GridPoint, group_for: Callable | None,
                 proceed: Callable[[float], bool] | None) -> tuple[int, dict[str, float] | None]:
    """(length actually run, this rank's measurement, ``None`` when ``proceed`` abandoned the point after its
    warm-up pass) for one grid point on its SP group. ``proceed`` is a world collective: every rank calls it once
    (or none does: ``None``, a point that runs whatever it costs)."""
    from lightning_dcp.sp.packing import pack_samples

    p = point.sp
    block = run.rank // p * p
    sp_rank = run.rank - block
    seq_len, idx = run.samples.pick(point.seq_len, point.micro_batch)
    if block + p > run.world_size:  # no aligned block of p ranks holds this rank (W=3: rank 2 at SP 2)
        # it sits the point out; the MAX over ranks ignores it
        return seq_len, dict.fromkeys(_MEASURED, 0.0) if proceed is None or proceed(0.0) else None
    group = group_for(list(range(block, block + p))) if p > 1 else None
    batch = pack_samples([run.samples[i] for i in idx], pad_to_multiple=p, sample_indices=idx)
    batch = harness.to_device(local_batch(run.contract, batch, sp_rank, p, "token").data, run.device)
    with sp_context(SPContext(group=group, size=p, rank=sp_rank, recompute=0)):
        args, kwargs = measure.capture(run.module, run.stack, batch, run.step_fn, run.autocast)
        m = measure.measure_point(run.stack, args, kwargs, run.device, run.autocast, run.exclude, group, proceed)
    return seq_len, m


#: A point forecast to fit the budget this many times over skips the probe after its first pass.
PROBE_MARGIN = 10.0


def _agreed_elapsed(deadline: ProfileDeadline, run: _Run) -> float:
    return measure.allreduce_max([deadline.elapsed()], run.device)[0]


def _measure_grid(run: _Run, grid: ProfileGrid, group_for: Callable | None, deadline: ProfileDeadline,
                  forecast: PointForecast, after_first: Callable[[], None]) -> list[dict]:
    """The grid's entries, agreed by MAX over ranks. Required points always run; any other point only when its
    forecast (and, after its warm-up pass, the forecast of its remaining passes), plus the constant parts still
    to measure, ends within the budget; the others are recorded in ``deadline.skipped``. Every decision is taken
    on values agreed over the ranks, so every rank measures the same points (a point forecast to fit
    :data:`PROBE_MARGIN` times over is not probed). ``after_first()`` runs once the first
    point is measured (the constants at the shortest length: a bypassed layer must know what a layer returns)."""
    entries: list[dict] = []
    elapsed = _agreed_elapsed(deadline, run)
    for point in grid.points:
        longest = max([point.seq_len, *(e["seq_len"] for e in entries)])
        reserve = forecast.constant(longest) if longest > grid.lengths[0] else 0.0  # the constants at the end
        ahead = forecast.point(point.seq_len, point.micro_batch, point.sp)
        if not point.required and ahead is not None and not deadline.allows(ahead + reserve, elapsed):
            deadline.skip(Skip(point.seq_len, point.micro_batch, point.sp, ahead))
            continue
        began = elapsed
        probe: dict[str, float] = {}

        def proceed(warmup_s: float) -> bool:
            warm, now = measure.allreduce_max([warmup_s, deadline.elapsed()], run.device)
            probe["rest"] = warm * PASSES_AFTER_WARMUP
            return deadline.allows(probe["rest"] + reserve, now)

        # no collective to ask after the first pass: a point that runs whatever it costs, or one whose forecast fits
        # the budget PROBE_MARGIN times over (a probe syncs the ranks mid-point: on a loaded machine that costs)
        no_probe = point.required or deadline.budget_s is None or (
            ahead is not None and deadline.allows(PROBE_MARGIN * ahead + reserve, elapsed))
        seq_len, m = _measure_one(run, point, group_for, None if no_probe else proceed)
        if m is None:  # abandoned after its warm-up pass: its forecast is the pass so far plus the passes left
            elapsed = _agreed_elapsed(deadline, run)
            deadline.skip(Skip(point.seq_len, point.micro_batch, point.sp, elapsed - began + probe.get("rest", 0.0)))
            continue
        fwd, bwd, rec, act, inp, peak, elapsed = measure.allreduce_max(
            [m["forward_s"], m["backward_s"], m["recompute_s"], m["activation_bytes"], m["input_bytes"], m["peak_bytes"],
             deadline.elapsed()], run.device)
        forecast.record(seq_len, point.micro_batch, point.sp, elapsed - began)
        entries.append({"seq_len": seq_len, "micro_batch": point.micro_batch, "sp": point.sp, "forward_s": fwd,
                        "backward_s": bwd, "recompute_s": rec, "activation_bytes": int(act), "input_bytes": int(inp),
                        "peak_bytes": int(peak) if run.device.type == "cuda" else None})
        if len(entries) == 1:
            after_first()
            elapsed = _agreed_elapsed(deadline, run)
    return entries


@dataclass
class _States:
    """Model-state sizes of the full model (a replica's, whatever the sharding): what is reduced, stepped
    and held; ``memory_bytes = weight_bytes + buffer_bytes + param_bytes + optimizer_bytes``."""

    trainable_numel: int
    param_bytes: int
    grad_dtype: torch.dtype
    weight_bytes: int
    buffer_bytes: int
    optimizer_bytes: int

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.buffer_bytes + self.param_bytes + self.optimizer_bytes


def _model_states(module: nn.Module, states_module: nn.Module | None, optimizer: Any) -> _States:
    source = states_module if states_module is not None else module
    params = list(source.parameters())  # a sharded (DTensor) parameter counts its global size
    trainable = [p for p in params if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in trainable)
    return _States(sum(p.numel() for p in trainable), param_bytes, trainable[0].dtype if trainable else torch.float32,
                   weight_bytes=sum(p.numel() * p.element_size() for p in params),
                   buffer_bytes=sum(b.numel() * b.element_size() for b in source.buffers()),
                   optimizer_bytes=measure.optimizer_state_estimate(getattr(optimizer, "optim", optimizer), param_bytes))


def _constant_at(run: _Run, n: int) -> tuple[int, float, float, float]:
    """``(length run, seconds of the step with the layers bypassed, bytes it saves, host seconds)`` at SP 1."""
    from lightning_dcp.sp.packing import pack_samples

    seq_len, idx = run.samples.pick(n, 1)
    host = _host_time(run, idx)
    packed = pack_samples([run.samples[i] for i in idx], sample_indices=idx)
    batch = harness.to_device(local_batch(run.contract, packed, 0, 1, "token").data, run.device)
    with sp_context(SPContext()):
        t, saved = measure.measure_constant_run(run.module, run.stack, batch, run.step_fn, run.device, run.autocast,
                                                run.exclude)
    return seq_len, t, saved, host


def _constant_line(run: _Run, const: list[tuple[int, float, float, float]], optimizer: Any,
                   states: _States) -> dict[str, float]:
    """The ``constant`` section's measured fields: a line ``c0 + c1 * tokens`` through the step with the layers
    bypassed at the shortest and the longest length measured (SP 1; flat when only one was), the host's line
    likewise, optimizer and all-reduce time."""
    (n0, t0, s0, h0), (n1, t1, s1, h1) = const[0], const[-1]
    slope = max(0.0, (t1 - t0) / (n1 - n0)) if n1 > n0 else 0.0
    c0 = max(0.0, t0 - slope * n0)
    act_per_token = max(s0 / n0, s1 / n1)
    opt_s = measure.optimizer_time(optimizer, run.stack.measured_layer, states.trainable_numel)
    allreduce_s = measure.allreduce_time(states.param_bytes, states.grad_dtype, run.device)
    host_slope = max(0.0, (h1 - h0) / (n1 - n0)) if n1 > n0 else 0.0
    host_c = max(0.0, h0 - host_slope * n0)
    c0, slope, act_per_token, opt_s, allreduce_s, host_c, host_slope = measure.allreduce_max(
        [c0, slope, act_per_token, opt_s, allreduce_s, host_c, host_slope], run.device)
    return {"time_s": c0, "time_per_token_s": slope, "optimizer_s": opt_s, "allreduce_s": allreduce_s,
            "activation_bytes_per_token": act_per_token, "host_s": host_c, "host_per_token_s": host_slope}


def _host_time(run: _Run, idx: list[int], repeats: int = 5) -> float:
    """Seconds of the host's work for one micro-batch, as the runtime does it: load and pack the
    samples, the module's ``dcp_prepare_batch``, token weights, the shard, the copy to the device
    (the median of ``repeats``, as the layer timings)."""
    from lightning_dcp.sp.packing import pack_samples

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        packed = pack_samples([run.samples[i] for i in idx], sample_indices=idx)
        harness.to_device(local_batch(run.contract, packed, 0, 1, "token").data, run.device)
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def default_memory_limit(device: torch.device, memory_fraction: float = 0.9) -> float:
    """Usable bytes per device: CUDA total memory x ``memory_fraction``; 8 GiB on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory * memory_fraction
    return float(CPU_MEMORY_LIMIT)


def default_key(module: nn.Module, device: torch.device, precision: str, world_size: int) -> dict:
    """The cache key of a profile of ``module`` measured here (:class:`~lightning_dcp.profiling.cache.ProfileKey`)."""
    from lightning_dcp._version import __version__
    from lightning_dcp.profiling.cache import ProfileKey, device_name, model_signature

    return ProfileKey(model_signature(module), device_name(device), precision, world_size, __version__).to_dict()


def _assemble(run: _Run, grid: ProfileGrid, entries: list[dict], deadline: ProfileDeadline, constant: dict[str, float],
              states: _States, *, key: Mapping[str, Any], num_layers: int | None, memory_limit_bytes: float,
              density: str, profiling_s: float) -> dict:
    hidden = run.contract.hidden_size
    device = run.device
    return {
        "schema": PROFILE_SCHEMA,
        "key": dict(key),
        "model": {"num_layers": int(num_layers or len(run.stack)), "num_heads": int(run.heads or max(grid.sp_sizes)),
                  **({"hidden_size": hidden} if hidden else {}),
                  **({"per_sample_cost": True} if run.contract.per_sample_cost else {})},
        "device": {"memory_limit_bytes": float(memory_limit_bytes),
                   "gpus_per_node": torch.cuda.device_count() if device.type == "cuda" else 1},
        "constant": {**constant, "memory_bytes": float(states.memory_bytes), "param_bytes": float(states.param_bytes),
                     "weight_bytes": float(states.weight_bytes), "buffer_bytes": float(states.buffer_bytes),
                     "optimizer_bytes": float(states.optimizer_bytes)},
        "entries": entries,
        "meta": {"created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 "profiling_s": round(profiling_s, 3), "grid": len(entries),
                 "skipped": sum(s.what == "point" for s in deadline.skipped),
                 "skipped_points": [s.to_dict() for s in deadline.skipped], "time_budget_s": deadline.budget_s,
                 "time_budget_source": deadline.source, "measured_lengths": sorted({e["seq_len"] for e in entries}),
                 "density": density, "host": platform.node(),
                 "lengths": grid.lengths, "micro_batch_sizes": grid.micro_batch_sizes, "sp_sizes": grid.sp_sizes,
                 "profiled_layers": len(run.stack)},
    }


def profile_module(
    module: nn.Module,
    data: Any,
    *,
    device: torch.device | str | None = None,
    precision: str = "32-true",
    autocast: Callable[[], ContextManager] | None = None,
    step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    optimizer: Any = None,
    group_for: Callable[[Sequence[int]], Any] | None = None,
    lengths: Sequence[int] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    sp_sizes: Sequence[int] | None = None,
    density: str = "coarse",
    time_budget_s: float | None = 60.0,
    memory_limit_bytes: float | None = None,
    memory_fraction: float = 0.9,
    layers_attr: str | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
    key: Mapping[str, Any] | None = None,
    states_module: nn.Module | None = None,
    cpu_clock: str = "wall",
    contract: ModelContract | None = None,
    deadline: ProfileDeadline | None = None,
) -> dict:
    """Measure a dual-layer profile of ``module`` on ``data``; return a valid v1 profile dict.

    A collective when ``torch.distributed`` is initialised with more than one rank: every rank
    calls it with the same arguments (rank 0's grid is broadcast) and gets the same profile.

    Args:
        module: the model (a LightningModule, or any module ``step_fn`` can drive; its layers as
            :mod:`lightning_dcp.sp.contract` reads them), already on ``device``.
        data: a dataset with ``.lengths`` and ``__getitem__``, or a list of sample dicts.
        device: where to measure (default: the device of the module's first parameter).
        precision: Lightning precision name recorded in the key (``"32-true"``, ``"bf16-mixed"``...).
        autocast: factory of the context the forward runs in (Lightning's
            ``precision_plugin.train_step_context``; default none).
        step_fn: ``step_fn(module, batch) -> loss``; default ``module.training_step(batch, 0)``.
        optimizer: the optimizer whose step is timed (on clones); ``None`` gives ``optimizer_s = 0``.
        group_for: ``group_for(ranks) -> ProcessGroup | None`` (``DCPStrategy.sp_groups.group_for``);
            on several ranks without it, groups are created with :func:`~lightning_dcp.profiling.harness.make_sp_groups`.
        lengths: grid lengths (default: quantiles of the data's lengths, 4 coarse / 8 fine).
        micro_batch_sizes: default ``(1, 2)`` coarse, ``(1, 2, 4)`` fine.
        sp_sizes: default every size up to the world size that divides ``num_heads`` (powers of two when unknown).
        density: ``"coarse"`` or ``"fine"``.
        time_budget_s: wall seconds for the whole profile (``None``: every point); see
            :class:`~lightning_dcp.profiling.deadline.ProfileDeadline` for what runs and what is skipped.
        deadline: the budget as a ``ProfileDeadline`` (start, clock, the setting messages name); replaces
            ``time_budget_s``. :class:`DCPProfiler` starts it at fit start.
        memory_limit_bytes: ``device.memory_limit_bytes`` (default: CUDA total x ``memory_fraction``, CPU 8 GiB).
        layers_attr: dotted path to the repeated layers of a module with several stacks; ignored with ``contract``.
        num_layers: ``model.num_layers`` to record (default: the repeated layers'; the CLI's full count).
        num_heads: attention heads, which SP sizes divide (default: the contract's, else the module's).
        key: the ``key`` section (a ``ProfileKey`` dict); default from the module, device, precision, world size.
        states_module: whose parameters set ``param_bytes``, ``memory_bytes``, optimizer scaling (default ``module``).
        cpu_clock: ``"wall"`` (default) or ``"process"`` (``time.process_time``; one torch thread, SP 1 only).
        contract: what to read off ``module`` (default :func:`~lightning_dcp.sp.contract.read_model`).
    """
    deadline = deadline if deadline is not None else ProfileDeadline(time_budget_s)
    _check_options(cpu_clock, density)
    contract = contract if contract is not None else read_model(module, layers_attr)
    run = _prepare(module, data, device, autocast, step_fn, contract, num_heads)
    _refuse_safe_mode(contract)
    grid = _plan_grid(run, lengths, micro_batch_sizes, sp_sizes, density)
    states = _model_states(module, states_module, optimizer)
    entries, constant = _measure_all(module, run, grid, group_for, optimizer, states, cpu_clock, deadline)
    profile = _assemble(
        run, grid, entries, deadline, constant, states,
        key=key if key is not None else default_key(module, run.device, precision, run.world_size),
        num_layers=num_layers, density=density,
        memory_limit_bytes=memory_limit_bytes if memory_limit_bytes is not None else default_memory_limit(run.device, memory_fraction),
        profiling_s=deadline.elapsed(),
    )
    line = skipped_line(profile["meta"])
    if line:
        log.info(line)
    profile = measure.broadcast(profile)  # rank 0's copy everywhere (profiling_s and host may differ per rank)
    return validate_profile(profile)


def _check_options(cpu_clock: str, density: str) -> None:
    if cpu_clock not in measure.CPU_CLOCKS:
        raise ValueError(f"cpu_clock must be one of {sorted(measure.CPU_CLOCKS)}, got {cpu_clock!r}")
    if density not in DENSITIES:
        raise ValueError(f"density must be one of {sorted(DENSITIES)}, got {density!r}")


def _refuse_safe_mode(contract: ModelContract) -> None:
    if contract.support == "safe":
        raise ValueError(f"profile_module measures packed micro-batches, but {contract.name} runs in safe mode (its "
                         "batches come from its own collate_fn); declare dcp_support = 'packed' or 'sp' if the model "
                         "attends within each sample of a packed batch")


def _measure_all(module: nn.Module, run: Any, grid: Any, group_for: Any, optimizer: Any, states: Any, cpu_clock: str,
                 deadline: ProfileDeadline) -> tuple[Any, Any]:
    """The grid's entries and the constant parts: the constants at the shortest length after the first point
    (always; the forecast of the last step scales them), the grid, then the constants at the longest length measured, when
    they are forecast to fit the budget (else the constant line stays flat and that is recorded as skipped). SP
    groups this creates (no ``group_for`` given on several ranks) are destroyed before it returns."""
    own_groups = None
    if group_for is None and run.world_size > 1 and any(p > 1 for p in grid.sp_sizes):
        own_groups = harness.make_sp_groups(run.world_size, grid.sp_sizes)
        group_for = own_groups.group_for
    forecast = PointForecast()
    try:
        with measure.cpu_clock(cpu_clock), harness.preserved_state(module), harness.muted_logging(module):
            module.train()
            const: list[tuple[int, float, float, float]] = []

            def shortest_constant() -> None:
                began = _agreed_elapsed(deadline, run)
                const.append(_constant_at(run, grid.lengths[0]))
                forecast.record_constant(const[0][0], _agreed_elapsed(deadline, run) - began)

            entries = _measure_grid(run, grid, group_for, deadline, forecast, shortest_constant)
            longest = max(e["seq_len"] for e in entries if e["sp"] == min(grid.sp_sizes))
            if longest > const[0][0]:
                if deadline.allows(forecast.constant(longest), _agreed_elapsed(deadline, run)):
                    const.append(_constant_at(run, longest))
                else:
                    deadline.skip(Skip(longest, 1, 1, forecast.constant(longest), what="constant"))
            constant = _constant_line(run, const, optimizer, states)
    finally:
        if own_groups is not None:
            own_groups.destroy()
    return entries, constant
