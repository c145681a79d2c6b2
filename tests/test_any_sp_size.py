"""SP groups of any size the model allows, and ring attention past the heads, trained end to end.

DCPStrategy fits on 3 and 6 CPU processes (gloo) with hand-made plans (the planner is not asked; any
``plan_batch`` object drives the strategy) against single-process training of every sample alone: the
gradient of step 1 and the weights after the last step within 1e-5 (fp32), with recompute and different
micro-batch counts per rank:

* a 6-head model at SP 3 on 3 processes (and a non-aligned SP 2 on ranks 1-2, a ring item: SP 3 as ring 3);
* the same model on 6 processes, in one step: SP 6, SP 3 on ranks 1-3 (not an aligned block), SP 2, and SP sizes
  the heads do not divide -- SP 4 as ring 2 x Ulysses 2, SP 5 as ring 5;
* (slow) a 2-head model at SP 4 = ring 2 x Ulysses 2 and ring 4 on 4 processes, zigzag and contiguous layouts.
"""

from __future__ import annotations

import os
import random
from typing import Sequence

import pytest
import torch

from _dcp_helpers import Dump, TinyLM, make_dataset, make_trainer, max_rel_err, reference_run
from lightning_dcp import DCPStrategy
from lightning_dcp.models.transformer1d import Transformer1D
from lightning_dcp.planning.models import ModelSpec
from lightning_dcp.planning.plan import StepPlan, WorkItem

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC6 = ModelSpec("test-1d-6h", "1d", 3, 24, 6, True, 32, vocab_size=32)
SPEC2 = ModelSpec("test-1d-2h", "1d", 3, 16, 2, True, 32, vocab_size=32)


class SpecLM(TinyLM):
    """TinyLM (mean CE per micro-batch, SGD) on another model shape; ring items sharded by ``layout``."""

    def __init__(self, spec: ModelSpec, layout: str | None = "zigzag", **kw) -> None:
        super().__init__(**kw)
        torch.manual_seed(kw.get("init_seed", 0))
        self.model = Transformer1D(spec)
        self.dcp_ring_layout = layout


class HandPlanner:
    """Step ``k`` deals the global batch round-robin over the groups of ``layouts[k % len(layouts)]`` (each a
    ``(ranks, ring)`` pair, in plan order), recompute 0-2 per item."""

    one_step_per_batch = True

    def __init__(self, layouts: Sequence[Sequence[tuple[tuple[int, ...], int]]], seed: int = 0) -> None:
        self.layouts, self.seed = [list(layout) for layout in layouts], seed

    def plan_batch(self, samples, lengths, step: int = 0) -> list[StepPlan]:
        rng = random.Random(self.seed * 1000 + step)
        groups = self.layouts[step % len(self.layouts)]
        pairs = list(zip(samples, lengths))
        rng.shuffle(pairs)
        dealt: list[list] = [[] for _ in groups]
        for i, pair in enumerate(pairs):
            dealt[i % len(groups)].append(pair)
        items = [WorkItem(ranks, [s for s, _ in got], [n for _, n in got], rng.randint(0, 2), ring)
                 for (ranks, ring), got in zip(groups, dealt) if got]
        return [StepPlan(tuple(items))]


def _fit_here(rank: int, world: int, out: str, spec: ModelSpec, layouts, steps: int, layout: str | None,
              strategy_kwargs: dict) -> None:
    """One fit on the processes of the ``run_distributed`` call it runs in (fresh ones, forked with torch and
    Lightning imported); each rank's Dump files to ``out``."""
    planned = {"planner": HandPlanner(layouts)} if layouts is not None else {}
    strategy = DCPStrategy(**planned, global_batch_size=8, seed=1, log_metrics=False, **strategy_kwargs)
    trainer = make_trainer(world, strategy, [Dump(out, weights_at=(steps,))], max_steps=steps)
    trainer.fit(SpecLM(spec, layout))


