"""Encoding your own videos (lightning_dcp.diffusers.encode) and the fit-start data checks, end to end on CPU.

Generated lossless clips of several frame counts and resolutions, with captions from sidecar files
and a CSV, are encoded by a tiny random ``AutoencoderKLWan`` and ``UMT5EncoderModel`` (offline
WordLevel tokenizer), then a tiny Wan trains on them under DCPStrategy. A SIGKILLed encode, resumed,
gives byte-identical shards; a corrupt or too small video is named; bad shapes are refused at fit
start naming the sample.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings as hsettings, strategies as st

pytest.importorskip("diffusers")
pytest.importorskip("av")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from _encode_helpers import (  # noqa: E402
    LATENT_SHAPES, TEXT_DIM, make_videos, save_models, tiny_text_encoder, tiny_tokenizer, tiny_vae, tiny_wan, write_video,
)

from lightning_dcp import DCPStrategy  # noqa: E402
from lightning_dcp.cli import main as cli_main  # noqa: E402
from lightning_dcp.diffusers import (  # noqa: E402
    LATENTS, TEXT, EncodedVideoDataset, EncodeSettings, VideoDecodeError, VideoDiffusionModule, VideoShape,
    encode_videos, video_sample,
)
from lightning_dcp.diffusers.shards import INDEX, read_index  # noqa: E402
from lightning_dcp.diffusers.sources import find_sources  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT_LEN = 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The clips, a saved model folder, and one uninterrupted CLI encode of them (2 videos per shard)."""
    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("encode")
    videos = make_videos(base / "videos")
    models = save_models(base / "model")
    out = base / "clean"
    assert cli_main(_cli_args(videos, models, out)) == 0
    return videos, models, out


def _cli_args(videos: Path, models: Path, out: Path) -> list[str]:
    return ["encode", "--videos", str(videos), "--model", str(models), "--out", str(out), "--captions",
            str(videos / "captions.csv"), "--samples-per-shard", "2", "--text-len", str(TEXT_LEN), "--no-progress"]


def test_encoded_dataset_has_the_index_shapes_and_video_sample_items(data, monkeypatch):
    videos, _, out = data
    ds = EncodedVideoDataset(out, text_len=TEXT_LEN)
    assert [list(s.latent) for s in ds.video_shapes] == [list(s) for s in LATENT_SHAPES]
    assert ds.names == ["a.mkv", "b.mkv", "c.mkv", "d.mkv", "e.mkv"]
    assert ds.captions == ["a cat runs on the grass", "a dog jumps", "", "the red ball", "a video, slowly"]
    # text tokens: words + </s> ("a video, slowly" has 4 words and a comma)
    assert [s.text for s in ds.video_shapes] == [(7, TEXT_DIM), (4, TEXT_DIM), (1, TEXT_DIM), (4, TEXT_DIM), (5, TEXT_DIM)]
    assert ds.lengths == [f * (h // 2) * (w // 2) for _, f, h, w in LATENT_SHAPES]
    assert len(read_index(out)) == 3 and sorted(p.name for p in out.glob("shard-*")) == [
        "shard-000000.safetensors", "shard-000001.safetensors", "shard-000002.safetensors"]
    # lazy: lengths and shapes come from the index; no shard is opened until __getitem__
    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: pytest.fail("opened a shard"))
    again = EncodedVideoDataset(out, text_len=TEXT_LEN)
    assert again.lengths == ds.lengths and again.shapes == [s[1:] for s in LATENT_SHAPES]
    monkeypatch.undo()
    # items are what video_sample makes from the stored tensors, and those are the models' own encodings
    vae, te, tok = tiny_vae(), tiny_text_encoder(), tiny_tokenizer()
    from lightning_dcp.diffusers.encoder import VideoEncoder
    from lightning_dcp.diffusers.video_io import FrameGeometry, read_video

    enc = VideoEncoder(vae, te, tok, text_len=TEXT_LEN)
    latent = enc.encode_pixels(read_video(videos / "b.mkv", FrameGeometry(8, 4, (1, 2, 2))))
    text = enc.encode_text("a dog jumps")
    want = video_sample(latent, text, (1, 2, 2), text_len=TEXT_LEN, index=1)
    got = ds[1]
    assert torch.equal(got[LATENTS], want[LATENTS]) and torch.equal(got[TEXT][0], want[TEXT][0])
    assert got["sample_index"] == 1 and got[TEXT][0].shape == (TEXT_LEN, TEXT_DIM)
    # normalised as Wan's pipeline does: (mode - latents_mean) / latents_std per channel
    raw = vae.encode(read_video(videos / "b.mkv", FrameGeometry(8, 4, (1, 2, 2))).unsqueeze(0)).latent_dist.mode()[0]
    mean, std = torch.tensor([0.1, -0.2, 0.0, 0.3]), torch.tensor([1.5, 0.8, 1.0, 2.0])
    torch.testing.assert_close(latent, (raw - mean.view(4, 1, 1, 1)) / std.view(4, 1, 1, 1))


def test_train_on_encoded_videos_under_dcp_strategy(data):
    _, _, out = data
    ds = EncodedVideoDataset(out, text_len=TEXT_LEN)
    model = tiny_wan()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    module = VideoDiffusionModule(model, lr=1e-3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         strategy=DCPStrategy(global_batch_size=2, profile=False, log_metrics=False))
    trainer.fit(module, torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=VideoDiffusionModule.collate))
    assert trainer.global_step == 2
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert max(float((v - before[k]).abs().max()) for k, v in model.state_dict().items()) > 1e-4


