"""Sharded checkpoints (``sharding="zero2"`` / ``"fsdp"``): every rank writes and reads its own shards.

The layout is Lightning's own distributed checkpoint (as its ``ModelParallelStrategy`` writes it): a
directory where ``torch.distributed.checkpoint`` keeps the model's and the optimizers' sharded
states (``"state_dict"``, ``"optimizer_0"``, ...) and rank 0 writes everything else Lightning's
checkpoint holds (loops, sampler position, schedulers, callbacks) to ``meta.pt``. No rank ever holds
the full weights or the full optimizer state. States are taken and set with
``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` / ``set_model_state_dict`` and
the optimizer's), so their keys are parameter names and a checkpoint loads on another world size.
Every function here is collective: all ranks call it together.

A callback whose state holds DTensors (:class:`~lightning_dcp.callbacks.EMA` under sharded weights) has those
entries saved with the shards too (as ``"callback_<n>"``); ``meta.pt`` keeps the rest of its state and
the name (:data:`SHARDED_STATE`), and the callback reads its shards back with :func:`load_callback_state`. A
checkpoint may hold only the parameters that train (a LoRA run's adapter): the frozen ones keep the values the
module was built with.

Saving is atomic: the states go to a sibling directory ``.<name>.partial`` and ``meta.pt`` is written
last, after every rank's shards; only then does rank 0 move the finished directory to ``path`` (an
earlier checkpoint there is moved aside first and deleted after). A process killed during a save
therefore leaves the previous checkpoint at ``path`` untouched, and a directory without ``meta.pt``
(an interrupted save) is refused by :func:`load_sharded` with an error that names it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["METADATA_FILENAME", "SHARDED_STATE", "IncompleteCheckpointError", "is_sharded_checkpoint", "partial_path",
           "load_callback_state", "load_sharded", "model_state", "optimizer_state", "save_sharded"]

#: The file of a sharded checkpoint directory holding everything but the model and optimizer states
#: (the name Lightning's ``ModelParallelStrategy`` uses, so either strategy recognises the other's).
METADATA_FILENAME = "meta.pt"
#: In ``meta.pt``, a callback state's key naming where its DTensor entries are in the shards.
SHARDED_STATE = "lightning_dcp_sharded_state"
#: Set by :func:`load_sharded` beside :data:`SHARDED_STATE`: the directory the state was loaded from.
SHARDED_FROM = "lightning_dcp_sharded_from"


class IncompleteCheckpointError(ValueError):
    """A sharded checkpoint directory whose save did not finish (no ``meta.pt``)."""


def partial_path(path: Path) -> Path:
    """Where :func:`save_sharded` writes ``path`` until the save is complete."""
    return path.with_name(f".{path.name}.partial")


def _aside_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.previous")


def _remove(path: Path) -> None:
    if path.is_file() or path.is_symlink():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint directory."""
    path = Path(path)
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


