"""Validation videos during training: the :class:`ValidationVideos` callback.

Every ``every_n_steps`` optimizer steps (and at the end of the fit), the family's diffusers pipeline
(:attr:`~lightning_dcp.diffusers.family.VideoFamily.pipeline`: ``WanPipeline``, ``LTXPipeline``,
``CogVideoXPipeline``, ``HunyuanVideoPipeline``) generates a video for each fixed prompt and seed with the
transformer being trained -- its raw weights, or their average when an :class:`~lightning_dcp.callbacks.EMA`
callback runs -- and writes it as an mp4 (PyAV). The files are logged to every logger that takes videos
(W&B's ``log_video``, TensorBoard's ``add_video``) and listed in ``videos.csv`` beside them (step, prompt,
seed, weights, path), in ``<logger.log_dir>/validation_videos/`` (the first logger with a ``log_dir``, e.g.
``CSVLogger``'s), else ``<default_root_dir>/validation_videos/``.

It never desynchronises the step's collectives: it runs in ``on_train_batch_end``, after the step's last
collective, on every rank.

* Replicated weights (``DCPStrategy(sharding="none" | "zero1")``, a single device): each rank holds the whole
  model, so the prompts are spread over the ranks (job ``j`` on rank ``j % world``); each generates with the live
  transformer (the EMA averages swapped in and back), whose own forward -- what a pipeline calls -- runs no
  collective. One ``all_gather_object`` of the written paths follows (a world collective, once, after the step).
* Sharded weights (the optimizer steps DTensor shards: ``"zero2"``, ``"fsdp"``, ``"hsdp"``): every rank takes
  part in gathering the full weights (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``, and the
  EMA's :meth:`~lightning_dcp.callbacks.EMA.full_weights`) onto rank 0, which alone builds a plain transformer
  of the same class, config and adapter (:class:`~lightning_dcp.diffusers.record.ModelRecord`), loads them and
  generates; the others wait in the closing gather.

The ranks that are not generating wait in that gather: a validation longer than ``DCPStrategy(timeout=...)``
(300 s by default) ends the run as a stuck collective -- keep the prompts few and the videos short, or raise it.
"""

from __future__ import annotations

import contextlib
import csv
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_dcp.callbacks.ema import EMA, trained_parameters
from lightning_dcp.diffusers.family import family_of
from lightning_dcp.diffusers.mp4 import write_mp4
from lightning_dcp.diffusers.record import ModelRecord, module_weights

__all__ = ["INDEX_FILE", "ValidationVideo", "ValidationVideos"]

#: The file listing every validation video (one row each), in the videos folder.
INDEX_FILE = "videos.csv"


@dataclass(frozen=True)
class ValidationVideo:
    """One generated video: the step after which it was made, its prompt and seed, the weights (``"ema"`` or
    ``"raw"``), the mp4 file, and its frames, frame rate and size."""

    step: int
    prompt: str
    seed: int
    weights: str
    path: str
    frames: int = 0
    fps: float = 0.0
    width: int = 0
    height: int = 0

    def line(self) -> str:
        """What :class:`ValidationVideos` prints when it writes the video."""
        return (f"validation video: {self.path} ({self.frames} frames at {self.fps:g} fps, {self.width}x{self.height}, "
                f"step {self.step}, {self.weights} weights, prompt {self.prompt!r}, seed {self.seed})")


