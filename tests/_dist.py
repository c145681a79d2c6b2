"""Run a test function on N fresh CPU processes (forked from a warm server) joined by a gloo process group.

Usage (the function must be defined at module level so it pickles)::

    from _dist import run_distributed

    def _check(rank, world_size, scale):
        t = torch.ones(1) * rank
        dist.all_reduce(t)
        assert t.item() == scale * sum(range(world_size))

    def test_all_reduce():
        run_distributed(_check, 2, 1.0)

The processes are forked from a server that imported torch and Lightning once per test session
(multiprocessing's ``forkserver`` with a preload, :func:`_preload_fork_server`): each call still gets fresh processes, which
start from that server's clean state, not the pytest process's, with the pytest process's environment variables,
working directory and ``sys.path`` at the call, as spawned ones would; only the imports are not paid again
(about 8 s of CPU per process for ``lightning.pytorch``, most of a small multi-process test's time).

Each process calls ``dist.init_process_group("gloo")`` on a free TCP port of 127.0.0.1, runs
``fn(rank, world_size, *args)``, then destroys the group. An exception or failed assert in any
process is re-raised in the pytest process (with the child's traceback in the message); a
process that hangs (e.g. a collective with a missing peer) makes the call fail after ``timeout``
seconds instead of blocking the test run forever.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import multiprocessing
import os
import socket
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["find_free_port", "run_distributed"]


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Imported once by the fork server (a module that fails to import is left out); the test module of ``fn`` and
#: what it imports beyond these are imported by each process, as under spawn.
_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "lightning.pytorch", "lightning_dcp"]


def _preload_fork_server() -> None:
    """Have the ``forkserver`` (started by the first call of the session) preload ``_PRELOAD``."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)  # no effect once the server runs


def _worker(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple, timeout: float,
            environ: dict) -> None:
    # The fork server's environment is the pytest process's when it started; this call's is the caller's now.
    os.environ.clear()
    os.environ.update(environ)
    faulthandler.enable()  # a child killed by a signal (SIGABRT, SIGSEGV) prints its Python stack
    # One thread per process: the tests share few cores, and oversubscription makes them crawl.
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    from lightning_dcp.runtime.exit import import_group_defaults

    import_group_defaults()  # so that no function's default argument keeps the group alive past destruction
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():  # fn may have destroyed it (tests/test_exit.py)
            dist.destroy_process_group()
        # Free the process groups' C++ objects (their gloo worker threads) while the interpreter is alive:
        # left to the finalizer's last collection, a worker thread that still drops a finished collective's
        # tensors needs the GIL during finalization and aborts the process (SIGABRT, "terminate called
        # without an active exception"; see lightning_dcp/runtime/exit.py).
        gc.collect()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh gloo processes; re-raise failures.

    Args:
        fn: a module-level (picklable) function; it runs after ``dist.init_process_group("gloo")``.
        world_size: number of processes.
        *args: picklable arguments passed to ``fn`` after ``rank, world_size``.
        timeout: seconds before the processes are killed and :class:`TimeoutError` is raised.

    Raises:
        torch.multiprocessing.ProcessRaisedException: ``fn`` raised in some process (message
            holds that process's traceback).
        torch.multiprocessing.ProcessExitedException: a process died without a Python exception.
        TimeoutError: the processes did not all finish within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed needs world_size >= 1, got {world_size}.")
    port = find_free_port()
    _preload_fork_server()
    ctx = mp.start_processes(
        _worker,
        args=(fn, world_size, port, args, timeout, dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"run_distributed({getattr(fn, '__name__', fn)!r}, world_size={world_size}) did not finish "
                    f"within {timeout:.0f} s; a collective probably waits on a rank that never calls it."
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
