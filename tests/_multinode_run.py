"""One rank of a multi-node test run (launched by torchrun or with SLURM variables by tests/test_multinode.py).

Trains ``TinyLM`` for a few steps under ``DCPStrategy`` with plans that put one SP-4 group across
both "nodes" (ranks 0-3) and SP-2 groups inside each, on 2 nodes x 2 CPU processes (``PER_NODE`` 1: SP-2 groups
across the 2 nodes x 1 process); rank 0 writes the plans and the final weights to ``OUT``.
Usage: ``_multinode_run.py OUT [PER_NODE]`` (default 2).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _dcp_helpers import Dump, RandomPlanner, TinyLM  # noqa: E402

import lightning.pytorch as pl  # noqa: E402

from lightning_dcp import DCPStrategy  # noqa: E402

STEPS = 4


def main(out_dir: str, per_node: int = 2) -> None:
    torch.set_num_threads(1)
    world = 2 * per_node
    strategy = DCPStrategy(planner=RandomPlanner(world, seed=world, force_mix=True), global_batch_size=8, seed=1,
                           log_metrics=False, process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=per_node, num_nodes=2, strategy=strategy, max_steps=STEPS,
                         callbacks=[Dump(out_dir, weights_at=(STEPS,))], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(TinyLM())
    print(f"rank {trainer.global_rank}: env {type(trainer.strategy.cluster_environment).__name__}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
