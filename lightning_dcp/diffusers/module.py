"""A ready LightningModule for diffusers video transformers under DCP: :class:`VideoDiffusionModule`.

Batch flow under :class:`~lightning_dcp.DCPStrategy` (the strategy calls the hooks)::

    video_sample dicts  --pack_samples-->  packed micro-batch of clean latents (host)
      --dcp_prepare_batch-->  + noisy input, timestep, velocity target, loss scale per token
      --shard_batch-->  this SP rank's contiguous token chunk  --training_step-->  weighted loss

Noise and timesteps are drawn on the host, per sample, from ``(seed, epoch, dataset index)``
(:class:`~lightning_dcp.diffusers.flow.FlowMatching`), before packing decisions can matter, so
the run equals plain data-parallel training on the same global batches whatever the plan.
"""

from __future__ import annotations

from typing import Any, Mapping

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_dcp.diffusers.checks import check_train_data
from lightning_dcp.diffusers.dispatch import adapt, is_adapted, packed_forward
from lightning_dcp.diffusers.family import family_of
from lightning_dcp.diffusers.flow import LOSS_SCALE, TARGET, FlowMatching
from lightning_dcp.diffusers.forward import HIDDEN_STATES
from lightning_dcp.diffusers.lora import add_lora, check_adapter, has_lora, trainable_state
from lightning_dcp.diffusers.record import RECORD_KEY, ModelRecord
from lightning_dcp.diffusers.samples import LATENTS, collate_video
from lightning_dcp.sp.context import CU_SEQLENS, LOSS_MASK, TOKEN_WEIGHT, active_context
from lightning_dcp.sp.tokens import LOSS_REDUCTIONS, add_token_weights, weighted_loss
from lightning_dcp.diffusers.summary import video_support_message
from lightning_dcp.step_loss import StepLossLogging

__all__ = ["TRAINABLE_ONLY", "VideoDiffusionModule"]

#: Checkpoint key: the ``state_dict`` holds only the parameters that train (a LoRA run's adapter weights).
TRAINABLE_ONLY = "lightning_dcp_trainable_only"


