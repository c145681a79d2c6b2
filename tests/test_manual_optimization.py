"""Manual optimization under DCPStrategy: ``training_step`` drives the planned micro-batches, exact against DDP.

A two-optimizer module (a generator and a critic, GAN-style) with ``automatic_optimization = False``: every step
the critic trains on its loop over ``micro_batches(batch)`` (its gradients clipped after the loop), and every
other step the generator too. The generator's backward leaves gradients on the critic that its optimizer does not
clear, so the next critic loop starts on top of them (as under DDP). The same module runs under ``DDPStrategy``
(``micro_batches`` yields a plain batch once) with the same data order; a planner with uneven micro-batch counts
per rank runs it under DCPStrategy. Weights, ``global_step`` and the logged losses agree (1e-5).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from _dist import run_distributed
from _dcp_helpers import make_trainer, max_rel_err
from lightning_dcp import DCPStrategy, micro_batches
from lightning_dcp.planning.plan import StepPlan, WorkItem
from lightning_dcp.runtime.checks import check_fit

PER_RANK, WORLD, STEPS = 3, 2, 4


class GanLike(pl.LightningModule):
    """Generator ``G`` (noise -> sample) and critic ``D`` (sample -> score), one optimizer each."""

    def __init__(self, ordered_ddp: bool = False, misuse: str = "") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.ordered_ddp, self.misuse = ordered_ddp, misuse
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
        self.D = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def critic_loss(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        fake = self.G(z).detach()
        return (self.D(fake) - self.D(x)).mean() + 0.1 * (self.D(x) ** 2).mean()

    def training_step(self, batch, batch_idx: int):
        g_opt, d_opt = self.optimizers()
        if self.misuse == "backward_outside":
            x, z = next(iter(micro_batches(batch)))
            self.manual_backward(self.critic_loss(x, z))  # after the loop object is gone: outside a loop
        loss_d = torch.zeros(())  # a rank may have no micro-batch in a step
        for x, z in micro_batches(batch):
            loss_d = self.critic_loss(x, z)
            self.manual_backward(loss_d)
            if self.misuse == "step_inside":
                d_opt.step()
            if self.misuse == "break":
                break
            if self.misuse == "collective" and self.global_rank == 0:  # a world collective on one rank only
                torch.distributed.all_reduce(torch.ones(1))
        self.clip_gradients(d_opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        d_opt.step()
        d_opt.zero_grad()
        if batch_idx % 2 == 0:
            for x, z in micro_batches(batch):
                self.manual_backward(-self.D(self.G(z)).mean())  # gradients on D too: left for the next critic loop
            g_opt.step()
            g_opt.zero_grad()
        self.log("d_norm", torch.stack([p.grad.norm() for p in self.D.parameters() if p.grad is not None]).sum()
                 if any(p.grad is not None for p in self.D.parameters()) else torch.tensor(0.0))
        return {"loss": loss_d.detach()}

    def configure_optimizers(self):
        return [torch.optim.SGD(self.G.parameters(), lr=0.2, momentum=0.5),
                torch.optim.SGD(self.D.parameters(), lr=0.1)]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)
        data = TensorDataset(torch.randn(24, 6, generator=g) * 0.5 + 1.0, torch.randn(24, 4, generator=g))
        if self.ordered_ddp:  # Lightning shuffles DDP's train data; in order, rank r gets samples r, r + world, ...
            sampler = DistributedSampler(data, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
            return DataLoader(data, batch_size=PER_RANK, sampler=sampler)
        return DataLoader(data, batch_size=PER_RANK)


class UnevenPlanner:
    """Rank 0 runs one micro-batch of one sample and one of two; rank 1 one of three (or, on odd steps, all six on
    rank 1 in three micro-batches and none on rank 0)."""

    one_step_per_batch = True

    def __init__(self, world: int = WORLD) -> None:
        self.last = world - 1

    def plan_batch(self, samples, lengths, step: int = 0):
        s, n, last = list(samples), list(lengths), self.last
        if step % 2:
            parts = [(last, [0, 1]), (last, [2]), (last, [3, 4, 5])]
        else:
            parts = [(0, [0]), (0, [1, 2]), (last, [3, 4, 5])]
        return [StepPlan(tuple(WorkItem((r,), tuple(s[i] for i in idx), tuple(n[i] for i in idx), 0)
                               for r, idx in parts))]


class Final(pl.Callback):
    def __init__(self, out_dir: str, tag: str) -> None:
        self.out_dir, self.tag, self.d_norms, self.losses = out_dir, tag, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.d_norms.append(float(trainer.callback_metrics["d_norm"]))

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save({"weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                    "global_step": trainer.global_step, "d_norms": self.d_norms},
                   os.path.join(self.out_dir, f"{self.tag}{trainer.global_rank}.pt"))


def _fit(strategy, out_dir: str, tag: str, ddp: bool = False, devices: int = WORLD, **module_kw) -> pl.Trainer:
    trainer = make_trainer(devices, strategy, [Final(out_dir, tag)], max_steps=-1, max_epochs=1,
                           limit_train_batches=STEPS, use_distributed_sampler=not ddp)
    trainer.fit(GanLike(ordered_ddp=ddp, **module_kw))
    return trainer


def _ddp_then_dcp(rank, world, out_dir, sharding):
    """The DDP fit, then the DCP fit, on the same processes (one spawn for both)."""
    from lightning.pytorch.strategies import DDPStrategy

    _fit(DDPStrategy(process_group_backend="gloo", find_unused_parameters=True), out_dir, "ddp", ddp=True)
    _fit(DCPStrategy(planner=UnevenPlanner(), shuffle=False, sharding=sharding), out_dir, "dcp")


@pytest.mark.parametrize("sharding", ["none", "zero1"])  # zero1: slow (tests/conftest.py SLOW)
def test_two_optimizers_equal_ddp(tmp_path, sharding):
    run_distributed(_ddp_then_dcp, WORLD, str(tmp_path), sharding, timeout=600)
    worst = 0.0
    for r in range(WORLD):
        ddp = torch.load(os.path.join(tmp_path, f"ddp{r}.pt"))
        dcp = torch.load(os.path.join(tmp_path, f"dcp{r}.pt"))
        # the critic every step, the generator every other step
        assert dcp["global_step"] == ddp["global_step"] == STEPS + STEPS // 2
        # the critic's gradient norm after the generator's loop: the reduced gradients, as DDP's
        assert dcp["d_norms"] == pytest.approx(ddp["d_norms"], rel=1e-5)
        for name, w in dcp["weights"].items():
            err = max_rel_err(w, ddp["weights"][name])
            assert err < 1e-5, f"rank {r}, {name}: relative error {err:.2e}"
            worst = max(worst, err)
    print(f"manual optimization ({sharding}), two optimizers vs DDP: max rel weight err {worst:.2e}", flush=True)


@pytest.mark.parametrize("misuse,match", [
    ("backward_outside", r"self.manual_backward\(loss\) (after a loop over micro_batches\(batch\) in step 0 of epoch 0 "
                         r"stopped before this rank's last micro-batch|outside a loop over micro_batches)"),
    ("step_inside", r"opt.step\(\) inside a loop over micro_batches\(batch\) \(step 0 of epoch 0\).*step the "
                    r"optimizer after the loop"),
    ("break", r"after a loop over micro_batches\(batch\) in step 0 of epoch 0 stopped before this rank's last "
              r"micro-batch.*Let every loop over micro_batches\(batch\) run to its end"),
])
def test_misuse_names_the_fix(tmp_path, misuse, match):
    with pytest.raises(RuntimeError, match=match):
        _fit(DCPStrategy(planner=UnevenPlanner(1), shuffle=False, global_batch_size=6), str(tmp_path), "one",
             devices=1, misuse=misuse)


def test_a_world_collective_inside_a_loop_stops_every_rank(tmp_path):
    """Rank 0 calls all_reduce inside its critic loop; rank 1 reaches the loop's end: both raise the same error
    there (no hang until the collective time-out)."""
    with pytest.raises(Exception, match=r"torch.distributed.all_reduce on the world group inside training_step under "
                                        r"DCPStrategy \(rank 0, step 0 of epoch 0.*Every rank stopped at the end of "
                                        r"this step \(rank 0 made such a call\)"):
        run_distributed(_collective_fit, WORLD, str(tmp_path), timeout=300)


def _collective_fit(rank, world, out_dir):
    _fit(DCPStrategy(planner=UnevenPlanner(), shuffle=False, timeout=60), out_dir, "coll", misuse="collective")


def test_micro_batches_outside_dcp_yields_the_batch():
    batch = (torch.zeros(2, 6), torch.zeros(2, 4))
    assert list(micro_batches(batch)) == [batch]


def test_sharded_weights_are_refused_with_manual_optimization():
    trainer = SimpleNamespace(callbacks=[])
    manual = SimpleNamespace(automatic_optimization=False)
    check_fit(trainer, manual, "none")
    check_fit(trainer, manual, "zero1")
    check_fit(trainer, SimpleNamespace(automatic_optimization=True), "fsdp")
    with pytest.raises(ValueError, match=r"DCPStrategy\(sharding='fsdp'\) with manual optimization \(SimpleNamespace"
                                         r".automatic_optimization is False\).*Use a mode that keeps full weights with "
                                         r"manual optimization \('none', 'zero1'"):
        check_fit(trainer, manual, "fsdp")


def test_the_docs_example_runs(tmp_path):
    """docs/strategy.md's manual-optimization example, as written (2 processes, Lightning's popen launcher)."""
    import subprocess
    import sys

    from _docs import ROOT

    section = (ROOT / "docs" / "strategy.md").read_text().split("## Manual optimization", 1)[1]
    script = tmp_path / "gan.py"
    script.write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                                                            "LOCAL_RANK", "NODE_RANK")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
               OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("global_step 8") == 2, run.stdout  # 4 steps x 2 optimizers, on each rank
