"""Loss-curve parity: dcp, bucket and plain DDP train the same model on the same global batches, step for step.

For each model family -- T-1D (the package's :class:`~lightning_dcp.models.Transformer1D`, ``tiny-1d``),
a Hugging Face Llama (:class:`~lightning_dcp.hf.CausalLMModule` on a tiny random ``LlamaForCausalLM``),
Wan (:class:`~lightning_dcp.diffusers.VideoDiffusionModule` on a tiny random
``WanTransformer3DModel``) and CogVideoX (the same module on a tiny random ``CogVideoXTransformer3DModel``:
joint attention, each sample's prompt tokens are rows of its sequence and count in its length) -- three runs of ``--steps`` optimizer steps on 2 CPU processes (gloo), fp32:

* ``ddp``: Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` (the DDP wrapper), each rank
  its share of every global batch (sample ``j`` of the batch on rank ``j % 2``) in one packed batch;
* ``dcp``: ``DCPStrategy(policy="dcp")``;
* ``bucket``: the bucket policy's layout -- one SP size and one recompute count for the run, samples
  in length buckets, per-bucket micro-batch sizes (:class:`~lightning_dcp.planning.policies.bucket.BucketPolicy`)
  -- with all of a global batch's micro-batches accumulated into one optimizer step
  (:class:`BucketPerGlobalBatch`). ``DCPStrategy(policy="bucket")`` itself deals bucket micro-batches
  over the epoch, one per SP group per optimizer step (Open-Sora's sampler), so its optimizer steps are
  not the global batches and its curve could not be compared step by step.

What is the same in the three runs of a family: the initial weights (seeded), the data (the samples are a
pure function of their index; Wan's flow-matching noise and timestep of ``(seed, epoch, index)``), the
global batches in the same order (the DCP sampler's seeded permutation,
:meth:`~lightning_dcp.runtime.sampler.DCPBatchSampler.global_batches`, which the DDP run's batch sampler
reads too; the samples of every step are compared across runs), the optimizer (each module's AdamW), the
two processes with one thread each.

The objective is the global batch's token mean, what DCPStrategy trains (``loss_reduction="token"``):
next-token cross-entropy over every label that is not ``-100`` (T-1D, Llama; the Llama samples mask a
quarter of their tokens as a prompt), the flow-matching squared error over every video token (Wan, CogVideoX: text rows carry no loss).
Plain DDP *averages* the ranks' gradients, so each DDP rank's loss is the sum of its per-token losses
divided by the global batch's token count (an all-reduce of the ranks' counts), times the world size
(:class:`GlobalBatchMean`); the DDP loss recorded is the all-reduced global mean. The DCP loss recorded
is ``outputs["loss"]`` in ``on_train_batch_end``: the step's global mean, the same on every rank.

dcp and bucket plan with :class:`~lightning_dcp.planning.default_cost.DefaultCostModel` and a memory budget
of ``--max-tokens`` tokens per rank without recomputation (no profiling): the longer samples need an SP
group of 2 and recomputed layers, as under ``lightning-dcp train``'s small CPU memory limit. The report
counts the micro-batches that ran at SP 2 and with recompute in each run.

The two worker processes are started once (gloo process group, as ``torchrun`` would) and run every fit
in turn; Lightning finds the launched processes through ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``.

Outputs: ``<out>/<family>.csv`` and ``<out>/<family>.json`` (per-step losses, differences, plan counts),
``<out>/summary.json`` and ``<out>/summary.md`` (largest per-step differences, absolute and relative, of
every pair), and the plot (default ``docs/loss_parity.png``)::

    python benchmarks/loss_parity.py                          # 200 steps, four families
    python benchmarks/loss_parity.py --families cogvideox      # one family
    python benchmarks/loss_parity.py --quick --families t1d   # 3 steps, a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import math
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

if __package__ in (None, ""):  # `python benchmarks/loss_parity.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("t1d", "llama", "wan", "cogvideox")
RUNS = ("ddp", "dcp", "bucket")
PAIRS = (("dcp", "ddp"), ("bucket", "ddp"), ("dcp", "bucket"))
TITLES = {"t1d": "T-1D (tiny-1d, lightning_dcp.models)", "llama": "HF Llama (CausalLMModule)",
          "wan": "Wan (VideoDiffusionModule)", "cogvideox": "CogVideoX, joint attention (VideoDiffusionModule)"}
NUM_LAYERS = 4
NUM_HEADS = 4
WORLD_SIZE = 2
#: The Llama samples' prompt: this fraction of each sample's first tokens carries no loss (label -100).
PROMPT_FRACTION = 0.25
#: Wan: latent channels, patch, text embedding width and tokens; latent (frames, height, width) choices.
VIDEO_CHANNELS, VIDEO_PATCH, TEXT_DIM, TEXT_LEN = 4, (1, 2, 2), 32, 16
VIDEO_FRAMES = (1, 1, 2, 3, 5)
VIDEO_SIZES = ((4, 4), (4, 8), (8, 4), (6, 6), (8, 8), (8, 12), (12, 8), (12, 12))
OBJECTIVE = ("the global batch's token mean (DCPStrategy's loss_reduction='token'); plain DDP averages the ranks' "
             "gradients, so each DDP rank's loss is the sum of its per-token losses / the global batch's loss tokens "
             "x the world size, and the DDP loss recorded is the all-reduced global mean")
BUCKET_NOTE = ("the bucket policy's micro-batches (one SP size and recompute count, length buckets) accumulated into "
               "one optimizer step per global batch (DCPStrategy(policy='bucket') would deal them over several steps)")


# ---------------------------------------------------------------------------------------------
# data: samples are pure functions of (seed, index)
# ---------------------------------------------------------------------------------------------

class TokenSamples(Dataset):
    """Token samples of :class:`~lightning_dcp.data.SyntheticTokenDataset` (a learnable arithmetic
    pattern) with their dataset index under ``"sample_index"``.

    ``causal=False`` (T-1D): ``input_ids`` and ``labels`` (the next token at every position).
    ``causal=True`` (Llama; :class:`~lightning_dcp.hf.CausalLMModule` shifts labels itself):
    ``input_ids`` and ``labels = input_ids`` with the first :data:`PROMPT_FRACTION` masked (-100).
    """

    def __init__(self, lengths: Sequence[int], vocab_size: int, seed: int, causal: bool) -> None:
        from lightning_dcp.data import SyntheticTokenDataset

        self.base = SyntheticTokenDataset(lengths, vocab_size=vocab_size, seed=seed)
        self.lengths = self.base.lengths
        self.causal = causal

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = self.base[i]
        if not self.causal:
            return {**s, "sample_index": int(i)}
        labels = s["input_ids"].clone()
        labels[: int(len(labels) * PROMPT_FRACTION)] = -100
        return {"input_ids": s["input_ids"], "labels": labels, "sample_index": int(i)}


class SmoothVideos(Dataset):
    """Latent videos of mixed sizes (1-5 latent frames, 8 resolutions) whose content a model can learn:
    a few low-frequency waves over (frame, row, column) per channel, with random phases, plus random
    "text" embeddings; :func:`~lightning_dcp.diffusers.video_sample` with ``index=i`` (the flow-matching
    noise is keyed on it). ``lengths``: video tokens after the (1, 2, 2) patch."""

    def __init__(self, n: int, seed: int, joint: bool = False) -> None:
        rng = random.Random(seed)
        self.shapes = [(rng.choice(VIDEO_FRAMES), *rng.choice(VIDEO_SIZES)) for _ in range(n)]
        self.lengths = [math.prod(d // p for d, p in zip(s, VIDEO_PATCH)) for s in self.shapes]
        self.seed, self.joint = seed, joint
        # joint attention (CogVideoX): the prompt's tokens are rows of the sample, so lengths count them too
        self.text_lens = [1 + rng.randrange(TEXT_LEN) for _ in range(n)] if joint else None
        if joint:
            self.lengths = [n_video + n_text for n_video, n_text in zip(self.lengths, self.text_lens)]

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int) -> dict[str, Any]:
        from lightning_dcp.diffusers import video_sample

        f, h, w = self.shapes[i]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        grid = torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij")
        freq = torch.rand(VIDEO_CHANNELS, 3, 3, generator=g) * 0.8  # channel x wave x axis
        phase = torch.rand(VIDEO_CHANNELS, 3, generator=g) * 2 * math.pi
        arg = sum(freq[..., a, None, None, None] * grid[a] for a in range(3)) + phase[..., None, None, None]
        latent = torch.sin(arg).sum(1) / math.sqrt(1.5)  # [C, F, H, W], unit variance
        if self.joint:
            from lightning_dcp.diffusers import cogvideox_sample

            return cogvideox_sample(latent, torch.randn(self.text_lens[i], TEXT_DIM, generator=g), VIDEO_PATCH, index=i)
        text = torch.randn(1 + int(torch.randint(TEXT_LEN, (1,), generator=g)), TEXT_DIM, generator=g)
        return video_sample(latent, text, VIDEO_PATCH, text_len=TEXT_LEN, index=i)


def make_dataset(family: str, num_samples: int, seed: int) -> Dataset:
    """The family's dataset of ``num_samples`` samples: T-1D 8-192 tokens (skewed log-uniform,
    :func:`~lightning_dcp.data.tiny_lengths`), Llama 12-192 tokens (Pareto-tailed documents, as in
    ``examples/hf_causal_lm.py``), Wan videos of 4-180 tokens."""
    from lightning_dcp.data import tiny_lengths

    if family in ("wan", "cogvideox"):
        return SmoothVideos(num_samples, seed, joint=family == "cogvideox")
    if family == "t1d":
        return TokenSamples(tiny_lengths(num_samples, seed, min_len=8, max_len=192), 256, seed, causal=False)
    rng = random.Random(seed)
    lengths = [min(192, int(rng.paretovariate(1.2) * 12)) for _ in range(num_samples)]
    return TokenSamples(lengths, 128, seed, causal=True)


# ---------------------------------------------------------------------------------------------
# models: the shipped modules; DDP variants train the global batch's token mean
# ---------------------------------------------------------------------------------------------

class GlobalBatchMean:
    """LightningModule mixin for plain DDP: train the global batch's token-mean loss, not this rank's mean.

    DDP averages the ranks' gradients. This rank's loss is therefore ``(sum of its per-token losses) /
    (loss tokens of the whole global batch) * world size``: averaged over the ranks, the gradient is that
    of the global batch's token mean, DCPStrategy's objective. The global count is an all-reduce of the
    ranks' counts. The per-token losses are the module's own ``training_step`` given ``TOKEN_WEIGHT``
    (1 on every loss token, :func:`~lightning_dcp.sp.tokens.add_token_weights`), which then returns
    their sum (:func:`~lightning_dcp.sp.tokens.weighted_loss`).
    """

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        from lightning_dcp.sp.tokens import add_token_weights

        prepare = getattr(self, "dcp_prepare_batch", None)  # Llama: shifted labels; Wan: noise, timestep, target
        batch = prepare(batch) if prepare is not None else dict(batch)
        local_units = add_token_weights(batch, "token")
        local_sum = super().training_step(batch, batch_idx)  # type: ignore[misc]
        units = torch.tensor(float(local_units), dtype=torch.float64)
        dist.all_reduce(units)
        return local_sum * (self.trainer.world_size / float(units))  # type: ignore[attr-defined]


def ddp_variant(base: type, ddp: bool) -> type:
    """``base``, or for the DDP run ``base`` with :class:`GlobalBatchMean` mixed in."""
    if not ddp:
        return base
    return type(f"DDP{base.__name__}", (GlobalBatchMean, base),
                {"__module__": __name__,
                 "__doc__": f"{base.__name__} training the global batch's token mean under plain DDP."})


def make_module(family: str, ddp: bool, seed: int, lr: float) -> Any:
    """The family's LightningModule with seeded initial weights (the same for every run of the family)."""
    torch.manual_seed(seed)
    if family == "t1d":
        from lightning_dcp.models.module import DCPTransformerModule

        return ddp_variant(DCPTransformerModule, ddp)("tiny-1d", lr=lr)
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        from lightning_dcp.hf import CausalLMModule

        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
                             num_attention_heads=NUM_HEADS, num_key_value_heads=2, max_position_embeddings=256)
        return ddp_variant(CausalLMModule, ddp)(LlamaForCausalLM(config), lr=lr)
    if family == "wan":
        from diffusers import WanTransformer3DModel

        from lightning_dcp.diffusers import VideoDiffusionModule

        model = WanTransformer3DModel(patch_size=VIDEO_PATCH, num_attention_heads=NUM_HEADS, attention_head_dim=16,
                                      in_channels=VIDEO_CHANNELS, out_channels=VIDEO_CHANNELS, text_dim=TEXT_DIM,
                                      freq_dim=32, ffn_dim=128, num_layers=NUM_LAYERS, rope_max_seq_len=64)
        return ddp_variant(VideoDiffusionModule, ddp)(model, lr=lr, seed=seed)
    if family == "cogvideox":
        from diffusers import CogVideoXTransformer3DModel

        from lightning_dcp.diffusers import VideoDiffusionModule

        model = CogVideoXTransformer3DModel(num_attention_heads=NUM_HEADS, attention_head_dim=16, in_channels=VIDEO_CHANNELS,
                                            out_channels=VIDEO_CHANNELS, time_embed_dim=32, text_embed_dim=TEXT_DIM,
                                            num_layers=NUM_LAYERS, sample_width=24, sample_height=24, sample_frames=17,
                                            patch_size=VIDEO_PATCH[1], max_text_seq_length=TEXT_LEN,
                                            use_rotary_positional_embeddings=True)
        return ddp_variant(VideoDiffusionModule, ddp)(model, lr=lr, seed=seed)
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def collate_fn(family: str) -> Any:
    """The plain DataLoader's ``collate_fn`` (one packed batch per rank and step)."""
    if family == "llama":
        from lightning_dcp.hf import CausalLMModule

        return CausalLMModule.collate
    from lightning_dcp.sp.packing import pack_samples

    return pack_samples


