"""Dual-layer profiling (DCP paper §3.5): measure two repeated layers, write a v1 profile.

:class:`DCPProfiler` is a Lightning callback; at ``on_fit_start`` it loads the profile from the
cache (:mod:`lightning_dcp.profile_cache`) or measures it with :func:`profile_module`, the
measuring core that the ``lightning-dcp profile`` command uses outside a fit too.

What one grid point ``(seq_len l, micro_batch b, sp p)`` measures, generically:

1. **Input.** ``b`` dataset samples of length exactly ``l`` (the grid lengths are taken *from*
   the dataset's lengths; with fewer than ``b`` such samples the same samples repeat; a requested
   length the data lacks is replaced by the nearest length it has, and the entry records the
   length actually run). They are packed with :func:`lightning_dcp.packing.pack_samples`
   (``pad_to_multiple=p``), sharded for this rank of its SP group, and moved to the device.
2. **Capture.** The module's own step (``training_step`` by default) runs under the SP context
   until the :class:`~lightning_dcp.recompute.RecomputeLayers` is called; a forward pre-hook
   records its ``(args, kwargs)`` and stops the step. Nothing else about the model is assumed.
3. **Two layers**, no checkpointing, the SP context of the group active: ``layers[0]`` forward +
   backward (warm-up), ``layers[1]`` forward with saved-tensor hooks (activation count) +
   backward, then ``layers[1]`` forward and backward timed separately, repeated (at least 3
   times and until 50 ms were measured, at most 10): the medians are kept on CUDA, the minima on
   CPU (CPU timings carry one-sided noise from other processes sharing the cores; the minimum is
   the reproducible estimate there). Then ``layers[1]`` once more, fwd + bwd under
   :class:`~lightning_dcp.recompute.RecomputeLayers` checkpointing (as a recomputed layer runs
   in training): ``recompute_s`` (added optional field) = that time - ``forward_s`` -
   ``backward_s``, the real extra cost of recomputing one layer (its forward again plus the
   checkpoint machinery; paper eq. 5 approximates it by ``forward_s``). Inputs: a detached,
   grad-requiring copy of the captured ``x`` (and of any other floating tensor argument that
   required grad); the backward seeds a random gradient of the output's shape. Timing:
   ``torch.cuda.Event`` on CUDA, ``time.perf_counter`` on CPU.
4. **Memory.** ``activation_bytes``: the bytes of the unique storages (deduplicated by
   ``untyped_storage().data_ptr()``, each counted at ``untyped_storage().nbytes()``) that
   ``layers[1]``'s forward saves for backward, excluding parameters, buffers, the layer input
   ``x`` and every tensor of the captured arguments (the batch). ``input_bytes``:
   ``x.numel() * x.element_size()``. So paper eq. 6 reads
   ``M = (L - r) * activation_bytes + L * input_bytes + M_C``. ``peak_bytes`` (CUDA only):
   ``torch.cuda.max_memory_allocated`` during the point, absolute (model states included).
5. **Agreement.** On ``W > 1`` ranks every rank runs every point in the same order (the grid is
   built on rank 0 and broadcast); the ranks of each aligned block of ``p`` form the SP group and
   run the same micro-batch; the numbers are ``all_reduce(MAX)``-ed over the world, so every rank
   ends with the same entries.

Constant parts, measured once at SP 1 (``constant`` section):

* ``time_s`` / ``time_per_token_s`` (added optional field): the module's step forward + backward
  with the repeated layers *bypassed* (``layers`` returns its input), timed at the smallest and
  the largest grid length; a two-point line ``c0 + c1 * local_tokens`` (both clamped >= 0).
  ``time_s = c0``, the per-micro-batch cost; ``time_per_token_s = c1`` (embedding, head, loss
  grow with tokens). ``activation_bytes_per_token`` (added optional field): bytes saved for
  backward outside the repeated layers in that run, per local token.
* ``optimizer_s``: a fresh optimizer of the same class and defaults steps over *clones* of
  ``layers[1]``'s trainable parameters with random gradients (two untimed steps create the
  state, then the median of three), scaled by ``total trainable numel / layer numel``. The real
  weights and optimizer state are never touched. 0 without an optimizer.
* ``allreduce_s``: ``all_reduce`` of a flat buffer of the gradient bytes over the world (at most
  256 MiB, time scaled linearly to the full size); 0 on one rank.
* ``memory_bytes``: parameter + buffer bytes + gradient bytes (trainable parameters) + optimizer
  state bytes (the real state when it exists; else an estimate: 2x trainable parameter bytes for
  Adam-like optimizers, 1x for SGD with momentum, 0 for plain SGD, 2x otherwise).
* ``param_bytes``: gradient bytes reduced per step.

``device.memory_limit_bytes``: on CUDA ``total_memory * memory_fraction`` (0.9 default), on CPU
8 GiB by default; either overridden by ``memory_limit_bytes``.

Everything runs under :func:`lightning.pytorch.utilities.seed.isolate_rng`, with the module's
train/eval modes, buffers and ``.grad`` restored afterwards: a fit that profiles and one that hits
the cache continue identically.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_dcp.context import SPContext, sp_context
from lightning_dcp.planning.profile import PROFILE_SCHEMA, validate_profile

log = logging.getLogger(__name__)

__all__ = ["DCPProfiler", "GridPoint", "ProfileGrid", "profile_module", "select_lengths", "build_grid", "make_sp_groups"]

#: Lengths per SP size and micro-batch sizes per density (``lengths`` / ``micro_batch_sizes`` override).
DENSITIES = {"coarse": (4, (1, 2)), "fine": (8, (1, 2, 4))}
CPU_MEMORY_LIMIT = 8 * 2**30
_ALLREDUCE_CAP_BYTES = 256 * 2**20
_MIN_REPEATS, _MAX_REPEATS, _MIN_MEASURED_S = 3, 10, 0.05


class _Captured(Exception):
    """Raised by the capture pre-hook to stop the step once the layers' inputs are known."""


