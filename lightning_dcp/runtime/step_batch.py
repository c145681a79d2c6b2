"""The batch a Lightning hook sees: this rank's samples of the step, as the user's ``collate_fn`` batches them.

Under DDP, ``on_train_batch_start(trainer, module, batch, batch_idx)`` and ``on_train_batch_end`` get the
rank's batch as the DataLoader's ``collate_fn`` made it, so callbacks write ``x, y = batch`` (sample and image
loggers, Lightning's docs). Under :class:`~lightning_dcp.DCPStrategy` the batch of those hooks is a
:class:`~lightning_dcp.runtime.step.PreparedStep` (the step plan, this rank's micro-batches); in safe mode
(the module declares nothing, see :mod:`~lightning_dcp.runtime.support`) each micro-batch *is* the user's
``collate_fn`` output for its samples, and the step unpacks like the rank's whole batch:
``x, y = batch``, ``batch["image"]``, ``len(batch)``, ``dict(batch)`` read :attr:`PreparedStep.data
<lightning_dcp.runtime.step.PreparedStep.data>`, which :func:`join_batches` builds on first use from the
micro-batches as ``training_step`` saw them (on the device), in execution order:

- tensors are concatenated along their first (batch) dimension; 0-d tensors are stacked;
- mappings join key by key, tuples, lists and named tuples field by field;
- a list of strings or numbers (``default_collate`` of a string field) is the batch dimension: concatenated.

So a fixed-shape collate (images, ``TensorDataset``, ``default_collate``) gives exactly the batch the same
samples would make in one ``collate_fn`` call. Tensors whose trailing shapes differ (a collate that pads each
micro-batch to its own longest sample) do not join: :class:`StepBatchError` names them and the fix.
At the ``"packed"`` and ``"sp"`` levels the micro-batches are packed shards (:func:`~lightning_dcp.sp.packing.pack_samples`),
not the user's batches: read ``batch.micro_batches[i].data`` and ``batch.step.items`` there.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["StepBatchError", "join_batches"]

_LEAVES = (str, bytes, int, float, complex, bool, type(None))


class StepBatchError(TypeError):
    """This rank's micro-batches of a step do not make one batch (the message says why and what to read instead)."""


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def join_batches(parts: Sequence[Any], where: str = "batch") -> Any:
    """One batch from the collated micro-batches ``parts`` (see the module docstring); ``where`` names the
    position in errors (``batch['input_ids']``, ``batch[1]``).

    Raises:
        StepBatchError: no parts, or parts that differ in structure or in a tensor's trailing shape.
    """
    if not parts:
        raise StepBatchError(f"{where}: no micro-batch to join")
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if all(isinstance(p, Tensor) for p in parts):
        return _join_tensors(parts, where)
    if all(isinstance(p, Mapping) for p in parts):
        keys = list(first.keys())
        if any(list(p.keys()) != keys for p in parts[1:]):
            raise StepBatchError(f"{where}: the micro-batches have different keys "
                                 f"({', '.join(str(list(p.keys())) for p in parts)}), so they do not join into one batch; "
                                 "read them one by one: batch.micro_batches[i].data")
        joined = {k: join_batches([p[k] for p in parts], f"{where}[{k!r}]") for k in keys}
        try:
            return type(first)(joined)
        except Exception:  # noqa: BLE001 - a mapping type that is not built from a dict
            return joined
    if all(isinstance(p, (list, tuple)) for p in parts) and len({type(p) for p in parts}) == 1:
        if isinstance(first, list) and all(isinstance(v, _LEAVES) for p in parts for v in p):
            return [v for p in parts for v in p]  # the batch dimension (strings, numbers)
        if any(len(p) != len(first) for p in parts[1:]):
            raise StepBatchError(f"{where}: the micro-batches hold {[len(p) for p in parts]} fields, so they do not "
                                 "join into one batch; read them one by one: batch.micro_batches[i].data")
        fields = [join_batches(list(column), f"{where}[{i}]") for i, column in enumerate(zip(*parts))]
        if _is_namedtuple(first):
            return type(first)(*fields)
        return type(first)(fields)
    if all(isinstance(p, _LEAVES) for p in parts) and all(p == first for p in parts[1:]):
        return first
    kinds = sorted({type(p).__name__ for p in parts})
    raise StepBatchError(f"{where}: the micro-batches hold {', '.join(kinds)} values "
                         f"{[p for p in parts] if all(isinstance(p, _LEAVES) for p in parts) else ''} that do not join "
                         "into one batch; read them one by one: batch.micro_batches[i].data")


def _join_tensors(parts: Sequence[Tensor], where: str) -> Tensor:
    if all(p.dim() == 0 for p in parts):
        return torch.stack(list(parts))
    shapes = [tuple(p.shape) for p in parts]
    if any(p.dim() == 0 for p in parts) or len({s[1:] for s in shapes}) > 1:
        raise StepBatchError(
            f"{where}: this rank's micro-batches have shapes {', '.join(str(s) for s in shapes)}, which do not join "
            "along the batch dimension (a collate_fn that pads each batch to its own longest sample does this); pad to "
            "a fixed length in collate_fn, or read the micro-batches one by one: batch.micro_batches[i].data")
    return torch.cat(list(parts), dim=0)