def _fit_and_check(tmp_path, world: int, spec: ModelSpec, layouts, steps: int, layout: str | None = "zigzag",
                   **strategy_kwargs):
    from _dist import run_distributed

    run_distributed(_fit_here, world, str(tmp_path), spec, layouts, steps, layout, strategy_kwargs, timeout=600)
    plans = torch.load(os.path.join(tmp_path, "log_rank0.pt"))["plans"]
    ref_grads, ref_weights = reference_run(plans, steps, dataset=make_dataset(), module=SpecLM(spec, layout))
    worst = 0.0
    for r in range(world):
        for name, g in torch.load(os.path.join(tmp_path, f"grads0_rank{r}.pt")).items():
            err = max_rel_err(g, ref_grads[name])
            assert err < 1e-5, f"rank {r} grad {name}: relative error {err:.2e}"
        for name, w in torch.load(os.path.join(tmp_path, f"weights{steps}_rank{r}.pt")).items():
            err = max_rel_err(w, ref_weights[name])
            assert err < 1e-5, f"rank {r} weight {name} after {steps} steps: relative error {err:.2e}"
            worst = max(worst, err)
    used = sorted({(len(it["ranks"]), it.get("ring", 1)) for p in plans for it in p["items"]})
    print(f"world {world}, {spec.num_heads} heads, (SP, ring) {used}: max rel weight err {worst:.2e}", flush=True)
    return plans


def _counts(plans, world):
    """Per step, how many micro-batches each rank ran."""
    return [[sum(r in it["ranks"] for it in p["items"]) for r in range(world)] for p in plans]


def test_sp3_on_three_processes_six_heads_is_exact(tmp_path):
    layouts = [[((0, 1, 2), 1), ((0,), 1), ((1, 2), 1), ((0,), 1)],
               [((1, 2), 1), ((0,), 1), ((0, 1, 2), 3), ((2,), 1)]]
    plans = _fit_and_check(tmp_path, 3, SPEC6, layouts, steps=2)
    assert _counts(plans, 3) == [[3, 2, 2], [2, 2, 3]]
    assert {it["recompute"] for p in plans for it in p["items"]} >= {1, 2}
    assert plans[1]["items"][2]["ring"] == 3 and "ring" not in plans[0]["items"][0]


def test_sp6_on_six_processes_with_ring_past_the_heads_is_exact(tmp_path):
    """One step (kept short: 6 processes on few cores) with every kind of group at once."""
    layouts = [[((0, 1, 2, 3, 4, 5), 1), ((1, 2, 3), 1), ((4, 5), 1), ((0,), 1), ((2, 3, 4, 5), 2), ((0, 1), 1),
                ((0, 1, 2, 3, 4), 5)]]
    plans = _fit_and_check(tmp_path, 6, SPEC6, layouts, steps=1)
    assert _counts(plans, 6) == [[4, 4, 4, 4, 4, 3]]
    assert [(len(it["ranks"]), it.get("ring", 1)) for it in plans[0]["items"]] == [
        (6, 1), (3, 1), (2, 1), (1, 1), (4, 2), (2, 1), (5, 5)]


def test_the_planners_own_sp3_plans_train_exactly_on_three_processes(tmp_path):
    """No hand-made plan: the dcp planner, given a 6-head cost model whose budget holds the longest samples only at
    SP 3, plans SP 3 groups (a head divisor, not a power of two) itself, and the fit equals single-process
    training."""
    from _fakes import FakeCostModel

    cost_model = FakeCostModel(num_layers=SPEC6.num_layers, num_heads=6, memory_limit=20.05)
    assert not cost_model.fits([40], 2, SPEC6.num_layers) and cost_model.fits([40], 3, SPEC6.num_layers)
    plans = _fit_and_check(tmp_path, 3, SPEC6, None, steps=2, cost_model=cost_model, profile=False)
    assert any(len(it["ranks"]) == 3 for p in plans for it in p["items"])


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_at_sp4_on_a_two_head_model_is_exact(tmp_path, layout):
    """SP 4 on 2 heads: ring 2 x Ulysses 2 and ring 4 (Ulysses alone stops at SP 2), with SP 2 and SP 1 beside."""
    layouts = [[((0, 1, 2, 3), 2), ((0, 1), 1), ((2,), 1)], [((0, 1, 2, 3), 4), ((1, 2, 3), 3), ((0,), 1)]]
    plans = _fit_and_check(tmp_path, 4, SPEC2, layouts, steps=3, layout=layout)
    assert {(len(it["ranks"]), it.get("ring", 1)) for p in plans for it in p["items"]} >= {(4, 2), (4, 4), (3, 3)}


