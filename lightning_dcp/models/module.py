"""A ready-made LightningModule around the reference models, for the CLI, the demo and the profiler."""

from __future__ import annotations

from typing import Any, Mapping

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_dcp.sp.context import LOSS_MASK, SEGMENT_IDS, TOKEN_WEIGHT
from lightning_dcp.models import build_model, resolve_spec
from lightning_dcp.models.transformer2d import shard_video_batch, video_shapes
from lightning_dcp.planning.models import ModelSpec
from lightning_dcp.sp.tokens import weighted_loss
from lightning_dcp.step_loss import StepLossLogging

__all__ = ["DCPTransformerModule", "resolve_spec"]  # resolve_spec re-exported from lightning_dcp.models


class DCPTransformerModule(StepLossLogging, pl.LightningModule):
    """Trains :class:`~lightning_dcp.models.Transformer1D` (next-token cross-entropy) or
    :class:`~lightning_dcp.models.Transformer2D` (masked MSE to ``batch["targets"]``).

    Works with the DCP strategy and equally as a plain LightningModule (single device, DDP) fed
    by ``DataLoader(..., collate_fn=lightning_dcp.sp.packing.plain_collate)``.

    Args:
        model: registry name (``"tiny-1d"``, ``"tiny-2d"``, ``"transformer-1d"``, ``"transformer-2d"``),
            a :class:`~lightning_dcp.planning.models.ModelSpec`, or its ``to_dict()``.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    ``training_step`` returns the mean loss over this rank's local loss tokens (non-padding, and
    for 1d labels != -100) -- or, when the DCP strategy put ``TOKEN_WEIGHT`` in the batch,
    :func:`lightning_dcp.sp.tokens.weighted_loss` of the per-token losses (exact for the
    strategy's ``"token"`` and ``"sample"`` reductions). The step's loss is logged as ``train/loss``
    (:class:`~lightning_dcp.step_loss.StepLossLogging`): the global mean under DCPStrategy, the batch
    mean under a plain Trainer. :meth:`token_losses` gives the per-token values and mask. For ``"2d"`` models the module has a
    ``dcp_shard_batch(batch, sp_rank, sp_size)`` hook (whole frames per SP rank, see
    :func:`~lightning_dcp.models.transformer2d.shard_video_batch`); ``"1d"`` models have none
    (``hasattr`` is False), so the strategy's generic token chunking applies.
    """

    def __init__(self, model: str | ModelSpec | Mapping[str, Any] = "tiny-1d", lr: float = 1e-3, weight_decay: float = 0.0):
        super().__init__()
        spec = resolve_spec(model)
        self.save_hyperparameters({"model": model if isinstance(model, str) else spec.to_dict(), "lr": lr,
                                   "weight_decay": weight_decay})
        self.spec = spec
        self.lr, self.weight_decay = lr, weight_decay
        self.model: torch.nn.Module = build_model(spec)

    @property
    def num_heads(self) -> int:
        """Attention heads: every SP size the planner uses must divide it."""
        return self.spec.num_heads

    @property
    def dcp_ring_layout(self) -> str:
        """Token layout of ring items (:mod:`lightning_dcp.sp.ring`): ``"zigzag"`` for a causal model (every ring
        position gets as much causal work), else ``"contiguous"``."""
        return "zigzag" if self.spec.causal else "contiguous"

    @property
    def dcp_shard_batch(self):  # noqa: D401 - a hook, present only for 2d models
        """Hook for the DCP strategy (2d only): ``dcp_shard_batch(batch, sp_rank, sp_size) -> dict``."""
        if self.spec.kind != "2d":
            raise AttributeError(f"{type(self).__name__} for a {self.spec.kind!r} model has no dcp_shard_batch; "
                                 "the strategy's generic token chunking applies")
        return shard_video_batch

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        return self.model(batch)

    def token_losses(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, mask)`` per local token: float32 ``[local_tokens]`` and bool ``[local_tokens]``
        (False on padding and, for 1d, on labels == -100); ``loss`` is 0 where ``mask`` is False."""
        out = self.model(batch)
        if self.spec.kind == "1d":
            labels = batch["labels"]
            loss = F.cross_entropy(out.float(), labels, ignore_index=-100, reduction="none")
            mask = labels != -100
        else:
            loss = (out.float() - batch["targets"].float()).pow(2).mean(dim=-1)
            mask = torch.ones_like(loss, dtype=torch.bool)
        if LOSS_MASK in batch:
            mask = mask & batch[LOSS_MASK].to(device=mask.device, dtype=torch.bool)
        return torch.where(mask, loss, torch.zeros_like(loss)), mask

    def _mean_loss(self, batch: Mapping[str, Any]) -> torch.Tensor:
        loss, mask = self.token_losses(batch)
        # A rank whose shard is all padding still returns a loss connected to the graph, so it
        # takes part in the backward all-to-alls of its SP group.
        return loss.sum() / mask.sum().clamp_min(1)

    def _batch_size(self, batch: Mapping[str, Any]) -> int:
        if self.spec.kind == "2d" and "shapes" in batch:
            return len(video_shapes(batch["shapes"]))
        seg = batch.get(SEGMENT_IDS)
        if isinstance(seg, torch.Tensor) and seg.numel():
            return max(1, int(seg.max()) + 1)
        return 1

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        loss, mask = self.token_losses(batch)
        if TOKEN_WEIGHT in batch:  # under DCPStrategy: exact for both loss reductions, packed or not
            return weighted_loss(loss, batch)
        return loss.sum() / mask.sum().clamp_min(1)

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self._mean_loss(batch)
        self.log("val_loss", loss, prog_bar=True, batch_size=self._batch_size(batch))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