class VideoDiffusionModule(StepLossLogging, pl.LightningModule):
    """Trains a diffusers video transformer (Wan, LTX-Video, CogVideoX, HunyuanVideo) with flow matching, under
    DCPStrategy or a plain Trainer.

    Samples are the family's sample dicts (:attr:`~lightning_dcp.diffusers.family.VideoFamily.sample`:
    :func:`~lightning_dcp.diffusers.video_sample` for Wan, :func:`~lightning_dcp.diffusers.ltx_video_sample`,
    :func:`~lightning_dcp.diffusers.cogvideox_sample`, :func:`~lightning_dcp.diffusers.hunyuan_sample`): clean
    VAE latents of any size, text embeddings; give ``index=`` so the noise is keyed on the dataset index under a
    plain DataLoader too. The dataset's ``lengths`` are the samples' video tokens,
    ``(F/pt) * (H/ph) * (W/pw)`` of the latent -- plus the text tokens for the joint-attention families
    (:mod:`lightning_dcp.diffusers.joint`), whose text rows carry no loss.

    Loss: the squared error between the predicted and the true velocity ``noise - x0``, averaged
    over each token's ``C x pt x ph x pw`` values (times the sigma weight of ``weighting_scheme``,
    1 by default), then

    * ``loss_reduction="token"``: the mean over every video token of the global batch (the mean
      squared error over all latent values of the batch: long videos weigh more);
    * ``"sample"``: the mean over samples of each sample's mean -- what Wan-style training with
      one video per GPU and data parallelism averages.

    Under DCPStrategy the strategy's ``loss_reduction`` decides (``None`` here follows it; a
    different explicit value is refused at setup); under a plain Trainer this module's (default ``"token"``).

    Args:
        model: a diffusers ``WanTransformer3DModel``, ``LTXVideoTransformer3DModel``,
            ``CogVideoXTransformer3DModel`` or ``HunyuanVideoTransformer3DModel``
            (:data:`~lightning_dcp.diffusers.family.FAMILIES`); :func:`~lightning_dcp.diffusers.adapt` is applied
            unless done.
        lr, weight_decay, betas: AdamW settings of the default :meth:`configure_optimizers`.
        seed, shift, num_train_timesteps, weighting_scheme, logit_mean, logit_std, mode_scale:
            the flow-matching schedule and sampling (:class:`~lightning_dcp.diffusers.flow.FlowMatching`).
        loss_reduction: ``"token"``, ``"sample"`` or ``None`` (see above).
        timestep_range: ``(lo, hi)`` fractions of ``num_train_timesteps`` to draw timesteps from, e.g.
            ``(boundary_ratio, 1.0)`` to train Wan 2.2 A14B's high-noise expert (see
            :class:`~lightning_dcp.diffusers.flow.FlowMatching`).
        lora: train a LoRA adapter instead of the whole model: peft's ``LoraConfig``, or an int (its rank, with the
            family's target modules, :func:`~lightning_dcp.diffusers.lora.lora_config`). The adapter is added with
            ``model.add_adapter`` (:func:`~lightning_dcp.diffusers.lora.add_lora`); the base stays frozen, the
            default optimizer holds only the adapter weights and checkpoints keep only them (the frozen base is
            restored from the model the module was built with). A model that carries an adapter already trains
            it the same way.
    """

    #: Tells DCPStrategy that this module takes packed, SP-sharded micro-batches.
    dcp_support = "sp"
    #: ``collate_fn`` for plain DataLoaders.
    collate = staticmethod(collate_video)
    #: The epoch validation draws its noise and timesteps for, whatever the training epoch: each
    #: validation sample gets the same noise every epoch, so ``val_loss`` is comparable across epochs.
    validation_epoch = 0
    #: At fit start the train dataset is checked against the model config (channels, text width, patch
    #: divisibility, rotary table): every sample of a dataset with ``video_shapes`` (an index, e.g.
    #: :class:`~lightning_dcp.diffusers.EncodedVideoDataset`), else the first this-many samples (``None``: all,
    #: ``0``: no check). See :mod:`lightning_dcp.diffusers.checks`.
    setup_check_samples: int | None = 32

    def __init__(self, model: nn.Module, lr: float = 1e-5, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), seed: int = 0, shift: float = 5.0,
                 num_train_timesteps: int = 1000, weighting_scheme: str = "none", logit_mean: float = 0.0,
                 logit_std: float = 1.0, mode_scale: float = 1.29, loss_reduction: str | None = None,
                 timestep_range: tuple[float, float] = (0.0, 1.0), lora: Any = None) -> None:
        super().__init__()
        if loss_reduction is not None and loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS} or None, got {loss_reduction!r}")
        check_adapter(model)  # an adapter added with model.add_adapter before
        self.model = model if is_adapted(model) else adapt(model)
        if lora is not None:
            add_lora(self.model, lora)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.loss_reduction = loss_reduction
        family = family_of(model)
        self.flow = FlowMatching(family.patch_size(model.config), seed=seed, shift=shift,
                                 num_train_timesteps=num_train_timesteps, weighting_scheme=weighting_scheme,
                                 logit_mean=logit_mean, logit_std=logit_std, mode_scale=mode_scale,
                                 timestep_range=timestep_range, target_layout=family.output_layout)

    @property
    def trains_adapter(self) -> bool:
        """Whether the model carries a LoRA adapter: only its weights train and are checkpointed."""
        return has_lora(self.model)

    @property
    def dcp_num_heads(self) -> int:
        """The attention head count SP sizes must divide."""
        return int(self.model.dcp_num_heads)

    def dcp_support_message(self, support: str) -> str | None:
        """The line DCPStrategy prints at fit start (:func:`~lightning_dcp.diffusers.summary.video_support_message`)."""
        return video_support_message(self, support)

    def setup(self, stage: str) -> None:
        strategy_reduction = getattr(getattr(self._trainer, "strategy", None), "loss_reduction", None)
        if self.loss_reduction is not None and strategy_reduction is not None and strategy_reduction != self.loss_reduction:
            raise ValueError(f"{type(self).__name__}(loss_reduction={self.loss_reduction!r}) but the strategy reduces by "
                             f"{strategy_reduction!r}; under DCPStrategy the strategy's loss_reduction decides: pass the "
                             "same value to both, or leave the module's at None")
        check_adapter(self.model)
        if stage == "fit" and self._trainer is not None:
            check_train_data(self._trainer, self.model, self.setup_check_samples)

    def dcp_prepare_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """DCPStrategy hook, on the whole packed micro-batch before sharding: noise, timestep and target per token."""
        if HIDDEN_STATES in batch:
            return dict(batch)
        return self.flow.prepare(batch, self.current_epoch)

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Predicted velocity ``[local_tokens, features]`` (in the family's output layout) of a prepared (possibly
        SP-sharded) batch."""
        return packed_forward(self.model, batch)

    def token_losses(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Per-token squared error (mean over the token's values) times its sigma weight, fp32 ``[local_tokens]``."""
        pred = self(batch)
        return (pred.float() - batch[TARGET].float()).pow(2).mean(-1) * batch[LOSS_SCALE].float()

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        """The flow-matching loss of the micro-batch (see the class docstring for the reductions)."""
        batch = self._as_prepared(batch)
        token_loss = self.token_losses(batch)
        if TOKEN_WEIGHT in batch:  # under DCPStrategy: exact for any packing, SP size and reduction
            return weighted_loss(token_loss, batch)
        weights = dict(batch)
        units = add_token_weights(weights, self.loss_reduction or "token")
        return (token_loss * weights[TOKEN_WEIGHT].to(token_loss.device)).sum() / max(units, 1)

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        """Mean flow-matching loss over the batch's video tokens, logged as ``val_loss``.

        The noise and timesteps are those of epoch :attr:`validation_epoch` in every epoch (keyed on
        each sample's ``index=``), so ``val_loss`` changes only when the weights do and is comparable
        across epochs. Samples made without ``index=`` get fresh random noise each time instead.
        """
        batch = self._as_prepared(batch, epoch=self.validation_epoch)
        mask = batch[LOSS_MASK].to(torch.float32)
        token_loss = self.token_losses(batch)
        loss = (token_loss * mask.to(token_loss.device)).sum() / mask.sum().clamp_min(1)
        self.log("val_loss", loss, batch_size=int(mask.sum()))
        return loss

    def _as_prepared(self, batch: Mapping[str, Any], epoch: int | None = None) -> Mapping[str, Any]:
        """``batch`` with noise, timestep and target (drawn for ``epoch``, default the current one) unless it has them."""
        if HIDDEN_STATES in batch:
            return batch
        latents = batch.get(LATENTS)
        sharded = (CU_SEQLENS in batch and isinstance(latents, torch.Tensor)
                   and latents.shape[0] != int(batch[CU_SEQLENS][-1]))
        if sharded or TOKEN_WEIGHT in batch or active_context().size > 1:
            raise RuntimeError(
                f"{type(self).__name__}.training_step got a DCP micro-batch without {HIDDEN_STATES!r}: the noise must "
                "be drawn on the whole packed micro-batch before SP sharding, which DCPStrategy does by calling the "
                "module's dcp_prepare_batch(batch) hook; this strategy version did not call it.")
        return self.dcp_prepare_batch(batch) if epoch is None else self.flow.prepare(batch, epoch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over all trainable parameters with ``lr``, ``weight_decay`` and ``betas``."""
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay, betas=self.betas)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The transformer's class, config and adapter config (:class:`~lightning_dcp.diffusers.record.ModelRecord`,
        what export rebuilds it from); with a LoRA adapter, only the trained (adapter) weights."""
        checkpoint[RECORD_KEY] = ModelRecord.of(self.model).to_dict()
        if self.trains_adapter:
            checkpoint["state_dict"] = trainable_state(self, checkpoint["state_dict"])
            checkpoint[TRAINABLE_ONLY] = True

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of the adapter weights only: the frozen base comes from the module as built."""
        if checkpoint.get(TRAINABLE_ONLY) and isinstance(checkpoint.get("state_dict"), dict):
            for key, value in self.state_dict().items():
                checkpoint["state_dict"].setdefault(key, value)
