"""The plans ``lightning-dcp plan`` writes for a dataset are, step for step, the plans a DCPStrategy fit on that
dataset executes (issue 37): the same permutation per epoch, the same batch cutter, the same step keys, the
same policy preparation, compared by :meth:`StepPlan.digest`.

The fit runs on 2 gloo processes (``run_distributed``) with a tiny model over two epochs (the second epoch's order differs; each
epoch's incomplete last batch is dropped) and ``calibration="off"`` (an adaptive fit plans the steps after
its first refit with measured factors, which no offline plan can know). Its cost model is a profile file,
the one the command reads, whose memory budget makes dcp mix SP 1 and SP 2, recompute counts and
accumulation counts.
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch

import lightning_dcp.cli as cli
from _dcp_helpers import TinyLM, make_dataset, make_trainer
from _dist import run_distributed
from lightning_dcp.planning.plan import Plan, StepPlan
from lightning_dcp.planning.profile import PROFILE_SCHEMA

SEED, TOKENS, STEPS = 7, 160, 8


def tiny_profile() -> dict:
    """A measured-style profile of TinyLM's shape (3 layers, 4 heads) on 2 ranks, with a budget that holds at most
    34 tokens at SP 1 (every layer recomputed): the dataset's longest samples (up to 40) need SP 2."""
    entries = []
    for sp, scale in ((1, 1.0), (2, 0.6)):
        for mb in (1, 2):
            for n in (8, 16, 32, 64):
                t = mb * n
                entries.append({"seq_len": n, "micro_batch": mb, "sp": sp,
                                "forward_s": scale * (2e-5 * t + 1e-6 * mb * n * n) + 1e-4 * sp,
                                "backward_s": scale * (4e-5 * t + 2e-6 * mb * n * n) + 2e-4 * sp,
                                "activation_bytes": 400 * t // sp + 4096, "input_bytes": 40 * t // sp})
    return {"schema": PROFILE_SCHEMA, "key": {"world_size": 2}, "model": {"num_layers": 3, "num_heads": 4},
            "device": {"memory_limit_bytes": 42000, "gpus_per_node": 8},
            "constant": {"time_s": 1e-3, "optimizer_s": 1e-3, "allreduce_s": 1e-3, "memory_bytes": 20000,
                         "param_bytes": 2**18},
            "entries": entries, "meta": {}}


class Digests(pl.Callback):
    """Rank 0 writes the digest of every step the strategy executed (``strategy.last_step_plan``)."""

    def __init__(self, path: str) -> None:
        self.path, self.digests, self.epochs = path, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.digests.append(StepPlan.from_dict(trainer.strategy.last_step_plan).digest())
        self.epochs.append(trainer.current_epoch)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "w") as fh:
                json.dump({"digests": self.digests, "epochs": self.epochs}, fh)


def _fit_digests(rank: int, world: int, profile: str, ran: str) -> None:
    """The fit, on the 2 fresh processes of a ``run_distributed`` call; rank 0 writes the executed digests to ``ran``."""
    from lightning_dcp import DCPStrategy
    from lightning_dcp.planning.profiled import ProfiledCostModel

    strategy = DCPStrategy(cost_model=ProfiledCostModel.from_file(profile), global_batch_tokens=TOKENS, seed=SEED,
                           calibration="off", profile=False, log_metrics=False)
    torch.manual_seed(0)
    make_trainer(world, strategy, [Digests(ran)], max_steps=STEPS).fit(TinyLM())


def test_the_plans_lightning_dcp_plan_writes_are_the_plans_a_fit_executes(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(tiny_profile()))
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps(make_dataset().lengths))  # TinyLM's train dataset
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--lengths", str(lengths), "--world-size", "2", "--profile", str(profile),
                     "--global-batch-tokens", str(TOKENS), "--seed", str(SEED), "--epochs", "2", "--out", str(out)]) == 0
    plan = Plan.from_json(out.read_text())
    per_epoch = plan.extra["epoch_steps"]
    assert per_epoch[0] < STEPS <= sum(per_epoch)  # the fit runs into the second epoch

    ran = tmp_path / "ran.json"
    run_distributed(_fit_digests, 2, str(profile), str(ran), timeout=600)
    executed = json.loads(ran.read_text())
    assert executed["epochs"] == [0] * per_epoch[0] + [1] * (STEPS - per_epoch[0])
    assert executed["digests"] == [step.digest() for step in plan.steps[:STEPS]]
    sizes = {len(item.ranks) for step in plan.steps for item in step.items}
    counts = {sum(0 in item.ranks for item in step.items) for step in plan.steps}
    assert sizes == {1, 2} and len(counts) > 1, (sizes, counts)  # not a trivial plan: SP 1 and 2, varied accumulation
    assert os.path.getsize(out) > 0
