"""lightning-dcp train-video: its settings (YAML, flags, --set) and the offline path on CPU with the tiny Wan:
own clips -> encode -> train-video (LoRA, EMA, validation video, checkpoints) -> export -> the family's
pipeline loads the result and generates.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_dcp.cli import main
from lightning_dcp.diffusers.train_config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_settings_from_yaml_flags_and_set(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model: tiny-wan\ndata: encoded/\nlora: {rank: 8}\ntrain: {lr: 1e-4, steps: 50}\n"
                      "validation: {prompts: [a red ball]}\nbudget: 40\n")
    got = load_config(config, {"train.steps": 20}, ["ema.decay=0.99", "lora.alpha=16"])
    assert (got.model, got.lora.rank, got.lora.alpha, got.train.lr, got.train.steps) == ("tiny-wan", 8, 16, 1e-4, 20)
    assert (got.ema.decay, got.validation.prompts, got.memory_limit_mib, got.profile) == (0.99, ["a red ball"], 40.0, True)
    assert load_config(config, sets=["lora=null", "budget=none"]).lora.rank == 0  # full fine-tune, no profile
    with pytest.raises(ValueError, match=r"unknown setting 'train.step' \(did you mean 'steps'\?\)"):
        load_config(config, {"train.step": 3})
    with pytest.raises(ValueError, match=r"(?s)lora.rank: -1 must be an int >= 0.*logger: 'mlflow' is not one of"):
        load_config(config, {"lora.rank": -1, "logger": "mlflow"})
    assert main(["train-video", "--config", str(config), "--lora-rank", "4", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "model: tiny-wan" in printed and "rank: 4" in printed and "steps: 50" in printed
    assert main(["train-video", "--model", "tiny-wan"]) == 2
    assert "data: missing" in capsys.readouterr().err


def test_clips_to_a_generated_video_offline(tmp_path, capsys, monkeypatch):
    """The quick start's path in one process (2 processes: docs/video.md's commands, run by tests/test_docs.py)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("av")
    pytest.importorskip("peft")
    import diffusers
    from _encode_helpers import make_videos

    monkeypatch.chdir(tmp_path)
    make_videos(Path("clips"))
    assert main(["encode", "--videos", "clips", "--captions", "clips/captions.csv", "--model", "tiny-wan", "--out",
                 "encoded", "--no-progress", "--fps", "8"]) == 0
    printed = capsys.readouterr().out
    assert len([line for line in printed.splitlines() if line.startswith("  ") and line.endswith(" tokens")]) == 5
    assert "tokens per sample: min" in printed  # what each clip becomes
    args = ["train-video", "--model", "tiny-wan", "--data", "encoded", "--out", "runs/tiny", "--steps", "3",
            "--global-batch-size", "2", "--devices", "1", "--prompt", "a red ball", "--validate-every", "2",
            "--budget", "none", "--set", "validation={num_frames: 5, height: 32, width: 32, num_inference_steps: 2}"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "DCP training done: 3 steps" in printed and "export: lightning-dcp export" in printed
    assert "logs: runs/tiny/logs/version_0/" in printed
    assert "train (epoch" in printed and "3/3" in printed and "train/loss=" in printed  # the run's steps bar
    videos = sorted(Path("runs/tiny/logs/version_0/validation_videos").glob("*.mp4"))
    assert [v.name for v in videos] == ["step0000002-prompt0-seed0.mp4", "step0000003-prompt0-seed0.mp4"]
    for v in videos:  # a line per video, at the encoded set's 8 fps (not 16)
        assert f"validation video: runs/tiny/logs/version_0/validation_videos/{v.name} (5 frames at 8 fps, 32x32" in printed

    # a resumed run continues the checkpoint and logs into the next version (Lightning's convention), and says so
    assert main([*args[:args.index("--steps")], "--steps", "4", *args[args.index("--steps") + 2:],
                 "--resume", "last"]) == 0
    printed = capsys.readouterr().out
    assert "resumed from runs/tiny/checkpoints/last.ckpt at step 3; this run logs into runs/tiny/logs/version_1/" in printed
    assert [v.name for v in Path("runs/tiny/logs/version_1/validation_videos").glob("*.mp4")] == [
        "step0000004-prompt0-seed0.mp4"]
    assert "DCP training done: 4 steps" in printed
    ckpt = torch.load("runs/tiny/checkpoints/last.ckpt", weights_only=False)
    assert all(".lora_" in k for k in ckpt["state_dict"]) and any(k.startswith("EMA") for k in ckpt["callbacks"])

    assert main(["export", "runs/tiny/checkpoints/last.ckpt", "--out", "pipe", "--pipeline", "tiny-wan"]) == 0
    pipe = diffusers.WanPipeline.from_pretrained("pipe")
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(prompt="a red ball", num_frames=5, height=32, width=32, num_inference_steps=2, output_type="np",
                  generator=torch.Generator().manual_seed(0)).frames[0]
    assert frames.shape == (5, 32, 32, 3)


def test_validation_fps_defaults_to_the_encoded_sets(tmp_path):
    from lightning_dcp.diffusers.recipe import DEFAULT_VALIDATION_FPS, validation_fps
    from lightning_dcp.diffusers.shards import write_meta

    for fps, want in ((12.0, 12.0), (None, DEFAULT_VALIDATION_FPS)):
        folder = tmp_path / f"enc{fps}"
        folder.mkdir()
        write_meta(folder, {"settings": {"fps": fps}})
        config = load_config(None, {"model": "tiny-wan", "data": str(folder)})
        assert config.validation.fps is None and validation_fps(config) == want
    assert validation_fps(load_config(None, {"model": "m", "data": str(folder), "validation.fps": 24})) == 24.0


def test_train_video_profiles_within_its_time_and_names_its_own_flags(tmp_path):
    """The profiler train-video adds keeps --profile-seconds as its whole-profile budget and names train-video's
    flags (--budget, --profile-seconds) in the planning line and in what a stopped profile says."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from lightning_dcp.diffusers.recipe import build_run
    from lightning_dcp.diffusers.tiny import tiny_transformer
    from lightning_dcp.profiling import DCPProfiler
    from lightning_dcp.profiling.budget import resolve_budget

    model = tiny_transformer("tiny-wan")
    channels, text_dim = int(model.config.out_channels), int(model.config.text_dim)
    data = _encoded_folder(tmp_path / "encoded", channels, text_dim, (1, 2, 2), [(1, 2, 2), (2, 1, 2)], [3, 5])
    args = ["--model", "tiny-wan", "--data", str(data), "--out", str(tmp_path / "run"), "--devices", "1"]
    from lightning_dcp.commands.train_video import _overrides, add_arguments
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = load_config(None, _overrides(parser.parse_args([*args, "--profile-seconds", "12"])))
    assert config.profile_seconds == 12.0 and load_config(None, {"model": "m", "data": "d"}).profile_seconds == 60.0
    with pytest.raises(ValueError, match="profile_seconds: -1.0 must be seconds >= 0"):
        load_config(None, {"model": "m", "data": "d", "profile_seconds": -1.0})
    run = build_run(config)
    profiler = next(c for c in run.trainer.callbacks if isinstance(c, DCPProfiler))
    assert profiler.time_budget_s == 12.0 and "--profile-seconds" in profiler.time_budget_source
    _, source = resolve_budget("cpu", profiler.memory_limit_bytes, profiler.memory_limit_source,
                               profiler.memory_limit_setting)
    assert "train-video's --budget MiB" in source and "DCPProfiler(" not in source


def _encoded_folder(root: Path, channels: int, text_dim: int, patch, shapes, text_lens) -> Path:
    """An encode output folder written directly (meta.json, one shard, index.jsonl), as `lightning-dcp encode` lays it out."""
    import math

    from safetensors.torch import save_file

    from lightning_dcp.diffusers.shards import SampleRecord, ShardRecord, append_index, shard_name, write_meta

    root.mkdir(parents=True)
    write_meta(root, {"settings": {"patch_size": list(patch)}, "sources": []})
    g, tensors, records = torch.Generator().manual_seed(0), {}, []
    for j, ((f, h, w), n) in enumerate(zip(shapes, text_lens)):
        shape = (channels, f * patch[0], h * patch[1], w * patch[2])
        record = SampleRecord(j, f"clip{j}.mp4", "a caption", shape, n, text_dim, f * h * w)
        tensors[record.latent_key], tensors[record.text_key] = torch.randn(shape, generator=g), torch.randn(n, text_dim)
        records.append(record)
    save_file(tensors, str(root / shard_name(0)))
    append_index(root, ShardRecord(0, shard_name(0), tuple(records)))
    return root


@pytest.mark.parametrize("name", ["tiny-ltx", "tiny-cogvideox", "tiny-hunyuan"])
def test_encoded_latents_train_every_family_that_can_build_its_samples(tmp_path, name):
    pytest.importorskip("diffusers")
    import lightning.pytorch as pl

    from lightning_dcp.diffusers import VideoDiffusionModule, family_of
    from lightning_dcp.diffusers.family_data import family_dataset
    from lightning_dcp.diffusers.tiny import tiny_transformer

    model = tiny_transformer(name)
    family = family_of(model)
    patch, config = family.patch_size(model.config), model.config
    channels = int(config.in_channels) // (1 if family.joint else int(torch.tensor(patch).prod()))
    root = _encoded_folder(tmp_path / "encoded", channels, family.text_dim(config), patch, [(1, 2, 2), (2, 1, 2)], [3, 5])
    if name == "tiny-hunyuan":
        with pytest.raises(ValueError, match="pooled CLIP projection"):
            family_dataset(str(root), family, patch)
        return
    data = family_dataset(str(root), family, patch)
    assert data.lengths == ([4 + 3, 4 + 5] if family.joint else [4, 4])  # a joint family's prompt rows count
    assert int(data[1]["latents"].shape[0]) == data.lengths[1]
    module = VideoDiffusionModule(model, lr=1e-2, lora=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2, collate_fn=VideoDiffusionModule.collate))
    assert trainer.global_step == 1


def test_the_quick_start_runs_as_written(tmp_path):
    """docs/video.md's quick start, as a newcomer runs it: its three commands (2 CPU processes for train-video), then
    its Python snippet that loads the exported pipeline and writes the generated video (slow: about 2 minutes)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("av")
    import os
    import re
    import shlex
    import subprocess
    import sys

    from _encode_helpers import make_videos

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "video.md").read_text()
    section = text[text.index("## Quick start"):text.index("## Encode, then train")]
    commands = [line for line in re.findall(r"```bash\n(.*?)```", section, re.S)[0].splitlines() if line.strip()]
    snippet = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    assert [c.split()[1] for c in commands] == ["encode", "train-video", "export"]
    make_videos(tmp_path / "clips")
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for command in commands:
        argv = [sys.executable, "-m", "lightning_dcp.cli", *shlex.split(command)[1:]]
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "generated.mp4").stat().st_size > 0
    assert len(list((tmp_path / "runs/tiny/logs/version_0/validation_videos").glob("*.mp4"))) == 2
