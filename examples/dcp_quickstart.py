"""Adopting DCPStrategy: an existing LightningModule, one changed Trainer argument.

The module's ``training_step(batch, batch_idx)`` returns the mean loss over its (local)
non-padding tokens, as usual; the dataset tells DCP each sample's length via ``.lengths``.

    python examples/dcp_quickstart.py            # 2 CPU processes (all GPUs when present)
"""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_dcp.data import SyntheticTokenDataset, plain_collate, tiny_lengths
from lightning_dcp.models.module import DCPTransformerModule
from lightning_dcp import DCPStrategy

if __name__ == "__main__":
    dataset = SyntheticTokenDataset(tiny_lengths(512, seed=0, min_len=16, max_len=512))  # has .lengths
    model = DCPTransformerModule(model="tiny-1d")
    trainer = pl.Trainer(
        accelerator="auto",
        devices=torch.cuda.device_count() or 2,
        # was: strategy="ddp"
        strategy=DCPStrategy(global_batch_size=16, loss_reduction="token"),
        max_steps=20,
        gradient_clip_val=1.0,
    )
    trainer.fit(model, DataLoader(dataset, batch_size=8, collate_fn=plain_collate))
    if trainer.is_global_zero:
        m = trainer.strategy.last_step_metrics
        print(f"last step: SP sizes {m.sp_sizes}, micro-batches per rank {m.microbatches}, imbalance {m.imbalance:.3f}")