_KILLER = """
import os, signal, sys
import torch
torch.set_num_threads(1)
from lightning_dcp.diffusers import encoder
calls = [0]
original = encoder.VideoEncoder.encode_pixels
def encode_pixels(self, pixels):
    calls[0] += 1
    if calls[0] == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-shard: no cleanup, no finally
    return original(self, pixels)
encoder.VideoEncoder.encode_pixels = encode_pixels
from lightning_dcp.cli import main
sys.exit(main({argv!r}))
"""


def test_killed_encode_resumes_to_the_same_shards(data, tmp_path):
    videos, models, clean = data
    out = tmp_path / "killed"
    argv = _cli_args(videos, models, out)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLER.format(kill_at=4, argv=argv))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [r.file for r in read_index(out)] == ["shard-000000.safetensors"]  # shard 1 was half done
    assert len(EncodedVideoDataset(out)) == 2  # a dataset over a killed encode sees the completed shards only
    # a crash while writing shard 1 and appending its index line: a temporary file and a torn line
    (out / ".shard-000001.safetensors.abc123.tmp").write_bytes(b"half a shard")
    with open(out / INDEX, "a") as fh:
        fh.write('{"file": "shard-000001.safetensors", "samp')
    assert cli_main(argv) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in clean.iterdir()), names
    for name in names:
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    # a rerun of a finished encode does nothing; another setting is refused instead of mixing encodes
    assert cli_main(argv) == 0
    assert cli_main(argv[:-1] + ["--max-frames", "5", "--no-progress"]) == 2


def test_corrupt_and_too_small_videos_are_named(data, tmp_path, capsys):
    videos, models, _ = data
    folder = tmp_path / "bad"
    folder.mkdir()
    write_video(folder / "ok.mkv", 5, 32, 32)
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    write_video(folder / "tiny.mkv", 5, 8, 40)
    for name in ("ok", "broken", "tiny"):
        (folder / f"{name}.txt").write_text("a cat")
    kw = dict(vae=tiny_vae(), text_encoder=tiny_text_encoder(), tokenizer=tiny_tokenizer(), progress=False)
    settings = EncodeSettings(text_len=TEXT_LEN, samples_per_shard=2)
    with pytest.raises(VideoDecodeError, match=r"broken\.mp4: cannot decode"):
        encode_videos(folder, tmp_path / "o1", settings=settings, **kw)
    only_tiny = tmp_path / "tiny.txt"
    only_tiny.write_text("bad/tiny.mkv\n")
    with pytest.raises(VideoDecodeError, match=r"tiny\.mkv: 40x8 pixels is smaller than one patch: height must be >= 16"):
        encode_videos(only_tiny, tmp_path / "o2", settings=settings, **kw)
    # the CLI says the same with exit code 2
    assert cli_main(["encode", "--videos", str(folder), "--model", str(models), "--out", str(tmp_path / "o3"),
                     "--no-progress"]) == 2
    assert "broken.mp4: cannot decode" in capsys.readouterr().err
    # on_error="skip" records them and keeps the good one
    result = encode_videos(folder, tmp_path / "o4", settings=EncodeSettings(text_len=TEXT_LEN, samples_per_shard=2,
                                                                               on_error="skip"), **kw)
    assert [n for n, _ in result.skipped] == ["broken.mp4", "tiny.mkv"] and result.samples == 1
    assert EncodedVideoDataset(tmp_path / "o4").names == ["ok.mkv"]


