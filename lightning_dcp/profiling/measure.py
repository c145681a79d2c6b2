"""Measuring primitives: timers, saved-tensor byte counts, the capture of the layers' inputs, one
grid point, the constant parts, and the few collectives that make every rank agree.

Timing: ``torch.cuda.Event`` on CUDA; on CPU the clock chosen with :func:`cpu_clock` (wall clock
``time.perf_counter`` by default, or process CPU time ``time.process_time``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import statistics
import time
from typing import Any, Callable, ContextManager, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from lightning_dcp.profiling.layers import LayerStack

log = logging.getLogger(__name__)

_ALLREDUCE_CAP_BYTES = 256 * 2**20
_MIN_REPEATS, _MAX_REPEATS, _MIN_MEASURED_S = 3, 10, 0.05

#: CPU clocks: ``"wall"`` (perf_counter, the default) or ``"process"`` (process CPU time: immune to
#: other processes sharing the cores; meaningful with one torch thread and SP 1 only).
CPU_CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
_cpu_clock: Callable[[], float] = time.perf_counter


@contextlib.contextmanager
def cpu_clock(name: str) -> Iterator[None]:
    """Time CPU work with clock ``name`` (a key of :data:`CPU_CLOCKS`) while the context is open."""
    global _cpu_clock
    if name not in CPU_CLOCKS:
        raise ValueError(f"cpu_clock must be one of {sorted(CPU_CLOCKS)}, got {name!r}")
    previous, _cpu_clock = _cpu_clock, CPU_CLOCKS[name]
    try:
        yield
    finally:
        _cpu_clock = previous


class _Captured(Exception):
    """Raised by the capture pre-hook to stop the step once the layers' inputs are known."""


class Timer:
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


class SavedBytes:
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


