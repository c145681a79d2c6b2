"""An exponential moving average of the trained weights: the :class:`EMA` callback.

After every optimizer step (Lightning's ``on_train_batch_end``, after the step's collectives), for each
parameter that trains -- all of them in a full fine-tune, the adapter's in a LoRA run --
``ema = decay * ema + (1 - decay) * weight``. The averages are kept the way the strategy keeps the weights
the optimizer steps (:func:`trained_parameters`): full tensors under ``DCPStrategy(sharding="none" |
"zero1")`` (every rank holds the same average), each rank's DTensor shard under ``"zero2"`` / ``"fsdp"`` /
``"hsdp"`` -- the average of a shard is the shard of the average, so the update is local and no
collective runs. They are saved in Lightning's checkpoint (the callback's state; with sharded weights
every rank writes its shards of them into the sharded checkpoint directory,
:mod:`lightning_dcp.runtime.checkpoint`) and restored on resume;
:meth:`EMA.full_weights` gathers them (every rank calls it together) for validation videos
(:class:`~lightning_dcp.diffusers.validation.ValidationVideos`) and export
(:mod:`lightning_dcp.diffusers.export`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from typing_extensions import override

__all__ = ["EMA", "full_tensor", "trained_parameters"]


def trained_parameters(trainer: Any) -> dict[str, Tensor]:
    """Name -> the tensor the optimizer steps, for every parameter of the LightningModule that requires gradients:
    the module's own parameters, or under a strategy that shards them (``strategy.shards.sharded``) each rank's
    sharded DTensor."""
    shards = getattr(getattr(trainer, "strategy", None), "shards", None)
    named = getattr(shards, "sharded", None) or dict(trainer.lightning_module.named_parameters())
    return {name: p for name, p in named.items() if p.requires_grad}


def full_tensor(t: Tensor) -> Tensor:
    """``t`` whole: a DTensor is all-gathered (a collective of its mesh: every rank calls it), a tensor is itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class EMA(pl.Callback):
    """Keeps ``ema = decay * ema + (1 - decay) * weight`` of every trained parameter (see the module docstring).

    Args:
        decay: the average's decay per update (``0.999``: about the last thousand updates).
        every_n_steps: update after every n-th optimizer step (the decay applies per update).
        start_step: before this optimizer step the average follows the weights (it is set to them).

    Attributes:
        shadow: name -> the average (keyed like the LightningModule's ``named_parameters()``, e.g.
            ``"model.blocks.0.attn1.to_q.lora_A.default.weight"``), from the fit's start on.
        updates: how many updates the average has had.
    """

    def __init__(self, decay: float = 0.999, every_n_steps: int = 1, start_step: int = 0) -> None:
        if not 0.0 <= float(decay) < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay!r} (e.g. 0.999)")
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"EMA every_n_steps must be an int >= 1, got {every_n_steps!r}")
        self.decay, self.every_n_steps, self.start_step = float(decay), int(every_n_steps), int(start_step)
        self.shadow: dict[str, Tensor] = {}
        self.updates = 0
        self._params: dict[str, Tensor] = {}
        self._pending: Mapping[str, Any] | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(decay=self.decay, every_n_steps=self.every_n_steps)

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._params = trained_parameters(trainer)
        if not self._params:
            raise ValueError(f"EMA: {type(pl_module).__name__} has no parameter that requires gradients")
        fresh = set(self._params) != set(self.shadow)
        if fresh:
            self.shadow = {n: p.detach().clone() for n, p in self._params.items()}
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step  # optimizer steps done, this one included
        if step % self.every_n_steps:
            return
        names = list(self._params)
        shadow, weights = [self.shadow[n] for n in names], [self._params[n].detach() for n in names]
        with torch.no_grad():
            if step <= self.start_step:
                for s, w in zip(shadow, weights):
                    s.copy_(w)
            else:
                torch._foreach_lerp_(shadow, weights, 1.0 - self.decay)
        self.updates += 1

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "shadow": dict(self.shadow)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict  # applied once the fit's parameters are known (on_train_start)
        self.updates = int(state_dict.get("updates", 0))

    def _restore(self, state: Mapping[str, Any]) -> None:
        from lightning_dcp.runtime.checkpoint import SHARDED_STATE, load_callback_state

        if SHARDED_STATE in state:  # a sharded checkpoint: this rank's shards of the averages, read in place
            load_callback_state(dict(state), {"shadow": self.shadow})
            return
        saved = state.get("shadow", {})
        missing, extra = sorted(set(self.shadow) - set(saved)), sorted(set(saved) - set(self.shadow))
        if missing or extra:
            raise ValueError(f"EMA: the checkpoint's averages do not match the trained parameters (missing "
                             f"{missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
                             f"{'...' if len(extra) > 3 else ''}); resume with the same model and LoRA settings")
        with torch.no_grad():
            for name, value in saved.items():
                target = self.shadow[name]
                local = getattr(target, "_local_tensor", target)
                src = getattr(value, "_local_tensor", value)
                local.copy_(src.to(local.device, local.dtype))

    # ------------------------------------------------------------------ using the average
    def full_weights(self) -> dict[str, Tensor]:
        """Name -> the whole average (DTensor shards are all-gathered: every rank calls this together, in the
        same order)."""
        return {name: full_tensor(t.detach()) for name, t in self.shadow.items()}

    @contextlib.contextmanager
    def swapped(self, module: nn.Module) -> Iterator[nn.Module]:
        """``module`` (the LightningModule) with the averages copied into its parameters, the trained weights put
        back on exit. For replicated weights (``sharding="none"`` / ``"zero1"``): no collective."""
        params = dict(module.named_parameters())
        if any(hasattr(self.shadow[n], "full_tensor") or hasattr(params[n], "full_tensor") for n in self.shadow):
            raise RuntimeError("EMA.swapped works on replicated weights; with sharded weights gather full_weights() "
                               "(all ranks) and load them into a copy of the model")
        saved = {n: params[n].detach().clone() for n in self.shadow}
        with torch.no_grad():
            for n, t in self.shadow.items():
                params[n].copy_(t)
        try:
            yield module
        finally:
            with torch.no_grad():
                for n, t in saved.items():
                    params[n].copy_(t)