def model_state(module: nn.Module) -> dict[str, Any]:
    """The module's sharded state dict (DTensors: each rank's shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module)


def optimizer_state(module: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's sharded state dict, keyed by parameter names."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, getattr(optimizer, "_optimizer", optimizer))


def save_sharded(checkpoint: dict[str, Any], path: Path, *, rank: int, barrier: Any) -> None:
    """Write Lightning's ``checkpoint`` (built with :func:`model_state` / :func:`optimizer_state`) to the
    directory ``path``: the states through ``torch.distributed.checkpoint``, the rest to ``meta.pt``.
    An earlier file or directory at ``path`` is replaced once the new one is complete (see the module
    docstring)."""
    from torch.distributed.checkpoint import save

    partial = partial_path(path)
    if rank == 0:
        _remove(partial)  # a save interrupted earlier
        partial.mkdir(parents=True)
    barrier()
    states = {"state_dict": checkpoint.pop("state_dict")}
    states.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    callbacks = checkpoint.get("callbacks") or {}
    for n, (key, state) in enumerate(list(callbacks.items())):
        if isinstance(state, dict) and _holds_dtensor(state):  # its shards go with the others, the rest to meta.pt
            name = f"callback_{n}"
            states[name] = {k: v for k, v in state.items() if _holds_dtensor(v)}
            callbacks[key] = {**{k: v for k, v in state.items() if not _holds_dtensor(v)}, SHARDED_STATE: name}
    save(states, checkpoint_id=partial)
    barrier()  # every rank's shards are on disk before meta.pt marks the directory complete
    if rank == 0:
        torch.save(checkpoint, partial / METADATA_FILENAME)
        aside = _aside_path(path)
        _remove(aside)
        if path.exists() or path.is_symlink():
            path.rename(aside)
        partial.rename(path)
        _remove(aside)
    barrier()


def load_sharded(path: Path, module: nn.Module, optimizers: list[Any], *, strict: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_sharded` into the sharded ``module`` and ``optimizers``
    (in place); return the rest of Lightning's checkpoint (``meta.pt``).

    Raises:
        IncompleteCheckpointError: ``path`` is a directory whose save was interrupted (no ``meta.pt``).
        ValueError: ``path`` is not a sharded checkpoint directory (e.g. a single file written without
            ``sharding="zero2"`` / ``"fsdp"``), naming the fix.
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    _check_complete(path)
    if not is_sharded_checkpoint(path):
        kind = "a single file (written without sharded weights)" if path.is_file() else "not a sharded checkpoint"
        raise ValueError(f"{str(path)!r} is {kind}; DCPStrategy(sharding='zero2' | 'fsdp') resumes from the sharded "
                         f"checkpoint directories it writes (with {METADATA_FILENAME} inside). Resume it with the "
                         "sharding it was saved with")
    states: dict[str, Any] = {"state_dict": _saved_part(path, module, model_state(module), strict)}
    load(states, checkpoint_id=path)
    partial = len(states["state_dict"]) < len(module.state_dict())
    set_model_state_dict(module, states["state_dict"], options=StateDictOptions(strict=strict and not partial))
    for i, opt in enumerate(optimizers):
        key = f"optimizer_{i}"
        opt_states = {key: optimizer_state(module, opt)}
        load(opt_states, checkpoint_id=path)
        set_optimizer_state_dict(module, getattr(opt, "_optimizer", opt), optim_state_dict=opt_states[key])
    meta = torch.load(path / METADATA_FILENAME, weights_only=False)
    for state in (meta.get("callbacks") or {}).values():
        if isinstance(state, dict) and SHARDED_STATE in state:
            state[SHARDED_FROM] = str(path)
    return meta


def load_callback_state(state: dict[str, Any], targets: dict[str, Any]) -> None:
    """Read the DTensor entries of a callback's state that :func:`save_sharded` put with the shards into ``targets``
    (the same entries, allocated as this rank's shards), in place. Collective: every rank calls it."""
    from torch.distributed.checkpoint import load

    load({state[SHARDED_STATE]: targets}, checkpoint_id=state[SHARDED_FROM])


def _holds_dtensor(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_holds_dtensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_dtensor(v) for v in value)
    return hasattr(value, "device_mesh") and hasattr(value, "placements")


def _saved_part(path: Path, module: nn.Module, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """The entries of the module's ``state`` the checkpoint holds. A checkpoint may leave out what does not train
    (a LoRA run's frozen base); a trained parameter it lacks is an error (with ``strict``)."""
    from torch.distributed.checkpoint import FileSystemReader

    prefix = "state_dict."
    saved = {k[len(prefix):] for k in FileSystemReader(str(path)).read_metadata().state_dict_metadata if
             k.startswith(prefix)}
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    lacking = sorted(k for k in state if k not in saved and k in trained)
    if lacking and strict:
        raise ValueError(f"{str(path)!r} lacks {len(lacking)} trained weights of {type(module).__name__} "
                         f"({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}): it was written by a run "
                         "training other parameters (another LoRA setting?); resume with the same model and adapter")
    return {k: v for k, v in state.items() if k in saved}


def _check_complete(path: Path) -> None:
    """Refuse an interrupted save by name (a ``.partial`` directory, or one without ``meta.pt``)."""
    if path.is_dir() and not (path / METADATA_FILENAME).is_file():
        final = path.with_name(path.name[1:-len(".partial")]) if path.name.startswith(".") and \
            path.name.endswith(".partial") else path
        raise IncompleteCheckpointError(
            f"{str(path)!r} is an incomplete sharded checkpoint: its save was interrupted before "
            f"{METADATA_FILENAME} was written, so its shards may be missing or torn. Resume from the last complete "
            f"checkpoint instead ({str(final)!r} if it exists, or another one the checkpoint callback kept)")
    if not path.exists():
        aside = _aside_path(path)
        if (aside / METADATA_FILENAME).is_file():
            raise FileNotFoundError(
                f"{str(path)!r} does not exist: a save replacing it was interrupted after the previous checkpoint "
                f"was moved aside to {str(aside)!r}, which is complete; rename it back to {str(path)!r} to resume")
