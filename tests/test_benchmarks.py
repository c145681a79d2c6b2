"""Smoke test of the benchmark pieces: data scaling, the timing module, run.py's analysis and reports,
simulate_scaling on a tiny grid. One real 2-process fit of 1-2 steps (spawned gloo) per run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_dcp.planning.cost_model import CostModel

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import data as bdata  # noqa: E402
from benchmarks import models as bmodels  # noqa: E402
from benchmarks import run as brun  # noqa: E402


@pytest.mark.parametrize("dist", ["short", "balanced", "long", "video", "code"])
def test_scaled_distributions_are_cpu_sized_and_deterministic(dist):
    for kind in ("1d", "2d"):
        dm = bdata.BenchDataModule(kind, dist, 64, seed=3)
        ls = dm.lengths
        assert len(ls) == 64 and max(ls) <= bdata.MAX_LEN and min(ls) >= 1
        assert ls == bdata.BenchDataModule(kind, dist, 64, seed=3).lengths
        if kind == "2d":
            assert [f * h * w for f, h, w in dm.shapes] == ls
            s = dm.dataset[0]
            assert s["latents"].shape[0] == ls[0] and s["shapes"] == dm.shapes[0]
        else:
            assert dm.dataset[0]["input_ids"].shape[0] == ls[0]


def test_scaling_keeps_the_band_order():
    raw = bdata.scaled_lengths("balanced", 500, 0, scale=1, min_len=1, max_len=None)
    scaled = bdata.scaled_lengths("balanced", 500, 0)
    assert all(bdata.MIN_LEN <= s <= bdata.MAX_LEN for s in scaled)
    assert all(s == max(bdata.MIN_LEN, min(bdata.MAX_LEN, round(r / 64))) for r, s in zip(raw, scaled))


def test_benchmark_module_sizes():
    assert bmodels.bench_spec("transformer-1d").num_layers == 42
    assert bmodels.bench_spec("transformer-2d").hidden_size == 1152
    small = bmodels.bench_spec("small-2d")
    assert small.kind == "2d" and small.hidden_size == 128
    with pytest.raises(ValueError, match="unknown benchmark model"):
        bmodels.bench_spec("nope")


def _fake_ranks(world=2, steps=3):
    """Two ranks' records as BenchmarkModule writes them (plans: SP-1 items, rank 1 busier)."""
    recs = [[] for _ in range(world)]
    t = 100.0
    for k in range(steps):
        plan = {"items": [{"ranks": [0], "samples": [3 * k], "lengths": [20], "recompute": 0},
                          {"ranks": [1], "samples": [3 * k + 1, 3 * k + 2], "lengths": [20, 30], "recompute": 0}]}
        metrics = {"busy_s": [0.1, 0.2], "idle_s": [0.1, 0.0], "imbalance": 0.25}
        for r in range(world):
            items = [[0.0, 0.1, 0.0, 0.09]] if r == 0 else [[0.0, 0.2, 0.0, 0.18]]
            recs[r].append({"epoch": 0, "step": k, "global_step": k, "start": t, "end": t + 0.25, "step_s": 0.25,
                            "step_cpu_s": 0.22 if r else 0.12, "items": items, "plan": plan, "metrics": metrics})
        t += 0.3
    return [{"rank": r, "world_size": world, "records": recs[r]} for r in range(world)]


class _LinearCost(CostModel):
    """A cost model: 1 ms per token per SP rank, 10 ms step overhead, no memory limit."""

    num_layers = 4
    num_heads = 4
    memory_limit = float("inf")

    def item_memory(self, lengths, sp, recompute, ring=1):
        return float(sum(lengths)) / sp

    def signature(self):
        return {"kind": "linear-test"}

    def item_cost(self, lengths, sp, recompute, ring=1):
        from lightning_dcp.planning.cost_model import ItemCost

        t = sum(lengths) * 1e-3 / sp
        return ItemCost(compute=t, recompute=0.0, comm=0.0, overhead=0.0, ideal=t)

    def step_overhead(self, world_size):
        return 0.01


def test_analyze_measured_and_predicted():
    row, sim = brun.analyze("dcp", _fake_ranks(), warmup_epochs=0, cost_model=_LinearCost())
    assert row["steps"] == 3 and row["tokens"] == 3 * 70 and row["samples"] == 9
    assert row["busy_s"] == pytest.approx([0.3, 0.6]) and row["idle_s"] == pytest.approx([0.3, 0.0])
    assert row["imbalance"] == pytest.approx(0.3 / (2 * 0.6))
    assert row["tokens_per_s"] == pytest.approx(210 / (0.6 + 0.25))
    assert row["pred_step_s_mean"] == pytest.approx(0.05 + 0.01)  # rank 1: 50 tokens * 1 ms, + overhead
    assert row["step_error"] == pytest.approx((0.06 - 0.25) / 0.25)
    assert row["step_cpu_s_mean"] == pytest.approx(0.22)
    assert row["pred_imbalance"] == pytest.approx((0.05 - 0.02) / (2 * 0.05))
    # per SP size: 6 items; predicted 3 x (20 + 50) ms against 3 x (0.1 + 0.2) s wall and 3 x (0.09 + 0.18) s CPU
    assert row["item_ratio_by_sp"] == {"1": [6, pytest.approx(0.21 / 0.9), pytest.approx(0.21 / 0.81)]}
    targets = brun.check_targets([row, {**row, "policy": "bucket", "imbalance": 0.5, "tokens_per_s": 1.0}], 0.2)
    assert any("imbalance" in t and "MET" in t for t in targets)
    assert any("within 20%" in t and "NOT MET" in t for t in targets)
    assert "| dcp | 3 |" in brun.markdown_table([row])


