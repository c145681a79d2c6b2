"""lightning-dcp export / lightning_dcp.diffusers.export_checkpoint: a diffusers folder from any video checkpoint.

* a LoRA run (with EMA): the pipeline's LoRA file, holding the EMA averages (or, with --weights raw, the trained
  adapter), which the tiny pipeline's load_lora_weights reads back; --pipeline writes the whole pipeline with the
  adapter fused, which from_pretrained loads and runs;
* a full fine-tune: the transformer's save_pretrained folder, from_pretrained equal to the trained weights;
* sharded checkpoint directories (DCPStrategy(sharding="fsdp") on 2 processes): read offline, the same weights
  as the run gathered; a LoRA run's holds the adapter and its EMA shards, resumes exactly, and its validation video
  (from the gathered averages on rank 0) is the pipeline's output with them;
* errors that say what is wrong.
"""

from __future__ import annotations

import os

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

import lightning.pytorch as pl  # noqa: E402
from _tiny_video_data import TinyVideos  # noqa: E402

from lightning_dcp import EMA  # noqa: E402
from lightning_dcp.cli import main  # noqa: E402
from lightning_dcp.diffusers import VideoDiffusionModule  # noqa: E402
from lightning_dcp.diffusers.export import EXPORT_INFO, export_checkpoint  # noqa: E402
from lightning_dcp.diffusers.lora import LORA_WEIGHTS_FILE, lora_config  # noqa: E402
from lightning_dcp.diffusers.tiny import tiny_pipeline, tiny_transformer  # noqa: E402

try:
    from _dist import run_distributed
except ImportError:  # tests/ imported as a package
    from tests._dist import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")

CALL = dict(num_frames=5, height=32, width=32, num_inference_steps=2, guidance_scale=1.0, output_type="np")


def _fit(tmp_path, lora, ema=True, steps=3):
    model = tiny_transformer("tiny-wan")
    module = VideoDiffusionModule(model, lr=5e-2, lora=lora_config(model, rank=4, alpha=8.0) if lora else None)
    callbacks = [EMA(decay=0.5)] if ema else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, torch.utils.data.DataLoader(TinyVideos(n=6), batch_size=2, collate_fn=VideoDiffusionModule.collate))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    averages = {k.removeprefix("model."): v.clone() for k, v in callbacks[0].shadow.items()} if ema else {}
    return module, averages, tmp_path / "run.ckpt"


def _adapter(model):
    from peft.utils import get_peft_model_state_dict

    (name,) = model.peft_config
    return get_peft_model_state_dict(model, adapter_name=name)


