"""The tiny offline models (lightning_dcp/diffusers/tiny.py): deterministic, one per family, and each family's
diffusers pipeline runs on them without a download."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lightning_dcp.diffusers import family_of  # noqa: E402
from lightning_dcp.diffusers.tiny import TINY_MODELS, is_tiny, save_tiny, tiny_components, tiny_pipeline  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

#: keyword arguments for a 2-step generation at the smallest size each pipeline takes
GENERATE = {
    "tiny-wan": dict(height=32, width=32, num_frames=5),
    "tiny-ltx": dict(height=64, width=64, num_frames=9, max_sequence_length=128),
    "tiny-cogvideox": dict(height=32, width=32, num_frames=5, max_sequence_length=16),
    "tiny-hunyuan": dict(height=32, width=32, num_frames=5, max_sequence_length=32),
}


def test_every_family_has_a_tiny_model():
    assert set(GENERATE) == set(TINY_MODELS)
    assert {family_of(tiny_components(n)["transformer"]).class_name for n in TINY_MODELS} == {
        "WanTransformer3DModel", "LTXVideoTransformer3DModel", "CogVideoXTransformer3DModel",
        "HunyuanVideoTransformer3DModel"}
    assert is_tiny("tiny-wan") and not is_tiny("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") and not is_tiny(None)
    with pytest.raises(ValueError, match="tiny-wan, tiny-ltx"):
        tiny_components("tiny-sora")


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_models_are_deterministic_and_leave_the_global_rng_alone(name):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = tiny_components(name), tiny_components(name)
    assert torch.equal(torch.get_rng_state(), before)
    for key in a:
        if isinstance(a[key], torch.nn.Module):
            sa, sb = a[key].state_dict(), b[key].state_dict()
            assert all(torch.equal(sa[k], sb[k]) for k in sa), (name, key)
    other = tiny_components(name, seed=1)["transformer"].state_dict()
    assert any(not torch.equal(v, other[k]) for k, v in a["transformer"].state_dict().items())
    assert a["transformer"].config.num_attention_heads == 4


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_the_family_pipeline_generates_offline(name):
    pipe = tiny_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt="a cat runs on the grass", num_inference_steps=2, output_type="np",
               generator=torch.Generator().manual_seed(0), **GENERATE[name])
    frames = out.frames[0]
    assert frames.ndim == 4 and frames.shape[-1] == 3 and frames.shape[1:3] == (GENERATE[name]["height"],
                                                                                 GENERATE[name]["width"])


def test_a_saved_tiny_model_loads_back_with_the_same_weights(tmp_path):
    """As the docs load a checkpoint: from_pretrained(..., torch_dtype=torch.float32), which needs accelerate (in the
    diffusers, encode and test extras) because Wan keeps some modules in fp32."""
    import diffusers

    folder = save_tiny("tiny-wan", tmp_path / "tiny-wan")
    assert {"vae", "text_encoder", "tokenizer", "transformer", "scheduler"} <= {p.name for p in folder.iterdir()}
    loaded = diffusers.WanTransformer3DModel.from_pretrained(folder, subfolder="transformer", torch_dtype=torch.float32)
    built = tiny_components("tiny-wan")["transformer"].state_dict()
    assert all(torch.equal(v, built[k]) for k, v in loaded.state_dict().items())
