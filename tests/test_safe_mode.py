"""Safe mode: an unchanged LightningModule (no DCP helpers) trains exactly, never silently wrong.

Two ordinary modules, neither of which knows about DCP:

- ``PlainEncoderLM``: ``nn.TransformerEncoder`` over a padded ``[B, T]`` batch from its own
  ``collate_fn`` (pads with -100 labels and a key-padding mask), mean cross-entropy over its
  non-ignored labels -- with prompt masking. Packing would make samples attend to each other;
  safe mode never packs.
- ``PlainRegressor``: an MLP on a ``TensorDataset`` of tuples, mean MSE over its samples.

Each trains under ``DCPStrategy`` on 1, 2 and 4 spawned gloo processes; the weights after
several steps equal a single-process reference that runs the module's own loss on each step's
whole global batch with plain torch (1e-5, fp32).
"""

from __future__ import annotations

import os
import random

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _dcp_helpers import make_trainer, max_rel_err
from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model
from lightning_dcp import DCPStrategy, DefaultCostModel
from lightning_dcp.planning.padded import PaddedCostModel, PaddedPlanner
from lightning_dcp.sp.contract import local_batch, read_model

VOCAB = 24


class PromptTokens(torch.utils.data.Dataset):
    """Token samples of varied lengths; a prompt prefix carries label -100."""

    def __init__(self, n: int = 40, seed: int = 2) -> None:
        rng = random.Random(seed)
        self.lengths = [rng.randint(3, 30) for _ in range(n)]
        self.prompt = [rng.randint(0, n_ - 2) for n_ in self.lengths]
        g = torch.Generator().manual_seed(seed)
        self.ids = [torch.randint(VOCAB, (n_ + 1,), generator=g) for n_ in self.lengths]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i]
        labels = ids[1:].clone()
        labels[: self.prompt[i]] = -100
        return {"input_ids": ids[:-1], "labels": labels}


def pad_collate(samples: list[dict]) -> dict:
    """The user's own collate: right-pad to the longest sample."""
    t = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), t, dtype=torch.long)
    labels = torch.full((len(samples), t), -100, dtype=torch.long)
    pad = torch.ones(len(samples), t, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n], labels[i, :n], pad[i, :n] = s["input_ids"], s["labels"], False
    return {"input_ids": ids, "labels": labels, "padding_mask": pad}


class PlainEncoderLM(pl.LightningModule):
    """An ordinary module: nothing in it knows about DCP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, VOCAB)

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def loss(self, batch: dict) -> torch.Tensor:
        x = self.encoder(self.embed(batch["input_ids"]), src_key_padding_mask=batch["padding_mask"])
        return F.cross_entropy(self.head(x).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(PromptTokens(), batch_size=3, collate_fn=pad_collate)


class PlainRegressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1), y)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(4)
        x = torch.randn(36, 6, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1) * 0.3), batch_size=3)


class Record(pl.Callback):
    def __init__(self, out_dir: str, at: int) -> None:
        self.out_dir, self.at, self.plans, self.losses = out_dir, at, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.plans.append(batch.step.plan.to_dict())
        self.losses.append((float(outputs["loss"]), trainer.strategy.last_step_metrics.loss))
        if trainer.global_step == self.at:
            sd = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            torch.save({"weights": sd, "plans": self.plans, "losses": self.losses},
                       os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def _reference(module_cls, plans, dataset, collate, steps: int) -> tuple[dict, list[float]]:
    """Plain torch: each step, the module's own loss on the whole global batch, one SGD step."""
    module = module_cls()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for plan in plans[:steps]:
        samples = [dataset[s] for it in plan["items"] for s in it["samples"]]
        opt.zero_grad()
        loss = module.loss(collate(samples))
        loss.backward()
        losses.append(float(loss))
        opt.step()
    return module.state_dict(), losses


CASES = {
    "encoder": (PlainEncoderLM, PromptTokens, pad_collate),
    "tensor": (PlainRegressor, None, torch.utils.data.default_collate),
}


_STEPS = 5


def _safe_fit(out_dir: str, case: str, world: int, spawn: bool = True) -> None:
    """One fit of CASES[case] in safe mode; ``spawn=False``: on the processes of the run_distributed call it runs in."""
    strategy = DCPStrategy(seed=3, global_batch_size=8, **({"start_method": "spawn"} if spawn else {}))
    trainer = make_trainer(world, strategy, [Record(out_dir, _STEPS)], max_steps=_STEPS)
    trainer.fit(CASES[case][0]())


def _two_process_safe_fits(rank: int, world: int, out: str) -> None:
    for case in CASES:
        os.makedirs(os.path.join(out, case), exist_ok=True)
        _safe_fit(os.path.join(out, case), case, world, spawn=False)


@pytest.fixture(scope="module")
def two_process_safe_fits(tmp_path_factory):
    """The Record folder of each case's 2-process fit (CASES' names), all on one spawn of 2 processes."""
    from _dist import run_distributed

    out = str(tmp_path_factory.mktemp("safe2"))
    run_distributed(_two_process_safe_fits, 2, out, timeout=600)
    return out


