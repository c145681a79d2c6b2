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


pytestmark = pytest.mark.usefixtures("one_thread")


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


# -------------------------------------------------- 3: memory figures in MiB/GiB, with their source

def _profile(sp_sizes=(1, 2), num_layers=4) -> dict:
    """A synthetic measured profile: memory linear in local tokens; SP 2 halves a rank's tokens but is
    no faster per rank than SP 1 (so the planner uses SP 2 only when memory forces it)."""
    from lightning_dcp.planning.profile import PROFILE_SCHEMA

    entries = []
    for p in sp_sizes:
        for b in (1, 2):
            for n in (16, 64, 256, 1024):
                t = b * n
                entries.append({"seq_len": n, "micro_batch": b, "sp": p, "forward_s": 1e-6 * t + 2e-9 * b * n * n + 1e-4 * p,
                                "backward_s": 2e-6 * t + 4e-9 * b * n * n + 2e-4 * p, "activation_bytes": 400 * t // p + 4096,
                                "input_bytes": 40 * t // p})
    return {"schema": PROFILE_SCHEMA, "key": {"world_size": max(sp_sizes)},
            "model": {"num_layers": num_layers, "num_heads": 4},
            "device": {"memory_limit_bytes": 8 * 2**30, "gpus_per_node": 8},
            "constant": {"time_s": 1e-3, "optimizer_s": 1e-3, "allreduce_s": 1e-3, "memory_bytes": 3 * MIB,
                         "param_bytes": MIB, "activation_bytes_per_token": 64},
            "entries": entries, "meta": {}}


def test_format_bytes_prints_binary_units():
    from lightning_dcp.planning.units import format_bytes

    assert format_bytes(5.50502e6) == "5.25 MiB"
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"
    assert format_bytes(4880) == "4.77 KiB"
    assert format_bytes(12) == "12 B"


@pytest.mark.parametrize("source, expected", [(None, "memory_limit="), ("--memory-limit-mib 5.25", "--memory-limit-mib 5.25")])
def test_a_too_long_sample_names_the_budget_in_mib_and_where_it_came_from(source, expected):
    from lightning_dcp.planning.errors import PlanningError
    from lightning_dcp.planning.planner import Planner
    from lightning_dcp.planning.profiled import ProfiledCostModel

    cm = ProfiledCostModel(_profile(), memory_limit=5.50502e6, memory_limit_source=source)
    with pytest.raises(PlanningError) as err:
        Planner(2, cm, dataset_lengths=[100, 50_000])
    msg = str(err.value)
    assert "5.25 MiB per device" in msg and f"({expected})" in msg and "e+06" not in msg, msg


def test_a_profile_file_s_budget_names_the_file(tmp_path):
    from lightning_dcp.planning.profiled import ProfiledCostModel

    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile()))
    assert ProfiledCostModel.from_file(path).describe_limit() == f"8.00 GiB per device (device.memory_limit_bytes of profile {path})"


def test_the_callback_s_cost_model_says_its_budget_is_the_default(tmp_path):
    run = _fit(tmp_path)
    assert run.cost_model.describe_limit().startswith("8.00 GiB per device (DCPProfiler's default, 8.00 GiB on CPU")


# ----------------------------------------------------------------------------- 4: the budget helper

LENGTHS = [40, 64, 100, 200, 300, 500, 900, 1500] * 2


def _at(budget: float, sp_sizes=(1, 2)):
    from lightning_dcp.planning.profiled import ProfiledCostModel

    return ProfiledCostModel(_profile(sp_sizes), memory_limit=budget)


def _sp_and_recompute(budget: float, lengths=LENGTHS) -> tuple[int, int]:
    from lightning_dcp.planning.planner import plan

    items = [it for step in plan(lengths, 2, _at(budget), "dcp").steps for it in step.items]
    return max(it.sp_size for it in items), max(it.recompute for it in items)


def test_at_the_reported_budget_the_planner_needs_sp2_and_at_one_byte_more_it_does_not():
    from lightning_dcp.planning.budget import budget_report

    report = budget_report(_at(8 * 2**30), 2, LENGTHS)
    x = report.needs_sp_below
    assert report.longest == 1500 and x == report.per_sp[0].need_full_recompute
    assert _sp_and_recompute(x - 1)[0] == 2  # just below: the longest sample runs on SP 2
    sp, recompute = _sp_and_recompute(x)  # at it: SP 1 holds it, with every layer recomputed
    assert sp == 1 and recompute == 4
    assert _sp_and_recompute(x + 1)[0] == 1
    # the recompute threshold: SP 1 holds the longest sample with no recompute from there on
    y = report.needs_recompute_below
    cm = _at(y)
    assert cm.min_recompute([1500], 1) == 0 and _at(y - 1).min_recompute([1500], 1) > 0
    assert report.min_budget == report.per_sp[1].need_full_recompute < x  # SP 2 holds it on less


