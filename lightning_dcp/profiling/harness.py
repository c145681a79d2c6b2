"""How the profiler drives a user's module without changing it: the default step, muted ``self.log``,
state restored afterwards. (One SP rank's batch is :func:`lightning_dcp.sp.contract.local_batch`, as in
training; what the module says about itself is its :class:`~lightning_dcp.sp.contract.ModelContract`.)"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["default_step", "make_sp_groups", "muted_logging", "preserved_state", "to_device"]


def make_sp_groups(world_size: int, sp_sizes: Sequence[int]) -> Any:
    """Create the SP groups of every aligned block up to ``max(sp_sizes)`` (a collective: every rank calls it
    with the same arguments): a :class:`lightning_dcp.sp.groups.SPGroups` (``group_for``; ``destroy()`` when done).

    For use outside :class:`~lightning_dcp.DCPStrategy`, which has its own ``sp_groups``.
    """
    from lightning_dcp.sp.groups import SPGroups

    return SPGroups(world_size, dist.get_rank(), max_sp_size=max(sp_sizes))


def to_device(batch: Any, device: torch.device) -> Any:
    from lightning.fabric.utilities.apply_func import move_data_to_device

    return move_data_to_device(batch, device)


def default_step(module: nn.Module, batch: Any) -> torch.Tensor:
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
def muted_logging(module: nn.Module) -> Iterator[None]:
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
def preserved_state(module: nn.Module) -> Iterator[None]:
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