def test_reports_and_plots(tmp_path):
    ranks = _fake_ranks()
    rows, sims = [], {}
    for pol in ("dcp", "bucket"):
        row, sim = brun.analyze(pol, ranks, 0, cost_model=_LinearCost())
        rows.append(row)
        sims[pol] = sim
    brun.write_csv(rows, tmp_path / "run.csv")
    assert (tmp_path / "run.csv").read_text().splitlines()[0].startswith("policy,")
    paths = brun.plot(rows, sims, {"dcp": ranks, "bucket": ranks}, tmp_path, "test", 0)
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)


def test_simulate_scaling_tiny_grid(tmp_path):
    from benchmarks import simulate_scaling

    out = tmp_path / "s.md"
    simulate_scaling.main(["--models", "transformer-1d", "--worlds", "8", "--dists", "balanced",
                           "--policies", "dcp,bucket", "--steps", "1", "--out", str(out), "--profiles", str(tmp_path)])
    text = out.read_text()
    assert "| 8 | balanced |" in text and out.with_suffix(".png").exists()


def test_simulate_slow_rank_tiny_grid(tmp_path):
    from benchmarks import simulate_slow_rank

    out = tmp_path / "slow.md"
    simulate_slow_rank.main(["--worlds", "16", "--dists", "long", "--steps", "1", "--out", str(out)])
    row = next(line for line in out.read_text().splitlines() if line.startswith("| transformer-1d | 16 | long |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    blind, aware, healthy = (float(cells[i].replace(",", "")) for i in (4, 5, 10))
    assert aware > blind and healthy >= aware


def test_step_bound_tiny_grid_with_before_after(tmp_path):
    import json as _json

    from benchmarks import step_bound

    out, saved = tmp_path / "sb.md", tmp_path / "sb.json"
    args = ["--steps", "2", "--models", "transformer-1d", "--cells", "32:524288", "--dists", "video",
            "--policies", "dcp,dcp-intra", "--out", str(out), "--save-json", str(saved)]
    assert step_bound.main(args) == 0
    figures = _json.loads(saved.read_text())
    cell = figures["transformer-1d|32|524288|video"]
    assert 0 < cell["dcp"] <= 1 + 1e-9 and cell["dcp_worst"] <= cell["dcp"] + 1e-12 and cell["ceiling"] <= 1 + 1e-9
    assert cell["steps"] == 2
    assert step_bound.main(args + ["--before", str(saved), "--before-label", "same"]) == 0
    text = out.read_text()
    assert "| transformer-1d | 32 | 524,288 | video |" in text and "## Before / after (same -> this table)" in text


def test_bound_check_table(capsys):
    from benchmarks import bound_check

    assert bound_check.main(["--model", "transformer-1d", "--dist", "video,long", "--tokens", "524288",
                             "--seeds", "1", "--steps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| model |") and len(lines) == 4
    assert lines[2].startswith("| transformer-1d | 524,288 | video | 1 |")


@pytest.mark.parametrize("policies", ["dcp", "dcp,packed"])  # dcp,packed (a launch per policy): slow (conftest.py)
def test_run_two_processes_one_step(tmp_path, policies):
    """The whole run.py on 2 spawned gloo processes: 1 or 2 policies, one step each, no profiling (fast)."""
    out = tmp_path / "res"
    rc = brun.main(["--model", "tiny-1d", "--distribution", "balanced", "--policies", policies, "--devices", "2",
                    "--num-samples", "8", "--global-batch-size", "8", "--warmup-epochs", "0", "--epochs", "1",
                    "--no-profile", "--out", str(out), "--tag", "t"])
    assert rc == 0
    res = json.loads((out / "t" / "run.json").read_text())
    assert [r["policy"] for r in res["rows"]] == policies.split(",")
    for r in res["rows"]:
        assert r["steps"] == 1 and r["samples"] == 8 and len(r["busy_s"]) == 2
    assert (out / "t" / "run.md").exists() and (out / "t" / "timeline.png").exists()


def test_planner_speed_rows_have_the_step_beside_the_planning_time():
    from benchmarks import planner_speed

    assert {w for w, _ in planner_speed.SETTINGS} == {32, 256, 1024}
    r = planner_speed.measure(8, 8 * 65536, "balanced", "transformer-1d", 1, "dcp")
    assert r["samples"] > 0 and r["cpu_median_ms"] >= 0.0 and r["step_s"] > 0.0 and 0.0 < r["bound"] <= 1.0 + 1e-9


def test_plan_digests_prints_each_step_and_is_a_function_of_the_code(capsys):
    from benchmarks import plan_digests

    args = ["--cells", "w8-long-zero1,w8-long-none", "--policies", "static,flexsp", "--steps", "1"]
    plan_digests.main(args)
    first = capsys.readouterr().out.splitlines()
    plan_digests.main(args)
    assert capsys.readouterr().out.splitlines() == first
    assert any(line.startswith("w8-long-zero1 static step 0 items ") and " full " in line for line in first)
    assert any(line.startswith("w8-long-zero1 flexsp tokens/s ") for line in first)
    assert any(line.startswith("w8-long-none static refused PlanningError: ") for line in first)
