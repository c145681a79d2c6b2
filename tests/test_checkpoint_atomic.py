"""A sharded checkpoint save killed half-way leaves the previous checkpoint resumable, and the partial
directory is refused by name (``lightning_dcp.runtime.checkpoint``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_dcp.runtime.checkpoint import (METADATA_FILENAME, IncompleteCheckpointError, load_sharded,
                                              partial_path, save_sharded)

ROOT = Path(__file__).resolve().parents[1]

_SAVE_THEN_DIE = """
import os, socket, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from pathlib import Path
from lightning_dcp.runtime.checkpoint import model_state, save_sharded

path, die_at = Path(sys.argv[1]), sys.argv[2]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
module = torch.nn.Linear(4, 4)
with torch.no_grad():
    module.weight.fill_(1.0); module.bias.fill_(1.0)
save_sharded({"state_dict": model_state(module), "tag": "first"}, path, rank=0, barrier=dist.barrier)
with torch.no_grad():
    module.weight.fill_(2.0); module.bias.fill_(2.0)
real_save, real_torch_save = dcp.save, torch.save
def dying_torch_save(obj, f, *args, **kwargs):  # ... or after the shards, while meta.pt is written
    Path(f).write_bytes(b"torn")
    os._exit(9)
def dying_save(*args, **kwargs):  # the process is killed while the shards are being written ...
    if die_at == "shards":
        os._exit(9)
    result = real_save(*args, **kwargs)
    torch.save = dying_torch_save
    return result
dcp.save = dying_save
save_sharded({"state_dict": model_state(module), "tag": "second"}, path, rank=0, barrier=dist.barrier)
print("not killed")
"""


def _fresh() -> torch.nn.Linear:
    module = torch.nn.Linear(4, 4)
    with torch.no_grad():
        module.weight.zero_()
        module.bias.zero_()
    return module


@pytest.mark.parametrize("die_at", ["shards", "meta"])
def test_killed_save_keeps_the_previous_checkpoint_and_refuses_the_partial(tmp_path, die_at):
    path = tmp_path / "last.ckpt"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_SAVE_THEN_DIE), str(path), die_at], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stdout + proc.stderr
    partial = partial_path(path)
    assert partial.is_dir() and path.is_dir()

    module = _fresh()
    meta = load_sharded(path, module, [])  # the previous checkpoint is whole and resumable
    assert meta["tag"] == "first"
    assert torch.equal(module.weight, torch.ones(4, 4)) and torch.equal(module.bias, torch.ones(4))

    if die_at == "meta":  # a torn meta.pt in the partial directory does not make it look complete
        (partial / METADATA_FILENAME).unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"last\.ckpt\.partial.*incomplete sharded checkpoint"):
        load_sharded(partial, _fresh(), [])


def test_interrupted_save_without_meta_at_the_final_path_is_refused_by_name(tmp_path):
    path = tmp_path / "epoch=0-step=3.ckpt"
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"")  # shards of a save (by an older version) that never finished
    with pytest.raises(IncompleteCheckpointError, match=r"epoch=0-step=3\.ckpt"):
        load_sharded(path, _fresh(), [])


def test_a_completed_save_replaces_the_previous_checkpoint(tmp_path):
    import torch.distributed as dist

    from lightning_dcp.runtime.checkpoint import model_state

    path = tmp_path / "last.ckpt"
    for tag, value in (("first", 1.0), ("second", 2.0)):
        module = _fresh()
        with torch.no_grad():
            module.weight.fill_(value)
        save_sharded({"state_dict": model_state(module), "tag": tag}, path, rank=0, barrier=lambda: None)
    assert not dist.is_initialized()
    module = _fresh()
    assert load_sharded(path, module, [])["tag"] == "second"
    assert torch.equal(module.weight, torch.full((4, 4), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # nothing partial or set aside is left
