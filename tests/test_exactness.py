"""The issue's proof: DCPStrategy's gradients equal plain data-parallel training on the same global batch.

Lightning runs on fresh processes (1, 2, 4 CPU processes, gloo, ``run_distributed``; the default run's 2-process fits
on one call) with plans that mix SP
sizes 1, 2 and 4 in one step, different micro-batch counts per rank (ranks with none included)
and different recompute counts. Checked against a single-process reference that runs every
sample alone at SP 1: the gradient after step 1 (1e-5 relative, fp32), the weights after 20
steps (1e-5), equal weights on all ranks, and (4 processes) 30 random plans in a row without a
hang, with ``self.log(..., sync_dist=True)`` inside ``training_step``.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from _dcp_helpers import Dump, RandomPlanner, TinyLM, make_dataset, make_trainer, max_rel_err, reference_run
from _dist import run_distributed
from lightning_dcp import DCPStrategy


def _fit(tmp_path, world: int, steps: int, weights_at, reduction: str = "token", log_sync: bool = False,
         masked: bool = False, split_loss: bool = False, spawn: bool = True, **planner_kw):
    """One fit; ``spawn=True``: on ``world`` fresh processes of its own (a ``run_distributed`` call, whose forked
    processes have torch and Lightning imported already), rank 0's log returned; ``spawn=False``: on the processes
    of the ``run_distributed`` call it runs in (no log returned)."""
    if spawn:
        kw = dict(reduction=reduction, log_sync=log_sync, masked=masked, split_loss=split_loss, **planner_kw)
        run_distributed(_fit_here, world, str(tmp_path), steps, weights_at, kw, timeout=600)
        return torch.load(os.path.join(tmp_path, "log_rank0.pt"))
    planner = RandomPlanner(world, seed=world, **planner_kw)
    strategy = DCPStrategy(planner=planner, global_batch_size=8, loss_reduction=reduction, seed=1, log_metrics=True)
    dump = Dump(str(tmp_path), weights_at=weights_at)
    trainer = make_trainer(world, strategy, [dump], max_steps=steps)
    trainer.fit(TinyLM(reduction=reduction, log_sync=log_sync, masked=masked, split_loss=split_loss))


def _fit_here(rank: int, world: int, out: str, steps: int, weights_at, kw: dict) -> None:
    _fit(out, world, steps, weights_at, spawn=False, **kw)


#: The default run's 2-process fits (the keyword arguments of _fit), one after the other on one spawn.
_TWO_PROCESS_FITS = {
    "sample": dict(steps=20, weights_at=(20,), reduction="sample"),
    "masked-token-split": dict(steps=8, weights_at=(8,), reduction="token", masked=True, split_loss=True),
}


def _two_process_fits(rank: int, world: int, out: str) -> None:
    for name, kw in _TWO_PROCESS_FITS.items():
        os.makedirs(os.path.join(out, name), exist_ok=True)
        _fit(os.path.join(out, name), world, spawn=False, **kw)


@pytest.fixture(scope="module")
def two_process_fits(tmp_path_factory):
    """The folder of each of _TWO_PROCESS_FITS' fits (their Dump files), all run on one spawn of 2 processes."""
    out = str(tmp_path_factory.mktemp("exact2"))
    run_distributed(_two_process_fits, 2, out, timeout=600)
    return out


def _two_process_fit(out: str, name: str):
    """The Dump folder and rank 0's log of the 2-process fit ``name``."""
    path = os.path.join(out, name)
    return path, torch.load(os.path.join(path, "log_rank0.pt"))


def _check(tmp_path, world: int, log: dict, steps_w: int, reduction: str = "token", masked: bool = False):
    plans = log["plans"]
    ref_grads, ref_weights = reference_run(plans, steps_w, reduction=reduction, dataset=make_dataset(masked=masked))
    worst = 0.0
    for r in range(world):
        grads = torch.load(os.path.join(tmp_path, f"grads0_rank{r}.pt"))
        for name, g in grads.items():
            assert g is not None, name
            err = max_rel_err(g, ref_grads[name])
            assert err < 1e-5, f"rank {r} grad {name}: relative error {err:.2e}"
        weights = torch.load(os.path.join(tmp_path, f"weights{steps_w}_rank{r}.pt"))
        for name, w in weights.items():
            err = max_rel_err(w, ref_weights[name])
            assert err < 1e-5, f"rank {r} weight {name} after {steps_w} steps: relative error {err:.2e}"
            worst = max(worst, err)
    print(f"world {world} {reduction}{' prompt-masked' if masked else ''}: max rel weight err {worst:.2e}", flush=True)
    return plans


def _mixes(plans, world):
    """SP sizes used in one step, and whether micro-batch counts differed across ranks in some step."""
    sizes0 = sorted({len(it["ranks"]) for it in plans[0]["items"]})
    uneven = idle = False
    recompute = set()
    for p in plans:
        counts = [0] * world
        for it in p["items"]:
            recompute.add(it["recompute"])
            for r in it["ranks"]:
                counts[r] += 1
        uneven |= len(set(counts)) > 1
        idle |= 0 in counts
    return sizes0, uneven, idle, recompute


def test_exact_one_process(tmp_path):
    log = _fit(tmp_path, 1, 20, (20,))
    _check(tmp_path, 1, log, 20)


def test_exact_two_processes_sample_reduction(two_process_fits):
    path, log = _two_process_fit(two_process_fits, "sample")  # _fit(path, 2, 20, (20,), reduction="sample")
    plans = _check(path, 2, log, 20, reduction="sample")
    sizes0, uneven, idle, recompute = _mixes(plans, 2)
    assert sizes0 == [1, 2] and uneven and len(recompute) > 1


def test_exact_four_processes_30_random_plans(tmp_path):
    """SP 1/2/4 in one step, uneven and empty ranks, recompute 0..3, sync_dist logging: 30 steps, no hang."""
    log = _fit(tmp_path, 4, 30, (20,), log_sync=True)
    plans = _check(tmp_path, 4, log, 20)
    assert len(plans) == 30
    sizes0, uneven, idle, recompute = _mixes(plans, 4)
    assert sizes0 == [1, 2, 4], sizes0
    assert uneven and idle and recompute == {0, 1, 2, 3}
    m = log["metrics"][-1]
    assert len(m["busy_s"]) == 4 and 0.0 <= m["imbalance"] < 1.0
    assert m["global_tokens"] == sum(sum(it["lengths"]) for it in plans[-1]["items"])


@pytest.mark.parametrize("world,reduction,split_loss", [(2, "token", True), (4, "sample", False)])
def test_exact_with_prompt_masked_labels(tmp_path, request, world, reduction, split_loss):
    """SFT prompt masking (labels -100 inside samples, some samples without any loss token): the
    token mean is over loss tokens of the global batch, counted on the host, not over all tokens.
    With ``split_loss`` the module returns ``weighted_loss(a) + weighted_loss(b)``, a new tensor
    without the weighted marker: the strategy still takes it as the sum it is."""
    if (world, reduction, split_loss) == (2, "token", True):  # run on two_process_fits' spawn
        tmp_path, log = _two_process_fit(request.getfixturevalue("two_process_fits"), "masked-token-split")
    else:
        log = _fit(tmp_path, world, 8, (8,), reduction=reduction, masked=True, split_loss=split_loss)
    plans = _check(tmp_path, world, log, 8, reduction=reduction, masked=True)
    assert _mixes(plans, world)[0] == ([1, 2] if world == 2 else [1, 2, 4])
