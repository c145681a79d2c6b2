"""World collectives from user code inside the micro-batch loop: refused at the first call, on every rank.

Ranks run different numbers of micro-batches per step, so a collective of the world inside
``training_step`` (a direct ``torch.distributed.all_reduce``, ``self.all_gather``, a torchmetrics metric
built with ``dist_sync_on_step=True``) waits for ranks that never call it -- a hang until the collective
time-out, and one that a smoke test with even counts does not show. :class:`LoopCollectiveGuard` makes it
an error at the first such call:

- **the call**: while this rank's loop runs, the ``torch.distributed`` collectives (``all_reduce``,
  ``all_gather``, ``broadcast``, ``barrier``, ``reduce_scatter_tensor``, the ``*_object`` ones, group
  creation...) are wrapped; a call from the loop's thread on a group other than the active item's SP
  groups (its group, a ring item's Ulysses subgroup and ring) -- the world above all -- raises
  :class:`CollectiveInLoopError` at once, before anything is sent. The strategy's own ``all_gather``,
  ``barrier``, ``broadcast`` and ``reduce_boolean_decision`` raise it too (:mod:`~lightning_dcp.runtime.guards`).
  The guard records the refused call as it raises, so user code that catches the error (``try: ... except``)
  still stops at the step end like code that lets it propagate.
  In a lockstep round (``sharding="hsdp"``) the shard mesh's groups are allowed as well (FSDP's per-layer
  collectives). The SP groups' collectives, point-to-point ops and other threads' calls pass;
- **the other ranks**: the executor keeps the error, skips this rank's other SP-1 items (it still runs its
  SP > 1 items, whose partners need it) and flags it on the step-end all-gather
  (:attr:`~lightning_dcp.runtime.row.StepRow.loop_collective`); seeing a flag, every rank gathers the
  flagged ranks' messages (one more world all-gather) and raises the first one: the same error on every
  rank, within the step, instead of a hang;
- **what it cannot sync**: a rank-dependent call (``if self.global_rank == 0: ...``) inside an SP > 1
  item, or any call in a lockstep round, leaves partners inside the item's collectives; there the calling
  rank raises at once and stops, and its partners end with the
  :class:`~lightning_dcp.runtime.faults.CollectiveError` of a stopped peer.

Calls that bypass the module attributes (a function imported as ``from torch.distributed import
all_reduce`` before the loop, ``torch.distributed._functional_collectives``) are not seen.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GUARDED_CALLS", "CollectiveInLoopError", "LoopCollectiveGuard", "strategy_call_error"]

#: ``torch.distributed`` functions refused inside the loop on a group other than the active SP groups.
GUARDED_CALLS = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_single",
                 "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced", "gather", "scatter",
                 "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base",
                 "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "all_gather_object",
                 "gather_object", "broadcast_object_list", "scatter_object_list")
#: Group creation: a collective of the world whatever its arguments.
CREATION_CALLS = ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group")

_MESSAGE_BYTES = 4096  # one rank's message on the report all-gather (utf-8, zero-padded)

_FIX_DIRECT = ("move the collective out of training_step, into on_train_batch_end (every rank runs it once per step) "
               "or an epoch-end hook; for a number to log, self.log(name, value, sync_dist=True) inside training_step "
               "(reduced over the whole step at its end); inside a micro-batch only the active SP group may communicate "
               "(lightning_dcp.sp.context.active_context().group)")
_FIX_STRATEGY = {
    "self.all_gather": "gather in on_train_batch_end or an epoch-end hook instead (every rank runs those once per step)",
    "barrier": "move the barrier to a hook outside training_step (on_train_batch_end runs once per step on every rank)",
    "broadcast": "broadcast from a hook outside training_step (on_train_batch_end runs once per step on every rank)",
    "reduce_boolean_decision": "call it outside training_step (on_train_batch_end runs once per step on every rank)",
}

_ACTIVE: "LoopCollectiveGuard | None" = None  # the guard whose loop runs now (one per process)


class CollectiveInLoopError(RuntimeError):
    """A world collective (or one of a group other than the active SP group) was called inside the micro-batch
    loop; the message names the call, where it ran, and the fix."""


class LoopCollectiveGuard:
    """Refuses world collectives inside this rank's micro-batch loop and reports them to every rank.

    Args:
        module: the LightningModule (names a torchmetrics metric by its attribute path).
        rank, world_size: this process's global rank and the world.
        timeout_s: the collective time-out, named in the message (``None``: the backend's default).
    """

    def __init__(self, module: Any = None, rank: int = 0, world_size: int = 1, timeout_s: float | None = None) -> None:
        self.module, self.rank, self.world_size, self.timeout_s = module, int(rank), int(world_size), timeout_s
        self.tripped: CollectiveInLoopError | None = None
        self._where = ""
        self._extra: tuple[Any, ...] = ()
        self._thread: int | None = None
        self._saved: list[tuple[Any, str, Any]] = []

    # ------------------------------------------------------------------ the loop
    @contextlib.contextmanager
    def loop(self) -> Iterator["LoopCollectiveGuard"]:
        """While the block runs (this rank's micro-batch loop), the collectives are guarded; ``tripped`` starts empty."""
        global _ACTIVE
        self.tripped, self._thread = None, threading.get_ident()
        previous, _ACTIVE = _ACTIVE, self
        self._install()
        try:
            yield self
        finally:
            self._uninstall()
            _ACTIVE, self._thread, self._where, self._extra = previous, None, "", ()

    @contextlib.contextmanager
    def round(self, where: str, groups: Sequence[Any] = ()) -> Iterator[None]:
        """One round of the loop: ``where`` names it in messages; ``groups`` (a lockstep round's shard mesh
        groups) are allowed besides the active SP groups."""
        self._where, self._extra = where, tuple(g for g in groups if g is not None)
        try:
            yield
        finally:
            self._where, self._extra = "", ()

    def trip(self, err: CollectiveInLoopError) -> None:
        """Keep the first refused call of the step (the executor reports it at the step end)."""
        if self.tripped is None:
            self.tripped = err

    def refuse(self, call: str, group_desc: str, fix: str | None = None) -> CollectiveInLoopError:
        """:meth:`error`, recorded with :meth:`trip` before the caller raises it: caught by user code, it still
        stops every rank at the step end."""
        err = self.error(call, group_desc, fix)
        self.trip(err)
        return err

    @property
    def flag(self) -> int:
        """1 when a call was refused in this rank's loop this step (the step-end row's ``loop_collective``)."""
        return int(self.tripped is not None)

    def stop_if_tripped(self, flags: Sequence[float], gather: Callable[[Tensor], Tensor]) -> None:
        """After the step-end gather: if any rank flagged a refused call, every rank gathers the messages
        (``gather``: a world all-gather, ``[world, n]``) and raises the first flagged rank's, naming all of them."""
        flagged = [r for r, f in enumerate(flags) if f]
        if not flagged:
            return
        own = str(self.tripped) if self.tripped is not None else ""
        messages = [_decode(row) for row in gather(_encode(own)).tolist()] if self.world_size > 1 else [own]
        first = messages[flagged[0]] or own or "a world collective was called inside training_step"
        ranks = f"rank {flagged[0]}" if len(flagged) == 1 else f"ranks {flagged}"
        message = f"{first}. Every rank stopped at the end of this step ({ranks} made such a call)"
        err = self.tripped
        self.tripped = None
        if err is not None:  # this rank's own error: its traceback shows the user's call
            err.args = (message,)
            raise err
        raise CollectiveInLoopError(message)

    # ------------------------------------------------------------------ the check
    def check(self, name: str, group: Any, creation: bool = False) -> None:
        """Raise :class:`CollectiveInLoopError` unless ``group`` is one of the active SP groups (or allowed)."""
        if not creation and self._allowed(group):
            return
        raise self.refuse(f"torch.distributed.{name}", "a collective of the world" if creation else _describe_group(group))

    def _allowed(self, group: Any) -> bool:
        from lightning_dcp.sp.context import active_context

        if group is None or group is getattr(dist.group, "WORLD", None):
            if not dist.is_initialized():
                return False
            group = dist.distributed_c10d._get_default_group()
        ctx = active_context()
        allowed = [ctx.group, *self._extra]
        if ctx.ring is not None:
            allowed += [ctx.ring.ulysses_group, ctx.ring.ring_group]
        return any(g is not None and _same_group(g, group) for g in allowed)

    def error(self, call: str, group_desc: str, fix: str | None = None) -> CollectiveInLoopError:
        """The error for ``call`` on ``group_desc``, naming where it ran, a torchmetrics metric behind it, and the fix."""
        metric = _metric_behind(self.module)
        if metric is not None:
            call = f"{call} (the state sync of {metric[0]})"
        where = f"rank {self.rank}" + (f", {self._where}" if self._where else "")
        site = _call_site()
        if site:
            where += f"; called from {site}"
        limit = f"{self.timeout_s:g} s" if self.timeout_s is not None else "the backend's"
        fix = metric[1] if metric is not None else fix or _FIX_DIRECT
        return CollectiveInLoopError(
            f"{call} on {group_desc} inside training_step under DCPStrategy ({where}). Ranks run different numbers of "
            f"micro-batches per step, so a collective of the world there waits for ranks that never call it: a hang "
            f"until the collective time-out ({limit}). Inside training_step only the active SP group's collectives may "
            f"run. Fix: {fix}")

    # ------------------------------------------------------------------ the wrappers
    def _install(self) -> None:
        modules = (dist, dist.distributed_c10d)
        for name in GUARDED_CALLS + CREATION_CALLS:
            original = getattr(dist.distributed_c10d, name, None)
            if original is None:
                continue
            wrapper = _wrapper(name, original, name in CREATION_CALLS)
            for mod in modules:
                if getattr(mod, name, None) is original:
                    self._saved.append((mod, name, original))
                    setattr(mod, name, wrapper)

    def _uninstall(self) -> None:
        for mod, name, original in reversed(self._saved):
            setattr(mod, name, original)
        self._saved = []


def strategy_call_error(call: str) -> CollectiveInLoopError:
    """The error for the strategy's own world collective (``"self.all_gather"``, ``"barrier"``, ``"broadcast"``,
    ``"reduce_boolean_decision"``) called inside the loop; recorded by the running loop's guard (a caught one
    still stops every rank at the step end)."""
    name = call if call.startswith("self.") else f"trainer.strategy.{call}"
    fix = _FIX_STRATEGY.get(call)
    if _ACTIVE is not None:
        return _ACTIVE.refuse(name, "the world group", fix)
    return LoopCollectiveGuard().error(name, "the world group", fix)


@functools.lru_cache(maxsize=None)
def _group_position(fn: Callable[..., Any]) -> int | None:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("group") if "group" in params else None


def _wrapper(name: str, original: Callable[..., Any], creation: bool) -> Callable[..., Any]:
    position = None if creation else _group_position(original)

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        guard = _ACTIVE
        if guard is not None and guard._thread == threading.get_ident():
            if "group" in kwargs:
                group = kwargs["group"]
            else:
                group = args[position] if position is not None and position < len(args) else None
            guard.check(name, group, creation)
        return original(*args, **kwargs)

    guarded.__dcp_guarded__ = original  # type: ignore[attr-defined]
    return guarded


def _same_group(a: Any, b: Any) -> bool:
    if a is b:
        return True
    name_a, name_b = getattr(a, "group_name", None), getattr(b, "group_name", None)
    return name_a is not None and name_a == name_b


def _describe_group(group: Any) -> str:
    if group is None or group is getattr(dist.group, "WORLD", None):
        return "the world group"
    if dist.is_initialized() and _same_group(group, dist.distributed_c10d._get_default_group()):
        return "the world group"
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # a group this rank cannot resolve
        return "a process group other than the active SP group"
    return f"the process group of ranks {list(ranks)} (not the active SP group)"


def _metric_behind(module: Any) -> tuple[str, str] | None:
    """(the metric, the fix) for a torchmetrics metric whose sync made the call (``None``: no metric on the stack)."""
    if "torchmetrics" not in sys.modules:
        return None
    from torchmetrics import Metric

    frame = sys._getframe(1)
    metric, in_compute = None, False
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Metric):
            metric = owner
            in_compute = in_compute or frame.f_code.co_name == "compute"
        frame = frame.f_back
    if metric is None:
        return None
    name = _attribute_path(module, metric)
    cls = type(metric).__name__
    label = f"the torchmetrics metric {name} ({cls})" if name else f"a torchmetrics {cls} metric"
    attr = name or "metric"
    log = (f"log the metric object instead, self.log('{attr.split('.')[-1]}', {attr}, on_step=False, on_epoch=True) "
           f"(Lightning syncs it once at epoch end), or call {attr}.compute() in on_train_epoch_end")
    if getattr(metric, "dist_sync_on_step", False) and not in_compute:
        return label, (f"{label} syncs its state across ranks on every call because it was built with "
                       f"dist_sync_on_step=True; build it with dist_sync_on_step=False (the default) and {log}")
    return label, f"{label} syncs across ranks inside training_step ({attr}.compute() there); {log}"


def _attribute_path(module: Any, target: Any) -> str | None:
    if module is None or not hasattr(module, "named_modules"):
        return None
    for path, sub in module.named_modules():
        if sub is target and path:
            return f"self.{path}"
    return None


def _library_dirs() -> tuple[str, ...]:
    here = os.path.dirname(os.path.abspath(__file__))  # lightning_dcp/runtime, and lightning_dcp/sp beside it
    dirs = [os.path.dirname(os.__file__), os.path.dirname(torch.__file__), here,
            os.path.join(os.path.dirname(here), "sp")]
    for name in ("lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics", "deepspeed", "typing_extensions"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(path if path.endswith("typing_extensions.py") else os.path.dirname(path))
    return tuple(dict.fromkeys(dirs))


def _call_site() -> str | None:
    """``path:line in function`` of the innermost frame outside torch, Lightning, torchmetrics and this runtime."""
    skip = _library_dirs()
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(skip) and not path.startswith("<"):
            return f"{_short(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def _encode(message: str) -> Tensor:
    data = message.encode("utf-8")[: _MESSAGE_BYTES - 1]
    out = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _decode(row: Sequence[float]) -> str:
    data = bytes(int(v) for v in row)
    return data.split(b"\0", 1)[0].decode("utf-8", errors="replace")
