"""Fit-start checks on 2 popen processes (tests/test_preflight.py): ``python tests/_fit_start_runs.py SCENARIO OUT``.

``small_dataset``: 6 samples, ``global_batch_size=32``, profiling on (the default): every rank stops at strategy
setup, before the profiler measures anything, and the error prints once.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _dcp_helpers import TinyLM, make_dataset, make_trainer  # noqa: E402
from lightning_dcp import DCPProfiler, DCPStrategy  # noqa: E402


class SixSamplesLM(TinyLM):
    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(make_dataset(n=6), batch_size=4)


def _small_dataset(out: str) -> None:
    profiler = DCPProfiler(cache_dir=os.path.join(out, "profiles"), time_budget_s=5.0)
    make_trainer(2, DCPStrategy(global_batch_size=32, start_method="popen"), [profiler], max_steps=2).fit(SixSamplesLM())


SCENARIOS = {"small_dataset": _small_dataset}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](sys.argv[2])