# ---------------------------------------------------------------------------------------------
# grid
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GridPoint:
    """One measurement: ``micro_batch`` samples of ``seq_len`` tokens on an SP group of ``sp`` ranks.

    ``required`` points (smallest and largest length at the smallest micro-batch size, and the
    smallest length at the next one) run even past the time budget, so every SP size gets enough
    points to fit ``a*sum(l^2) + b*tokens + c``.
    """

    seq_len: int
    micro_batch: int
    sp: int
    required: bool = False


@dataclass
class ProfileGrid:
    """The ordered grid (required points first) plus what was asked for, for logs and ``meta``."""

    points: list[GridPoint]
    lengths: list[int]
    micro_batch_sizes: list[int]
    sp_sizes: list[int]


def select_lengths(lengths: Sequence[int], count: int) -> list[int]:
    """``count`` lengths of the data at evenly spaced quantiles, min and max included; sorted, unique.

    Every returned value is a length some sample has (quantile by rank, no interpolation).
    """
    if not lengths:
        raise ValueError("cannot pick profile lengths from an empty dataset; give the profiler lengths=[...]")
    ordered = sorted(int(n) for n in lengths)
    count = max(1, int(count))
    if count == 1:
        return [ordered[len(ordered) // 2]]
    picks = {ordered[round(i * (len(ordered) - 1) / (count - 1))] for i in range(count)}
    return sorted(picks)


def _default_sp_sizes(world_size: int, num_heads: int | None) -> list[int]:
    out, p = [], 1
    while p <= world_size:
        if num_heads is None or num_heads % p == 0:
            out.append(p)
        p *= 2
    return out


def build_grid(lengths: Sequence[int], micro_batch_sizes: Sequence[int], sp_sizes: Sequence[int]) -> ProfileGrid:
    """Order the grid: required points of every SP size first, then the rest by SP size and length.

    Points whose per-rank token count would be below 1 (``l * b < p``) are left out.
    """
    lengths = sorted({int(n) for n in lengths})
    mbs = sorted({int(b) for b in micro_batch_sizes})
    sps = sorted({int(p) for p in sp_sizes})
    if not lengths or not mbs or not sps:
        raise ValueError(f"empty profile grid: lengths={lengths}, micro_batch_sizes={mbs}, sp_sizes={sps}")
    if min(lengths) < 1 or min(mbs) < 1 or min(sps) < 1:
        raise ValueError(f"grid values must be positive: lengths={lengths}, micro_batch_sizes={mbs}, sp_sizes={sps}")
    required_keys = {(lengths[0], mbs[0]), (lengths[-1], mbs[0])}
    if len(mbs) > 1:
        required_keys.add((lengths[0], mbs[1]))
    required, optional = [], []
    for p in sps:
        for b in mbs:
            for n in lengths:
                if n * b < p:
                    continue
                (required if (n, b) in required_keys else optional).append(GridPoint(n, b, p, (n, b) in required_keys))
    return ProfileGrid(required + optional, lengths, mbs, sps)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

class _Samples:
    """Lengths plus random access to samples, from a dataset with ``.lengths`` or a list of samples."""

    def __init__(self, data: Any):
        from lightning_dcp.packing import sample_length

        self.data = data
        lengths = getattr(data, "lengths", None)
        if lengths is None:
            if not isinstance(data, Sequence):
                raise TypeError(
                    f"the profiler needs the dataset's sample lengths: {type(data).__name__} has no `.lengths`; give the "
                    "dataset a `lengths` list (tokens per sample) or pass DCPProfiler(dataset=...) one that has it"
                )
            lengths = [sample_length(s) for s in data]
        self.lengths = [int(n) for n in lengths]
        if not self.lengths:
            raise ValueError("the profiler got an empty dataset; it needs samples to build micro-batches from")

    def pick(self, seq_len: int, count: int) -> tuple[int, list[int]]:
        """(length actually used, ``count`` sample indices of that length; repeated if too few)."""
        exact = [i for i, n in enumerate(self.lengths) if n == seq_len]
        if not exact:
            nearest = min(self.lengths, key=lambda n: (abs(n - seq_len), n))
            seq_len = nearest
            exact = [i for i, n in enumerate(self.lengths) if n == seq_len]
        return seq_len, [exact[i % len(exact)] for i in range(count)]

    def __getitem__(self, index: int) -> Any:
        return self.data[index]


def make_sp_groups(world_size: int, sp_sizes: Sequence[int]) -> Callable[[Sequence[int]], Any]:
    """Create the SP groups of every aligned block up to ``max(sp_sizes)`` (:class:`lightning_dcp.groups.SPGroups`;
    a collective: every rank calls it with the same arguments) and return their ``group_for``.

    For use outside :class:`~lightning_dcp.DCPStrategy`, which has its own ``sp_groups``.
    """
    from lightning_dcp.groups import SPGroups

    return SPGroups(world_size, dist.get_rank(), max_sp_size=max(sp_sizes)).group_for


def _shard_batch(module: nn.Module, batch: dict, sp: int, sp_rank: int) -> dict:
    """This rank's shard of a packed micro-batch: the module's ``dcp_shard_batch`` hook if it has
    one, else :mod:`lightning_dcp.sharding`'s function; identity at SP 1."""
    if sp == 1:
        return batch
    hook = getattr(module, "dcp_shard_batch", None)  # (batch, sp_rank, sp_size), as DCPStrategy calls it
    if callable(hook):
        return hook(batch, sp_rank, sp)
    from lightning_dcp.sharding import shard_batch

    return shard_batch(batch, sp_rank, sp)


def _to_device(batch: Any, device: torch.device) -> Any:
    from lightning.fabric.utilities.apply_func import move_data_to_device

    return move_data_to_device(batch, device)


def _default_step(module: nn.Module, batch: Any) -> torch.Tensor:
    """``module.training_step(batch, 0)``, the loss out of a dict if it returns one."""
    out = module.training_step(batch, 0)
    if isinstance(out, Mapping):
        out = out["loss"]
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"{type(module).__name__}.training_step returned {type(out).__name__}, not a loss tensor; pass "
            "step_fn=lambda module, batch: <loss tensor> to the profiler"
        )
    return out


@contextlib.contextmanager
def _muted_logging(module: nn.Module) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` do nothing while the profiler drives the step."""
    saved = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
    if hasattr(module, "log"):
        module.log = lambda *a, **k: None  # type: ignore[method-assign]
        module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            module.__dict__.pop(name, None)
        module.__dict__.update(saved)


@contextlib.contextmanager
def _preserved_state(module: nn.Module) -> Iterator[None]:
    """Restore train/eval modes, buffers and ``.grad`` of ``module``; isolate the RNG."""
    from lightning.pytorch.utilities.seed import isolate_rng

    modes = {m: m.training for m in module.modules()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    grads = {p: p.grad for p in module.parameters()}
    with isolate_rng(include_cuda=torch.cuda.is_available()):
        try:
            for p in grads:
                p.grad = None
            yield
        finally:
            with torch.no_grad():
                for name, b in module.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])
            for p, g in grads.items():
                p.grad = g
            for m, mode in modes.items():
                m.training = mode


def _find_layers(module: nn.Module, layers_attr: str | None) -> nn.Module:
    from lightning_dcp.recompute import RecomputeLayers, find_recompute_layers

    if layers_attr is not None:
        try:
            layers = module.get_submodule(layers_attr)
        except AttributeError:
            raise ValueError(f"layers_attr={layers_attr!r}: {type(module).__name__} has no submodule of that name") from None
        if not isinstance(layers, RecomputeLayers):
            raise TypeError(f"layers_attr={layers_attr!r} is a {type(layers).__name__}; it must name the model's "
                            "RecomputeLayers (wrap the repeated layers' ModuleList in lightning_dcp.RecomputeLayers)")
        return layers
    found = find_recompute_layers(module)
    if not found:
        raise ValueError(
            f"{type(module).__name__} has no RecomputeLayers: the profiler measures the repeated layers held in one; "
            "wrap them, e.g. self.layers = RecomputeLayers(nn.ModuleList([...]))"
        )
    if len(found) > 1:
        names = {id(m): n for n, m in module.named_modules()}
        biggest = max(found, key=lambda m: sum(p.numel() for p in m.parameters()))
        log.warning("%s has %d RecomputeLayers (%s); profiling the largest, %r. Pass layers_attr=... to choose.",
                    type(module).__name__, len(found), [names.get(id(m)) for m in found], names.get(id(biggest)))
        return biggest
    return found[0]


def _find_int_attr(module: nn.Module, name: str) -> int | None:
    for holder in (module, getattr(module, "spec", None), getattr(getattr(module, "model", None), "spec", None)):
        value = getattr(holder, name, None) if holder is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    for m in module.modules():
        value = getattr(m, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


#: CPU clock used by the timers: ``"wall"`` (perf_counter, the default) or ``"process"`` (process
#: CPU time: immune to other processes sharing the cores, meaningful with one torch thread and SP 1
#: only; for benchmarks on shared machines). Set through ``profile_module(cpu_clock=...)``.
_CPU_CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
_cpu_clock = time.perf_counter


class _Timer:
    """Seconds of ``fn()``: CUDA events on CUDA (synchronised), the CPU clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.clock = _cpu_clock

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = self.clock()
        out = fn()
        return out, self.clock() - t0


class _SavedBytes:
    """Saved-tensor hooks that sum unique storages' bytes, skipping excluded storages."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.exclude and ptr not in self.seen:
                self.seen[ptr] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            pass
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def hooks(self) -> ContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _storage_ptrs(obj: Any, out: set[int]) -> set[int]:
    if isinstance(obj, torch.Tensor):
        try:
            out.add(obj.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            pass
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _storage_ptrs(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storage_ptrs(v, out)
    return out


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (list, tuple)):
        for v in out:
            if isinstance(v, torch.Tensor):
                return v
    raise TypeError(f"a repeated layer returned {type(out).__name__}; the profiler needs it to return the next x (a tensor)")


def _fresh_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Detached copies of floating tensors that required grad (x among them), requiring grad again."""

    def fresh(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad:
            return v.detach().requires_grad_(True)
        return v

    return tuple(fresh(a) for a in args), {k: fresh(v) for k, v in kwargs.items()}


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------

def _capture(module: nn.Module, layers: nn.Module, batch: Any, step_fn: Callable, autocast: Callable[[], ContextManager]) -> tuple[tuple, dict]:
    captured: dict[str, Any] = {}

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["args"], captured["kwargs"] = args, kwargs
        raise _Captured

    handle = layers.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.enable_grad(), autocast():
            step_fn(module, batch)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "args" not in captured:
        raise RuntimeError(
            f"{type(module).__name__}'s step finished without calling its RecomputeLayers; the profiler captures the layers' "
            "inputs on the way there. Make the training step call the layers, or pass step_fn=..."
        )
    args = captured["args"]
    if not args or not isinstance(args[0], torch.Tensor):
        raise TypeError("RecomputeLayers was called without a tensor as its first argument; the profiler needs x first")
    x = args[0]
    if not x.requires_grad:
        args = (x.detach().requires_grad_(True), *args[1:])
    return _fresh_inputs(args, captured["kwargs"])


def _measure_point(layers: nn.Module, args: tuple, kwargs: dict, device: torch.device,
                   autocast: Callable[[], ContextManager], exclude: set[int], group: Any = None) -> dict[str, float]:
    timer = _Timer(device)

    def more(times: list[float]) -> bool:
        # Whether to time another repeat. With an SP group the layer runs all-to-alls, so every
        # rank of the group must repeat equally often: the ranks agree (any rank wanting more wins).
        want = len(times) < _MAX_REPEATS and (len(times) < _MIN_REPEATS or sum(times) < _MIN_MEASURED_S)
        if group is None:
            return want
        flag = torch.tensor([1.0 if want else 0.0], device=device if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    layer0 = layers[0]
    layer1 = layers[1] if len(layers) > 1 else layers[0]
    x0 = args[0]
    rest = args[1:]
    exclude = set(exclude) | _storage_ptrs(args, set()) | _storage_ptrs(kwargs, set())

    def fwd(layer: nn.Module, counter: _SavedBytes | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.detach().requires_grad_(True)
        ctx = counter.hooks() if counter is not None else contextlib.nullcontext()
        with torch.enable_grad(), autocast(), ctx:
            y = _first_tensor(layer(x, *rest, **kwargs))
        return x, y

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # warm-up: layer 0 forward + backward
    _, y = fwd(layer0)
    grad = torch.randn_like(y)
    torch.autograd.backward(y, grad)
    del y
    # layer 1, untimed: count what its forward saves for backward
    counter = _SavedBytes(exclude | {x0.untyped_storage().data_ptr()})
    x, y = fwd(layer1, counter)
    counter.seen.pop(x.untyped_storage().data_ptr(), None)
    torch.autograd.backward(y, grad)
    del x, y
    fw, bw = [], []
    while more([f + b for f, b in zip(fw, bw)]):
        (x, y), tf = timer(lambda: fwd(layer1))
        _, tb = timer(lambda: torch.autograd.backward(y, grad))
        del x, y
        fw.append(tf)
        bw.append(tb)
    # the same layer under RecomputeLayers' checkpointing (as a recomputed layer runs in training)
    from lightning_dcp.recompute import RecomputeLayers

    ckpt = RecomputeLayers(nn.ModuleList([layer1]), recompute_override=1)
    ck = []

    def ckpt_step() -> None:
        x = x0.detach().requires_grad_(True)
        with torch.enable_grad(), autocast():
            y = _first_tensor(ckpt(x, *rest, **kwargs))
        torch.autograd.backward(y, grad)

    ckpt_step()  # warm-up
    while more(ck):
        ck.append(timer(ckpt_step)[1])
    for p in layers.parameters():
        p.grad = None
    pick = statistics.median if device.type == "cuda" else min
    return {
        "forward_s": pick(fw),
        "backward_s": pick(bw),
        "recompute_s": max(0.0, pick(ck) - pick(fw) - pick(bw)),
        "activation_bytes": float(counter.total),
        "input_bytes": float(x0.numel() * x0.element_size()),
        "peak_bytes": float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0,
    }


def _measure_constant_run(module: nn.Module, layers: nn.Module, batch: Any, step_fn: Callable, device: torch.device,
                          autocast: Callable[[], ContextManager], exclude: set[int]) -> tuple[float, float]:
    """(median seconds of step forward + backward with the layers bypassed, bytes saved for backward)."""
    timer = _Timer(device)
    layers.forward = lambda x, *a, **k: x  # type: ignore[method-assign]
    try:
        def run(counter: _SavedBytes | None = None) -> None:
            ctx = counter.hooks() if counter is not None else contextlib.nullcontext()
            with torch.enable_grad(), ctx:
                with autocast():
                    loss = step_fn(module, batch)
            loss.backward()

        counter = _SavedBytes(exclude | _storage_ptrs(batch, set()))
        run(counter)  # warm-up and count
        times = []
        while len(times) < _MAX_REPEATS and (len(times) < _MIN_REPEATS or sum(times) < _MIN_MEASURED_S):
            times.append(timer(run)[1])
        return (statistics.median if device.type == "cuda" else min)(times), float(counter.total)
    finally:
        del layers.forward
        for p in module.parameters():
            p.grad = None


def _optimizer_time(optimizer: Any, layer: nn.Module, total_numel: int) -> float:
    """Seconds of one optimizer step over all trainable parameters, from a step on clones of ``layer``'s."""
    if optimizer is None:
        return 0.0
    params = [p for p in layer.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    if not numel:
        return 0.0
    clones = [nn.Parameter(p.detach().clone()) for p in params]
    for c in clones:
        c.grad = torch.randn_like(c) * 1e-3
    hyper = {k: copy.deepcopy(v) for k, v in optimizer.param_groups[0].items() if k != "params"}
    try:  # one param group carrying the real first group's hyper-parameters (foreach/fused flags included)
        opt = type(optimizer)([{"params": clones, **hyper}])
    except Exception as err:  # noqa: BLE001 - any optimizer we cannot rebuild is timed as 0
        log.warning("cannot rebuild %s to time its step (%s); constant.optimizer_s = 0", type(optimizer).__name__, err)
        return 0.0
    timer = _Timer(clones[0].device)
    opt.step()
    opt.step()
    times = [timer(opt.step)[1] for _ in range(3)]
    return statistics.median(times) * total_numel / numel


def _allreduce_time(param_bytes: int, dtype: torch.dtype, device: torch.device) -> float:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or param_bytes == 0:
        return 0.0
    elem = torch.tensor([], dtype=dtype).element_size()
    nbytes = min(param_bytes, _ALLREDUCE_CAP_BYTES)
    buf = torch.zeros(max(1, nbytes // elem), dtype=dtype, device=device)
    timer = _Timer(device)
    dist.all_reduce(buf)
    times = [timer(lambda: dist.all_reduce(buf))[1] for _ in range(3)]
    return statistics.median(times) * param_bytes / (buf.numel() * elem)


def _optimizer_state_bytes(optimizer: Any, trainable_bytes: int) -> int:
    if optimizer is None:
        return 0
    state = getattr(optimizer, "state", None)
    if state:
        return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))
    name = type(optimizer).__name__.lower()
    if "adam" in name:
        return 2 * trainable_bytes
    if name == "sgd":
        return trainable_bytes if optimizer.defaults.get("momentum", 0) else 0
    return 2 * trainable_bytes


def _allreduce_max(values: list[float], device: torch.device) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _broadcast(obj: Any) -> Any:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _nullcontext() -> ContextManager:
    return contextlib.nullcontext()


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
) -> dict:
    """Measure a dual-layer profile of ``module`` on ``data``; return a valid v1 profile dict.

    A collective when ``torch.distributed`` is initialised with more than one rank: every rank
    calls it with the same arguments (rank 0's grid is broadcast) and gets the same profile.

    Args:
        module: the model (a LightningModule, or any module ``step_fn`` can drive) holding one
            :class:`~lightning_dcp.recompute.RecomputeLayers`; already on ``device``.
        data: a dataset with ``.lengths`` and ``__getitem__``, or a list of sample dicts.
        device: where to measure (default: the device of the module's first parameter).
        precision: Lightning precision name recorded in the key (``"32-true"``, ``"bf16-mixed"``...).
        autocast: factory of the context the forward runs in (Lightning's
            ``precision_plugin.train_step_context``; default none).
        step_fn: ``step_fn(module, batch) -> loss``; default ``module.training_step(batch, 0)``.
        optimizer: the optimizer whose step is timed (on clones); ``None`` gives ``optimizer_s = 0``.
        group_for: ``group_for(ranks) -> ProcessGroup | None`` (``DCPStrategy.sp_groups.group_for``);
            on several ranks without it, groups are created with :func:`make_sp_groups`.
        lengths: grid lengths (default: quantiles of the data's lengths, 4 coarse / 8 fine).
        micro_batch_sizes: default ``(1, 2)`` coarse, ``(1, 2, 4)`` fine.
        sp_sizes: default every power of two up to the world size that divides ``num_heads``.
        density: ``"coarse"`` or ``"fine"``.
        time_budget_s: after this many seconds of profiling, points not ``required`` are skipped
            (logged); ``None``: no budget.
        memory_limit_bytes: ``device.memory_limit_bytes`` (default: CUDA total x ``memory_fraction``, CPU 8 GiB).
        layers_attr: dotted name of the RecomputeLayers when the module has several.
        num_layers: ``model.num_layers`` to record (default ``len(layers)``; the CLI records the
            full model's count after profiling a reduced one).
        num_heads: attention heads (default: found as a ``num_heads`` attribute in the module; SP
            sizes must divide it).
        key: the ``key`` section (a :class:`~lightning_dcp.profile_cache.ProfileKey` dict); default
            computed from the module, device, precision and world size.
        states_module: the module whose parameters define ``param_bytes``, ``memory_bytes`` and
            the optimizer-time scaling (default ``module``; the CLI passes the full model built on
            the meta device when it measured a reduced-layer copy).
        cpu_clock: ``"wall"`` (default, ``time.perf_counter``) or ``"process"``
            (``time.process_time``: immune to other processes on a shared machine; use with one
            torch thread and SP 1 only, e.g. for accuracy benchmarks).
    """
    from lightning_dcp import __version__
    from lightning_dcp.packing import pack_samples
    from lightning_dcp.profile_cache import ProfileKey, device_name, model_signature

    global _cpu_clock
    t_start = time.perf_counter()
    if cpu_clock not in _CPU_CLOCKS:
        raise ValueError(f"cpu_clock must be one of {sorted(_CPU_CLOCKS)}, got {cpu_clock!r}")
    if density not in DENSITIES:
        raise ValueError(f"density must be one of {sorted(DENSITIES)}, got {density!r}")
    device = torch.device(device) if device is not None else next(module.parameters()).device
    autocast = autocast or _nullcontext
    step_fn = step_fn or _default_step
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    layers = _find_layers(module, layers_attr)
    heads = num_heads or _find_int_attr(module, "num_heads")
    samples = _Samples(data)

    # grid (rank 0's, broadcast)
    count, default_mbs = DENSITIES[density]
    sps = list(sp_sizes) if sp_sizes is not None else _default_sp_sizes(world_size, heads)
    bad = [p for p in sps if p < 1 or p > world_size or p & (p - 1) or (heads is not None and heads % p)]
    if bad:
        raise ValueError(f"sp_sizes {bad} are not usable on {world_size} rank(s) with {heads} heads: an SP size is a power "
                         f"of two <= the world size that divides the head count; drop them")
    wanted = list(lengths) if lengths is not None else select_lengths(samples.lengths, count)
    actual = sorted({samples.pick(n, 1)[0] for n in wanted})
    if lengths is not None and actual != sorted(set(int(n) for n in wanted)):
        log.info("profile lengths %s not all in the data; using the nearest lengths it has: %s", sorted(wanted), actual)
    grid = _broadcast(build_grid(actual, micro_batch_sizes or default_mbs, sps))
    if group_for is None and world_size > 1 and any(p > 1 for p in grid.sp_sizes):
        group_for = make_sp_groups(world_size, grid.sp_sizes)

    params = list(module.parameters())
    exclude = {p.untyped_storage().data_ptr() for p in params} | {b.untyped_storage().data_ptr() for b in module.buffers()}
    entries: list[dict] = []
    skipped: list[GridPoint] = []
    over_budget = False
    previous_clock, _cpu_clock = _cpu_clock, _CPU_CLOCKS[cpu_clock]
    with _preserved_state(module), _muted_logging(module):
        module.train()
        for point in grid.points:
            if over_budget and not point.required:
                skipped.append(point)
                continue
            p = point.sp
            block = rank // p * p
            sp_rank = rank - block
            group = group_for(list(range(block, block + p))) if p > 1 else None
            seq_len, idx = samples.pick(point.seq_len, point.micro_batch)
            batch = pack_samples([samples[i] for i in idx], pad_to_multiple=p, sample_indices=idx)
            batch = _to_device(_shard_batch(module, batch, p, sp_rank), device)
            with sp_context(SPContext(group=group, size=p, rank=sp_rank, recompute=0)):
                args, kwargs = _capture(module, layers, batch, step_fn, autocast)
                m = _measure_point(layers, args, kwargs, device, autocast, exclude, group)
            del args, kwargs
            elapsed = time.perf_counter() - t_start
            fwd, bwd, rec, act, inp, peak, elapsed = _allreduce_max(
                [m["forward_s"], m["backward_s"], m["recompute_s"], m["activation_bytes"], m["input_bytes"], m["peak_bytes"],
                 elapsed], device)
            entries.append({"seq_len": seq_len, "micro_batch": point.micro_batch, "sp": p, "forward_s": fwd,
                            "backward_s": bwd, "recompute_s": rec, "activation_bytes": int(act), "input_bytes": int(inp),
                            "peak_bytes": int(peak) if device.type == "cuda" else None})
            if time_budget_s is not None and elapsed > time_budget_s:
                over_budget = True

        # constant parts at SP 1: layers bypassed, smallest and largest grid length
        const = []
        for n in sorted({grid.lengths[0], grid.lengths[-1]}):
            seq_len, idx = samples.pick(n, 1)
            batch = _to_device(pack_samples([samples[i] for i in idx], sample_indices=idx), device)
            tokens = seq_len
            with sp_context(SPContext()):
                t, saved = _measure_constant_run(module, layers, batch, step_fn, device, autocast, exclude)
            const.append((tokens, t, saved))
        (n0, t0, s0), (n1, t1, s1) = const[0], const[-1]
        slope = max(0.0, (t1 - t0) / (n1 - n0)) if n1 > n0 else 0.0
        c0 = max(0.0, t0 - slope * n0)
        act_per_token = max(s0 / n0, s1 / n1)
        state_params = list(states_module.parameters()) if states_module is not None else params
        trainable = [p for p in state_params if p.requires_grad]
        trainable_numel = sum(p.numel() for p in trainable)
        param_bytes = sum(p.numel() * p.element_size() for p in trainable)
        opt_s = _optimizer_time(optimizer, layers[1] if len(layers) > 1 else layers[0], trainable_numel)
        grad_dtype = trainable[0].dtype if trainable else torch.float32
        allreduce_s = _allreduce_time(param_bytes, grad_dtype, device)
        c0, slope, act_per_token, opt_s, allreduce_s = _allreduce_max([c0, slope, act_per_token, opt_s, allreduce_s], device)
    _cpu_clock = previous_clock

    state_buffers = list((states_module or module).buffers())
    state_bytes = (sum(p.numel() * p.element_size() for p in state_params) + sum(b.numel() * b.element_size() for b in state_buffers)
                   + param_bytes + _optimizer_state_bytes(optimizer, param_bytes))
    if memory_limit_bytes is None:
        if device.type == "cuda":
            memory_limit_bytes = torch.cuda.get_device_properties(device).total_memory * memory_fraction
        else:
            memory_limit_bytes = CPU_MEMORY_LIMIT
    if key is None:
        key = ProfileKey(model_signature(module), device_name(device), precision, world_size, __version__).to_dict()
    hidden = _find_int_attr(module, "hidden_size")
    profiling_s = time.perf_counter() - t_start
    profile = {
        "schema": PROFILE_SCHEMA,
        "key": dict(key),
        "model": {"num_layers": int(num_layers or len(layers)), "num_heads": int(heads or max(grid.sp_sizes)),
                  **({"hidden_size": hidden} if hidden else {})},
        "device": {"memory_limit_bytes": float(memory_limit_bytes),
                   "gpus_per_node": torch.cuda.device_count() if device.type == "cuda" else 1},
        "constant": {"time_s": c0, "time_per_token_s": slope, "optimizer_s": opt_s, "allreduce_s": allreduce_s,
                     "memory_bytes": float(state_bytes), "param_bytes": float(param_bytes),
                     "activation_bytes_per_token": act_per_token},
        "entries": entries,
        "meta": {"created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 "profiling_s": round(profiling_s, 3), "grid": len(entries), "skipped": len(skipped),
                 "density": density, "time_budget_s": time_budget_s, "host": platform.node(),
                 "lengths": grid.lengths, "micro_batch_sizes": grid.micro_batch_sizes, "sp_sizes": grid.sp_sizes,
                 "profiled_layers": len(layers)},
    }
    if skipped:
        log.info("profiling went over its %.0f s budget: skipped %d of %d grid points (%s)", time_budget_s, len(skipped),
                 len(grid.points), ", ".join(f"l={q.seq_len} b={q.micro_batch} sp={q.sp}" for q in skipped[:8]))
    profile = _broadcast(profile)  # rank 0's copy everywhere (profiling_s and host may differ per rank)
    return validate_profile(profile)


# ---------------------------------------------------------------------------------------------
# the callback
# ---------------------------------------------------------------------------------------------

class DCPProfiler(Callback):
    """Profile (or load the cached profile) at fit start and hand the cost model to the strategy.

    At ``on_fit_start`` (after ``strategy.setup``, before the dataloaders and the DCP sampler
    exist): compute the cache key (model signature, device name, precision, world size, package
    version); rank 0 looks it up in the cache; on a hit the profile is broadcast to every rank;
    otherwise every rank runs :func:`profile_module` together (SP sizes above 1 on the strategy's
    real groups) and rank 0 writes the file. A corrupt or foreign cache file is reported with a
    warning and replaced. Then ``trainer.strategy.set_cost_model(ProfiledCostModel(profile))``
    when the strategy has it; the profile and cost model also stay on the callback
    (:attr:`profile`, :attr:`cost_model`), as do :attr:`cache_status` and :attr:`profiling_s`.

    Args:
        cache_dir: cache directory (default ``$LIGHTNING_DCP_CACHE`` or ``~/.cache/lightning-dcp/profiles``).
        time_budget_s: seconds after which optional grid points are skipped (``None``: no budget).
        density: ``"coarse"`` (4 lengths x micro-batch {1, 2}) or ``"fine"`` (8 x {1, 2, 4}).
        lengths: explicit grid lengths (default: quantiles of the dataset's lengths).
        micro_batch_sizes: explicit micro-batch sizes (default by density).
        sp_sizes: explicit SP sizes (default: powers of two up to the world size dividing the
            heads under a strategy with ``sp_groups``; ``[1]`` otherwise).
        memory_limit_bytes: usable bytes per device (default: CUDA total x 0.9, CPU 8 GiB).
        enabled: ``False`` turns the callback into a no-op.
        layers_attr: dotted name of the RecomputeLayers when the model has several.
        dataset: the dataset to draw micro-batches from (default: the train dataloader's dataset,
            obtained by calling the ``train_dataloader`` hook once more).
        step_fn: ``step_fn(module, batch) -> loss`` (default ``module.training_step(batch, 0)``).
        use_cache: ``False`` always profiles and writes nothing.
    """

    def __init__(self, cache_dir: str | None = None, time_budget_s: float | None = 60.0, density: str = "coarse",
                 lengths: Sequence[int] | None = None, micro_batch_sizes: Sequence[int] | None = None,
                 sp_sizes: Sequence[int] | None = None, memory_limit_bytes: float | None = None, enabled: bool = True,
                 layers_attr: str | None = None, dataset: Any = None,
                 step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None, use_cache: bool = True):
        if density not in DENSITIES:
            raise ValueError(f"density must be one of {sorted(DENSITIES)}, got {density!r}")
        if time_budget_s is not None and time_budget_s < 0:
            raise ValueError(f"time_budget_s must be >= 0 or None, got {time_budget_s}")
        self.cache_dir = cache_dir
        self.time_budget_s = time_budget_s
        self.density = density
        self.lengths = list(lengths) if lengths is not None else None
        self.micro_batch_sizes = list(micro_batch_sizes) if micro_batch_sizes is not None else None
        self.sp_sizes = list(sp_sizes) if sp_sizes is not None else None
        self.memory_limit_bytes = memory_limit_bytes
        self.enabled = enabled
        self.layers_attr = layers_attr
        self.dataset = dataset
        self.step_fn = step_fn
        self.use_cache = use_cache
        self.profile: dict | None = None
        self.cost_model: Any = None
        self.cache_status: str | None = None
        self.cache_file: str | None = None
        self.profiling_s: float = 0.0

    # -- helpers -------------------------------------------------------------------------------

    def _dataset(self, trainer: Any) -> Any:
        if self.dataset is not None:
            return self.dataset
        source = trainer.fit_loop._data_source
        if not source.is_defined():
            raise RuntimeError("DCPProfiler found no train dataloader to take samples from; pass DCPProfiler(dataset=...)")
        loaders = source.dataloader()
        loader = loaders if not isinstance(loaders, (list, tuple, dict)) else (
            next(iter(loaders.values())) if isinstance(loaders, dict) else loaders[0])
        dataset = getattr(loader, "dataset", loader)
        return dataset

    def _key(self, trainer: Any, module: nn.Module) -> Any:
        from lightning_dcp import __version__
        from lightning_dcp.profile_cache import ProfileKey, device_name, model_signature

        return ProfileKey(model_signature(module), device_name(trainer.strategy.root_device), str(trainer.precision),
                          trainer.world_size, __version__)

    def _log(self, trainer: Any, profile: dict) -> None:
        meta = profile.get("meta", {})
        if trainer.is_global_zero:
            log.info("DCP profile %s: %s grid points, %.1f s profiling (cache %s: %s)", profile["key"]["model_signature"][:12],
                     meta.get("grid"), self.profiling_s, self.cache_status, self.cache_file)
        logger = getattr(trainer, "logger", None)
        if logger is not None:
            try:
                logger.log_metrics({"dcp/profile_s": float(self.profiling_s), "dcp/profile_grid": float(meta.get("grid", 0)),
                                    "dcp/profile_cache_hit": float(self.cache_status == "hit")}, step=0)
            except Exception as err:  # noqa: BLE001 - a logger failure must not stop the fit
                log.warning("could not log profiling metrics: %s", err)

    # -- hook ----------------------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.enabled:
            self.cache_status = "disabled"
            return
        from lightning_dcp import profile_cache

        t0 = time.perf_counter()
        strategy = trainer.strategy
        key = self._key(trainer, pl_module)
        lookup = None
        if self.use_cache and trainer.is_global_zero:
            lookup = profile_cache.load_cached(key, self.cache_dir)
        status, profile = strategy.broadcast((lookup.status, lookup.profile) if lookup else ("off", None), src=0)
        if profile is None:
            sp_groups = getattr(strategy, "sp_groups", None)
            group_for = getattr(sp_groups, "group_for", None)
            sp_sizes = self.sp_sizes
            if sp_sizes is None and group_for is None:
                sp_sizes = [1]  # no SP groups to profile on (not a DCP strategy)
            elif sp_sizes is None and getattr(sp_groups, "sizes", None):
                heads = _find_int_attr(pl_module, "num_heads")  # the strategy's groups, those the heads allow
                sp_sizes = [p for p in sp_groups.sizes if heads is None or heads % p == 0]
            optimizers = getattr(trainer, "optimizers", None) or [None]
            profile = profile_module(
                pl_module, self._dataset(trainer), device=strategy.root_device, precision=str(trainer.precision),
                autocast=strategy.precision_plugin.train_step_context, step_fn=self.step_fn, optimizer=optimizers[0],
                group_for=group_for, lengths=self.lengths, micro_batch_sizes=self.micro_batch_sizes, sp_sizes=sp_sizes,
                density=self.density, time_budget_s=self.time_budget_s, memory_limit_bytes=self.memory_limit_bytes,
                layers_attr=self.layers_attr, key=key.to_dict(),
            )
            if self.use_cache and trainer.is_global_zero:
                path = profile_cache.store(profile, self.cache_dir)
                log.info("DCP profile written to %s", path)
            strategy.barrier("dcp_profile_stored")
        self.cache_status = status
        self.cache_file = str(profile_cache.profile_path(key, self.cache_dir)) if self.use_cache else None
        self.profiling_s = time.perf_counter() - t0
        self.profile = profile
        from lightning_dcp.planning.profiled import ProfiledCostModel

        # An explicit limit is a planning budget, not a measurement: it applies to cached profiles too.
        self.cost_model = ProfiledCostModel(profile, memory_limit=self.memory_limit_bytes)
        set_cost_model = getattr(strategy, "set_cost_model", None)
        if callable(set_cost_model):
            set_cost_model(self.cost_model)
        self._log(trainer, profile)
