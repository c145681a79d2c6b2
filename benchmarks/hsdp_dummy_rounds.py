"""What a dummy round of ``sharding="hsdp"`` costs: the collectives only, or the cheapest input through the model.

A rank without an item in a lockstep round must run the round's per-layer collectives
(:mod:`lightning_dcp.runtime.sharding.dummy`). Two ways, timed on two gloo CPU processes (one shard group
of 2, both ranks running the same dummy round together, so the time is the round's):

- ``collectives``: :meth:`HsdpShards.run_dummy` -- FSDP's hooks around a forward that computes nothing;
- ``input``: ``training_step`` on a packed micro-batch of ``--tokens`` tokens (default 8: the fewest an LM
  takes), the loss times 0, backward -- the cheapest input that triggers the same collectives.

Prints the median milliseconds per round over ``--rounds`` rounds (after 3 warm-up rounds) as one JSON
line. Run each variant as its own process to compare whole processes::

    python benchmarks/hsdp_dummy_rounds.py --variant collectives
    python benchmarks/hsdp_dummy_rounds.py --variant input --tokens 8
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: ``ModelSpec`` of the timed model: a 1d decoder of 8 layers, width 256 (about 6.8M parameters).
SPEC = ("bench-1d", "1d", 8, 256, 8, True, 1024)
VOCAB = 1024


def _run(rank: int, port: int, variant: str, tokens: int, rounds: int, out: str) -> None:
    import lightning.pytorch as pl
    import torch.nn.functional as F

    from lightning_dcp.data import SyntheticTokenDataset
    from lightning_dcp.models.transformer1d import Transformer1D
    from lightning_dcp.planning.models import ModelSpec
    from lightning_dcp.planning.sharding.registry import get_mode
    from lightning_dcp.runtime.sharding.hsdp import HsdpShards
    from lightning_dcp.runtime.sharding.protocol import Round
    from lightning_dcp.sp.packing import pack_samples

    torch.set_num_threads(1)
    from lightning_dcp.runtime.exit import import_group_defaults

    import_group_defaults()  # before the group exists: see lightning_dcp/runtime/exit.py
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = Transformer1D(ModelSpec(*SPEC, vocab_size=VOCAB))

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return F.cross_entropy(self.model(batch).float(), batch["labels"], ignore_index=-100)

    module = LM()
    shards = HsdpShards(module, get_mode("hsdp", 2, shard_group_size=2), torch.device("cpu"),
                        layers=list(module.model.layers))
    batch = pack_samples([SyntheticTokenDataset([tokens], vocab_size=VOCAB, seed=1)[0]])
    rnd = Round(None, last=False, lockstep=True)

    def one() -> None:
        shards.begin_round(rnd)
        if variant == "collectives":
            shards.run_dummy()
        else:
            (module.training_step(batch, 0) * 0.0).backward()

    for _ in range(3):
        one()
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"variant": variant, "tokens": tokens if variant == "input" else 0,
                                         "rounds": rounds, "median_ms": 1e3 * statistics.median(times),
                                         "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times)}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=("collectives", "input"), default="collectives")
    ap.add_argument("--tokens", type=int, default=8, help="input variant: tokens of the micro-batch (default 8)")
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/hsdp_dummy_rounds_{os.getpid()}.json"
    mp.start_processes(_run, args=(port, args.variant, args.tokens, args.rounds, out), nprocs=2, start_method="spawn")
    print(Path(out).read_text())
    os.unlink(out)


if __name__ == "__main__":
    main()