# ---------------------------------------------------------------------------------------------
# the same global batches for DDP; bucket with one optimizer step per global batch
# ---------------------------------------------------------------------------------------------

class RankShareSampler:
    """Batch sampler for plain DDP: per step, this rank's share of DCPStrategy's global batch.

    The global batches are :meth:`DCPBatchSampler.global_batches` with the strategy's seed, batch size,
    shuffling and ``drop_last`` (the same seeded permutation per epoch); rank ``r`` takes the batch's
    samples ``r, r + W, r + 2W, ...``. The rank is read from the process group when iterating.
    """

    def __init__(self, lengths: Sequence[int], global_batch_size: int, seed: int, world_size: int) -> None:
        from lightning_dcp.runtime.sampler import DCPBatchSampler

        if global_batch_size < world_size:
            raise ValueError(f"global_batch_size {global_batch_size} < world size {world_size}: every DDP rank needs "
                             "a sample per step")
        self.batches = DCPBatchSampler(lengths, planner=None, global_batch_size=global_batch_size, seed=seed)
        self.world_size = world_size
        self.epoch = 0
        self.sampler = self  # Lightning calls set_epoch on batch_sampler.sampler

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.batches.global_batches(self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        for batch in self.batches.global_batches(self.epoch):
            yield batch[rank::self.world_size]


class BucketPerGlobalBatch:
    """The bucket policy's layout with one optimizer step per global batch.

    :class:`~lightning_dcp.planning.policies.bucket.BucketPolicy` splits a set of samples into bucket
    micro-batches (one SP size and recompute count for the run, per-bucket micro-batch sizes) and deals
    them one per SP group per optimizer step. This planner keeps its micro-batches and puts all of a
    global batch's into one step (gradient accumulation), so the step trains on that global batch.
    """

    one_step_per_batch = True

    def __init__(self, planner: Any) -> None:
        if planner.policy_name != "bucket":
            raise ValueError(f"BucketPerGlobalBatch wraps a bucket planner, got policy {planner.policy_name!r}")
        self.planner = planner

    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> Any:
        from lightning_dcp.planning.plan import StepPlan

        steps = self.planner.plan_batch(samples, lengths, step).steps
        return [StepPlan(tuple(it for s in steps for it in s.items), steps[0].notes)]


def cost_model(max_tokens: int) -> Any:
    """The planner's memory budget: ``max_tokens`` tokens per rank hold all layers' activations."""
    from lightning_dcp import DefaultCostModel

    return DefaultCostModel(num_layers=NUM_LAYERS, num_heads=NUM_HEADS, max_tokens=max_tokens)


# ---------------------------------------------------------------------------------------------
# one fit (inside the launched worker processes)
# ---------------------------------------------------------------------------------------------

class LossRecorder(pl.Callback):
    """Each step's loss and samples; rank 0 writes them, with the step plans, to ``path`` at the end.

    The loss is ``outputs["loss"]`` in ``on_train_batch_end``: under DCPStrategy the step's global mean
    (every rank the same); under DDP this rank's share of it (:class:`GlobalBatchMean`), so the ranks'
    mean -- an all-reduce -- is the global mean.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.losses: list[float] = []
        self.samples: list[list[int]] = []
        self.plans: list[list[list[int]]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        from lightning_dcp.step_loss import step_loss

        loss = step_loss(outputs)
        plan = getattr(trainer.strategy, "last_step_plan", None)
        if plan is not None:  # DCPStrategy: the global mean already; the plan that ran names its samples
            samples = sorted(int(s) for it in plan["items"] for s in it["samples"])
        else:
            loss = trainer.strategy.reduce(loss, reduce_op="mean")
            parts: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(parts, [int(s) for s in batch["sample_index"]])
            samples, plan = sorted(s for p in parts for s in p), None
        if trainer.is_global_zero:
            self.losses.append(float(loss))
            self.samples.append(samples)
            if plan is not None:
                self.plans.append([[len(it["ranks"]), int(it["recompute"]), len(it["samples"])]
                                   for it in plan["items"]])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps({"loss": self.losses, "samples": self.samples, "plans": self.plans}))


def fit_one(family: str, run: str, cfg: Mapping[str, Any], path: str) -> None:
    """Train ``family`` under ``run`` (``ddp``, ``dcp`` or ``bucket``) for ``cfg["steps"]`` steps; rank 0
    writes the losses, samples and plans to ``path``."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    from lightning_dcp import DCPStrategy
    from lightning_dcp.planning.planner import Planner

    steps, gbs, seed = cfg["steps"], cfg["global_batch_size"], cfg["seed"]
    dataset = make_dataset(family, steps * gbs, seed)  # one epoch of exactly `steps` global batches
    module = make_module(family, run == "ddp", seed, cfg["lr"])
    collate = collate_fn(family)
    trainer_kw: dict[str, Any] = {}
    if run == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="gloo")
        loader = DataLoader(dataset, batch_sampler=RankShareSampler(dataset.lengths, gbs, seed, WORLD_SIZE),
                            collate_fn=collate)
        trainer_kw["use_distributed_sampler"] = False
    else:
        cm = cost_model(cfg["max_tokens"])
        kw: dict[str, Any] = {"policy": "dcp"}
        if run == "bucket":
            kw = {"planner": BucketPerGlobalBatch(Planner(WORLD_SIZE, cm, "bucket", seed=seed,
                                                          dataset_lengths=dataset.lengths, max_sp_size=WORLD_SIZE))}
        strategy = DCPStrategy(global_batch_size=gbs, seed=seed, loss_reduction="token", cost_model=cm, profile=False,
                               log_metrics=False, **kw)
        loader = DataLoader(dataset, batch_size=gbs // WORLD_SIZE, collate_fn=collate)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, precision="32-true", max_steps=steps,
                         callbacks=[LossRecorder(path)], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, **trainer_kw)
    trainer.fit(module, loader)


