"""What the video-family fit tests share: an SGD video module on one thread, and a callback keeping the plans.

Import after ``pytest.importorskip("diffusers")`` (the module imports the diffusers adapters).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_dcp.diffusers import VideoDiffusionModule


class SGDVideo(VideoDiffusionModule):
    """Plain SGD (the reference trainings step by hand with the same rule), one intra-op thread per rank."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def setup(self, stage):
        super().setup(stage)
        torch.set_num_threads(1)


class PlanRecorder(pl.Callback):
    """The plan of every step that ran, as dicts (what the single-process references replay)."""

    def __init__(self):
        self.plans = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.plans.append(batch.step.plan.to_dict())
