"""Validation videos (lightning_dcp.diffusers.ValidationVideos) on CPU with the tiny offline models.

* every n steps and at the end, each prompt and seed becomes an mp4 (PyAV) of the requested frames and size,
  listed in videos.csv beside the CSV logs; W&B-style (``log_video``) and TensorBoard-style (``add_video``)
  loggers receive them;
* the video is the family pipeline's output with the trained transformer: the same bytes as generating
  offline with its weights (or their EMA) and writing the frames with write_mp4;
* under DCPStrategy on 2 processes the prompts are spread over the ranks, rank 0 lists them all, and the run
  goes on to its next steps (no collective left behind).
"""

from __future__ import annotations

import csv
import os

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("av")
pytest.importorskip("peft")

import lightning.pytorch as pl  # noqa: E402
from _tiny_video_data import TinyVideos  # noqa: E402

from lightning_dcp import EMA  # noqa: E402
from lightning_dcp.diffusers import VideoDiffusionModule  # noqa: E402
from lightning_dcp.diffusers.mp4 import write_mp4  # noqa: E402
from lightning_dcp.diffusers.tiny import tiny_pipeline, tiny_transformer  # noqa: E402
from lightning_dcp.diffusers.validation import INDEX_FILE, ValidationVideos  # noqa: E402

try:
    from _dist import run_distributed
except ImportError:  # tests/ imported as a package
    from tests._dist import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")

CALL = dict(num_frames=5, height=32, width=32, num_inference_steps=2, guidance_scale=1.0)


def _frames(path):
    import av

    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


class _VideoLogger(pl.loggers.CSVLogger):
    """A CSV logger that also takes videos the way W&B's logger does (``log_video``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logged = []

    def log_video(self, key, videos, step=None, **kwargs):
        self.logged.append((key, list(videos), step, kwargs.get("caption")))


class _Writer:
    def __init__(self):
        self.calls = []

    def add_video(self, tag, video, global_step=None, fps=None):
        self.calls.append((tag, tuple(video.shape), video.dtype, global_step))


class _BoardLogger(pl.loggers.Logger):
    """A logger whose experiment takes videos the way TensorBoard's SummaryWriter does (``add_video``)."""

    def __init__(self):
        super().__init__()
        self.writer = _Writer()

    name, version = "board", 0

    @property
    def experiment(self):
        return self.writer

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


