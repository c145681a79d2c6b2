"""Shared pieces of the DCPStrategy tests: a tiny Ulysses LM, planners with handcrafted plans, a
grad/weight dump callback, a single-process reference, and a Trainer runner.

Everything here is module-level so it pickles into spawned processes.
"""

from __future__ import annotations

import os
import random
from typing import Any, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_dcp.data import SyntheticTokenDataset, pack_samples
from lightning_dcp.models.transformer1d import Transformer1D
from lightning_dcp.planning.models import ModelSpec
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.sp.tokens import weighted_loss

SPEC = ModelSpec("test-1d", "1d", 3, 16, 4, True, 32, vocab_size=32)


class TinyLM(pl.LightningModule):
    """An unchanged-style LightningModule: training_step returns the mean CE over its tokens."""

    def __init__(self, lr: float = 0.05, reduction: str = "token", optimizer: str = "sgd", log_sync: bool = False,
                 init_seed: int = 0, masked: bool = False, split_loss: bool = False) -> None:
        super().__init__()
        self.lr, self.reduction, self.optimizer_name, self.log_sync = lr, reduction, optimizer, log_sync
        self.masked, self.split_loss = masked, split_loss
        torch.manual_seed(init_seed)
        self.model = Transformer1D(SPEC)

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # the test machines have few cores shared by several processes

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch)
        if self.split_loss and "token_weight" in batch:  # a sum of two weighted losses (it loses the marker)
            tl = F.cross_entropy(logits.float(), batch["labels"], reduction="none", ignore_index=-100)
            first = (torch.arange(tl.numel()) % 2 == 0).to(tl.dtype)
            return weighted_loss(tl * first, batch) + weighted_loss(tl * (1 - first), batch)
        if self.reduction == "sample":
            tl = F.cross_entropy(logits.float(), batch["labels"], reduction="none", ignore_index=-100)
            return weighted_loss(tl, batch)
        loss = F.cross_entropy(logits.float(), batch["labels"], ignore_index=-100)
        if self.log_sync:
            self.log("train_loss", torch.nan_to_num(loss), sync_dist=True, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        if self.optimizer_name == "momentum":  # has state, and stays linear in the gradients (exact comparisons)
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(make_dataset(masked=self.masked), batch_size=4)


class PromptMaskedDataset(torch.utils.data.Dataset):
    """SFT-style labels: a per-sample prompt prefix (0 to all tokens) has label -100."""

    def __init__(self, base: SyntheticTokenDataset, seed: int = 5) -> None:
        self.base, self.lengths = base, base.lengths
        rng = random.Random(seed)
        self.prompt = [n if rng.random() < 0.1 else rng.randint(0, n - 1) for n in base.lengths]

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict:
        s = dict(self.base[i])
        s["labels"] = s["labels"].clone()
        s["labels"][: self.prompt[i]] = -100
        return s


def make_dataset(n: int = 48, seed: int = 3, min_len: int = 2, max_len: int = 40, masked: bool = False) -> Any:
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(n)]
    base = SyntheticTokenDataset(lengths, vocab_size=SPEC.vocab_size, seed=seed)
    return PromptMaskedDataset(base) if masked else base


def _blocks(world: int, size: int) -> list[tuple[int, ...]]:
    return [tuple(range(s, s + size)) for s in range(0, world - size + 1, size)]


class RandomPlanner:
    """Random but deterministic plans mixing SP sizes, packing, accumulation counts and recompute.

    Step 0 (and every step when ``force_mix``) starts with one item on the largest SP size and
    one on SP 2 (when the world allows), so one step mixes SP 1/2/4; the remaining samples go
    to random aligned blocks of random sizes, 1-3 samples per item, recompute 0..3. Some steps
    leave ranks without any item (``idle_prob``).
    """

    one_step_per_batch = True

    def __init__(self, world_size: int, seed: int = 0, max_sp: int = 4, idle_prob: float = 0.3, force_mix: bool = False):
        self.world_size, self.seed, self.max_sp, self.idle_prob, self.force_mix = world_size, seed, max_sp, idle_prob, force_mix

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        rng = random.Random(self.seed * 7919 + step)
        pairs = list(zip(samples, lengths))
        rng.shuffle(pairs)
        sizes = [s for s in (1, 2, 4, 8) if s <= min(self.world_size, self.max_sp)]
        # ranks allowed this step: sometimes only the first half -> idle ranks
        usable = self.world_size
        if self.world_size > 1 and rng.random() < self.idle_prob:
            usable = self.world_size // 2
        items: list[WorkItem] = []
        forced = []
        if step == 0 or self.force_mix:
            forced = [s for s in (max(sizes), 2) if 1 < s <= max(sizes)]
            forced = list(dict.fromkeys(forced))
        while pairs:
            if forced:
                sp = forced.pop(0)
                blocks = _blocks(self.world_size, sp)
            else:
                sp = rng.choice([s for s in sizes if s <= max(1, usable)])
                blocks = _blocks(usable, sp) or _blocks(self.world_size, sp)
            ranks = rng.choice(blocks)
            k = min(len(pairs), rng.randint(1, 3))
            chunk, pairs = pairs[:k], pairs[k:]
            items.append(WorkItem(ranks, tuple(s for s, _ in chunk), tuple(n for _, n in chunk), rng.randint(0, 3)))
        return [StepPlan(tuple(items))]


