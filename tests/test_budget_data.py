"""Budget and data for video (issue 31, item 7): ``lightning-dcp budget`` reads an encoded folder and profiles a
diffusers family; ``ProfiledCostModel`` is exported; ``EncodedVideoDataset`` checks its shards at construction and
names the clip in errors; the video module's fit-start line; why a sample runs at SP > 1; the epoch remainder."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("av")

import torch  # noqa: E402

from _dcp_helpers import RandomPlanner  # noqa: E402
from _encode_helpers import write_video  # noqa: E402

from lightning_dcp.cli import main as cli_main  # noqa: E402
from lightning_dcp.diffusers import EncodedVideoDataset, EncodeSettings, VideoDiffusionModule, encode_videos  # noqa: E402
from lightning_dcp.diffusers.encoded import EncodedSampleError  # noqa: E402
from lightning_dcp.diffusers.synthetic import SyntheticVideos, video_grid  # noqa: E402
from lightning_dcp.diffusers.tiny import TINY_MODELS, tiny_components, tiny_transformer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """Three clips encoded with tiny-wan, one sample per shard."""
    base = tmp_path_factory.mktemp("budget")
    clips = base / "clips"
    clips.mkdir()
    for name, (f, h, w) in {"a.mkv": (5, 32, 32), "b.mkv": (9, 32, 64), "c.mkv": (1, 48, 48)}.items():
        write_video(clips / name, f, h, w)
        (clips / name).with_suffix(".txt").write_text(f"clip {name}")
    parts = tiny_components("tiny-wan")
    out = base / "encoded"
    encode_videos(clips, out, vae=parts["vae"], text_encoder=parts["text_encoder"], tokenizer=parts["tokenizer"],
                  settings=EncodeSettings(text_len=16, samples_per_shard=1), progress=False)
    return out


def test_profiled_cost_model_is_exported_where_the_docs_import_it():
    import lightning_dcp
    import lightning_dcp.profiling
    from lightning_dcp.planning.profiled import ProfiledCostModel

    assert lightning_dcp.ProfiledCostModel is ProfiledCostModel is lightning_dcp.profiling.ProfiledCostModel
    assert "ProfiledCostModel" in lightning_dcp.__all__ and "ProfiledCostModel" in lightning_dcp.profiling.__all__


def test_budget_reads_an_encoded_folder_or_its_index(encoded, tmp_path, capsys):
    from test_budget import _profile

    (tmp_path / "p.json").write_text(json.dumps(_profile()))
    lengths = EncodedVideoDataset(encoded).lengths
    assert lengths == [8, 24, 9]
    outs = []
    for where in (encoded, encoded / "index.jsonl"):
        assert cli_main(["budget", "--profile", str(tmp_path / "p.json"), "--world-size", "2", "--memory-limit-mib", "5",
                         "--lengths", str(where)]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and "dataset: 3 samples of 8-24 tokens" in outs[0]


def test_budget_profiles_a_tiny_diffusers_model_on_the_encoded_videos(encoded, capsys):
    assert cli_main(["budget", "--model", "tiny-wan", "--lengths", str(encoded), "--world-size", "2",
                     "--memory-limit-mib", "40", "--micro-batch-sizes", "1"]) == 0
    out = capsys.readouterr().out
    assert f"tiny-wan (WanTransformer3DModel) measured on cpu" in out and f"the encoded videos of {encoded}" in out
    rows = [line for line in out.splitlines() if line.lstrip().startswith(("1 ", "2 "))]
    assert [r.rsplit("  ", 1)[-1] for r in rows] == ["measured", "estimated from SP 1"]
    assert "dataset: 3 samples of 8-24 tokens" in out


def test_budget_of_a_planning_preset_or_an_unreadable_model_is_one_clear_error(capsys, monkeypatch):
    assert cli_main(["budget", "--model", "wan-1.3b"]) == 2
    err = capsys.readouterr().err
    assert "wan-1.3b is a planning preset" in err and "--model tiny-wan" in err and "Traceback" not in err
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, **kw: (_ for _ in ()).throw(
        OSError("[Errno -2] Name or service not known")))
    assert cli_main(["budget", "--model", "no-such-org/no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "Hugging Face Hub cannot be reached" in err and "tiny-wan" in err and err.count("\n") == 1


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_synthetic_samples_of_every_family_have_the_lengths_asked_for_and_train(name):
    model = tiny_transformer(name)
    data = SyntheticVideos(model, [24, 300], copies=1)
    joint = name in ("tiny-cogvideox", "tiny-hunyuan")
    assert data.lengths == ([max(1, n - data.text_len) + data.text_len for n in (24, 300)] if joint else [24, 300])
    assert [s["latents"].shape[0] for s in data.samples] == data.lengths  # rows, as the sampler counts them
    loss = VideoDiffusionModule(model).training_step(VideoDiffusionModule.collate(data.samples), 0)
    assert torch.isfinite(loss)
    assert video_grid(300) == (1, 15, 20) and video_grid(7) == (1, 1, 7)


def test_the_dataset_checks_every_shard_at_construction_and_names_the_clips(encoded, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(encoded, copy)
    (copy / "shard-000001.safetensors").unlink()  # b.mkv's
    shard = copy / "shard-000002.safetensors"  # c.mkv's, cut short
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(FileNotFoundError) as info:
        EncodedVideoDataset(copy)
    msg = str(info.value)
    assert "2 of 3 shards in index.jsonl are not as encoded" in msg
    assert "shard-000001.safetensors is missing (shard 1: b.mkv)" in msg
    assert "shard-000002.safetensors has" in msg and "(shard 2: c.mkv; a copy cut short?)" in msg


def test_a_sample_that_cannot_be_read_or_built_names_its_clip(encoded, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(encoded, copy)
    shard = copy / "shard-000001.safetensors"
    shard.write_bytes(b"\0" * shard.stat().st_size)  # same size, not a shard
    ds = EncodedVideoDataset(copy)
    with pytest.raises(EncodedSampleError, match=r"sample 1 \(b\.mkv\): cannot read it from .*shard-000001"):
        ds[1]
    with pytest.raises(EncodedSampleError, match=r"sample 0 \(a\.mkv, in .*shard-000000.safetensors\): .*text_len"):
        EncodedVideoDataset(copy, text_len=2)[0]  # 7 text tokens do not fit 2


def test_the_video_module_says_what_it_trains_at_fit_start():
    from lightning_dcp.runtime.support import support_message
    from lightning_dcp.sp.contract import read_model

    module = VideoDiffusionModule(tiny_transformer("tiny-hunyuan"), shift=3.0)
    line = support_message(read_model(module))
    assert line.startswith("DCPStrategy: VideoDiffusionModule trains HunyuanVideoTransformer3DModel (HunyuanVideo) at "
                           "support level 'sp'")
    assert "joint attention over each video's text and video rows" in line
    assert "dividing its 4 attention heads" in line and "recompute of its 4 blocks" in line and "shift 3" in line
    assert module.dcp_support_message("safe") is None


def test_the_capacity_line_says_why_a_short_sample_runs_at_sp_2():
    from test_budget import MIB, _at

    from lightning_dcp.planning.budget import capacity_line

    cm = _at(5 * MIB)
    line = capacity_line(cm, 2)
    assert line.startswith("DCP planning at 5.00 MiB per device")
    assert f"SP 1 {cm.max_length(1, 0)} tokens ({cm.max_length(1, 4)} tokens with all 4 recomputed)" in line
    assert f"SP 2 {cm.max_length(2, 0)} tokens" in line and "A longer sample needs a larger SP size" in line


def test_the_profiler_prints_the_capacity_line_at_fit_start(tmp_path, monkeypatch):
    import lightning_dcp.profiling.callback as callback_mod
    from test_budget import _fit

    said = []  # Lightning's logger may not reach caplog (it depends on what ran before): record the calls
    monkeypatch.setattr(callback_mod, "rank_zero_info", lambda msg, *a, **k: said.append(str(msg)))
    profiler = _fit(tmp_path, memory_limit_bytes=20 * 2**20)
    lines = [m for m in said if m.startswith("DCP planning at")]
    assert len(lines) == 1 and f"SP 1 {profiler.cost_model.max_length(1, 0)} tokens" in lines[0]


@pytest.mark.parametrize("drop_last", [True, False])
def test_the_epoch_remainder_is_said_and_settable(drop_last, monkeypatch):
    import lightning_dcp.runtime.train_loader as train_loader
    from lightning_dcp.runtime.settings import DCPSettings
    from lightning_dcp.runtime.train_loader import build_sampler

    settings = DCPSettings(global_batch_size=4, drop_last=drop_last)
    calls = []  # Lightning's logger may not reach caplog (it depends on what ran before): record the calls
    monkeypatch.setattr(train_loader, "rank_zero_info", lambda msg, *a, **k: calls.append(str(msg)))
    sampler = build_sampler([8] * 10, RandomPlanner(2, seed=0), settings, global_batch_size=4,
                            global_batch_tokens=None, world_size=2, rank=0)
    said = [m for m in calls if "out of every epoch" in m]
    batches = sampler.global_batches(0)
    if drop_last:
        assert [len(b) for b in batches] == [4, 4] and sampler.left_out(0) == 2
        assert said == ["DCPStrategy: global batches of 4 samples leave 2 of 10 samples out of every epoch (drop_last=True; "
                        "other samples each epoch: the order is shuffled); DCPStrategy(drop_last=False) trains them as "
                        "a smaller last step"]
    else:
        assert [len(b) for b in batches] == [4, 4, 2] and sampler.left_out(0) == 0 and said == []


def test_runtime_and_planner_errors_name_the_clip(encoded):
    """EncodedVideoDataset.sample_name gives each sample's clip; what the runtime builds from the train dataset names
    it: the planner the strategy builds (a sample too long for the memory limit), out-of-memory stops and re-plans,
    item descriptions, the loader's sample checks -- through a Subset too; a dataset without names keeps the index."""
    from lightning_dcp.planning.default_cost import DefaultCostModel
    from lightning_dcp.planning.errors import PlanningError
    from lightning_dcp.planning.plan import StepPlan, WorkItem
    from lightning_dcp.runtime.model import SPCap
    from lightning_dcp.runtime.oom import OOMRecovery, StepOutOfMemoryError
    from lightning_dcp.runtime.planner_factory import PlannerFactory
    from lightning_dcp.runtime.sampler import DCPBatchSampler
    from lightning_dcp.runtime.settings import DCPSettings
    from lightning_dcp.runtime.step import Step
    from lightning_dcp.runtime.train_loader import build_loader, sample_namer

    ds = EncodedVideoDataset(encoded)
    assert [ds.sample_name(i) for i in range(3)] == ["a.mkv", "b.mkv", "c.mkv"]
    names = sample_namer(ds)
    assert sample_namer(torch.utils.data.Subset(ds, [2, 1]))(1) == "b.mkv" and sample_namer([1, 2]) is None
    i = max(range(3), key=lambda j: ds.lengths[j])
    clip, n = ds.sample_name(i), ds.lengths[i]
    factory = PlannerFactory(DCPSettings(), 1, SPCap(1), None, "sp", sample_name=names)
    with pytest.raises(PlanningError, match=rf"^sample {i} \({clip}\) has length {n} tokens, but the longest"):
        factory.planner(DefaultCostModel(0, 4, n - 1), ds.lengths)
    step = Step.build(StepPlan((WorkItem((0,), (i,), (n,), 0),)), epoch=0, index=3, rank=0, world_size=1)
    assert step.items[0].describe(names) == f"item 0 (samples [{i} ({clip})], lengths [{n}], SP 1, recompute 0)"
    assert step.items[0].describe() == f"item 0 (samples [{i}], lengths [{n}], SP 1, recompute 0)"
    oom = OOMRecovery(factory, max_replans=0, write_checkpoint=False)
    with pytest.raises(StepOutOfMemoryError, match=rf"at SP 1 \(item 0 \(samples \[{i} \({clip}\)\]"):
        oom.replan_failed(step, [0], 0, DefaultCostModel(2, 4, n), lambda *a: None, sample_name=names)
    stop = oom.sp_stop_message(step, step.items[0], rank=0, timeout_s=None, cost_model=None, trainer=None,
                               checkpoint_io=None, sample_name=names)
    assert f"item 0 (samples [{i} ({clip})]" in stop
    sampler = DCPBatchSampler(ds.lengths, planner=None, global_batch_size=1, plan_ahead=False)
    loader = build_loader(torch.utils.data.DataLoader(ds), sampler, "sp")
    wrong = Step.build(StepPlan((WorkItem((0,), (i,), (n + 1,), 0),)), epoch=0, index=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match=rf"^sample {i} \({clip}\) has {n} tokens but its length is given as {n + 1}"):
        loader.dataset[wrong]


def test_a_fit_names_the_clip_that_is_too_long_for_the_memory_limit(encoded):
    """DCPStrategy on an encoded folder whose longest clip fits no setting: the error at fit start names the clip."""
    import lightning.pytorch as pl

    from lightning_dcp import DCPStrategy
    from lightning_dcp.planning.default_cost import DefaultCostModel
    from lightning_dcp.planning.errors import PlanningError

    ds = EncodedVideoDataset(encoded, text_len=16)
    i = max(range(3), key=lambda j: ds.lengths[j])
    module = VideoDiffusionModule(tiny_transformer("tiny-wan"))
    strategy = DCPStrategy(cost_model=DefaultCostModel(0, 4, ds.lengths[i] - 1), profile=False,
                           global_batch_size=3, log_metrics=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=VideoDiffusionModule.collate)
    with pytest.raises(PlanningError, match=rf"sample {i} \({ds.sample_name(i)}\) has length {ds.lengths[i]} tokens"):
        trainer.fit(module, loader)
