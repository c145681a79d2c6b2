"""The EMA callback (lightning_dcp.callbacks.EMA): the average of the weights after each optimizer step, of the
trained parameters only, saved in checkpoints and resumed exactly, swapped in and out without a trace.

Sharded and multi-process runs: tests/test_lora.py (LoRA + EMA under DCPStrategy) and tests/test_sharding_lora.py.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_dcp import EMA

pytestmark = pytest.mark.usefixtures("one_thread")


class _Frozen(BoringModel):
    """BoringModel with a second, frozen layer: only ``layer`` trains."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


class _Fixed(BoringModel):
    """BoringModel on a fixed dataset of 3 batches (one epoch: 3 steps; a plain DataLoader resumes at an epoch's end)."""

    def train_dataloader(self):
        data = torch.randn(6, 32, generator=torch.Generator().manual_seed(3))
        return torch.utils.data.DataLoader(data, batch_size=2)


class _Trajectory(pl.Callback):
    """The trained weights after every optimizer step (before EMA's update, which runs after it in the list)."""

    def __init__(self):
        self.weights = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights.append({n: p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad})


def _trainer(steps, callbacks, **kw):
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kw)


def _replay(start, trajectory, decay, every=1, start_step=0):
    want = {n: t.clone() for n, t in start.items()}
    for step, weights in enumerate(trajectory, start=1):
        if step % every:
            continue
        for n, w in weights.items():
            want[n] = w.clone() if step <= start_step else decay * want[n] + (1 - decay) * w
    return want


@pytest.mark.parametrize("every,start_step", [(1, 0), (2, 3)])
def test_ema_follows_the_trained_weights_only(every, start_step):
    torch.manual_seed(0)
    model = _Frozen()
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    path, ema = _Trajectory(), EMA(decay=0.7, every_n_steps=every, start_step=start_step)
    _trainer(7, [path, ema]).fit(model)
    assert set(ema.shadow) == {"layer.weight", "layer.bias"}  # the frozen layer has no average
    want = _replay(start, path.weights, 0.7, every, start_step)
    for n, t in ema.shadow.items():
        torch.testing.assert_close(t, want[n], rtol=1e-6, atol=1e-7)
    assert ema.updates == 7 // every
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped(model):
        assert torch.equal(model.layer.weight, ema.shadow["layer.weight"])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # put back


def test_ema_is_checkpointed_and_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    full, ema_full = _Fixed(), EMA(decay=0.9)
    _trainer(6, [ema_full]).fit(full)
    torch.manual_seed(0)
    first, ema_first = _Fixed(), EMA(decay=0.9)
    trainer = _trainer(3, [ema_first])
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "ema.ckpt")
    saved = torch.load(tmp_path / "ema.ckpt", weights_only=False)["callbacks"][ema_first.state_key]
    assert set(saved["shadow"]) == {"layer.weight", "layer.bias"} and saved["updates"] == 3
    torch.manual_seed(1)  # other initial weights: the checkpoint restores weights and averages
    resumed, ema_resumed = _Fixed(), EMA(decay=0.9)
    _trainer(6, [ema_resumed]).fit(resumed, ckpt_path=tmp_path / "ema.ckpt")
    assert ema_resumed.updates == 6
    for n, t in ema_resumed.shadow.items():
        assert torch.equal(t, ema_full.shadow[n]), n


def test_ema_refuses_bad_settings_and_averages_of_other_parameters():
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\), got 1.0"):
        EMA(decay=1.0)
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
        EMA(every_n_steps=0)
    ema = EMA()
    ema.load_state_dict({"updates": 1, "shadow": {"layer.weight": torch.zeros(2, 32)}})  # a checkpoint's state
    with pytest.raises(ValueError, match=r"the checkpoint's averages do not match.*missing \['layer.bias'\]"):
        _trainer(1, [ema]).fit(BoringModel())