def test_a_video_without_a_caption_is_named(tmp_path):
    write_video(tmp_path / "x.mkv", 1, 16, 16)
    with pytest.raises(ValueError, match=r"x\.mkv: no caption: .*sidecar file .*x\.txt"):
        find_sources(tmp_path)
    (tmp_path / "caps.json").write_text(json.dumps([{"file": "x.mkv", "prompt": "a dog"}]))
    assert [s.caption for s in find_sources(tmp_path, tmp_path / "caps.json")] == ["a dog"]


def _fit_refused(model, dataset, match):
    module = VideoDiffusionModule(model)
    steps = []
    module.training_step = lambda *a, **k: steps.append(1)  # never reached
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=VideoDiffusionModule.collate))
    assert steps == []


class _Shapes(torch.utils.data.Dataset):
    """An indexed dataset whose items must never be read: the check uses video_shapes only."""

    def __init__(self, shapes):
        self.video_shapes = shapes
        self.lengths = [1] * len(shapes)

    def __len__(self):
        return len(self.video_shapes)

    def __getitem__(self, i):
        raise AssertionError("read a sample")


def test_setup_refuses_bad_shapes_naming_the_sample(data):
    _, _, out = data
    ds = EncodedVideoDataset(out, text_len=TEXT_LEN)
    # text embeddings of the wrong width: every sample named, with its clip, from the index
    _fit_refused(tiny_wan(text_dim=24), ds, r"(?s)5 bad of 5 samples.*sample 0 \(a\.mkv: latent \(4, 2, 4, 6\), text \(7, 16\)\): "
                                            r"text embedding width 16, expected the model's text_dim 24")
    # latents of the wrong channel count (the model's in_channels 8 = I2V without condition latents)
    _fit_refused(tiny_wan(in_channels=8), ds, r"sample 0 .*latent \+ condition channels 4 \+ 0, expected in_channels 8")
    # a latent whose height does not divide by the patch, in a large indexed dataset: found at fit start
    good = VideoShape((4, 2, 4, 6), (3, TEXT_DIM))
    shapes = [good] * 1000 + [VideoShape((4, 2, 5, 6), (3, TEXT_DIM))]
    _fit_refused(tiny_wan(), _Shapes(shapes), r"(?s)1 bad of 1001 samples.*sample 1000 .*latent height 5, expected a positive "
                                              r"multiple of the patch height 2")
    # through a Subset, the index is the Subset's
    subset = torch.utils.data.Subset(_Shapes(shapes), [1000, 3])
    _fit_refused(tiny_wan(), subset, r"(?s)1 bad of 2 samples.*sample 0 .*latent height 5")


def test_setup_checks_a_dataset_without_an_index_on_a_first_pass():
    g = torch.Generator().manual_seed(0)
    samples = [video_sample(torch.randn(4, 1, 2, 2, generator=g), torch.randn(3, TEXT_DIM if i != 2 else 8, generator=g),
                            (1, 2, 2), text_len=TEXT_LEN, index=i) for i in range(4)]

    class Plain(torch.utils.data.Dataset):
        lengths = [1] * 4

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return samples[i]

    _fit_refused(tiny_wan(), Plain(), r"(?s)first 4 samples\).*sample 2 .*text embedding width 8, expected the model's "
                                      r"text_dim 16")


@hsettings(max_examples=200, deadline=None)
@given(available=st.integers(0, 200), ts=st.sampled_from([1, 4, 8]), pt=st.integers(1, 3),
       height=st.integers(1, 300), width=st.integers(1, 300), area=st.one_of(st.none(), st.integers(1, 40000)))