# ------------------------------------------------------------------ a Hugging Face and a diffusers family (slow)

_FAMILY_LAYOUTS = [[((0, 1, 2), 1), ((0,), 1), ((1, 2), 1), ((0,), 1)],
                   [((0, 1, 2), 3), ((2,), 1), ((0, 1), 1)]]


def test_hf_twelve_heads_on_three_processes_sp3_and_ring_is_exact(tmp_path):
    """A 12-head Llama (grouped-query, 2 key/value heads) under CausalLMModule: SP 3 (Ulysses), SP 3 as ring 3
    (zigzag), SP 2 on ranks 1-2, uneven micro-batch counts, recompute: weights == plain transformers training."""
    pytest.importorskip("transformers")
    import lightning.pytorch as pl

    from lightning_dcp.hf import CausalLMModule
    from test_hf import _E2E_LR, _E2EDump, _SGDCausalLM, _e2e_dataset, _e2e_reference

    steps, dataset = 2, _e2e_dataset()
    strategy = DCPStrategy(planner=HandPlanner(_FAMILY_LAYOUTS), global_batch_size=8, start_method="spawn", seed=1,
                           log_metrics=False, profile=False)
    trainer = pl.Trainer(accelerator="cpu", devices=3, strategy=strategy, max_steps=steps,
                         callbacks=[_E2EDump(str(tmp_path))], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(_SGDCausalLM(("llama",), lr=_E2E_LR, heads=12),
                torch.utils.data.DataLoader(dataset, batch_size=4, collate_fn=CausalLMModule.collate))
    logs = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(3)]
    plans = logs[0]["plans"]
    assert {(len(it["ranks"]), it.get("ring", 1)) for p in plans for it in p["items"]} == {(1, 1), (2, 1), (3, 1), (3, 3)}
    assert any(it["recompute"] for p in plans for it in p["items"])
    want, _ = _e2e_reference(plans, dataset, "llama", heads=12)
    worst = 0.0
    for r, log in enumerate(logs):
        for n, w in log["weights"]["llama"].items():
            rel = max_rel_err(w, want[n])
            worst = max(worst, rel)
            assert rel < 1e-5, f"rank {r} weight {n} after {steps} steps: relative error {rel:.2e}"
    print(f"llama 12 heads, world 3: max rel weight err {worst:.2e}", flush=True)


def _wan_worker(rank, world, out_dir):
    from test_diffusers import _fit

    _fit(world, out_dir, "wan-6-heads", "token", heads=6, planner=HandPlanner(_FAMILY_LAYOUTS))


def test_diffusers_wan_six_heads_on_three_processes_sp3_and_ring_is_exact(tmp_path):
    """A 6-head Wan 2.1 (VideoDiffusionModule) at SP 3 (Ulysses), SP 3 as ring 3 (contiguous layout), SP 2 on ranks
    1-2, uneven micro-batch counts, recompute: weights after 3 steps == single-process diffusers training."""
    pytest.importorskip("diffusers")
    from _dist import run_distributed

    run_distributed(_wan_worker, 3, str(tmp_path), timeout=900)
    done = open(os.path.join(tmp_path, "wan-6-heads.done")).read()
    assert done.startswith("[1, 2, 3]"), done


def test_profiler_grid_takes_every_ulysses_size():
    """The profiler measures the sizes the runtime runs: every divisor of the heads, not only powers of two."""
    from lightning_dcp.profiling.grid import check_sp_sizes, default_sp_sizes

    assert default_sp_sizes(6, 6) == [1, 2, 3, 6] and default_sp_sizes(8, 12) == [1, 2, 3, 4, 6]
    assert default_sp_sizes(6, None) == [1, 2, 4]
    assert check_sp_sizes([1, 3, 6], 6, 12) == [1, 3, 6]
    with pytest.raises(ValueError, match=r"sp_sizes \[4, 7\] are not usable on 6 rank\(s\) with 6 heads"):
        check_sp_sizes([1, 4, 7], 6, 6)