def storage_ptrs(obj: Any, out: set[int]) -> set[int]:
    """Add the storage pointers of every tensor in ``obj`` (nested dicts, lists, tuples) to ``out``."""
    if isinstance(obj, torch.Tensor):
        try:
            out.add(obj.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            pass
    elif isinstance(obj, Mapping):
        for v in obj.values():
            storage_ptrs(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            storage_ptrs(v, out)
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
    """Detached copies of floating tensors that required grad (x among them), requiring grad again.

    Tensors inside tuples (named tuples included), lists and dicts are refreshed too: a layer may
    take a bundle such as the packed text of a cross-attention (:mod:`lightning_dcp.diffusers`),
    whose tensor would otherwise keep the step's graph and fail the second timed backward.
    """

    def fresh(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().requires_grad_(True) if v.is_floating_point() and v.requires_grad else v
        if isinstance(v, tuple):
            items = [fresh(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
        if isinstance(v, list):
            return [fresh(x) for x in v]
        if isinstance(v, dict):
            return {k: fresh(x) for k, x in v.items()}
        return v

    return tuple(fresh(a) for a in args), {k: fresh(v) for k, v in kwargs.items()}


def _repeat(times: list[float]) -> bool:
    return len(times) < _MAX_REPEATS and (len(times) < _MIN_REPEATS or sum(times) < _MIN_MEASURED_S)


def _pick(device: torch.device) -> Callable[[list[float]], float]:
    # medians on every device: training runs at the typical time, not the best one (on a shared CPU the
    # minimum predicted micro-batches 7-15% too fast; benchmarks/results/tiny-2d_balanced_2xcpu_mem20MiB)
    return statistics.median


# ---------------------------------------------------------------------------------------------
# capture and one grid point
# ---------------------------------------------------------------------------------------------

def capture(module: nn.Module, stack: LayerStack, batch: Any, step_fn: Callable,
            autocast: Callable[[], ContextManager]) -> tuple[tuple, dict]:
    """Run the step until the first repeated layer is called; return that call's fresh ``(args, kwargs)``."""
    captured: dict[str, Any] = {}

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["args"], captured["kwargs"] = args, kwargs
        raise _Captured

    handle = stack.hook_target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.enable_grad(), autocast():
            step_fn(module, batch)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "args" not in captured:
        raise RuntimeError(
            f"{type(module).__name__}'s step finished without calling {stack.name}; the profiler captures the layers' "
            "inputs on the way there. Make the training step call the layers, or pass step_fn=..."
        )
    args = captured["args"]
    if not args or not isinstance(args[0], torch.Tensor):
        raise TypeError(f"{stack.name} was called without a tensor as its first argument; the profiler needs x first "
                        "(positional)")
    x = args[0]
    if not x.requires_grad:
        args = (x.detach().requires_grad_(True), *args[1:])
    return _fresh_inputs(args, captured["kwargs"])


def _agree(group: Any, device: torch.device) -> Callable[[list[float]], bool]:
    """Whether to time another repeat. With an SP group the layer runs all-to-alls, so every rank
    of the group must repeat equally often: the ranks agree (any rank wanting more wins)."""

    def more(times: list[float]) -> bool:
        want = _repeat(times)
        if group is None:
            return want
        flag = torch.tensor([1.0 if want else 0.0], device=device if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    return more


def measure_point(stack: LayerStack, args: tuple, kwargs: dict, device: torch.device,
                  autocast: Callable[[], ContextManager], exclude: set[int], group: Any = None,
                  proceed: Callable[[float], bool] | None = None) -> dict[str, float] | None:
    """Warm up on ``layers[0]``, then measure ``layers[1]``: activation bytes, forward / backward
    seconds, the extra seconds of running it checkpointed, input bytes and (CUDA) peak bytes.

    ``proceed(warmup_s)``, when given, is asked after the warm-up pass (its seconds, this rank's) whether to go on:
    ``False`` returns ``None`` (the point is abandoned: it would not end within the profile's time budget)."""
    timer, more = Timer(device), _agree(group, device)
    x0, rest = args[0], args[1:]
    exclude = set(exclude) | storage_ptrs(args, set()) | storage_ptrs(kwargs, set())

    def fwd(layer: Callable, counter: SavedBytes | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.detach().requires_grad_(True)
        ctx = counter.hooks() if counter is not None else contextlib.nullcontext()
        with torch.enable_grad(), autocast(), ctx:
            out = layer(x, *rest, **kwargs)
        stack.returns_tuple = isinstance(out, tuple)
        return x, _first_tensor(out)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    def warmup() -> torch.Tensor:  # layer 0 forward + backward
        _, y = fwd(stack.warmup_layer)
        g = torch.randn_like(y)
        torch.autograd.backward(y, g)
        return g

    grad, warmup_s = timer(warmup)
    if proceed is not None and not proceed(warmup_s):
        for p in stack.parameters():
            p.grad = None
        return None
    counter = SavedBytes(exclude | {x0.untyped_storage().data_ptr()})  # layer 1, untimed: bytes saved for backward
    x, y = fwd(stack.measured_layer, counter)
    counter.seen.pop(x.untyped_storage().data_ptr(), None)
    torch.autograd.backward(y, grad)
    del x, y
    fw, bw = [], []
    while more([f + b for f, b in zip(fw, bw)]):
        (x, y), tf = timer(lambda: fwd(stack.measured_layer))
        _, tb = timer(lambda: torch.autograd.backward(y, grad))
        del x, y
        fw.append(tf)
        bw.append(tb)
    ckpt = stack.checkpointed(stack.measured_layer)  # as a recomputed layer runs in training

    def ckpt_step() -> None:
        torch.autograd.backward(fwd(ckpt)[1], grad)

    ckpt_step()  # warm-up
    ck: list[float] = []
    while more(ck):
        ck.append(timer(ckpt_step)[1])
    for p in stack.parameters():
        p.grad = None
    pick = _pick(device)
    return {"forward_s": pick(fw), "backward_s": pick(bw), "recompute_s": max(0.0, pick(ck) - pick(fw) - pick(bw)),
            "activation_bytes": float(counter.total), "input_bytes": float(x0.numel() * x0.element_size()),
            "peak_bytes": float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0}


# ---------------------------------------------------------------------------------------------
# constant parts
# ---------------------------------------------------------------------------------------------

def measure_constant_run(module: nn.Module, stack: LayerStack, batch: Any, step_fn: Callable, device: torch.device,
                         autocast: Callable[[], ContextManager], exclude: set[int]) -> tuple[float, float]:
    """(seconds of step forward + backward with the layers bypassed, bytes saved for backward)."""
    timer = Timer(device)

    def run(counter: SavedBytes | None = None) -> None:
        ctx = counter.hooks() if counter is not None else contextlib.nullcontext()
        with torch.enable_grad(), ctx:
            with autocast():
                loss = step_fn(module, batch)
        if loss.requires_grad:  # else nothing outside the layers trains (a LoRA adapter on them only): no backward
            loss.backward()

    try:
        with stack.bypassed():
            counter = SavedBytes(exclude | storage_ptrs(batch, set()))
            run(counter)  # warm-up and count
            times: list[float] = []
            while _repeat(times):
                times.append(timer(run)[1])
        return _pick(device)(times), float(counter.total)
    finally:
        for p in module.parameters():
            p.grad = None


def optimizer_time(optimizer: Any, layer: nn.Module, total_numel: int) -> float:
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
    timer = Timer(clones[0].device)
    opt.step()
    opt.step()
    times = [timer(opt.step)[1] for _ in range(3)]
    return statistics.median(times) * total_numel / numel


def optimizer_state_estimate(optimizer: Any, trainable_bytes: int) -> int:
    """The full optimizer state's bytes by class, whatever has been allocated yet (the same on every rank,
    for a sharded optimizer too, and before and after a resume): Adam-like 2x the trainable bytes, SGD with
    momentum 1x, plain SGD 0, anything else 2x."""
    if optimizer is None:
        return 0
    name = type(optimizer).__name__.lower()
    if "adam" in name:
        return 2 * trainable_bytes
    if name == "sgd":
        return trainable_bytes if optimizer.defaults.get("momentum", 0) else 0
    return 2 * trainable_bytes


# ---------------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------------

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def allreduce_time(param_bytes: int, dtype: torch.dtype, device: torch.device) -> float:
    """Seconds of the step-end gradient all-reduce (at most 256 MiB timed, scaled linearly); 0 on one rank."""
    if not _distributed() or param_bytes == 0:
        return 0.0
    elem = torch.tensor([], dtype=dtype).element_size()
    nbytes = min(param_bytes, _ALLREDUCE_CAP_BYTES)
    buf = torch.zeros(max(1, nbytes // elem), dtype=dtype, device=device)
    timer = Timer(device)
    dist.all_reduce(buf)
    times = [timer(lambda: dist.all_reduce(buf))[1] for _ in range(3)]
    return statistics.median(times) * param_bytes / (buf.numel() * elem)


def allreduce_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over the world (identity on one rank)."""
    if not _distributed():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (identity on one rank)."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