def test_longest_lengths_per_sp_size_match_the_cost_model_and_estimate_unmeasured_sizes():
    from lightning_dcp.planning.budget import budget_report

    cm = _at(5 * MIB)
    report = budget_report(cm, 4)
    assert [r.sp for r in report.per_sp] == [1, 2, 4] and [r.measured for r in report.per_sp] == [True, True, False]
    one, two, four = report.per_sp
    assert one.longest_no_recompute == cm.max_length(1, 0) and one.longest_full_recompute == cm.max_length(1, 4)
    assert cm.fits([one.longest_no_recompute], 1, 0) and not cm.fits([one.longest_no_recompute + 1], 1, 0)
    assert two.longest_full_recompute == cm.max_length(2, 4) > one.longest_full_recompute
    assert four.longest_full_recompute == 4 * one.longest_full_recompute  # estimated: a quarter of the tokens per rank
    assert report.longest is None and report.needs_sp_below is None
    text = "\n".join(report.lines())
    assert "5.00 MiB per device (memory_limit=)" in text
    assert [line.rsplit("  ", 1)[-1] for line in report.lines()[1:5]] == ["row", "measured", "measured",
                                                                          "estimated from SP 1"]  # every row labelled


def test_budget_report_refuses_bad_input():
    from lightning_dcp.planning.budget import budget_report
    from lightning_dcp.planning.errors import PlanningError

    with pytest.raises(PlanningError, match="world_size"):
        budget_report(_at(5 * MIB), 0)
    with pytest.raises(PlanningError, match="lengths"):
        budget_report(_at(5 * MIB), 2, [])
    with pytest.raises(PlanningError, match="SP size 1"):
        budget_report(_at(5 * MIB, sp_sizes=(2,)), 2)


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from lightning_dcp import cli

    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_budget_from_a_profile_prints_the_report_s_numbers(tmp_path, capsys):
    from lightning_dcp.planning.budget import budget_report
    from lightning_dcp.planning.profiled import ProfiledCostModel

    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile()))
    (tmp_path / "lengths.json").write_text(json.dumps(LENGTHS))
    code, out, _ = _cli(["budget", "--profile", str(path), "--world-size", "2", "--memory-limit-mib", "5",
                         "--lengths", str(tmp_path / "lengths.json")], capsys)
    assert code == 0
    report = budget_report(ProfiledCostModel(_profile(), memory_limit=5 * MIB), 2, LENGTHS)
    assert f"needs SP > 1 below {report.needs_sp_below / MIB:.2f} MiB per device ({report.needs_sp_below:.0f} bytes" in out
    assert "5.00 MiB per device (--memory-limit-mib 5)" in out
    assert f"{report.per_sp[0].longest_no_recompute} tokens" in out
    code, out2, _ = _cli(["budget", "--profile", str(path), "--world-size", "2", "--memory-limit-mib", "5",
                          "--lengths", ",".join(map(str, LENGTHS))], capsys)
    assert code == 0 and out2 == out  # a comma list reads as the JSON file


@pytest.mark.parametrize("extra, match", [(["--lengths", "3,-1"], "positive integers"),
                                          (["--memory-limit-mib", "0"], "must be positive"),
                                          (["--world-size", "0"], "world_size")])
def test_cli_budget_user_errors(tmp_path, capsys, extra, match):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile()))
    code, _, err = _cli(["budget", "--profile", str(path), *extra], capsys)
    assert code == 2 and match in err


def test_measure_budget_on_the_tiny_model_agrees_with_its_cost_model():
    from lightning_dcp.profiling import measure_budget

    torch.manual_seed(0)
    module = DCPTransformerModule("tiny-1d")
    data = SyntheticTokenDataset([32, 32, 64, 64, 128, 128, 256, 256])
    report = measure_budget(module, data, world_size=2, memory_limit_bytes=10 * MIB, micro_batch_sizes=[1],
                            lengths=[100, 1000], time_budget_s=None)
    one, two = report.per_sp
    assert one.measured and not two.measured and report.longest == 1000
    assert 0 < one.longest_no_recompute < one.longest_full_recompute and report.budget == 10 * MIB
    assert report.needs_recompute_below > report.needs_sp_below > two.need_full_recompute
