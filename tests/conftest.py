"""Shared test hygiene: no default process group (nor its MASTER_PORT) outlives the test that made it.

An in-process fit (one device) initialises a gloo process group in the pytest process, and Lightning
puts the port it picked in ``MASTER_PORT``. Left behind, the next test's spawned ranks inherit that
port and cannot bind it (``EADDRINUSE``): the group is destroyed and the variables restored after
every test.
"""

from __future__ import annotations

import os

import pytest

_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    before = {var: os.environ.get(var) for var in _DIST_VARS}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for var, value in before.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