class Dump(pl.Callback):
    """Writes, per rank, grads at the first optimizer step, weights after ``weights_at`` steps,
    the step plans (rank 0) and the step metrics, to ``out_dir``."""

    def __init__(self, out_dir: str, weights_at: Sequence[int] = (20,)) -> None:
        self.out_dir, self.weights_at = out_dir, tuple(weights_at)
        self.plans: list[dict] = []
        self.metrics: list[dict] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == 0:
            grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in pl_module.named_parameters()}
            torch.save(grads, os.path.join(self.out_dir, f"grads0_rank{trainer.global_rank}.pt"))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        self.plans.append(strategy.last_step_plan)  # the plan that ran (batch.step.plan before any OOM re-plan)
        m = getattr(strategy, "last_step_metrics", None)
        if m is not None:
            self.metrics.append(m.to_dict())
        if trainer.global_step in self.weights_at:
            sd = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            torch.save(sd, os.path.join(self.out_dir, f"weights{trainer.global_step}_rank{trainer.global_rank}.pt"))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save({"plans": self.plans, "metrics": self.metrics, "losses": getattr(self, "losses", None)},
                   os.path.join(self.out_dir, f"log_rank{trainer.global_rank}.pt"))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)  # the steps that did run


class AfterBackward(pl.Callback):
    """Per call of ``on_after_backward``: (global step, every gradient a DTensor shard, their global norm).
    :meth:`check`: once per step, sharded, and at step 0 the norm of :func:`reference_run`'s gradients."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, float]] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        sharded = bool(grads) and all(isinstance(g, DTensor) for g in grads)
        full = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]  # every rank runs this hook once
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in full]))
        self.calls.append((trainer.global_step, sharded, float(norm)))

    def check(self, plans: list[dict], steps: int, **reference_kw: Any) -> None:
        assert [(step, sharded) for step, sharded, _ in self.calls] == [(k, True) for k in range(steps)], self.calls
        grads0, _ = reference_run(plans, 1, **reference_kw)
        want = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads0.values() if g is not None])))
        assert abs(self.calls[0][2] - want) <= 1e-5 * want, (self.calls[0], want)


def reference_run(plans: list[dict], steps: int, lr: float = 0.05, dataset: Any = None, reduction: str = "token",
                  optimizer: str = "sgd", clip: float | None = None, module: Any = None) -> tuple[dict, dict]:
    """Single process, every sample alone at SP 1: grads of step 0 and weights after ``steps`` steps.

    The loss of plain data-parallel training on the step's global batch, written out: token mode
    sums the cross-entropy over every label != -100 and divides by their count over the global
    batch; sample mode averages each sample's mean over the samples that have such labels.
    ``clip``: clip the gradients' total norm to it before each step (``Trainer(gradient_clip_val=...)``).
    ``module``: a fresh module to train (default ``TinyLM(lr, reduction, optimizer)``)."""
    dataset = dataset if dataset is not None else make_dataset()
    module = module if module is not None else TinyLM(lr=lr, reduction=reduction, optimizer=optimizer)
    opt = module.configure_optimizers()
    grads0 = None
    for k in range(steps):
        samples = [dataset[s] for it in plans[k]["items"] for s in it["samples"]]
        valid = [int((s["labels"] != -100).sum()) for s in samples]
        total, with_loss = sum(valid), sum(1 for v in valid if v)
        opt.zero_grad(set_to_none=True)
        for sample, v in zip(samples, valid):
            if v == 0:
                continue
            logits = module.model({"input_ids": sample["input_ids"]})  # one plain sequence
            tl = F.cross_entropy(logits.float(), sample["labels"], reduction="sum", ignore_index=-100)
            loss = tl / total if reduction == "token" else tl / v / with_loss
            loss.backward()
        if k == 0:
            grads0 = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in module.named_parameters()}
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
    return grads0, {k: v.detach().clone() for k, v in module.state_dict().items()}


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def make_trainer(devices: int, strategy: Any, callbacks: list, max_steps: int, **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, callbacks=callbacks,
        logger=False, enable_checkpointing=kw.pop("enable_checkpointing", False), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, **kw,
    )


def regression_loader(trainer: pl.Trainer, batch_size: int, ordered_ddp: bool) -> "torch.utils.data.DataLoader":
    """48 samples of a small regression (6 features), for the tests against DDP. ``ordered_ddp``: DDP's loader
    in order (Lightning shuffles DDP's train data), so rank r gets samples r, r + world, ...; else the plain
    loader that DCPStrategy replaces with its own sampler."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    g = torch.Generator().manual_seed(4)
    x = torch.randn(48, 6, generator=g)
    data = TensorDataset(x, x.sum(1) * 0.3 + x[:, 0] ** 2)
    if ordered_ddp:
        sampler = DistributedSampler(data, trainer.world_size, trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=batch_size, sampler=sampler)
    return DataLoader(data, batch_size=batch_size)
