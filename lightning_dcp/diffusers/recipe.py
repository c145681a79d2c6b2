"""One video fine-tuning run from its settings: :func:`build_run` and :func:`train_video` (``lightning-dcp train-video``).

From a :class:`~lightning_dcp.diffusers.train_config.VideoTrainConfig`: the transformer
(:func:`~lightning_dcp.diffusers.pretrained.load_transformer`: a tiny offline model, or ``from_pretrained`` of a
pipeline folder or Hub id, fp32 weights), its family's samples of the encode folder
(:func:`~lightning_dcp.diffusers.family_data.family_dataset`), a
:class:`~lightning_dcp.diffusers.VideoDiffusionModule` (with a LoRA adapter unless ``lora.rank`` is 0), and a
Trainer under :class:`~lightning_dcp.DCPStrategy` with

* the dual-layer profiler at fit start under the memory ``budget`` (``auto``: the device's; ``none``: no
  profile, the analytic cost model);
* checkpoints every ``train.checkpoint_every`` steps and at the end (``<out>/checkpoints/``, ``last.ckpt``);
* :class:`~lightning_dcp.callbacks.EMA` (``ema.enabled``) and
  :class:`~lightning_dcp.diffusers.validation.ValidationVideos` (``validation.prompts``);
* the logger (``<out>/logs/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from lightning_dcp.diffusers.train_config import FAMILY_NAMES, VideoTrainConfig

__all__ = ["CHECKPOINTS", "VideoRun", "build_run", "train_video"]

#: The checkpoints' folder under ``out``.
CHECKPOINTS = "checkpoints"
#: The validation videos' frame rate when neither ``validation.fps`` nor the encode folder names one.
DEFAULT_VALIDATION_FPS = 16.0
#: How the profiler's messages name train-video's settings: the memory budget and the profile's time.
BUDGET_SETTING = "train-video's --budget MiB (budget: in the config)"
PROFILE_SECONDS_SETTING = "train-video's --profile-seconds S (profile_seconds: in the config)"


@dataclass
class VideoRun:
    """A built run: ``trainer.fit(module, loader, ckpt_path=...)`` trains it."""

    config: VideoTrainConfig
    module: Any
    trainer: Any
    loader: Any

    @property
    def checkpoints(self) -> Path:
        return Path(self.config.out) / CHECKPOINTS


def _logger(config: VideoTrainConfig) -> Any:
    from lightning.pytorch import loggers

    out = Path(config.out)
    if config.logger == "none":
        return False
    if config.logger == "csv":
        return loggers.CSVLogger(out, name="logs")
    if config.logger == "tensorboard":
        return loggers.TensorBoardLogger(out, name="logs")
    return loggers.WandbLogger(save_dir=str(out), project="lightning-dcp")


def _devices(config: VideoTrainConfig) -> tuple[str, int, str]:
    """``(accelerator, devices, precision)``: ``auto`` is every GPU with ``bf16-mixed`` (fp32 weights), else 2 CPU
    processes in fp32."""
    t = config.train
    cuda = torch.cuda.is_available() if t.accelerator == "auto" else t.accelerator in ("gpu", "cuda")
    accelerator = ("gpu" if cuda else "cpu") if t.accelerator == "auto" else t.accelerator
    devices = (torch.cuda.device_count() if cuda else 2) if t.devices == "auto" else int(t.devices)
    precision = ("bf16-mixed" if cuda else "32-true") if t.precision == "auto" else t.precision
    return accelerator, devices, precision


def validation_fps(config: VideoTrainConfig) -> float:
    """The validation videos' frame rate: ``validation.fps``, else the rate the data was encoded at (``lightning-dcp
    encode --fps``, in the encode folder's ``meta.json``), else :data:`DEFAULT_VALIDATION_FPS`."""
    if config.validation.fps is not None:
        return float(config.validation.fps)
    from lightning_dcp.diffusers.shards import read_meta

    try:
        meta = read_meta(Path(config.data)) or {}
    except (OSError, ValueError):  # the dataset itself reports an unreadable folder
        meta = {}
    fps = (meta.get("settings") or {}).get("fps")
    return float(fps) if isinstance(fps, (int, float)) and fps > 0 else DEFAULT_VALIDATION_FPS


