"""Stop after step k, resume from the ModelCheckpoint: weights after 2k steps equal an uninterrupted run.

k = 4 with 6 steps per epoch: the checkpoint is mid-epoch (the sampler's state continues the
same data order) and the resumed run crosses into epoch 1. AdamW, so optimizer state matters.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from _dist import run_distributed
from _dcp_helpers import Dump, RandomPlanner, TinyLM, make_trainer, max_rel_err
from lightning_dcp import DCPStrategy

K = 4


def _strategy():
    return DCPStrategy(planner=RandomPlanner(2, seed=11), global_batch_size=8, seed=4)


def _module():
    return TinyLM(lr=0.01, optimizer="adamw")


def _three_fits(rank, world, full, part):
    """The uninterrupted run, the run stopped after step K and its resumption, one after the other on the same
    two processes (one spawn for the three fits)."""
    make_trainer(2, _strategy(), [Dump(full, weights_at=(2 * K,))], max_steps=2 * K).fit(_module())

    ckpt = ModelCheckpoint(dirpath=part, every_n_train_steps=K, save_top_k=-1, save_last=False)
    make_trainer(2, _strategy(), [ckpt], max_steps=K, enable_checkpointing=True).fit(_module())
    dist.barrier()  # rank 0's checkpoint is on disk
    path = [os.path.join(part, f) for f in os.listdir(part) if f.endswith(".ckpt")]
    assert len(path) == 1, path
    state = torch.load(path[0], weights_only=False)
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"epoch": 0, "step": K, "seed": 4, "num_replicas": 2}]
    make_trainer(2, _strategy(), [Dump(part, weights_at=(2 * K,))], max_steps=2 * K).fit(_module(), ckpt_path=path[0])


def test_resume_mid_epoch_equals_uninterrupted(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir(), part.mkdir()
    run_distributed(_three_fits, 2, str(full), str(part), timeout=600)

    for r in range(2):
        a = torch.load(os.path.join(full, f"weights{2 * K}_rank{r}.pt"))
        b = torch.load(os.path.join(part, f"weights{2 * K}_rank{r}.pt"))
        for name in a:
            assert max_rel_err(b[name], a[name]) < 1e-6, name
    plans_full = torch.load(os.path.join(full, "log_rank0.pt"))["plans"]
    plans_resumed = torch.load(os.path.join(part, "log_rank0.pt"))["plans"]
    assert plans_resumed == plans_full[K:]
