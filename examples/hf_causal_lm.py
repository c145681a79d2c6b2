"""Train a Hugging Face causal LM with DCPStrategy: packed variable-length micro-batches, per-step
Ulysses SP groups, per-layer recompute -- the model's code unchanged.

CPU demo (default): a tiny random-config Llama with grouped-query attention (4 query heads,
2 key/value heads), no download, 2 CPU processes, a few steps (about 30 s on 2 cores)::

    python examples/hf_causal_lm.py

At fit start ``DCPProfiler`` measures the model's decoder layers on the 2 processes (a few seconds;
cached under ``--cache-dir``) with a per-process memory budget of ``--memory-limit-mib`` (default on
CPU: 4 MiB, a little above the model's weights, gradients and AdamW state), so that the longest
samples need an SP group of 2 and recomputed layers, as on a GPU at real sizes. Each step then
prints its plan as ``lightning-dcp train`` does (SP sizes, micro-batches per rank, recompute; see
``lightning-dcp train --help``), and the run ends with the imbalance ratio.

Real checkpoint on GPUs (fp32 weights, bf16-mixed, all visible GPUs; a local path or a hub id)::

    python examples/hf_causal_lm.py --model Qwen/Qwen2.5-0.5B --steps 200 --global-batch 64 --max-len 8192

With ``--model`` the script loads ``AutoModelForCausalLM.from_pretrained(path, dtype=float32)``,
uses ``precision="bf16-mixed"`` (fp32 weights: with bf16 weights most AdamW updates at lr 1e-5 round to
no change), ``devices=-1`` and the GPUs' own memory; plug your own tokenized dataset in
``make_dataset`` (each sample a dict with ``input_ids`` and optionally ``labels``, -100 = no loss;
the dataset needs a ``lengths`` attribute: tokens per sample, without loading them).
"""

from __future__ import annotations

import argparse
import random
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_dcp import DCPStrategy
from lightning_dcp.commands.console import PlanPrinter, training_summary
from lightning_dcp.hf import CausalLMModule
from lightning_dcp.profiling import DCPProfiler

#: Per-process memory budget of the CPU demo: the tiny Llama's static memory (weights, gradients,
#: AdamW state) is 2.8 MiB, so under the measured profile SP 1 holds at most 177 tokens even with
#: every layer recomputed: 256-token samples need SP 2 (and recompute all 4 layers there).
CPU_MEMORY_LIMIT_MIB = 4.0


class TokenDataset(Dataset):
    """Random token samples of varied lengths; ``lengths`` tells DCP the sizes without loading."""

    def __init__(self, lengths: list[int], vocab_size: int, seed: int = 0) -> None:
        self.lengths, self.vocab_size, self.seed = list(lengths), vocab_size, seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(0, self.vocab_size, (self.lengths[i],), generator=g)
        labels = ids.clone()
        labels[: self.lengths[i] // 4] = -100  # e.g. a prompt without loss
        return {"input_ids": ids, "labels": labels}


def make_dataset(n: int, max_len: int, vocab_size: int, seed: int = 0) -> TokenDataset:
    """Long-tailed lengths: many short samples, a few long ones (replace with your tokenized data)."""
    rng = random.Random(seed)
    lengths = [max(4, min(max_len, int(rng.paretovariate(1.2) * max_len / 16))) for _ in range(n)]
    return TokenDataset(lengths, vocab_size, seed)


def tiny_llama() -> torch.nn.Module:
    """A random-config Llama small enough for CPU: 4 layers, 4 query heads, 2 key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local path or hub id of a causal LM (GPU path); default: tiny Llama on CPU")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--memory-limit-mib", type=float, default=None,
                        help=f"per-process memory the planner may use (default: the GPU's; on CPU {CPU_MEMORY_LIMIT_MIB:g} "
                             "MiB, so that long samples need SP 2 or recompute)")
    parser.add_argument("--cache-dir", default=None, help="profile cache (default ~/.cache/lightning-dcp/profiles)")
    args = parser.parse_args()
    # CausalLMModule has a validation_step; this demo trains without validation on purpose
    warnings.filterwarnings("ignore", message=".*`validation_step` but have no `val_dataloader`")

    if args.model is None:
        model = tiny_llama()
        trainer_kw = dict(accelerator="cpu", devices=2, precision="32-true")
        torch.set_num_threads(1)  # 2 processes on a small machine
    else:
        from transformers import AutoModelForCausalLM

        # fp32 weights (transformers' default dtype "auto" would load a bf16 checkpoint as bf16), bf16 matmuls:
        # with bf16 weights most AdamW updates at small learning rates round to no change
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        trainer_kw = dict(accelerator="gpu", devices=-1, precision="bf16-mixed")
    module = CausalLMModule(model, lr=args.lr)  # adapts the model in place (attention, recompute switch)
    limit_mib = args.memory_limit_mib if args.memory_limit_mib is not None else (
        CPU_MEMORY_LIMIT_MIB if args.model is None else None)
    # Measures the decoder layers at fit start (SP 1 and 2, several lengths) and hands the strategy a cost
    # model; the planner then keeps every micro-batch within the memory budget.
    profiler = DCPProfiler(memory_limit_bytes=None if limit_mib is None else limit_mib * 2**20, density="coarse",
                           cache_dir=args.cache_dir)
    # The step size is global_batch_size samples over all ranks; the DataLoader's batch_size below does not set it.
    strategy = DCPStrategy(global_batch_size=args.global_batch, loss_reduction="token")
    dataset = make_dataset(16 * args.global_batch, args.max_len, model.config.vocab_size)
    trainer = pl.Trainer(strategy=strategy, max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=False, gradient_clip_val=1.0,
                         callbacks=[profiler, PlanPrinter()], **trainer_kw)
    trainer.fit(module, DataLoader(dataset, batch_size=4, collate_fn=CausalLMModule.collate))
    if trainer.is_global_zero:
        print(training_summary(trainer))


if __name__ == "__main__":
    main()
