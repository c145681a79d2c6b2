"""Train a Hugging Face causal LM with DCPStrategy: packed variable-length micro-batches, per-step
Ulysses SP groups, per-layer recompute -- the model's code unchanged.

CPU demo (default): a tiny random-config Llama with grouped-query attention (4 query heads,
2 key/value heads), no download, 2 CPU processes, a few steps (under 2 minutes on 2 cores)::

    python examples/hf_causal_lm.py

Real checkpoint on GPUs (bf16, all visible GPUs; a local path or a hub id)::

    python examples/hf_causal_lm.py --model Qwen/Qwen2.5-0.5B --steps 200 --global-batch 64 --max-len 8192

With ``--model`` the script loads ``AutoModelForCausalLM.from_pretrained(path, dtype=bfloat16)``,
uses ``precision="bf16-true"`` and ``devices=-1``; plug your own tokenized dataset in
``make_dataset`` (each sample a dict with ``input_ids`` and optionally ``labels``, -100 = no loss;
the dataset needs a ``lengths`` attribute: tokens per sample, without loading them).
"""

from __future__ import annotations

import argparse
import random

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_dcp.hf import CausalLMModule
from lightning_dcp import DCPStrategy, DefaultCostModel


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


class PrintSteps(pl.Callback):
    """Prints, on rank 0, each step's loss, SP sizes and micro-batches per rank."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        m = getattr(trainer.strategy, "last_step_metrics", None)
        if trainer.is_global_zero and m is not None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            print(f"step {trainer.global_step}: loss {float(loss):.4f}, SP sizes {m.sp_sizes}, "
                  f"micro-batches per rank {m.microbatches}, imbalance {m.imbalance:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local path or hub id of a causal LM (GPU path); default: tiny Llama on CPU")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--profile", action="store_true", help="measure the model at fit start (GPU runs)")
    args = parser.parse_args()

    if args.model is None:
        model = tiny_llama()
        trainer_kw = dict(accelerator="cpu", devices=2, precision="32-true")
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
        trainer_kw = dict(accelerator="gpu", devices=-1, precision="bf16-true")
    module = CausalLMModule(model, lr=args.lr)  # adapts the model in place (attention, recompute switch)
    config = model.config
    # Without --profile: the analytic fallback cost model. On the CPU demo its per-rank token budget is
    # tiny, so the long samples need SP 2 (and recomputation) -- the demo exercises Ulysses.
    budget = {"max_tokens": 32} if args.model is None else {}
    cost = None if args.profile else DefaultCostModel(num_layers=config.num_hidden_layers,
                                                      num_heads=config.num_attention_heads, **budget)
    strategy = DCPStrategy(global_batch_size=args.global_batch, loss_reduction="token", cost_model=cost,
                           profile=args.profile or None)
    dataset = make_dataset(16 * args.global_batch, args.max_len, config.vocab_size)
    trainer = pl.Trainer(strategy=strategy, max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=False, gradient_clip_val=1.0,
                         callbacks=[PrintSteps()], **trainer_kw)
    trainer.fit(module, DataLoader(dataset, batch_size=4, collate_fn=CausalLMModule.collate))


if __name__ == "__main__":
    main()