@pytest.mark.parametrize("case,world", [("encoder", 1), ("encoder", 2), ("tensor", 2), ("encoder", 4)])
def test_unchanged_module_trains_exactly_in_safe_mode(tmp_path, request, case, world):
    module_cls, _, collate = CASES[case]
    steps = _STEPS
    if world == 2:  # its fit: on two_process_safe_fits' spawn
        tmp_path = os.path.join(request.getfixturevalue("two_process_safe_fits"), case)
    else:
        _safe_fit(str(tmp_path), case, world)
    module = module_cls()
    dataset = module.train_dataloader().dataset
    worst = 0.0
    for r in range(world):
        got = torch.load(os.path.join(tmp_path, f"rank{r}.pt"))
        plans = got["plans"]
        assert all(len(it["ranks"]) == 1 and it["recompute"] == 0 for p in plans for it in p["items"])
        ref, ref_losses = _reference(module_cls, plans, dataset, collate, steps)
        for k, (returned, logged) in enumerate(got["losses"]):  # the step's global loss, as plain training has it
            assert returned == pytest.approx(ref_losses[k], rel=1e-5) and logged == pytest.approx(ref_losses[k], rel=1e-5)
        for name, w in got["weights"].items():
            err = max_rel_err(w, ref[name])
            assert err < 1e-5, f"{case}, rank {r}, {name}: relative error {err:.2e}"
            worst = max(worst, err)
    print(f"safe mode {case} world {world}: max rel weight err {worst:.2e}", flush=True)
    if world > 1:  # the planner spreads every step's work over all ranks
        for plan in plans:
            assert all(any(r in it["ranks"] for it in plan["items"]) for r in range(world)), plan


def test_support_levels_are_detected_and_declared():
    from _dcp_helpers import TinyLM

    assert read_model(PlainEncoderLM()).support == "safe"
    assert read_model(TinyLM()).support == "sp"
    assert read_model(PlainEncoderLM(), support="packed").support == "packed"
    m = PlainRegressor()
    m.dcp_support = "packed"
    assert read_model(m).support == "packed"
    m.dcp_support = "ulysses"
    with pytest.raises(ValueError, match=r"PlainRegressor.dcp_support is 'ulysses'; use one of \('safe', 'packed', 'sp'\)"):
        read_model(m)
    with pytest.raises(ValueError, match="support must be one of"):
        DCPStrategy(support="all")


def test_safe_mode_loss_units_and_padded_costs():
    batch = pad_collate([PromptTokens()[i] for i in range(3)])
    def units(module, mb, reduction):
        local = local_batch(read_model(module), mb, 0, 1, reduction, lengths=[5, 6, 7])
        assert local.data is mb and local.real_tokens == 18 and local.loss_units == local.local_loss_tokens
        return local.loss_units

    assert units(PlainEncoderLM(), batch, "token") == int((batch["labels"] != -100).sum())
    assert units(PlainEncoderLM(), batch, "sample") == 3
    assert units(PlainRegressor(), (torch.zeros(3, 6), torch.zeros(3)), "token") == 3
    base = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), 8)
    padded = PaddedCostModel(base, max_padded_tokens=40)
    assert padded.item_time([100, 4000], 1, 0) == pytest.approx(base.item_time([4000, 4000], 1, 0))
    assert padded.padded_tokens([1, 1, 1, 1, 11]) == 55 and not padded.fits([10], 2, 0) and padded.max_length(1) == 40
    assert padded.sp_sizes(8) == [1]


def test_padded_planner_splits_oversized_micro_batches():
    from lightning_dcp.planning.plan import Plan, StepPlan, WorkItem

    class Fixed:
        one_step_per_batch = True

        def plan_batch(self, samples, lengths, step=0):
            return Plan("dcp", 2, (StepPlan((WorkItem((0,), (1, 2, 3, 4), (30, 4, 17, 16), 0),
                                             WorkItem((1,), (5,), (8,), 0))),))

    padded = PaddedPlanner(Fixed(), PaddedCostModel(DefaultCostModel(0, 1, 64), max_padded_tokens=40))
    items = padded.plan_batch([1, 2, 3, 4, 5], [30, 4, 17, 16, 8]).steps[0].items
    assert [(it.ranks, it.samples) for it in items] == [((0,), (1,)), ((0,), (3, 4)), ((0,), (2,)), ((1,), (5,))]
    assert all(len(it.lengths) * max(it.lengths) <= 40 for it in items)


def test_tuple_samples_outside_safe_mode_name_the_fix():
    from lightning_dcp.planning.plan import StepPlan, WorkItem
    from lightning_dcp.runtime.loader import StepDataset
    from lightning_dcp.runtime.step import Step

    ds = StepDataset(TensorDataset(torch.zeros(4, 3), torch.zeros(4)))
    step = Step.build(StepPlan((WorkItem((0,), (1,), (3,)),)), epoch=0, index=0, rank=0, world_size=1)
    with pytest.raises(TypeError, match=r"sample 1 is a tuple, but packing needs dict samples.*support='safe'"):
        ds[step]