def test_frame_geometry_keeps_the_most_frames_and_pixels_that_divide(available, ts, pt, height, width, area):
    from lightning_dcp.diffusers.video_io import FrameGeometry

    g = FrameGeometry(8, ts, (pt, 2, 2), max_area=area)
    keep = g.frames_to_keep(available)
    latent = lambda n: n // 1 if ts == 1 else (n - 1) // ts + 1  # noqa: E731 - the VAE's latent frame count
    assert 0 <= keep <= available
    if keep:
        assert latent(keep) % pt == 0 and (ts == 1 or (keep - 1) % ts == 0)
    # maximal: no longer count that fits also gives whole temporal patches
    assert not any(latent(n) % pt == 0 and (ts == 1 or (n - 1) % ts == 0) for n in range(keep + 1, available + 1))
    h, w, ch, cw = g.size(height, width)
    assert ch % 16 == 0 and cw % 16 == 0 and 0 <= h - ch < 16 and 0 <= w - cw < 16
    if area is not None:
        assert h * w <= area * 1.05 + h + w + 1  # rounding of the scaled sides only
    assert h <= height and w <= width


def test_captions_from_json_mapping_and_jsonl(tmp_path):
    for name in ("one.mkv", "sub/two.mkv"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "caps.json").write_text(json.dumps({"one.mkv": "a cat", "sub/two.mkv": "a dog"}))
    assert [(s.name, s.caption) for s in find_sources(tmp_path, tmp_path / "caps.json")] == [
        ("one.mkv", "a cat"), ("sub/two.mkv", "a dog")]
    (tmp_path / "caps.jsonl").write_text('{"path": "one.mkv", "text": "x"}\n{"path": "two.mkv", "text": "y"}\n')
    assert [s.caption for s in find_sources(tmp_path, tmp_path / "caps.jsonl")] == ["x", "y"]  # bare names unique
    (tmp_path / "bad.csv").write_text("clip,words\none.mkv,a\n")
    with pytest.raises(ValueError, match=r"bad\.csv, row 1: no video path column"):
        find_sources(tmp_path, tmp_path / "bad.csv")


def test_encode_says_what_each_clip_becomes_and_names_max_area_for_a_clip_far_larger_than_the_rest(data, tmp_path,
                                                                                                     capsys):
    """Each sample's line (source size -> frames -> latent grid -> tokens) matches what the index records; a clip
    16x the median tokens gets one warning naming --max-area with a value, and that value brings it in line."""
    import re

    _, models, _ = data
    folder = tmp_path / "clips"
    folder.mkdir()
    for i, name in enumerate(("a", "b", "c")):
        write_video(folder / f"{name}.mkv", 5, 32, 32, seed=i)
    write_video(folder / "big.mkv", 5, 128, 128, seed=3)
    (folder / "captions.csv").write_text("video,caption\n" + "".join(f"{n}.mkv,a cat\n" for n in ("a", "b", "c", "big")))
    args = ["encode", "--videos", str(folder), "--model", str(models), "--captions", str(folder / "captions.csv"),
            "--text-len", str(TEXT_LEN), "--no-progress"]
    assert cli_main([*args, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    lines = {m.group(1): m for m in re.finditer(
        r"^  (\S+): (\d+)x(\d+), (\d+) frames at 8 fps -> (\d+) frames at 8 fps, (\d+)x(\d+) -> latent (\d+)x(\d+)x(\d+) "
        r"-> (\d+) tokens$",
        out, re.M)}
    records = {s.name: s for r in read_index(tmp_path / "out") for s in r.samples}
    assert set(lines) == set(records) == {"a.mkv", "b.mkv", "c.mkv", "big.mkv"}
    for name, m in lines.items():
        assert tuple(int(v) for v in m.group(8, 9, 10)) == tuple(records[name].latent_shape[1:])
        assert int(m.group(11)) == records[name].tokens
    assert lines["big.mkv"].group(2, 3, 4) == ("128", "128", "5") and records["big.mkv"].tokens == 16 * 8
    assert "tokens per sample: min 8, median 8, max 128 (4 samples)" in out
    warned = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "big.mkv makes 128-token samples, 16x the median 8" in warned[0]
    area = int(re.search(r"--max-area (\d+)", warned[0]).group(1))
    assert cli_main([*args, "--out", str(tmp_path / "capped"), "--max-area", str(area)]) == 0
    out = capsys.readouterr().out
    assert "warning:" not in out and "max 32 (4 samples)" in out  # 64x64 pixels: 4x the median, no longer far larger
