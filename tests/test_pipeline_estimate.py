"""Pipeline parallelism priced, not run (issue 36, item 4): lightning_dcp.planning.pipeline_estimate, the
pipelines' step end, the heap packing of the hydraulis peer, and ``lightning-dcp simulate --pp``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_dcp import cli
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp.planning.parallel_costs import Scheme, pipeline_step_overhead, scheme_capacities, scheme_cost
from lightning_dcp.planning.peers.hydraulis import HydraulisPolicy
from lightning_dcp.planning.pipeline_estimate import estimate_pipelines, pipeline_degrees, replica_cost_model
from lightning_dcp.planning.analytic import hsdp_view

H100 = get_hardware("h100")


def _llama7b(world: int = 16) -> AnalyticCostModel:
    return AnalyticCostModel(get_model("llama-7b"), H100, world, sharding="zero1")


def test_pipelines_step_end_reduces_each_ranks_slice_over_the_replicas():
    cm = _llama7b(32)
    scheme = Scheme(4, 2)
    grads = cm.full_state_parts["gradients"]
    comm = 2 * cm.collective_prices().ring(grads / 8, 4, extent=32)  # 4 replicas of 8 ranks
    assert pipeline_step_overhead(cm, scheme, 32) == pytest.approx(comm + cm.step_overhead(1) / 32, rel=1e-12)
    assert pipeline_step_overhead(cm, Scheme(8, 4), 32) == pytest.approx(cm.step_overhead(1) / 32)  # one pipeline


def test_pp_degrees_divide_the_layers_and_fit_the_world():
    assert pipeline_degrees(get_model_cm("llama-70b"), 256) == [2, 4, 8, 16]  # 80 layers
    assert pipeline_degrees(get_model_cm("hunyuanvideo-13b"), 256) == [2, 4]  # 60 layers
    assert pipeline_degrees(get_model_cm("wan-14b"), 4) == [2, 4]  # 40 layers, at most the world
    assert pipeline_degrees(get_model_cm("llama-70b"), 256, max_pp=4) == [2, 4]


def get_model_cm(name: str) -> AnalyticCostModel:
    return AnalyticCostModel(get_model(name), H100, 8)


def test_pipelines_are_priced_on_the_replicas_cost_model():
    view = hsdp_view(AnalyticCostModel(get_model("llama-70b"), H100, 64), 32)
    base = replica_cost_model(view)
    assert base is view.base and hasattr(base, "full_state_parts")
    cm = _llama7b()
    assert replica_cost_model(cm) is cm


def test_one_sample_on_one_pipeline_runs_pp_stage_times():
    """One sample on the one pipeline of 2 ranks (TP 1, PP 2): one micro-batch through both stages, so the span is
    2 stage times (the micro-batch and its bubble), plus the pipelines' step end."""
    cm, n = _llama7b(2), 4096
    est = estimate_pipelines([[n]], cm, 2, 2)
    assert est is not None and est.scheme == Scheme(1, 2) and est.pipelines == 1 and est.tokens == n
    r = next(i for i, c in enumerate(scheme_capacities(cm, est.scheme)) if c >= n)
    expect = 2 * scheme_cost(cm, [n], est.scheme, r).total + pipeline_step_overhead(cm, est.scheme, 2)
    assert est.step_times == (pytest.approx(expect, rel=1e-12),)
    assert est.idle == pytest.approx(0.5)  # each stage idles while the other works
    wide = estimate_pipelines([[n] * 8], _llama7b(16), 16, 2)
    assert wide is not None and wide.pipelines * wide.scheme.size == 16 and wide.scheme.pp == 2


def test_no_pipeline_that_holds_the_longest_sample_gives_none():
    cm = _llama7b(2)
    too_long = scheme_capacities(cm, Scheme(1, 2))[-1] + 1
    assert estimate_pipelines([[too_long]], cm, 2, 2) is None


def test_the_estimate_is_deterministic():
    cm = _llama7b(16)
    rng = np.random.default_rng(3)
    batches = [rng.integers(200, 20000, 60).tolist(), rng.integers(200, 20000, 50).tolist()]
    a, b = estimate_pipelines(batches, cm, 16, 4, seed=1), estimate_pipelines(batches, cm, 16, 4, seed=1)
    assert a == b and a is not None and a.tokens == sum(map(sum, batches)) and 0.0 <= a.idle < 1.0


def test_the_heap_packing_is_the_scan_it_replaced():
    def scan(idx, L, t, V, budget):  # the peer's former packing: every micro-batch scanned per sample
        order = sorted(idx, key=lambda i: (-t[i], i))
        loads, room, bins = [0.0] * V, [budget] * V, [[] for _ in range(V)]
        for i in order:
            fit = [b for b in range(len(bins)) if room[b] >= L[i]]
            if not fit:
                bins.append([])
                loads.append(0.0)
                room.append(budget)
                fit = [len(bins) - 1]
            b = min(fit, key=lambda x: (loads[x], x))
            bins[b].append(i)
            loads[b] += t[i]
            room[b] -= int(L[i])
        return [b for b in bins if b]

    rng = np.random.default_rng(0)
    for _ in range(100):
        n = int(rng.integers(1, 120))
        L = rng.integers(1, 5000, n)
        t = np.round(L * rng.uniform(0.5, 2, n), int(rng.integers(0, 3)))  # rounded: ties in the loads
        V, budget = int(rng.integers(1, 20)), int(rng.integers(5000, 30000))
        assert HydraulisPolicy._lpt(list(range(n)), L, t, V, budget) == scan(list(range(n)), L, t, V, budget)


def test_simulate_pp_reports_each_degree_and_the_verdict(tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = cli.main(["simulate", "--model", "llama-7b", "--world-size", "8", "--dataset", "short", "--num-steps", "1",
                     "--policies", "dcp", "--pp", "4", "--quiet", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "pipeline parallelism (priced; no runtime runs it)" in text
    assert "  PP 2: " in text and "  PP 4: " in text and "  PP 8" not in text
    assert "  best: PP " in text and ("pipelines would win here" in text or "pipelines would not win here" in text)
    pipes = json.loads(out.read_text())["pipelines"]
    assert [p["pp"] for p in pipes] == [2, 4] and all(p["vs_policy"] == "dcp" for p in pipes)
