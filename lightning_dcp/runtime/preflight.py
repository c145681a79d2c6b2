"""Fit-start checks that run before anything expensive, and that print once.

- :func:`check_train_data`: at strategy setup (the earliest hook where the train dataloader exists, before
  the profiler measures anything in ``on_fit_start``), the train dataset against the global batch: a
  dataset that gives no full global batch stops there, with the numbers and the fixes, instead of after
  minutes of profiling. (The option values are checked earlier, in ``DCPStrategy.__init__``:
  :mod:`~lightning_dcp.runtime.options`.)
- :func:`fit_start`: a ``with`` block around the fit-start checks. An error raised inside it is a
  configuration error that every rank raises alike, so it prints once: rank 0 prints its type and message
  (no traceback of Lightning's internals), every other rank one short line. Lightning's own exception
  handling (``on_exception`` callbacks, teardown) is unchanged; only the interpreter's final report is.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

from torch.utils.data import DataLoader

from lightning_dcp.planning.batches import cut_batches
from lightning_dcp.runtime.lengths import resolve_lengths
from lightning_dcp.runtime.settings import DCPSettings
from lightning_dcp.runtime.train_loader import global_batch, global_batch_source, map_style_dataset

__all__ = ["FIT_START_MARK", "check_train_data", "fit_start", "train_dataset"]

FIT_START_MARK = "__dcp_fit_start_rank__"
"""The attribute :func:`fit_start` sets on an exception: the global rank that raised it."""

_hook_installed = False


def train_dataset(trainer: Any) -> Any:
    """The fit's train dataset, from the loader Lightning will build (``None`` when there is none, several, or
    not a ``DataLoader``). Calls the module's ``train_dataloader`` hook when the loader comes from one."""
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is None or not source.is_defined():
        return None
    loader = source.dataloader()
    return loader if isinstance(loader, DataLoader) else None


def check_train_data(loader: DataLoader | None, settings: DCPSettings, world_size: int, accumulate: int = 1) -> None:
    """``loader``'s dataset gives at least one full global batch per epoch (with ``drop_last``); else a
    ``ValueError`` with the sample count, the global batch (and where it came from) and the fixes.
    ``accumulate``: ``Trainer(accumulate_grad_batches=...)``, which multiplies the global batch."""
    if loader is None:
        return
    dataset = map_style_dataset(loader)
    n = len(dataset)
    if n == 0 or not settings.drop_last:
        return  # an empty dataset is named by the lengths check; without drop_last every sample trains
    per_rank = loader.batch_size or 1
    gbs, gbt = global_batch(settings, per_rank, world_size, accumulate)
    name = type(dataset).__name__
    times = f" x Trainer(accumulate_grad_batches={accumulate})" if accumulate != 1 else ""
    if gbs is not None and n < gbs:
        source = global_batch_source(settings, per_rank, world_size) + times
        lower = (f"DCPStrategy(global_batch_size={n})" if not times else
                 f"DCPStrategy(global_batch_size={max(1, n // accumulate)}) with accumulate_grad_batches={accumulate}, "
                 "or a smaller accumulate_grad_batches")
        raise ValueError(
            f"the train dataset ({name}, {n} samples) gives no full global batch of {gbs} samples ({source}), so "
            f"with drop_last=True an epoch has no step. Lower the global batch to at most {n} "
            f"({lower}), train the {n} samples as one smaller step with "
            "DCPStrategy(drop_last=False), or add samples")
    if gbt is not None and (settings.lengths is not None or getattr(dataset, "lengths", None) is not None):
        lengths = resolve_lengths(dataset, settings.lengths)
        if not cut_batches(lengths, global_batch_tokens=gbt, drop_last=True):
            total = sum(lengths)
            with_n = f" with accumulate_grad_batches={accumulate}" if times else ""
            raise ValueError(
                f"the train dataset ({name}, {n} samples, {total} tokens) gives no full global batch of {gbt} tokens "
                f"(DCPStrategy(global_batch_tokens={settings.global_batch_tokens}){times}), so with drop_last=True an "
                f"epoch has no step. Lower it to at most {total} (DCPStrategy(global_batch_tokens="
                f"{max(1, total // accumulate)}){with_n}), "
                "train the samples as one smaller step with DCPStrategy(drop_last=False), or add samples")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def fit_start(rank: int) -> Iterator[None]:
    """Mark a ``ValueError`` / ``TypeError`` that lightning-dcp's own checks raise inside as a fit-start error of
    ``rank`` (printed once; see the module docstring) and re-raise it. Errors raised by other code (a user's
    ``train_dataloader``) keep their traceback."""
    try:
        yield
    except (ValueError, TypeError) as err:
        if not hasattr(err, FIT_START_MARK) and _raised_by_package(err):
            setattr(err, FIT_START_MARK, int(rank))
            _install_hook()
        raise


def _raised_by_package(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE + os.sep)


def _install_hook() -> None:
    """Wrap the current ``sys.excepthook`` (torch's ``[rankN]:`` prefixing one) once per process."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def print_once(kind: type[BaseException], err: BaseException, tb: Any) -> None:
        rank = getattr(err, FIT_START_MARK, None)
        if rank is None:
            return previous(kind, err, tb)
        if rank == 0:
            sys.stderr.write(f"{kind.__name__}: {err}\n(a DCPStrategy check at fit start: every rank stopped there; "
                             "no traceback)\n")
        else:
            sys.stderr.write(f"[rank{rank}]: stopped at fit start by the {kind.__name__} rank 0 printed\n")
        sys.stderr.flush()
        return None

    sys.excepthook = print_once