def _worker(rank: int, port: int, jobs: Sequence[tuple[str, str, str]], cfg: Mapping[str, Any]) -> None:
    import logging
    import warnings

    faulthandler.enable()
    torch.set_num_threads(cfg["threads"])
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*The number of training batches.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE))
    from lightning_dcp.runtime.exit import import_group_defaults

    import_group_defaults()  # before the group exists: see lightning_dcp/runtime/exit.py
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=600))
    try:
        for family, run, path in jobs:
            t0 = time.perf_counter()
            fit_one(family, run, cfg, path)
            dist.barrier()
            if rank == 0:
                data = json.loads(Path(path).read_text())
                data["fit_s"] = time.perf_counter() - t0
                Path(path).write_text(json.dumps(data))
                print(f"[loss_parity] {family} {run}: {len(data['loss'])} steps in {data['fit_s']:.0f} s, last loss "
                      f"{data['loss'][-1]:.5f}", flush=True)
    finally:
        dist.destroy_process_group()


def run_all(families: Sequence[str], cfg: Mapping[str, Any], raw_dir: Path, timeout_s: float) -> None:
    """Start the 2 gloo worker processes once; they run every (family, run) fit in turn."""
    import torch.multiprocessing as mp

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    jobs = [(f, r, str(raw_dir / f"{f}-{r}.json")) for f in families for r in RUNS]
    ctx = mp.start_processes(_worker, args=(port, jobs, dict(cfg)), nprocs=WORLD_SIZE, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fits did not finish within {timeout_s:.0f} s (--timeout)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


# ---------------------------------------------------------------------------------------------
# analysis (pure) and reports
# ---------------------------------------------------------------------------------------------

def differences(curves: Mapping[str, Sequence[float]]) -> dict[str, dict[str, float]]:
    """Per pair ``"a vs b"``: the largest per-step ``|a - b|`` (``max_abs``), the largest
    ``|a - b| / |b|`` (``max_rel``) and the step of the largest absolute difference."""
    out = {}
    for a, b in PAIRS:
        xs, ys = curves[a], curves[b]
        if len(xs) != len(ys):
            raise ValueError(f"{a} has {len(xs)} steps but {b} has {len(ys)}")
        diff = [abs(x - y) for x, y in zip(xs, ys)]
        rel = [d / abs(y) if y else (0.0 if d == 0 else math.inf) for d, y in zip(diff, ys)]
        worst = max(range(len(diff)), key=diff.__getitem__)
        out[f"{a} vs {b}"] = {"max_abs": max(diff), "max_rel": max(rel), "step": worst}
    return out


def plan_counts(plans: Sequence[Sequence[Sequence[int]]]) -> dict[str, int]:
    """Micro-batches of a DCP run's plans (``[sp, recompute, samples]`` per item): in all, at SP 2, with recompute."""
    items = [it for p in plans for it in p]
    return {"steps": len(plans), "items": len(items), "items_sp2": sum(1 for it in items if it[0] == 2),
            "items_recompute": sum(1 for it in items if it[1] > 0),
            "steps_with_sp2": sum(1 for p in plans if any(it[0] == 2 for it in p)),
            "max_recompute": max((it[1] for it in items), default=0)}


def family_report(family: str, raw: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Curves, differences and plan counts of one family's three runs; checks that every run trained
    on the same samples in every step."""
    ref = raw["ddp"]["samples"]
    for run in RUNS:
        got = raw[run]["samples"]
        bad = [k for k, (a, b) in enumerate(zip(got, ref)) if a != b]
        if len(got) != len(ref) or bad:
            raise RuntimeError(f"{family}: the {run} run trained on other samples than ddp ({len(got)} vs {len(ref)} "
                               f"steps; first differing step {bad[:1]}): the global batches must be the same")
    curves = {run: list(raw[run]["loss"]) for run in RUNS}
    return {"family": family, "title": TITLES[family], "steps": len(ref), "samples_per_step": len(ref[0]),
            "curves": curves, "differences": differences(curves),
            "plans": {run: plan_counts(raw[run]["plans"]) for run in ("dcp", "bucket")},
            "fit_s": {run: raw[run].get("fit_s") for run in RUNS}}


def write_family(rep: Mapping[str, Any], out: Path) -> None:
    import csv

    c = rep["curves"]
    with open(out / f"{rep['family']}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *RUNS, "dcp-ddp", "bucket-ddp"])
        for k in range(rep["steps"]):
            w.writerow([k, *(repr(c[r][k]) for r in RUNS), repr(c["dcp"][k] - c["ddp"][k]),
                        repr(c["bucket"][k] - c["ddp"][k])])
    (out / f"{rep['family']}.json").write_text(json.dumps(rep, indent=1))


def summary_markdown(reports: Sequence[Mapping[str, Any]], info: Mapping[str, Any], command: str,
                     cfg: Mapping[str, Any]) -> str:
    lines = ["# Loss-curve parity: dcp, bucket and plain DDP", "",
             f"- date: {info['date']}",
             f"- machine: {info['platform']}, {info['cpu_count']} CPUs, torch {info['torch']}, "
             f"lightning {info['lightning']} (2 gloo processes, {cfg['threads']} thread each, fp32)",
             f"- command: `{command}`",
             f"- {cfg['steps']} steps, {cfg['global_batch_size']} samples per global batch, seed {cfg['seed']}, AdamW "
             f"lr {cfg['lr']}; dcp and bucket plan with DefaultCostModel(max_tokens={cfg['max_tokens']})",
             f"- objective: {OBJECTIVE}", f"- bucket: {BUCKET_NOTE}", "",
             "Largest per-step difference of the step's global-mean loss (absolute / relative to the second run):", "",
             "| family | " + " | ".join(f"{a} vs {b}" for a, b in PAIRS) + " | first loss | last loss (ddp) |"
             " dcp: SP-2 / recompute / all micro-batches | bucket: SP-2 / recompute / all | fit s (ddp, dcp, bucket) |",
             "|---|" + "---|" * (len(PAIRS) + 5)]
    for rep in reports:
        d, p, c = rep["differences"], rep["plans"], rep["curves"]
        cells = [f"{d[f'{a} vs {b}']['max_abs']:.2e} / {d[f'{a} vs {b}']['max_rel']:.2e}" for a, b in PAIRS]
        plans = [f"{p[r]['items_sp2']} / {p[r]['items_recompute']} / {p[r]['items']}" for r in ("dcp", "bucket")]
        fits = ", ".join(f"{rep['fit_s'][r]:.0f}" if rep["fit_s"][r] is not None else "?" for r in RUNS)
        lines.append(f"| {rep['title']} | " + " | ".join(cells) + f" | {c['ddp'][0]:.4f} | {c['ddp'][-1]:.4f} | "
                     + " | ".join(plans) + f" | {fits} |")
    lines += ["", "Fit times are wall seconds on a shared machine (noisy), not a speed comparison.", ""]
    return "\n".join(lines)


def plot(reports: Sequence[Mapping[str, Any]], path: Path, subtitle: str) -> Path:
    """One column per family: the three loss curves on one axis (top); below, per step, |loss - DDP loss| of dcp
    and bucket where it is not 0, against the float32 spacing at the loss value (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    styles = {"ddp": dict(color="0.55", lw=4.0, ls="-", label="plain DDP"),
              "dcp": dict(color="tab:blue", lw=1.6, ls=(0, (5, 3)), label="DCPStrategy dcp"),
              "bucket": dict(color="tab:red", lw=1.6, ls=(0, (1, 2)), label="DCPStrategy bucket")}
    fig, axes = plt.subplots(2, len(reports), figsize=(5.2 * len(reports), 6.4), squeeze=False,
                             gridspec_kw={"height_ratios": [2.2, 1]})
    for col, rep in enumerate(reports):
        c, d = rep["curves"], rep["differences"]
        steps = list(range(1, rep["steps"] + 1))
        top, bottom = axes[0][col], axes[1][col]
        for run in RUNS:
            top.plot(steps, c[run], **styles[run])
        worst = max(d[f"{a} vs {b}"]["max_abs"] for a, b in PAIRS)
        rel = max(d[f"{a} vs {b}"]["max_rel"] for a, b in PAIRS)
        top.set_title(f"{rep['title']}\nmax per-step |Δ| {worst:.1e} (rel. {rel:.1e})", fontsize=10)
        top.set_ylabel("global-batch mean loss" if col == 0 else "")
        top.grid(alpha=0.3)
        ulp = [float(np.spacing(np.float32(y))) for y in c["ddp"]]
        bottom.semilogy(steps, ulp, color="0.4", lw=1.0, ls="--", label="float32 spacing at the loss")
        for run, color, marker in (("dcp", "tab:blue", "o"), ("bucket", "tab:red", "x")):
            gap = [abs(x - y) for x, y in zip(c[run], c["ddp"])]
            bottom.semilogy([s for s, g in zip(steps, gap) if g > 0], [g for g in gap if g > 0], marker, color=color,
                            ms=3, alpha=0.8, label=f"|{run} - DDP| (0 at {sum(1 for g in gap if g == 0)} steps)")
        bottom.set_ylim(1e-9, 1e-3)
        bottom.legend(loc="upper left", fontsize=7.5, ncol=1)
        bottom.set_xlabel("optimizer step")
        bottom.set_ylabel("|loss - DDP loss|" if col == 0 else "")
        bottom.grid(alpha=0.3, which="both")
        if col == 0:
            top.legend(loc="upper right", fontsize=9)
    fig.suptitle(f"Loss curves: DCPStrategy (dcp, bucket) overlay plain DDP on the same global batches ({subtitle})",
                 fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    p.add_argument("--quick", action="store_true", help="3 steps (a smoke run); the plot goes under --out")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    p.add_argument("--global-batch-size", type=int, default=8, help="samples per optimizer step (default 8)")
    p.add_argument("--seed", type=int, default=0, help="weights, data, data order and noise seed (default 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--max-tokens", type=int, default=20,
                   help="planner memory budget: tokens per rank without recompute (default 20; the longest samples, "
                        "up to 192 tokens, then need SP 2 and recomputed layers)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the fits are stopped (default 3600)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "loss_parity"), help="results directory")
    p.add_argument("--plot", default=None, help="plot path (default docs/loss_parity.png; <out>/loss_parity.png "
                                                "with --quick)")
    args = p.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    bad = [f for f in args.families if f not in FAMILIES]
    if bad or not args.families:
        p.error(f"unknown families {bad}; known: {', '.join(FAMILIES)}")
    if args.quick:
        args.steps = 3
    if args.steps < 1 or args.global_batch_size < WORLD_SIZE:
        p.error(f"need --steps >= 1 and --global-batch-size >= {WORLD_SIZE}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.run import machine_info

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    default_plot = out / "loss_parity.png" if args.quick else ROOT / "docs" / "loss_parity.png"
    plot_path = Path(args.plot) if args.plot else default_plot
    cfg = {"steps": args.steps, "global_batch_size": args.global_batch_size, "seed": args.seed, "lr": args.lr,
           "max_tokens": args.max_tokens, "threads": args.threads}
    command = " ".join(["python benchmarks/loss_parity.py", *(sys.argv[1:] if argv is None else argv)])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="loss_parity_") as tmp:
        run_all(args.families, cfg, Path(tmp), args.timeout)
        raw = {f: {r: json.loads((Path(tmp) / f"{f}-{r}.json").read_text()) for r in RUNS} for f in args.families}
    reports = [family_report(f, raw[f]) for f in args.families]
    info = machine_info()
    print(f"[loss_parity] objective: {OBJECTIVE}\n[loss_parity] bucket: {BUCKET_NOTE}", flush=True)
    for rep in reports:
        write_family(rep, out)
        for pair, d in rep["differences"].items():
            print(f"[loss_parity] {rep['family']}: {pair}: largest per-step difference {d['max_abs']:.3e} "
                  f"(relative {d['max_rel']:.3e}, step {d['step']})", flush=True)
        for run in ("dcp", "bucket"):
            p = rep["plans"][run]
            print(f"[loss_parity] {rep['family']}: {run} ran {p['items']} micro-batches, {p['items_sp2']} at SP 2 "
                  f"({p['steps_with_sp2']} of {p['steps']} steps), {p['items_recompute']} with recompute "
                  f"(up to {p['max_recompute']} layers)", flush=True)
    summary = {"machine": info, "command": command, "config": cfg, "wall_s": time.perf_counter() - t0,
               "objective": OBJECTIVE, "bucket": BUCKET_NOTE,
               "families": {rep["family"]: {"differences": rep["differences"], "plans": rep["plans"],
                                            "fit_s": rep["fit_s"]} for rep in reports}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(summary_markdown(reports, info, command, cfg))
    plot(reports, plot_path, f"{args.steps} steps, 2 CPU processes, fp32, {info['date'][:10]}")
    print(f"[loss_parity] wrote {out}/summary.md, summary.json, <family>.csv/.json and {plot_path} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
