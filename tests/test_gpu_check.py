"""benchmarks/gpu_check.py: the CPU dry run exercises every section (as the lent GPU image has it: no
DeepSpeed), the JSON has every section, and the pieces that decide figures (peak table, FLOP count) hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402

# deepspeed as if not installed (the GPU image has none): any import of it raises ImportError
_RUN = """
import runpy, sys
sys.modules["deepspeed"] = None
sys.argv = ["gpu_check.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def _run(args: list[str], env_extra: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
    code = _RUN.format(script=str(ROOT / "benchmarks" / "gpu_check.py"))
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_dry_run_without_cuda_writes_every_section(tmp_path):
    out = tmp_path / "gc"
    proc = _run(["--out", str(out)], {"CUDA_VISIBLE_DEVICES": "", "LIGHTNING_DCP_CACHE": str(tmp_path / "cache")},
                timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no CUDA device here; dry run" in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["schema"] == gpu_check.SCHEMA and report["mode"] == "dry"
    assert list(report["sections"]) == list(gpu_check.SECTIONS)
    for name, sec in report["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error"))
        assert sec["seconds"] > 0
    assert report["versions"]["deepspeed"].startswith("not importable")
    md = (out / "gpu_check.md").read_text()
    assert all(f"| {name} | ok |" in md for name in gpu_check.SECTIONS)

    sec = report["sections"]
    cases = sec["attention"]["results"]["cases"]
    sdpa = [c for c in cases if c["backend"] == "sdpa"]
    assert len(sdpa) == 2 * len(gpu_check.MODES["dry"].attn_mixes) and all(c["status"] == "ok" for c in sdpa)
    assert all(max(c["max_abs_err"].values()) < 1e-4 and c["kernels"] for c in sdpa)  # fp32 on the CPU
    assert all(c["status"] == "unavailable" and c["reason"] for c in cases if c["backend"] != "sdpa")

    for part in ("profile", "memory"):
        fits = sec[part]["results"]["fits"]
        assert [f["model"] for f in fits] == ["tiny-1d", "tiny-2d"]
        assert all(f["steps"] for f in fits)
    assert all(st["predicted_s"] > 0 and st["measured_s"] > 0 for f in sec["profile"]["results"]["fits"] for st in f["steps"])
    assert all(f["cost_model"] == "ProfiledCostModel" for f in sec["profile"]["results"]["fits"])
    assert all(st["predicted_bytes"] > 0 and st["measured_bytes"] is None
               for f in sec["memory"]["results"]["fits"] for st in f["steps"])
    assert (out / "profile_tiny-1d.json").exists() and (out / "profile_tiny-2d.json").exists()

    mfu = sec["mfu"]["results"]
    assert mfu["peak_flops"] is None and all(c["mfu"] is None for c in mfu["cases"])
    # the analytic GEMM count is what torch's FLOP counter sees in the layer's forward + backward
    assert all(c["gemm_flops_counted"] == c["flops"]["gemm"] > 0 for c in mfu["cases"])

    runs = {r["model"]: r for r in sec["fit"]["results"]["runs"]}
    llama = runs["llama (random weights)"]
    assert llama["status"] == "ok" and llama["steps"] == gpu_check.MODES["dry"].fit_steps and llama["finite"]
    wan = runs["wan (random weights)"]
    try:
        import diffusers  # noqa: F401
    except ImportError:
        assert wan["status"] == "skipped" and "diffusers" in wan["reason"]
    else:
        assert wan["status"] == "ok" and wan["finite"]


def test_wan_is_skipped_with_the_reason_when_diffusers_does_not_import(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "diffusers", None)
    ctx = gpu_check.Ctx(device=torch.device("cpu"), dtype=torch.float32, precision="32-true", accelerator="cpu",
                        sizes=gpu_check.MODES["dry"], out=tmp_path, device_name="cpu")
    run = gpu_check._fit_wan(ctx)
    assert run["status"] == "skipped" and run["reason"].startswith("diffusers does not import")


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H200", 989.4e12), ("NVIDIA H100 PCIe", None),
    ("NVIDIA H100 NVL", None), ("NVIDIA A100-SXM4-80GB", None),
])
def test_peak_table(name, peak):
    got, source = gpu_check.peak_bf16(name)
    assert got == peak
    assert source.startswith("unknown") == (peak is None)


def test_layer_flops_count_causal_attention_half():
    from dataclasses import replace

    from lightning_dcp.planning.models import get_model

    spec = get_model("transformer-1d")
    causal = gpu_check.layer_flops(spec, (100, 50))
    full = gpu_check.layer_flops(replace(spec, causal=False), (100, 50))
    assert causal["gemm"] == full["gemm"] == 3 * 2 * spec.layer_params() * 150
    assert full["attention"] == 2 * causal["attention"] == 3 * 4 * spec.hidden_size * (100**2 + 50**2)


def test_options():
    assert gpu_check.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_check.parse_args(["--sections", "mfu,attention"]).sections == ["mfu", "attention"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--sections", "attention,nope"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quick_run_on_a_gpu(tmp_path):
    proc = _run(["--quick", "--out", str(tmp_path)], {"LIGHTNING_DCP_CACHE": str(tmp_path / "cache")}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "quick" and all(s["status"] == "ok" for s in report["sections"].values())


def test_a_failing_case_or_section_is_recorded_and_the_others_still_run(monkeypatch, tmp_path):
    def attention(ctx):
        rows = [gpu_check._guarded(lambda: {"backend": "sdpa", "status": "ok"}, backend="sdpa"),
                gpu_check._guarded(lambda: 1 / 0, backend="flash")]
        return {"cases": rows, "failed": gpu_check._failed(rows)}

    def mfu(ctx):
        raise ValueError("no layer today")

    monkeypatch.setattr(gpu_check, "SECTION_FNS", {"attention": attention, "mfu": mfu,
                                                   "fit": lambda ctx: {"runs": [], "failed": []}})
    assert gpu_check.main(["--sections", "attention,mfu,fit", "--out", str(tmp_path)]) == 1
    sec = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sec["attention"]["status"] == "error" and "ZeroDivisionError" in sec["attention"]["error"]
    assert [c["status"] for c in sec["attention"]["results"]["cases"]] == ["ok", "error"]
    assert sec["mfu"]["status"] == "error" and "no layer today" in sec["mfu"]["error"]
    assert sec["fit"]["status"] == "ok"
    assert "| mfu | error |" in (tmp_path / "gpu_check.md").read_text()
