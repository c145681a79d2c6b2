"""A destroyed default group is freed before the interpreter exits (``lightning_dcp/runtime/exit.py``).

A gloo group that lives into interpreter finalization can abort a finished process (a worker thread
dropping a collective's tensors takes the GIL during finalization). The group outlives
``destroy_process_group()`` when a module imported after ``init_process_group`` bound it as a default
argument; these tests check that the strategy and the harness import those modules first.
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist

from lightning_dcp.runtime.exit import GROUP_DEFAULT_MODULES, import_group_defaults


def _defaults_hold_no_group(rank, world_size):
    import importlib

    import torch.distributed.nn.functional as dist_nn

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # `import ... as` finds deepspeed.comm's `torch` name

    world = dist.group.WORLD
    assert world is not None
    holders = [dist_nn.all_reduce, dist_nn.broadcast, ds_torch.TorchBackend.barrier]
    for fn in holders:
        assert not any(d is world for d in fn.__defaults__ or ()), f"{fn.__qualname__} bound the live default group"
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.destroy_process_group()
    gc.collect()
    # only this frame's name and getrefcount's argument are left: nothing keeps the group into finalization
    assert sys.getrefcount(world) == 2, f"{sys.getrefcount(world) - 2} references keep the destroyed group alive"


def test_after_destroy_nothing_holds_the_default_group():
    from _dist import run_distributed

    run_distributed(_defaults_hold_no_group, 2)


def test_import_group_defaults_imports_before_init_and_nothing_after():
    assert not dist.is_initialized()
    done = import_group_defaults()
    assert set(done) <= set(GROUP_DEFAULT_MODULES)
    assert "torch.distributed.nn" in done
    for name in done:
        assert name in sys.modules


def test_the_strategy_imports_them_before_lightning_creates_the_group(monkeypatch):
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_dcp import DCPStrategy
    import lightning_dcp.runtime.strategy as strategy_module

    order = []
    monkeypatch.setattr(strategy_module, "import_group_defaults", lambda: order.append("defaults"))
    monkeypatch.setattr(DDPStrategy, "setup_environment", lambda self: order.append("init"))
    strategy = DCPStrategy()
    try:
        strategy.setup_environment()
    except Exception:  # the rest of the set-up needs a Trainer; only the order of the first two calls matters
        pass
    assert order[:2] == ["defaults", "init"]
