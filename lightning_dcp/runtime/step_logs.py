"""``self.log(..., sync_dist=True)`` inside ``training_step``: one value per step, reduced over the whole step.

Under DDP, ``training_step`` runs once per rank and step, and Lightning syncs an on-step value there at once
(``strategy.reduce``, one world all-reduce per logged name). Under DCPStrategy it runs once per *micro-batch*, and
ranks run different numbers of them, so a world collective there would hang. Instead :class:`StepLogs`:

1. **in the loop** (:meth:`StepLogs.defer`, the strategy's ``reduce`` while the loop runs): returns the
   micro-batch's own value, so Lightning stores it as usual, and keeps it with the micro-batch's weight
   (:attr:`~lightning_dcp.runtime.step.MicroBatch.log_weight`). Which ``self.log`` name it belongs to is read back
   from Lightning's result collection (the tensor it stores is the one ``defer`` returned);
2. **at the step end** (:meth:`StepLogs.finish`, after the executor's step-end gather, whose row carries each rank's
   count and fingerprint of the names it logged): one more world collective -- an all-gather of a
   ``[names, 6]`` table when every rank logged the same names, else an all-gather of the per-rank tables by name
   (a rank that ran no micro-batch, names logged on some micro-batches only); none when no rank logged any;
3. **the value** each rank's result collection then holds for the step (what the loggers, the progress bar and
   ``callback_metrics`` read), by ``reduce_fx``:

   - ``"mean"`` (the default): the mean of every micro-batch's value on every rank, weighted by the micro-batch's
     samples (an SP item's shards split its samples' weight by their loss tokens; a shard without loss tokens
     does not count). DDP logs the mean over ranks of each rank's value on equal per-rank batches, so for a
     per-sample mean (a loss averaged over the batch's samples) both are the mean over the step's global batch:
     the same number. A mean over tokens of samples of different lengths is weighted by samples here as in DDP's
     per-rank mean, and equals neither DDP's number nor the exact global token mean (that is
     ``outputs["loss"]`` in ``on_train_batch_end``, :class:`~lightning_dcp.step_loss.StepLossLogging`);
   - ``"sum"``: the sum of every micro-batch's value on every rank (an SP item counts once per shard);
   - ``"max"`` / ``"min"``: over every micro-batch's value on every rank.

A value that cannot be matched stays this rank's own, with a warning naming it and the fix: a ``self.log`` with
``sync_dist_group=`` (a group of the user's), and a direct ``trainer.strategy.reduce(...)`` call. Epoch-level
values (``on_epoch=True``) are Lightning's: each micro-batch's value accumulated with its batch size, synced at
epoch end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_dcp.runtime.agreement import fingerprint

__all__ = ["GROUP_WARNING", "REDUCE_WARNING", "StepLogs"]

#: Warned once per name: ``self.log(..., sync_dist=True, sync_dist_group=...)`` inside ``training_step``.
GROUP_WARNING = ("self.log({name!r}, ..., sync_dist=True, sync_dist_group=...) inside training_step under DCPStrategy: "
                 "ranks run different numbers of micro-batches, so a group of your own cannot be reduced over; "
                 "{name!r} logs this rank's last micro-batch value. Drop sync_dist_group (the step's value is then "
                 "reduced over the world at the step end), or reduce it in on_train_batch_end (once per step on "
                 "every rank)")
#: Warned once: a ``trainer.strategy.reduce(...)`` call inside ``training_step`` that is not a ``self.log`` value.
REDUCE_WARNING = ("trainer.strategy.reduce(...) inside training_step under DCPStrategy returned this rank's own "
                  "value (ranks run different numbers of micro-batches, so a world collective there would hang). "
                  "Log the value with self.log(name, value, sync_dist=True) (reduced over the whole step at its end), "
                  "or call reduce in on_train_batch_end (once per step on every rank)")

_OPS = ("mean", "sum", "max", "min")
_WIDTH = 6  # per name: sum of weight x value, sum of weights, sum of values, count, max, min


@dataclass
class _Logged:
    op: str
    values: list[Tensor] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)


def _op_name(reduce_op: Any) -> str:
    name = str(getattr(reduce_op, "name", reduce_op)).lower().rsplit(".", 1)[-1]
    return "mean" if name == "avg" else name


class StepLogs:
    """This rank's ``sync_dist`` values of one step, by Lightning key (``"training_step.train_loss"``); see the module
    docstring. Built by the executor; ``results`` gives Lightning's result collection (``None``: no Trainer)."""

    def __init__(self, results: Callable[[], Any]) -> None:
        self._results = results
        self.weight = 1.0
        """The running micro-batch's weight (the executor sets it before each micro-batch)."""
        self._logged: dict[str, _Logged] = {}
        self._pending: tuple[Tensor, str, float, bool] | None = None  # (value, op, weight, own group)
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ in the loop
    def begin(self) -> None:
        """A new step (or a re-run of one): forget what an earlier attempt logged."""
        self._logged.clear()
        self._pending = None
        self.weight = 1.0

    def defer(self, tensor: Any, reduce_op: Any = "mean", group: Any = None) -> Any:
        """The strategy's ``reduce`` inside the loop: keep ``tensor`` for the step end, return it unchanged."""
        self._match()
        if isinstance(tensor, Tensor) and tensor.numel() == 1:
            self._pending = (tensor, _op_name(reduce_op), float(self.weight), group is not None)
        else:
            self._warn_once("reduce", REDUCE_WARNING)
        return tensor

    def _match(self) -> None:
        """Which ``self.log`` key the last deferred tensor became (Lightning stores it as the key's step value)."""
        if self._pending is None:
            return
        tensor, op, weight, grouped = self._pending
        self._pending = None
        key = self._key_of(tensor)
        if key is None or op not in _OPS:
            self._warn_once("reduce", REDUCE_WARNING)
        elif grouped:
            name = key.split(".", 1)[-1]
            self._warn_once(f"group:{key}", GROUP_WARNING.format(name=name))
        else:
            logged = self._logged.setdefault(key, _Logged(op))
            logged.values.append(tensor.detach().reshape(()))
            logged.weights.append(weight)

    def _key_of(self, tensor: Tensor) -> str | None:
        results = self._results()
        for key, metric in (results.items() if results is not None else ()):
            if getattr(metric, "_forward_cache", None) is tensor:
                return key
        return None

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            rank_zero_warn(message)

    # ------------------------------------------------------------------ the step end
    def local(self) -> tuple[list[str], list[str], Tensor]:
        """This rank's names (sorted), their ops and their ``[names, 6]`` float64 partials."""
        self._match()
        keys = sorted(self._logged)
        rows = []
        for key in keys:
            logged = self._logged[key]
            values = torch.stack(logged.values).double().cpu()
            weights = torch.tensor(logged.weights, dtype=torch.float64)
            counted = weights > 0  # a shard without loss tokens (its mean may be NaN) does not count in a mean
            weighted = float((values[counted] * weights[counted]).sum()) if bool(counted.any()) else 0.0
            rows.append([weighted, float(weights.sum()), float(values.sum()), float(len(values)), float(values.max()),
                         float(values.min())])
        table = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), _WIDTH)
        return keys, [self._logged[k].op for k in keys], table

    def signature(self) -> tuple[int, float]:
        """(how many names, their fingerprint; 0 for none) for the step-end gather's row."""
        self._match()
        if not self._logged:
            return 0, 0.0
        return len(self._logged), fingerprint(sorted((k, v.op) for k, v in self._logged.items())) or 1.0

    def finish(self, counts: Sequence[float], hashes: Sequence[float], gather: Callable[[Tensor], Tensor],
               gather_objects: Callable[[Any], list[Any]]) -> dict[str, float]:
        """Reduce the step's values over the world (``counts`` / ``hashes``: every rank's :meth:`signature`, from
        the step-end gather) and write them into Lightning's result collection; return them by key. Every rank
        calls it with the same ``counts`` and ``hashes``, so every rank runs the same collective (or none)."""
        keys, ops, table = self.local()
        self.begin()
        if not any(counts):
            return {}
        if all(c == counts[0] for c in counts) and len(set(hashes)) == 1:  # the same names everywhere: one tensor
            gathered = gather(table)  # [world, names, 6]
            per_key = {k: (op, gathered[:, i, :]) for i, (k, op) in enumerate(zip(keys, ops))}
        else:  # names differ across ranks (or a rank logged none): by name
            tables = gather_objects({k: (op, row.tolist()) for k, op, row in zip(keys, ops, table)})
            merged: dict[str, tuple[str, list[list[float]]]] = {}
            for t in tables:
                for k, (op, row) in t.items():
                    merged.setdefault(k, (op, []))[1].append(row)
            per_key = {k: (op, torch.tensor(rows, dtype=torch.float64)) for k, (op, rows) in merged.items()}
        values = {k: _combine(op, rows) for k, (op, rows) in per_key.items()}
        self._write(values)
        return values

    def _write(self, values: dict[str, float]) -> None:
        results = self._results()
        if results is None:
            return
        for key, value in values.items():
            metric = results.get(key)
            cache = getattr(metric, "_forward_cache", None)
            if not isinstance(cache, Tensor):
                continue  # this rank never logged the name
            reduced = torch.tensor(value, dtype=cache.dtype, device=cache.device)
            metric._forward_cache = reduced
            if not metric.meta.on_epoch:  # Lightning keeps an on-step-only value as the state too
                metric.value = reduced


def _combine(op: str, rows: Tensor) -> float:
    """One name's step value from the ranks' ``[*, 6]`` partials (rows with no value: count 0)."""
    rows = rows[rows[:, 3] > 0]
    if op == "sum":
        return float(rows[:, 2].sum())
    if op == "max":
        return float(rows[:, 4].max())
    if op == "min":
        return float(rows[:, 5].min())
    weight = float(rows[:, 1].sum())
    if weight > 0:
        return float(rows[:, 0].sum()) / weight
    return float(rows[:, 2].sum() / rows[:, 3].sum())  # no weighted value (every shard without loss tokens)