def test_lora_run_exports_the_pipelines_lora_file_with_the_ema(tmp_path, capsys):
    module, averages, ckpt = _fit(tmp_path, lora=True)
    assert main([ "export", str(ckpt), "--out", str(tmp_path / "ema")]) == 0
    printed = capsys.readouterr().out
    assert "LoRA weights of WanTransformer3DModel (ema weights, step 3)" in printed and "load_lora_weights" in printed
    assert (tmp_path / "ema" / LORA_WEIGHTS_FILE).is_file() and (tmp_path / "ema" / EXPORT_INFO).is_file()
    pipe = tiny_pipeline("tiny-wan")
    pipe.load_lora_weights(str(tmp_path / "ema"))
    got = _adapter(pipe.transformer)
    want = {k.replace(".default.", "."): v for k, v in averages.items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert pipe.transformer.peft_config[next(iter(pipe.transformer.peft_config))].lora_alpha == 8.0

    assert main(["export", str(ckpt), "--out", str(tmp_path / "raw"), "--weights", "raw"]) == 0
    pipe = tiny_pipeline("tiny-wan")
    pipe.load_lora_weights(str(tmp_path / "raw"))
    got, trained = _adapter(pipe.transformer), {k.replace(".default.", "."): v for k, v in
                                               module.model.state_dict().items() if ".lora_" in k}
    assert got.keys() == trained.keys() and all(torch.equal(got[k], trained[k]) for k in trained)


def test_lora_run_exports_a_whole_pipeline_with_the_adapter_fused(tmp_path):
    module, _, ckpt = _fit(tmp_path, lora=True, ema=False)
    result = export_checkpoint(ckpt, tmp_path / "pipe", pipeline="tiny-wan")
    assert result.kind == "pipeline" and result.weights == "raw"
    fused = diffusers.WanPipeline.from_pretrained(str(tmp_path / "pipe"))
    assert not getattr(fused.transformer, "peft_config", None)  # fused into the weights, no adapter left
    with_adapter = tiny_pipeline("tiny-wan")
    with_adapter.transformer = module.model
    for pipe in (fused, with_adapter):
        pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        a = fused(prompt="a cat", generator=torch.Generator().manual_seed(0), **CALL).frames[0]
        b = with_adapter(prompt="a cat", generator=torch.Generator().manual_seed(0), **CALL).frames[0]
    assert a.shape == (5, 32, 32, 3) and abs(a - b).max() < 1e-4


def test_full_fine_tune_exports_the_transformer_folder(tmp_path):
    module, averages, ckpt = _fit(tmp_path, lora=False)
    result = export_checkpoint(ckpt, tmp_path / "t", ema=False)
    assert result.kind == "transformer"
    loaded = diffusers.WanTransformer3DModel.from_pretrained(str(tmp_path / "t"))
    want = module.model.state_dict()
    assert loaded.state_dict().keys() == want.keys()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    export_checkpoint(ckpt, tmp_path / "e", dtype=torch.bfloat16)  # EMA (present), cast
    loaded = diffusers.WanTransformer3DModel.from_pretrained(str(tmp_path / "e"), torch_dtype=torch.bfloat16)
    weight = "blocks.0.attn1.to_q.weight"
    assert torch.equal(loaded.state_dict()[weight], averages[weight].to(torch.bfloat16))


def test_errors_say_what_is_wrong(tmp_path, capsys):
    _, _, ckpt = _fit(tmp_path, lora=False, ema=False, steps=1)
    with pytest.raises(ValueError, match="holds no EMA averages"):
        export_checkpoint(ckpt, tmp_path / "x", ema=True)
    data = torch.load(ckpt, weights_only=False)
    del data["lightning_dcp_video_model"]
    torch.save(data, tmp_path / "other.ckpt")
    assert main(["export", str(tmp_path / "other.ckpt"), "--out", str(tmp_path / "y")]) == 2
    assert "not written by lightning_dcp.diffusers.VideoDiffusionModule" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="neither a checkpoint file nor a sharded checkpoint directory"):
        export_checkpoint(tmp_path / "missing", tmp_path / "z")


