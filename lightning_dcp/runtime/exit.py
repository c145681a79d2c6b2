"""A clean interpreter exit for every backend and launcher.

A process group still alive when the interpreter exits can abort the process after all work is done
(``terminate called without an active exception``, exit by SIGABRT): measured with a torch-only script
that initialises gloo, creates one ``new_group`` and exits, a rank aborted in a few of every 30 launches,
and in none once ``destroy_process_group()`` ran first. Under a spawn launcher that turns a finished fit
into ``ProcessExitedException`` in the main process.

``destroy_process_group()`` alone is not enough: it unregisters the groups, but a group's C++ object
(and its gloo worker threads) lives on while Python objects still refer to it (a device mesh, a sharded
module), until the interpreter's final garbage collection. A core dump of such an abort (2026-11-27, a
2-process hsdp test, about 1 run in 9 on a loaded machine) shows it: the main thread in
``Py_FinalizeEx``'s collection, a gloo worker thread dropping a finished all-gather's tensors, taking
the GIL during finalization and ending in ``std::terminate``. So the handler also runs a collection
while the interpreter is fully alive: the groups that nothing reaches any more are freed then (their
destructor releases the GIL while it joins the worker threads).

What kept a destroyed default group alive until finalization (found 2026-11-27, a 3-process profiler
test that aborted once on CI and once in about 30 repeated runs here; core dump as above): default
arguments. ``torch.distributed.nn.functional`` (``group=group.WORLD``),
``torch.distributed.fsdp.sharded_grad_scaler``, ``torch.distributed.optim`` and ``deepspeed.comm.torch``
evaluate ``group.WORLD`` when imported; imported after ``init_process_group`` they bind the live default
group, 12 references no ``destroy_process_group()`` or collection can drop. Imported before it, they
bind ``None``. :func:`import_group_defaults` does that, and the strategy calls it before Lightning
initialises the group (the test harness and ``lightning-dcp profile`` too).

Lightning registers the default group's destruction at exit for NCCL only; the strategy registers it
for every backend (:func:`destroy_at_exit`) and destroys its own SP groups at teardown
(:meth:`~lightning_dcp.sp.groups.SPGroups.destroy`).
"""

from __future__ import annotations

import atexit
import gc
import importlib

import torch.distributed as dist

__all__ = ["destroy_at_exit", "import_group_defaults"]

GROUP_DEFAULT_MODULES = ("torch.distributed.nn", "torch.distributed.fsdp.sharded_grad_scaler",
                         "torch.distributed.optim", "deepspeed.comm.torch")
"""Modules whose functions take ``group.WORLD`` as a default argument, evaluated at import."""

_registered = False


def _destroy_default_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # free unreachable groups' C++ objects now, not in the interpreter's finalization


def destroy_at_exit() -> None:
    """Destroy the default process group (and with it every group left) when the interpreter exits.
    Registered once per process; a no-op at exit if someone destroyed the group before."""
    global _registered
    if not _registered:
        atexit.register(_destroy_default_group)
        _registered = True


def import_group_defaults() -> list[str]:
    """Import :data:`GROUP_DEFAULT_MODULES` while no default group exists, so that their default arguments bind
    ``None`` and not a group that would then outlive ``destroy_process_group()``. Call it before
    ``init_process_group``; after it it does nothing, and a module that is not installed is skipped. Returns the
    modules now imported (a module imported before is listed and left as it is)."""
    if not dist.is_available() or dist.is_initialized():
        return []
    done = []
    for name in GROUP_DEFAULT_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # deepspeed is optional on some machines (the GPU image has none)
            continue
        done.append(name)
    return done
