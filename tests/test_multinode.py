"""Multi-node through Lightning's own cluster environments, on one machine.

- torchrun: two ``torchrun`` "nodes" (1 process each by default, 2 each with ``-m slow``; c10d rendezvous on
  127.0.0.1);
- SLURM: four processes with the variables ``srun`` sets (Lightning's ``SLURMEnvironment``).

Each trains 4 steps whose plans hold an SP-4 group spanning the node boundary and SP-2 groups
inside the nodes (on 2 nodes x 1 process: SP-2 groups spanning it); the weights equal the single-process reference of the same plans (1e-5), the
same check the 1/2/4-process exactness tests make. Hard time-outs: a hang fails, never blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from _dcp_helpers import max_rel_err, reference_run
from _dist import find_free_port

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "_multinode_run.py")
STEPS = 4
TIMEOUT = 240


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in [k for k in env if k.startswith(("SLURM_", "TORCHELASTIC_", "LOCAL_RANK", "GROUP_RANK"))]:
        del env[k]
    return env


def _wait(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"a process exited with {p.returncode}:\n{out[-4000:]}"
    return outs


def _check(out_dir: str, per_node: int = 2) -> None:
    world = 2 * per_node
    log = torch.load(os.path.join(out_dir, "log_rank0.pt"))
    plans = log["plans"]
    assert len(plans) == STEPS
    spans = [it["ranks"] for p in plans for it in p["items"] if len(it["ranks"]) == world]  # every rank: both nodes
    assert spans, "the plans must hold SP groups across the nodes"
    if per_node > 1:
        inside = [it["ranks"] for p in plans for it in p["items"] if len(it["ranks"]) == 2]
        assert inside, "the plans must hold SP groups inside the nodes"
    _, ref = reference_run(plans, STEPS)
    for r in range(world):
        weights = torch.load(os.path.join(out_dir, f"weights{STEPS}_rank{r}.pt"))
        for name, w in weights.items():
            err = max_rel_err(w, ref[name])
            assert err < 1e-5, f"rank {r} {name}: relative error {err:.2e}"


@pytest.mark.parametrize("per_node", [1, 2], ids=["2x1", "2x2"])  # 2x2 (4 processes): slow (tests/conftest.py)
def test_two_torchrun_nodes_train_exactly(tmp_path, per_node):
    port = find_free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={per_node}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=dcp-test", "--max-restarts=0", SCRIPT,
           str(tmp_path), str(per_node)]
    procs = [subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = _wait(procs)
    assert "TorchElasticEnvironment" in "".join(outs)
    _check(str(tmp_path), per_node)


def test_slurm_variables_are_detected_and_train_exactly(tmp_path):
    port = find_free_port()
    procs = []
    for rank in range(4):
        env = _env()
        env.update(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2",
                   SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(rank // 2),
                   SLURM_JOB_ID="4242", SLURM_JOB_NAME="dcp-test", SLURM_NODELIST="localhost",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, SCRIPT, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = _wait(procs)
    assert "SLURMEnvironment" in "".join(outs)
    _check(str(tmp_path))