class ValidationVideos(pl.Callback):
    """Generates videos of fixed prompts and seeds with the trained transformer every ``every_n_steps`` steps.

    Args:
        pipeline: where the pipeline's other components (VAE, text encoders, tokenizers, scheduler) come from: a
            tiny model name (``"tiny-wan"``, :mod:`lightning_dcp.diffusers.tiny`), a diffusers pipeline folder or hub
            id (the family pipeline's ``from_pretrained``, without its transformer), or ``f(transformer) ->
            pipeline``.
        prompts: the prompts, each generated once per seed.
        seeds: the seeds of the pipeline's generator (a CPU ``torch.Generator``).
        every_n_steps: generate after every n-th optimizer step (0: only at the end).
        at_end: also generate when the fit ends (unless its last step just did).
        ema: use the EMA callback's averages (``None``: when an :class:`~lightning_dcp.callbacks.EMA` callback runs).
        num_frames, height, width, num_inference_steps, guidance_scale: the pipeline call's (``guidance_scale``
            ``None``: the pipeline's default).
        fps: the mp4's frame rate (``lightning-dcp train-video``: the encoded set's, by default).
        verbose: rank 0 prints a line per video written (:meth:`ValidationVideo.line`: path, frames, fps).
        out_dir: the videos folder (default: see the module docstring).
        pipeline_kwargs: more keyword arguments of the pipeline call (``negative_prompt``, ``frame_rate``, ...)
            or, for a folder or hub id, of ``from_pretrained`` under the key ``"from_pretrained"``.
    """

    def __init__(self, pipeline: str | Path | Callable[[nn.Module], Any], prompts: Sequence[str], *,
                 seeds: Sequence[int] = (0,), every_n_steps: int = 100, at_end: bool = True, ema: bool | None = None,
                 num_frames: int = 17, height: int = 256, width: int = 256, num_inference_steps: int = 30,
                 guidance_scale: float | None = None, fps: float = 16.0, out_dir: str | Path | None = None,
                 pipeline_kwargs: dict[str, Any] | None = None, verbose: bool = True) -> None:
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"ValidationVideos needs one or more prompts (strings), got {prompts!r}")
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"every_n_steps must be an int >= 0 (0: only at the end), got {every_n_steps!r}")
        self.source, self.prompts, self.seeds = pipeline, list(prompts), [int(s) for s in seeds]
        self.every_n_steps, self.at_end, self.ema = every_n_steps, bool(at_end), ema
        self.call = {"num_frames": int(num_frames), "height": int(height), "width": int(width),
                     "num_inference_steps": int(num_inference_steps)}
        if guidance_scale is not None:
            self.call["guidance_scale"] = float(guidance_scale)
        extra = dict(pipeline_kwargs or {})
        self.load_kwargs = dict(extra.pop("from_pretrained", {}))
        self.call.update(extra)
        self.fps, self.out_dir = float(fps), None if out_dir is None else Path(out_dir)
        self.verbose = bool(verbose)
        self.videos: list[ValidationVideo] = []
        """Every video generated so far (on rank 0: all ranks' videos)."""
        self._pipeline: Any = None
        self._last_step = -1

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        folder = self.out_dir or _default_folder(trainer)
        self.out_dir = Path(trainer.strategy.broadcast(str(folder)))  # one folder, rank 0's
        if self._ema_callback(trainer) is None and self.ema:
            raise ValueError("ValidationVideos(ema=True) needs an EMA callback in the Trainer's callbacks "
                             "(lightning_dcp.EMA)")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0:
            self.generate(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_end and trainer.global_step != self._last_step:
            self.generate(trainer, pl_module)

    # ------------------------------------------------------------------ generation
    def generate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[ValidationVideo]:
        """Generate, write and log this step's videos (every rank calls it together); the videos, on rank 0."""
        step, self._last_step = trainer.global_step, trainer.global_step
        ema = self._ema_callback(trainer) if self.ema is not False else None
        weights = "ema" if ema is not None else "raw"
        world, rank = trainer.world_size, trainer.global_rank
        jobs = [(p, s) for p in self.prompts for s in self.seeds]
        sharded = any(hasattr(t, "full_tensor") for t in trained_parameters(trainer).values())
        mine = [(j, *job) for j, job in enumerate(jobs) if (rank == 0 if sharded else j % world == rank)]
        with self._transformer(trainer, pl_module, ema, sharded) as transformer:
            made = [self._one(transformer, pl_module.device, trainer, step, j, prompt, seed, weights)
                    for j, prompt, seed in mine] if transformer is not None else []
        if self._pipeline is not None:  # no reference to a gathered copy left; text encoders and VAE off the device
            self._pipeline.register_modules(transformer=None)
            self._components_to(torch.device("cpu"))
        if world > 1 and dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, made)
            made = [item for part in gathered for item in part]
        videos = [video for _, video in sorted(made, key=lambda item: item[0])]
        if rank == 0:
            self.videos.extend(videos)
            _write_index(self.out_dir, videos)
            _log(trainer, videos, self.fps)
            if self.verbose:
                for video in videos:
                    pl_module.print(video.line())
        return videos

    def _ema_callback(self, trainer: pl.Trainer) -> EMA | None:
        found = [c for c in trainer.callbacks if isinstance(c, EMA)]
        return found[0] if found else None

    @contextlib.contextmanager
    def _transformer(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ema: EMA | None,
                     sharded: bool) -> Iterator[nn.Module | None]:
        """The transformer to generate with on this rank (``None``: this rank generates nothing)."""
        model = pl_module.model
        if not sharded:
            training = model.training
            swap = ema.swapped(pl_module) if ema is not None else contextlib.nullcontext()
            with swap:
                model.eval()
                try:
                    yield model
                finally:
                    model.train(training)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        averages = {n: t.cpu() for n, t in ema.full_weights().items()} if ema is not None else None
        shards = getattr(trainer.strategy, "shards", None)
        if shards is not None:
            shards.at_rest()  # taking the full state resharded the units; the mode's resting state again
        if trainer.global_rank != 0:
            yield None
            return
        copy = ModelRecord.of(model).build()
        copy.load_state_dict(module_weights(state, averages))
        yield copy.to(pl_module.device).eval()
        del copy

    def _one(self, transformer: nn.Module, device: torch.device, trainer: pl.Trainer, step: int, job: int, prompt: str,
             seed: int, weights: str) -> tuple[int, ValidationVideo]:
        pipe = self._pipe(transformer, device)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            frames = pipe(prompt=prompt, generator=generator, output_type="np", **self.call).frames[0]
        path = self.out_dir / f"step{step:07d}-prompt{self.prompts.index(prompt)}-seed{seed}.mp4"
        write_mp4(frames, path, fps=self.fps)
        count, height, width = (int(v) for v in frames.shape[:3])
        return job, ValidationVideo(step, prompt, seed, weights, str(path), count, self.fps, width, height)

    def _pipe(self, transformer: nn.Module, device: torch.device) -> Any:
        """The pipeline (built once on each rank that generates) around ``transformer``, its other components on
        ``device`` (between validations they wait on the CPU)."""
        if self._pipeline is None:
            self._pipeline = _build_pipeline(self.source, transformer, self.load_kwargs)
            self._pipeline.set_progress_bar_config(disable=True)
        self._pipeline.register_modules(transformer=transformer)
        self._components_to(device)
        return self._pipeline

    def _components_to(self, device: torch.device) -> None:
        """The pipeline's components other than the trained transformer to ``device``."""
        if self._pipeline is None:
            return
        for name, component in self._pipeline.components.items():
            if name != "transformer" and isinstance(component, nn.Module):
                component.to(device)


