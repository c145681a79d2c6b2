"""Encode's pre-flight, frame sampling, resume and model loading (lightning_dcp.diffusers.preflight / frames / encode).

Every problem (no caption, cannot be decoded, too small) is listed at once before any model loads; ``--on-error skip``
covers them all; a resume names the setting that differs and ignores ``--on-error``; ``--fps`` resamples by
timestamp; ``--frame-offset``, ``--max-frames``, ``--segments`` and ``--crops`` pick each sample's frames and pixels;
``--model tiny-wan`` runs offline and a hub id that cannot be read is one clear line.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from lightning_dcp.diffusers.frames import FrameSampling

pytest.importorskip("diffusers")
pytest.importorskip("av")

import torch  # noqa: E402

from _encode_helpers import write_video  # noqa: E402

import lightning_dcp.commands.encode as encode_command  # noqa: E402
from lightning_dcp.cli import main as cli_main  # noqa: E402
from lightning_dcp.diffusers import EncodedVideoDataset, EncodeSettings, encode_videos  # noqa: E402
from lightning_dcp.diffusers.encoder import VideoEncoder  # noqa: E402
from lightning_dcp.diffusers.preflight import PreflightError  # noqa: E402
from lightning_dcp.diffusers.shards import read_index, read_meta  # noqa: E402
from lightning_dcp.diffusers.tiny import tiny_components  # noqa: E402
from lightning_dcp.diffusers.video_io import read_video  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT_LEN = 16


def _models():
    parts = tiny_components("tiny-wan")
    return dict(vae=parts["vae"], text_encoder=parts["text_encoder"], tokenizer=parts["tokenizer"])


def _clip(folder, name, frames=5, height=32, width=32, caption="a cat", **kw):
    write_video(folder / name, frames, height, width, **kw)
    if caption is not None:
        (folder / name).with_suffix(".txt").write_text(caption)


@pytest.fixture
def bad_folder(tmp_path):
    """One good clip and four that cannot be encoded, each for another reason (one for two)."""
    folder = tmp_path / "clips"
    folder.mkdir()
    _clip(folder, "ok.mkv")
    _clip(folder, "nocap.mkv", caption=None)
    _clip(folder, "tiny.mkv", height=8, width=40)
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    (folder / "broken.txt").write_text("a dog")
    (folder / "both.mp4").write_bytes(b"not a video at all")
    return folder


def test_every_problem_is_listed_before_any_model_loads(bad_folder, tmp_path, capsys, monkeypatch):
    def no_model(args):
        raise AssertionError("a model was loaded before the pre-flight's problems were reported")

    monkeypatch.setattr(encode_command, "load_models", no_model)
    out = tmp_path / "out"
    assert cli_main(["encode", "--videos", str(bad_folder), "--model", "tiny-wan", "--out", str(out),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "3 of 5 videos cannot be encoded" in err and "--on-error skip" in err
    assert "broken.mp4: cannot decode the video" in err
    assert "nocap.mkv: no caption: add it to a sidecar file" in err
    both = next(line for line in err.splitlines() if "both.mp4:" in line)
    assert "no caption" in both and "cannot decode" in both  # both of its problems, on its line
    assert not out.exists()


def test_the_api_lists_too_small_clips_with_the_rest_and_writes_nothing(bad_folder, tmp_path):
    with pytest.raises(PreflightError) as info:
        encode_videos(bad_folder, tmp_path / "out", settings=EncodeSettings(text_len=TEXT_LEN), progress=False,
                      **_models())
    assert [p.name for p in info.value.problems] == ["both.mp4", "broken.mp4", "nocap.mkv", "tiny.mkv"]
    assert "tiny.mkv: 40x8 pixels is smaller than one patch: height must be >= 16" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_on_error_skip_covers_a_missing_caption_and_a_rerun_with_raise_resumes(bad_folder, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["encode", "--videos", str(bad_folder), "--model", "tiny-wan", "--out", str(out), "--text-len",
            str(TEXT_LEN), "--no-progress"]
    assert cli_main(argv + ["--on-error", "skip"]) == 0
    printed = capsys.readouterr().out
    assert "1 samples in 1 shards, 4 videos skipped" in printed and "skipped " in printed and "nocap.mkv: no caption" in printed
    assert EncodedVideoDataset(out).names == ["ok.mkv"]
    assert [name for name, _ in read_meta(out)["skipped"]] == ["both.mp4", "broken.mp4", "nocap.mkv", "tiny.mkv"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # --on-error changes nothing written: the same folder resumes (finished: nothing to do) with the default "raise"
    assert cli_main(argv) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_rerun_with_other_settings_or_videos_names_what_differs(tmp_path, capsys):
    folder = tmp_path / "clips"
    folder.mkdir()
    for name in ("a.mkv", "b.mkv"):
        _clip(folder, name, frames=9)
    out = tmp_path / "out"
    argv = ["encode", "--videos", str(folder), "--model", "tiny-wan", "--out", str(out), "--text-len", str(TEXT_LEN),
            "--no-progress"]
    assert cli_main(argv) == 0
    capsys.readouterr()
    assert cli_main(argv + ["--max-frames", "5", "--fps", "4"]) == 2
    err = capsys.readouterr().err
    assert "setting fps: None -> 4.0" in err and "setting max_frames: None -> 5" in err
    assert "on_error" not in err
    (folder / "a.txt").write_text("a red ball")
    _clip(folder, "c.mkv")
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "videos added: c.mkv" in err and "captions changed: a.mkv" in err


@hsettings(max_examples=200, deadline=None)
@given(rate=st.sampled_from([8.0, 12.5, 24.0, 29.97, 30.0, 60.0]), fps=st.sampled_from([4.0, 8.0, 16.0, 24.0, 30.0]),
       n=st.integers(1, 120), jitter=st.lists(st.floats(0.0, 0.4), min_size=120, max_size=120))
def test_fps_takes_the_frame_on_screen_at_each_output_time(rate, fps, n, jitter):
    times = sorted((i + jitter[i]) / rate for i in range(n))  # a variable frame rate, presentation order
    picked = FrameSampling(fps=fps).output_frames(times)
    step = sorted(b - a for a, b in zip(times, times[1:]) if b > a)
    end = times[-1] + (step[len(step) // 2] if step else 1 / fps)
    assert len(picked) == math.ceil((end - times[0]) * fps - 1e-6)
    for k, i in enumerate(picked):
        t = times[0] + k / fps
        assert times[i] <= t + 1e-6 and (i + 1 == n or times[i + 1] > t + 1e-9)
    assert picked == sorted(picked)


def test_frame_offset_max_frames_and_segments_cut_windows_one_after_another():
    times = [i / 30 for i in range(60)]  # 2 s at 30 fps
    wan = lambda n: (n - 1) // 4 * 4 + 1 if n else 0  # noqa: E731 - Wan's VAE takes 4k + 1 frames
    sampling = FrameSampling(fps=10, frame_offset=2, max_frames=6, segments=4)
    # at 10 fps: frames 0, 3, 6, ...; skip 2; windows of 6 cut to 5; the third window (2 frames) is not full
    assert sampling.windows(times, wan) == [[6, 9, 12, 15, 18], [24, 27, 30, 33, 36], [42, 45, 48, 51, 54]]
    assert FrameSampling(frame_stride=2, max_frames=3).windows(times, wan) == [[0]]
    assert FrameSampling(max_frames=100).windows(times[:3], wan) == [[0]]  # a short clip: one short window
    with pytest.raises(ValueError, match="fps .* or frame_stride .*, not both"):
        FrameSampling(fps=8, frame_stride=2)
    with pytest.raises(ValueError, match="set max_frames"):
        FrameSampling(segments=2)


def test_fps_gives_clips_of_any_rate_the_same_speed(tmp_path):
    folder = tmp_path / "clips"
    folder.mkdir()
    _clip(folder, "slow.mkv", frames=16, rate=8)  # 2 s at 8 fps
    _clip(folder, "fast.mkv", frames=48, rate=24)  # 2 s at 24 fps
    kw = dict(progress=False, **_models())
    native = encode_videos(folder, tmp_path / "native", settings=EncodeSettings(text_len=TEXT_LEN), **kw)
    resampled = encode_videos(folder, tmp_path / "fps8", settings=EncodeSettings(text_len=TEXT_LEN, fps=8), **kw)
    assert native.samples == resampled.samples == 2
    frames = lambda out: {r.name: r.latent_shape[1] for s in read_index(out) for r in s.samples}  # noqa: E731
    assert frames(tmp_path / "native") == {"fast.mkv": 12, "slow.mkv": 4}  # 45 and 13 frames: (n - 1) / 4 + 1
    assert frames(tmp_path / "fps8") == {"fast.mkv": 4, "slow.mkv": 4}  # 16 frames at 8 fps each, cut to 13


def test_segments_and_crops_each_make_a_sample_with_exactly_those_pixels(tmp_path):
    folder = tmp_path / "clips"
    folder.mkdir()
    _clip(folder, "wide.mkv", frames=40, height=32, width=72)  # 72 px crop to 64: start, center, end differ
    _clip(folder, "square.mkv", frames=40, height=32, width=32)  # nothing to crop: one sample per window
    settings = EncodeSettings(text_len=TEXT_LEN, max_frames=9, frame_offset=3, segments=3,
                              crops=("start", "center", "end"))
    models = _models()
    encode_videos(folder, tmp_path / "out", settings=settings, progress=False, **models)
    ds = EncodedVideoDataset(tmp_path / "out", text_len=TEXT_LEN)
    labels = [r.label for r in ds.records]
    assert labels == ["square.mkv (crop start)", "square.mkv (segment 1, crop start)", "square.mkv (segment 2, crop start)",
                      "wide.mkv (crop start)", "wide.mkv", "wide.mkv (crop end)",
                      "wide.mkv (segment 1, crop start)", "wide.mkv (segment 1)", "wide.mkv (segment 1, crop end)",
                      "wide.mkv (segment 2, crop start)", "wide.mkv (segment 2)", "wide.mkv (segment 2, crop end)"]
    # wide.mkv's segment 1, crop end: frames 12..20 (offset 3, windows of 9), the right-most 64 columns
    encoder = VideoEncoder(text_len=TEXT_LEN, **models)
    geometry = settings.geometry(encoder.info.spatial_stride, encoder.info.temporal_stride)
    pixels = read_video(folder / "wide.mkv", geometry, frames=range(12, 21), crop="end")
    assert pixels.shape == (3, 9, 32, 64)
    assert torch.equal(ds.tensors(labels.index("wide.mkv (segment 1, crop end)"))[0], encoder.encode_pixels(pixels))


def test_tiny_wan_runs_offline_and_an_unreadable_hub_id_is_one_clear_error(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "clips"
    folder.mkdir()
    _clip(folder, "a.mkv")
    out = tmp_path / "out"
    assert cli_main(["encode", "--videos", str(folder), "--model", "tiny-wan", "--out", str(out), "--no-progress"]) == 0
    assert EncodedVideoDataset(out).video_shapes[0].latent == (4, 2, 4, 4)
    capsys.readouterr()
    import huggingface_hub

    def unreachable(self, repo, **kw):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)  # no network in tests, whatever the machine
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert cli_main(["encode", "--videos", str(folder), "--model", "no-such-org/no-such-model", "--out",
                     str(tmp_path / "o2"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "'no-such-org/no-such-model' is not a local folder, and the Hugging Face Hub cannot be reached" in err
    assert "--model tiny-wan" in err
    assert cli_main(["encode", "--videos", str(folder), "--model", "tiny-ltx", "--out", str(tmp_path / "o3"),
                     "--no-progress"]) == 2
    assert "its tiny model is tiny-wan" in capsys.readouterr().err
    assert json.loads((out / "meta.json").read_text())["settings"].get("on_error") is None


def test_the_pre_flight_fails_on_a_corrupt_clip_before_diffusers_is_imported(bad_folder, tmp_path):
    """``lightning-dcp encode`` in a fresh process: the pre-flight lists the corrupt clip and stops before anything
    imports diffusers (``lightning_dcp.diffusers`` imports its names on first use; diffusers takes seconds to import)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    argv = ["encode", "--videos", str(bad_folder), "--model", "tiny-wan", "--out", str(tmp_path / "out"), "--no-progress"]
    code = (f"import sys\nfrom lightning_dcp.cli import main\nrc = main({argv!r})\n"
            "print('exit', rc, 'diffusers imported', 'diffusers' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert "exit 2 diffusers imported False" in done.stdout, done.stdout + done.stderr
    assert "broken.mp4: cannot decode the video" in done.stderr and "3 of 5 videos cannot be encoded" in done.stderr
    assert not (tmp_path / "out").exists()