def _gathered(module):
    """The module's full weights, gathered from the shards (rank 0 holds them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("model."): v for k, v in full.items()}


def _sharded_fit(world, steps, lora, callbacks=(), ckpt_path=None):
    from lightning_dcp import DCPStrategy, DefaultCostModel

    model = tiny_transformer("tiny-wan")
    torch.manual_seed(5)
    module = VideoDiffusionModule(model, lr=5e-2, lora=lora_config(model, rank=4, alpha=8.0) if lora else None)
    strategy = DCPStrategy(global_batch_size=4, log_metrics=False, profile=False, sharding="fsdp",
                           cost_model=DefaultCostModel(num_layers=2, num_heads=4, max_tokens=8))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks))
    data = TinyVideos(n=8)  # 2 steps an epoch
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2, collate_fn=VideoDiffusionModule.collate),
                ckpt_path=ckpt_path)
    return module, trainer


def _sharded_worker(rank, world, out_dir):
    from lightning_dcp.diffusers.validation import ValidationVideos

    out = lambda name: os.path.join(out_dir, name)  # noqa: E731
    # a full fine-tune, its checkpoint directory
    module, trainer = _sharded_fit(world, 2, lora=False)
    trainer.save_checkpoint(out("full"))
    gathered = _gathered(module)
    if rank == 0:
        torch.save(gathered, out("full.pt"))
    # LoRA + EMA: 3 steps with a validation video at the end, vs 2 steps, a checkpoint, and a resumed third
    ema = EMA(decay=0.5)
    videos = ValidationVideos("tiny-wan", ["a cat"], every_n_steps=0, out_dir=out("videos"), ema=True,
                              **{k: v for k, v in CALL.items() if k != "output_type"})
    module, _ = _sharded_fit(world, 3, lora=True, callbacks=[ema, videos])
    whole = (_gathered(module), {k.removeprefix("model."): v.clone() for k, v in ema.full_weights().items()})
    ema2 = EMA(decay=0.5)
    module, trainer = _sharded_fit(world, 2, lora=True, callbacks=[ema2])
    trainer.save_checkpoint(out("lora"))
    at_two = {k.removeprefix("model."): v.clone() for k, v in ema2.full_weights().items()}
    ema3 = EMA(decay=0.5)
    module, _ = _sharded_fit(world, 3, lora=True, callbacks=[ema3], ckpt_path=out("lora"))
    resumed = (_gathered(module), {k.removeprefix("model."): v.clone() for k, v in ema3.full_weights().items()})
    if rank == 0:
        torch.save({"whole": whole, "resumed": resumed, "at_two": at_two}, out("lora.pt"))


def test_sharded_runs_checkpoint_resume_validate_and_export(tmp_path):
    """DCPStrategy(sharding="fsdp") on 2 processes. A full fine-tune's checkpoint directory, read offline, exports the
    weights the run gathered. A LoRA run with EMA: its checkpoint directory holds the adapter and the EMA shards, a
    resume from it ends exactly where the uninterrupted run does (adapter and averages), its validation video (rank 0,
    from the gathered averages) is the pipeline's output with them, and its export is the averages' LoRA file."""
    run_distributed(_sharded_worker, 2, str(tmp_path), timeout=900)
    result = export_checkpoint(tmp_path / "full", tmp_path / "t")
    assert result.kind == "transformer" and result.step == 2
    loaded = diffusers.WanTransformer3DModel.from_pretrained(str(tmp_path / "t")).state_dict()
    want = torch.load(tmp_path / "full.pt")
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)

    runs = torch.load(tmp_path / "lora.pt")
    (weights, averages), (weights_r, averages_r) = runs["whole"], runs["resumed"]
    assert averages.keys() == averages_r.keys() and all(".lora_" in k for k in averages)
    for k in averages:
        assert torch.equal(averages[k], averages_r[k]) and torch.equal(weights[k], weights_r[k]), k
    assert all(torch.equal(weights[k], weights_r[k]) for k in weights)  # the frozen base too

    result = export_checkpoint(tmp_path / "lora", tmp_path / "l")
    assert (result.kind, result.weights, result.step) == ("lora", "ema", 2)
    pipe = tiny_pipeline("tiny-wan")
    pipe.load_lora_weights(str(tmp_path / "l"))
    got = _adapter(pipe.transformer)
    at_two = {k.replace(".default.", "."): v for k, v in runs["at_two"].items()}
    assert got.keys() == at_two.keys() and all(torch.equal(got[k], at_two[k]) for k in at_two)

    from peft.utils import set_peft_model_state_dict

    from lightning_dcp.diffusers.mp4 import write_mp4

    (video,) = sorted((tmp_path / "videos").glob("*.mp4"))
    pipe = tiny_pipeline("tiny-wan")
    pipe.transformer.add_adapter(lora_config(pipe.transformer, rank=4, alpha=8.0))
    set_peft_model_state_dict(pipe.transformer, {k.replace(".default.", "."): v for k, v in averages.items()})
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        frames = pipe(prompt="a cat", generator=torch.Generator().manual_seed(0), **CALL).frames[0]
    want = _frames(write_mp4(frames, tmp_path / "want.mp4", fps=16))
    assert len(want) == 5 and all((a == b).all() for a, b in zip(want, _frames(video)))


def _frames(path):
    import av

    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