def build_run(config: VideoTrainConfig, *, callbacks: Sequence[Any] = (), progress_bar: bool = True) -> VideoRun:
    """The module, Trainer and DataLoader of ``config`` (nothing trains yet); ``callbacks`` go first in the Trainer's
    (``lightning-dcp train-video`` adds its plan printer).

    Raises:
        ValueError: the model is not of ``config.family``, or its family's samples cannot come from the encode folder.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_dcp.callbacks.ema import EMA
    from lightning_dcp.diffusers.family import family_of
    from lightning_dcp.diffusers.family_data import family_dataset
    from lightning_dcp.diffusers.lora import lora_config
    from lightning_dcp.diffusers.module import VideoDiffusionModule
    from lightning_dcp.diffusers.pretrained import load_transformer
    from lightning_dcp.diffusers.validation import ValidationVideos
    from lightning_dcp.runtime.strategy import DCPStrategy

    config.check()
    model = load_transformer(config.model)
    family = family_of(model)
    if config.family is not None and FAMILY_NAMES[config.family] != family.class_name:
        raise ValueError(f"family: {config.family} ({FAMILY_NAMES[config.family]}), but {config.model} is a "
                         f"{family.class_name} ({family.label}); drop `family` or name the right model")
    patch = family.patch_size(model.config)
    dataset = family_dataset(config.data, family, patch)
    t = config.train
    pl.seed_everything(t.seed, verbose=False)
    lora = None
    if config.lora.rank > 0:
        lora = lora_config(model, rank=config.lora.rank, alpha=config.lora.alpha, target_modules=config.lora.targets)
    module = VideoDiffusionModule(model, lr=t.lr, weight_decay=t.weight_decay, seed=t.seed, shift=t.shift, lora=lora)

    out = Path(config.out)
    callbacks = [*callbacks, ModelCheckpoint(dirpath=out / CHECKPOINTS, every_n_train_steps=t.checkpoint_every,
                                             save_last=True, save_top_k=1)]
    if config.ema.enabled:
        callbacks.append(EMA(decay=config.ema.decay))
    v = config.validation
    if v.prompts:
        callbacks.append(ValidationVideos(config.model, v.prompts, seeds=v.seeds, every_n_steps=v.every_n_steps,
                                          num_frames=v.num_frames, height=v.height, width=v.width,
                                          num_inference_steps=v.num_inference_steps, guidance_scale=v.guidance_scale,
                                          fps=validation_fps(config)))
    if config.profile:
        from lightning_dcp.profiling import DCPProfiler

        limit = config.memory_limit_mib
        callbacks.append(DCPProfiler(memory_limit_bytes=None if limit is None else limit * 2**20,
                                     memory_limit_source=None if limit is None else f"budget: {limit:g} MiB",
                                     memory_limit_setting=BUDGET_SETTING, time_budget_s=config.profile_seconds,
                                     time_budget_source=PROFILE_SECONDS_SETTING))
    if progress_bar:
        from lightning_dcp.callbacks.progress import StepProgressBar

        callbacks.append(StepProgressBar())
    accelerator, devices, precision = _devices(config)
    strategy = DCPStrategy(global_batch_size=t.global_batch_size, seed=t.seed, sharding=t.sharding,
                           profile=config.profile, drop_last=t.drop_last)
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, precision=precision,
                         max_steps=t.steps, logger=_logger(config), callbacks=callbacks, default_root_dir=str(out),
                         enable_model_summary=False, enable_progress_bar=progress_bar, num_sanity_val_steps=0,
                         limit_val_batches=0, log_every_n_steps=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=VideoDiffusionModule.collate)
    return VideoRun(config, module, trainer, loader)


def train_video(config: VideoTrainConfig, *, resume: str | None = None, callbacks: Sequence[Any] = (),
                progress_bar: bool = True) -> VideoRun:
    """Build and fit the run of ``config``; ``resume``: a checkpoint path, or ``"last"`` (``<out>/checkpoints/last.ckpt``)."""
    run = build_run(config, callbacks=callbacks, progress_bar=progress_bar)
    ckpt = str(run.checkpoints / "last.ckpt") if resume == "last" else resume
    run.trainer.fit(run.module, run.loader, ckpt_path=ckpt)
    return run