@pytest.mark.parametrize("use_ema", [False, True])
def test_videos_every_n_steps_are_the_pipelines_output_and_are_logged(tmp_path, use_ema, capsys):
    model = tiny_transformer("tiny-wan")
    module = VideoDiffusionModule(model, lr=1e-2, lora=4)
    videos = ValidationVideos("tiny-wan", ["a red ball", "a cat"], seeds=[3], every_n_steps=2, **CALL, fps=8)
    ema = EMA(decay=0.5)
    csv_logger, board = _VideoLogger(tmp_path / "logs"), _BoardLogger()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=[csv_logger, board],
                         callbacks=[ema, videos] if use_ema else [videos], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(TinyVideos(n=6), batch_size=2, collate_fn=VideoDiffusionModule.collate))

    folder = tmp_path / "logs" / "lightning_logs" / "version_0" / "validation_videos"
    assert [(v.step, v.prompt, v.seed) for v in videos.videos] == [
        (2, "a red ball", 3), (2, "a cat", 3), (3, "a red ball", 3), (3, "a cat", 3)]  # step 2, then the end
    assert all(v.weights == ("ema" if use_ema else "raw") for v in videos.videos)
    with open(folder / INDEX_FILE, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["path"] for r in rows] == [v.path for v in videos.videos]
    assert {(r["frames"], r["fps"], r["width"], r["height"]) for r in rows} == {("5", "8.0", "32", "32")}
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("validation video: ")]
    assert said == [v.line() for v in videos.videos] and len(said) == 4  # a line per video written
    assert f"validation video: {videos.videos[0].path} (5 frames at 8 fps, 32x32, step 2, " in said[0]
    for v in videos.videos:
        frames = _frames(v.path)
        assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    assert [(key, step) for key, _, step, _ in csv_logger.logged] == [("validation/videos", 2), ("validation/videos", 3)]
    assert csv_logger.logged[0][3] == [f"a red ball (seed 3, {videos.videos[0].weights})",
                                       f"a cat (seed 3, {videos.videos[0].weights})"]
    assert [(tag, shape, step) for tag, shape, _, step in board.writer.calls] == [
        ("validation/prompt0", (1, 5, 3, 32, 32), 2), ("validation/prompt1", (1, 5, 3, 32, 32), 2),
        ("validation/prompt0", (1, 5, 3, 32, 32), 3), ("validation/prompt1", (1, 5, 3, 32, 32), 3)]

    # the last videos are the tiny pipeline's output with the final weights (or their average): same bytes
    pipe = tiny_pipeline("tiny-wan")
    pipe.transformer = module.model
    pipe.set_progress_bar_config(disable=True)
    context = ema.swapped(module) if use_ema else torch.no_grad()
    with context, torch.no_grad():
        frames = pipe(prompt="a cat", generator=torch.Generator().manual_seed(3), output_type="np", **CALL).frames[0]
    want = write_mp4(frames, tmp_path / "want.mp4", fps=8)
    got = _frames(videos.videos[-1].path)
    assert len(got) == 5 and all((a == b).all() for a, b in zip(_frames(want), got))
    if use_ema:  # and not the raw weights' video
        with torch.no_grad():
            raw = pipe(prompt="a cat", generator=torch.Generator().manual_seed(3), output_type="np", **CALL).frames[0]
        other = _frames(write_mp4(raw, tmp_path / "raw.mp4", fps=8))
        assert any((a != b).any() for a, b in zip(other, got))
    assert module.model.training  # back to training mode


def test_settings_are_checked():
    with pytest.raises(ValueError, match="one or more prompts"):
        ValidationVideos("tiny-wan", [])
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 0"):
        ValidationVideos("tiny-wan", ["a"], every_n_steps=-1)
    videos = ValidationVideos("tiny-wan", ["a"], ema=True, every_n_steps=1, **CALL)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, callbacks=[videos],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"ema=True\) needs an EMA callback"):
        trainer.fit(VideoDiffusionModule(tiny_transformer("tiny-wan")),
                    torch.utils.data.DataLoader(TinyVideos(n=2), batch_size=2, collate_fn=VideoDiffusionModule.collate))


def _spread_worker(rank, world, out_dir):
    from lightning_dcp import DCPStrategy, DefaultCostModel

    model = tiny_transformer("tiny-wan")
    module = VideoDiffusionModule(model, lr=1e-2, lora=4)
    videos = ValidationVideos("tiny-wan", ["one", "two", "three"], every_n_steps=1, at_end=False, out_dir=out_dir, **CALL)
    strategy = DCPStrategy(global_batch_size=4, log_metrics=False, profile=False,
                           cost_model=DefaultCostModel(num_layers=2, num_heads=4, max_tokens=8))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=2, logger=False,
                         callbacks=[EMA(decay=0.5), videos], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(TinyVideos(n=8), batch_size=2, collate_fn=VideoDiffusionModule.collate))
    assert trainer.global_step == 2  # the steps after a validation ran: no collective was left unmatched
    if rank == 0:
        assert [(v.step, v.prompt) for v in videos.videos] == [(s, p) for s in (1, 2) for p in ("one", "two", "three")]
    else:
        assert videos.videos == []
    with open(os.path.join(out_dir, f"rank{rank}.done"), "w") as fh:
        fh.write("ok")


def test_prompts_are_spread_over_the_ranks(tmp_path):
    run_distributed(_spread_worker, 2, str(tmp_path), timeout=600)
    files = sorted(p for p in os.listdir(tmp_path) if p.endswith(".mp4"))
    assert files == sorted(f"step{s:07d}-prompt{p}-seed0.mp4" for s in (1, 2) for p in range(3))
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".done")) == ["rank0.done", "rank1.done"]