def _build_pipeline(source: Any, transformer: nn.Module, load_kwargs: dict[str, Any]) -> Any:
    import diffusers

    if callable(source) and not isinstance(source, (str, Path)):
        return source(transformer)
    cls = getattr(diffusers, family_of(transformer).pipeline)
    from lightning_dcp.diffusers.tiny import is_tiny, tiny_components

    if is_tiny(str(source)):
        components = tiny_components(str(source))
        components["transformer"] = transformer
        return cls(**components)
    return cls.from_pretrained(str(source), transformer=transformer, **load_kwargs)


def _default_folder(trainer: pl.Trainer) -> Path:
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)
        if log_dir:
            return Path(log_dir) / "validation_videos"
    return Path(trainer.default_root_dir) / "validation_videos"


def _write_index(folder: Path, videos: Sequence[ValidationVideo]) -> None:
    index = folder / INDEX_FILE
    new = not index.exists()
    folder.mkdir(parents=True, exist_ok=True)
    with open(index, "a", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(ValidationVideo.__dataclass_fields__))
        if new:
            writer.writeheader()
        for video in videos:
            writer.writerow(asdict(video))


def _log(trainer: pl.Trainer, videos: Sequence[ValidationVideo], fps: float) -> None:
    """Each video to every logger that takes videos: ``log_video`` (W&B), ``experiment.add_video`` (TensorBoard)."""
    if not videos:
        return
    step = videos[0].step
    captions = [f"{v.prompt} (seed {v.seed}, {v.weights})" for v in videos]
    for logger in trainer.loggers:
        if callable(getattr(logger, "log_video", None)):
            logger.log_video("validation/videos", [v.path for v in videos], step=step, caption=captions)
            continue
        add_video = getattr(getattr(logger, "experiment", None), "add_video", None)
        if callable(add_video):
            try:
                for i, video in enumerate(videos):
                    add_video(f"validation/prompt{i}", _read_mp4(video.path), global_step=step, fps=fps)
            except ImportError as err:  # TensorBoard encodes with moviepy
                rank_zero_warn(f"ValidationVideos: TensorBoard could not log the videos ({err}); they are listed in "
                               f"{INDEX_FILE} beside the mp4 files")


def _read_mp4(path: str) -> torch.Tensor:
    """``[1, T, 3, H, W]`` uint8 frames of an mp4 (what TensorBoard's ``add_video`` takes)."""
    import av
    import numpy as np

    with av.open(path) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)[None]
