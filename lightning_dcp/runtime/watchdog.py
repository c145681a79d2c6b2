"""SIGTERM ends every process of a run, even one blocked in a collective.

Python runs a signal handler only when the main thread gets back to the interpreter; a rank
blocked inside a collective (gloo/NCCL wait, GIL released) never does, so Lightning's SIGTERM
handler -- which forwards the signal to the ranks it started and stops at the next step -- never
runs, and a hung run ignores SIGTERM. :class:`ShutdownWatchdog` watches from a daemon thread:

- **SIGTERM**: the C-level signal handler writes the signal number to a wake-up file descriptor
  (:func:`signal.set_wakeup_fd`) even while the main thread is blocked; the watchdog forwards
  SIGTERM to this process's launched ranks at once, gives the normal shutdown ``grace_s`` seconds
  (Lightning's handler, a checkpoint on SIGTERM), then kills those ranks and exits with 143.
- **Launcher gone**: a rank started by a launcher (Lightning's spawn or popen launcher, torchrun,
  srun) exits within about a second once its parent process is gone, instead of waiting in a
  collective for a peer that no longer exists. The launcher process itself (popen rank 0, whose
  parent is the user's shell) does not watch its parent.

Only SIGTERM is handled here; SIGINT keeps Python's KeyboardInterrupt. The strategy starts the
watchdog in ``setup_environment`` (main thread) and stops it in ``teardown``.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

__all__ = ["ShutdownWatchdog", "rank_watchdog"]


class ShutdownWatchdog:
    """A daemon thread that ends this process (and the ranks it launched) on SIGTERM or launcher death.

    Args:
        grace_s: seconds between SIGTERM and a forced exit.
        watch_parent: exit when the parent process is gone (ranks started by a launcher).
        children: returns the ``subprocess.Popen`` objects of the ranks this process launched.
        name: for messages (e.g. ``"rank 1"``).
    """

    def __init__(self, grace_s: float = 30.0, watch_parent: bool = True,
                 children: Callable[[], Sequence[object]] = lambda: (), name: str = "") -> None:
        self.grace_s = float(grace_s)
        self.watch_parent = watch_parent
        self.children = children
        self.name = name
        self._ppid = os.getppid()
        self._stop = threading.Event()
        self._fds: tuple[int, int] | None = None
        self._old_fd = -1
        self._thread: threading.Thread | None = None
        self._sigterm_at: float | None = None

    def start(self) -> "ShutdownWatchdog":
        """Install the wake-up fd (must run in the main thread) and start the thread."""
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r), os.close(w)
            return self
        self._fds = (r, w)
        self._thread = threading.Thread(target=self._run, name="dcp-shutdown-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (restores the previous wake-up fd when called in the main thread)."""
        self._stop.set()
        if self._fds is not None and threading.current_thread() is threading.main_thread():
            try:
                signal.set_wakeup_fd(self._old_fd)
            except ValueError:
                pass
            r, w = self._fds
            self._fds = None
            if self._thread is not None:
                self._thread.join(2.0)
            for fd in (r, w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _run(self) -> None:
        r = self._fds[0]
        while not self._stop.is_set():
            ready, _, _ = select.select([r], [], [], 0.5)
            if ready:
                try:
                    data = os.read(r, 256)
                except OSError:
                    return
                if self._old_fd >= 0:
                    try:
                        os.write(self._old_fd, data)  # keep a previous owner of the wake-up fd informed
                    except OSError:
                        pass
                if signal.SIGTERM in data and self._sigterm_at is None:
                    self._sigterm_at = time.monotonic()
                    self._signal_children(signal.SIGTERM)
            if self._stop.is_set():
                return
            if self._sigterm_at is not None and time.monotonic() - self._sigterm_at >= self.grace_s:
                self._exit(143, f"SIGTERM received {self.grace_s:.0f} s ago and the process is still running (probably "
                                "blocked in a collective waiting for a peer)")
            if self.watch_parent and os.getppid() != self._ppid:
                self._exit(1, f"its launcher (process {self._ppid}) is gone")

    def _signal_children(self, signum: int) -> None:
        for proc in list(self.children()):
            try:
                proc.send_signal(signum)
            except (OSError, ValueError):
                pass

    def _exit(self, code: int, why: str) -> None:
        print(f"lightning-dcp: {self.name or 'process ' + str(os.getpid())} exits: {why}. A checkpoint resumes the "
              "run from the last saved step", file=sys.stderr, flush=True)
        self._signal_children(signal.SIGKILL)
        os._exit(code)


def rank_watchdog(launcher: Any, cluster_environment: Any, grace_s: float, rank: int) -> ShutdownWatchdog:
    """The started watchdog of a strategy's rank: SIGTERM ends this rank (and the ranks it launched, when
    ``launcher`` is Lightning's subprocess launcher) within ``grace_s`` even when it is blocked in a
    collective; a launched rank exits when its launcher is gone."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    is_launcher = isinstance(launcher, _SubprocessScriptLauncher) and not cluster_environment.creates_processes_externally
    children = (lambda: list(launcher.procs)) if is_launcher else (lambda: ())
    return ShutdownWatchdog(grace_s, watch_parent=not is_launcher, children=children, name=f"rank {rank}").start()
