"""benchmarks/loss_parity.py: the same global batches for DDP and DCP, bucket with one step per global batch,
the difference report, and one real quick run (T-1D, 3 steps of ddp, dcp and bucket on 2 gloo processes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import loss_parity as lp  # noqa: E402
from lightning_dcp.runtime.sampler import DCPBatchSampler  # noqa: E402


def test_ddp_ranks_share_the_dcp_global_batches(monkeypatch):
    lengths = list(range(1, 42))
    global_batches = DCPBatchSampler(lengths, planner=None, global_batch_size=8, seed=5).global_batches(1)
    sampler = lp.RankShareSampler(lengths, 8, seed=5, world_size=2)
    sampler.sampler.set_epoch(1)  # what Lightning calls each epoch
    shares = []
    for rank in (0, 1):
        monkeypatch.setattr(lp.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(lp.dist, "get_rank", lambda r=rank: r)
        shares.append(list(sampler))
    assert len(sampler) == len(global_batches) == 5  # 41 samples, the last partial batch dropped
    for k, batch in enumerate(global_batches):
        assert sorted(shares[0][k] + shares[1][k]) == sorted(batch) and len(shares[0][k]) == 4
    with pytest.raises(ValueError, match="every DDP rank needs a sample"):
        lp.RankShareSampler(lengths, 1, seed=0, world_size=2)


def test_bucket_per_global_batch_keeps_the_bucket_layout_in_one_step():
    from lightning_dcp.planning.planner import Planner

    lengths = [8, 150, 20, 33, 12, 90, 64, 17, 180, 9, 40, 25]
    planner = Planner(2, lp.cost_model(20), "bucket", seed=0, dataset_lengths=lengths, max_sp_size=2)
    samples = list(range(len(lengths)))
    native = planner.plan_batch(samples, lengths, step=3).steps
    assert len(native) > 1  # bucket deals its micro-batches over several optimizer steps
    (step,) = lp.BucketPerGlobalBatch(planner).plan_batch(samples, lengths, step=3)
    assert step.items == tuple(it for s in native for it in s.items)
    assert sorted(step.samples) == samples
    assert {len(it.ranks) for it in step.items} == {2} and min(it.recompute for it in step.items) > 0
    with pytest.raises(ValueError, match="wraps a bucket planner"):
        lp.BucketPerGlobalBatch(Planner(2, lp.cost_model(20), "dcp", dataset_lengths=lengths))


def test_differences_and_same_samples_check():
    curves = {"ddp": [2.0, 1.0, 0.5], "dcp": [2.0, 1.0 + 1e-6, 0.5], "bucket": [2.0 - 4e-6, 1.0, 0.5]}
    d = lp.differences(curves)
    assert d["dcp vs ddp"] == {"max_abs": pytest.approx(1e-6), "max_rel": pytest.approx(1e-6), "step": 1}
    assert d["bucket vs ddp"]["max_abs"] == pytest.approx(4e-6) and d["bucket vs ddp"]["max_rel"] == pytest.approx(2e-6)
    assert d["dcp vs bucket"]["step"] == 0
    raw = {r: {"loss": curves[r], "samples": [[0, 1], [2, 3], [4, 5]], "plans": [[[2, 1, 1]], [[1, 0, 2]], []]}
           for r in lp.RUNS}
    rep = lp.family_report("t1d", raw)
    assert rep["plans"]["dcp"] == {"steps": 3, "items": 2, "items_sp2": 1, "items_recompute": 1, "steps_with_sp2": 1,
                                   "max_recompute": 1}
    raw["bucket"]["samples"] = [[0, 1], [2, 4], [3, 5]]
    with pytest.raises(RuntimeError, match="bucket run trained on other samples than ddp"):
        lp.family_report("t1d", raw)


def test_quick_run_t1d(tmp_path):
    """ddp, dcp and bucket, 3 steps each on 2 gloo processes: the same samples per step, SP 2 and recompute
    in the DCP plans, and losses within 1e-5 (relative) of plain DDP at every step."""
    out, png = tmp_path / "res", tmp_path / "parity.png"
    assert lp.main(["--quick", "--families", "t1d", "--out", str(out), "--plot", str(png), "--timeout", "300"]) == 0
    rep = json.loads((out / "t1d.json").read_text())
    assert rep["steps"] == 3 and rep["samples_per_step"] == 8
    assert all(len(rep["curves"][r]) == 3 for r in lp.RUNS)
    for pair, d in rep["differences"].items():
        assert d["max_rel"] < 1e-5, (pair, d)
    for run in ("dcp", "bucket"):
        assert rep["plans"][run]["items_sp2"] > 0 and rep["plans"][run]["items_recompute"] > 0, rep["plans"]
    assert (out / "t1d.csv").read_text().splitlines()[0] == "step,ddp,dcp,bucket,dcp-ddp,bucket-ddp"
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["families"]) == {"t1d"} and "| T-1D" in (out / "summary.md").read_text()
    assert png.stat().st_size > 0
