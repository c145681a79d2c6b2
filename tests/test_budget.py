"""The memory budget: a run's budget wins over a cached profile's, the profile cache key covers the
inputs that set memory per token, memory figures print in MiB/GiB with the budget's source, and the
budget helper (API and ``lightning-dcp budget``) agrees with the planner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dcp.data import SyntheticTokenDataset, plain_collate
from lightning_dcp.models.module import DCPTransformerModule
from lightning_dcp.profiling import DCPProfiler
from lightning_dcp.profiling.assemble import CPU_MEMORY_LIMIT

MIB = 2**20


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer(profiler, precision="32-true"):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, max_steps=1, precision=precision, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[profiler])


def _fit(cache_dir, **profiler_kwargs) -> DCPProfiler:
    torch.manual_seed(0)
    module = DCPTransformerModule("tiny-1d")
    data = SyntheticTokenDataset(num_samples=16)
    profiler = DCPProfiler(cache_dir=str(cache_dir), lengths=[16, 64], micro_batch_sizes=[1], **profiler_kwargs)
    _trainer(profiler).fit(module, DataLoader(data, batch_size=2, collate_fn=plain_collate))
    return profiler


# ------------------------------------------------------------------- 1: the run's budget always wins

def test_a_default_run_does_not_reuse_the_budget_of_an_earlier_cached_run(tmp_path):
    small = _fit(tmp_path, memory_limit_bytes=64 * MIB)
    assert small.cache_status == "miss" and small.cost_model.memory_limit == 64 * MIB
    default = _fit(tmp_path)  # same cache key: a hit, but its budget is this run's (the documented default)
    assert default.cache_status == "hit"
    assert default.cost_model.memory_limit == CPU_MEMORY_LIMIT
    assert "default" in default.cost_model.memory_limit_source
    other = _fit(tmp_path, memory_limit_bytes=32 * MIB)
    assert other.cache_status == "hit" and other.cost_model.memory_limit == 32 * MIB
    assert "memory_limit_bytes" in other.cost_model.memory_limit_source
    # the cache holds the measurements and the device's own limit, not a run's budget decision
    stored = json.loads(Path(small.cache_file).read_text())
    assert stored["device"]["memory_limit_bytes"] == CPU_MEMORY_LIMIT


# --------------------------------------------------- 2: the cache key covers what sets memory per token

class _TextVideos(torch.utils.data.Dataset):
    """Latent videos of 4-16 tokens whose text is zero-padded to ``text_len`` tokens."""

    def __init__(self, text_len: int, text_dim: int = 8):
        from lightning_dcp.diffusers import video_sample

        g = torch.Generator().manual_seed(0)
        grids = [(1, 2, 2), (1, 2, 4), (2, 2, 2), (2, 2, 4)] * 2
        self.samples = [video_sample(torch.randn(4, f, 2 * h, 2 * w, generator=g), torch.randn(3, text_dim, generator=g),
                                     (1, 2, 2), text_len=text_len, index=i) for i, (f, h, w) in enumerate(grids)]
        self.lengths = [f * h * w for f, h, w in grids]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def _wan_fit(cache_dir, text_len: int) -> DCPProfiler:
    diffusers = pytest.importorskip("diffusers")
    from lightning_dcp.diffusers import VideoDiffusionModule

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                            in_channels=4, out_channels=4, text_dim=8, freq_dim=16, ffn_dim=32,
                                            num_layers=2, rope_max_seq_len=32)
    module = VideoDiffusionModule(model, lr=1e-4)
    data = _TextVideos(text_len)
    profiler = DCPProfiler(cache_dir=str(cache_dir), lengths=[4, 16], micro_batch_sizes=[1])
    _trainer(profiler).fit(module, DataLoader(data, batch_size=2, collate_fn=VideoDiffusionModule.collate))
    return profiler


def test_a_wan_profile_with_short_texts_is_not_reused_for_long_texts(tmp_path):
    short = _wan_fit(tmp_path, text_len=16)
    long = _wan_fit(tmp_path, text_len=512)
    assert short.cache_status == "miss"
    assert long.cache_status == "miss" and long.cache_file != short.cache_file
    # the text's keys and values are per sample: the fit's per-layer constant grows with the text length
    assert long.cost_model.item_memory([16], 1, 0) > 2 * short.cost_model.item_memory([16], 1, 0)
    again = _wan_fit(tmp_path, text_len=16)
    assert again.cache_status == "hit" and again.cache_file == short.cache_file


def test_the_inputs_signature_ignores_lengths_and_indices_but_not_shapes():
    from lightning_dcp.profiling.cache import describe_sample, inputs_signature

    def sample(n, text=16, width=8, index=0):
        return {"latents": torch.zeros(n, 16), "text": (torch.zeros(text, width),), "grid": (1, 2, n // 2), "index": index}

    base = inputs_signature([(sample(4), 4), (sample(16, index=3), 16)])
    assert base == inputs_signature([(sample(4, index=9), 4), (sample(16), 16)])  # indices, grids: not shape
    assert base == inputs_signature([(sample(6), 6), (sample(32), 32)])  # lengths are the grid's business
    assert base != inputs_signature([(sample(4, text=512), 4), (sample(16, text=512), 16)])  # text length
    assert base != inputs_signature([(sample(4, width=4), 4), (sample(16, width=4), 16)])  # text width
    assert base != inputs_signature([(sample(4), 4), (sample(16), 16)], layers_attr="model.blocks")
    half = {"latents": torch.zeros(4, 16, dtype=torch.float16), "text": (torch.zeros(16, 8),), "grid": (1, 2, 2), "index": 0}
    assert describe_sample(half, 4) != describe_sample(sample(4), 4)  # dtype


def test_the_model_signature_covers_the_configuration():
    diffusers = pytest.importorskip("diffusers")
    from lightning_dcp.profiling.cache import model_signature

    def wan(**over):
        cfg = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                   text_dim=8, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)
        cfg.update(over)
        with torch.device("meta"):
            return diffusers.WanTransformer3DModel(**cfg)

    assert model_signature(wan()) == model_signature(wan())
    assert model_signature(wan()) != model_signature(wan(rope_max_seq_len=64))  # same parameters, other config
    assert model_signature(wan()) != model_signature(wan(qk_norm=None))
