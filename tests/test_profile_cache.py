"""Profile cache: keys, hit / miss / corrupt / foreign lookups, atomic store."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from lightning_dcp.profiling import cache as pc
from lightning_dcp.planning.profile import PROFILE_SCHEMA


def _key(**over) -> pc.ProfileKey:
    base = dict(model_signature="ab" * 32, device="cpu (x86_64)", dtype="32-true", world_size=1, package_version="0.1.0")
    base.update(over)
    return pc.ProfileKey(**base)


def _profile(key: pc.ProfileKey) -> dict:
    return {
        "schema": PROFILE_SCHEMA, "key": key.to_dict(), "model": {"num_layers": 4, "num_heads": 4},
        "device": {"memory_limit_bytes": 8e9, "gpus_per_node": 1},
        "constant": {"time_s": 0.001, "optimizer_s": 0.002, "allreduce_s": 0.0, "memory_bytes": 1e6, "param_bytes": 2.5e5},
        "entries": [{"seq_len": n, "micro_batch": 1, "sp": 1, "forward_s": 1e-3 * n, "backward_s": 2e-3 * n,
                     "activation_bytes": 100 * n, "input_bytes": 10 * n} for n in (16, 64)],
        "meta": {},
    }


def test_every_key_field_changes_the_file_name():
    names = {_key().filename()}
    for field, value in [("model_signature", "cd" * 32), ("device", "NVIDIA H100"), ("dtype", "bf16-mixed"),
                         ("world_size", 2), ("package_version", "0.2.0"), ("inputs_signature", "ef" * 32)]:
        names.add(_key(**{field: value}).filename())
    assert len(names) == 7
    assert _key().filename() == _key().filename()  # deterministic
    assert pc.ProfileKey.from_dict(_key().to_dict()) == _key()
    older = {k: v for k, v in _key().to_dict().items() if k != "inputs_signature"}  # a key written before the field
    assert pc.ProfileKey.from_dict(older) == _key()


def test_model_signature_is_architecture_not_weights():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 8), nn.Linear(4, 8)
    assert pc.model_signature(a) == pc.model_signature(b)  # different weights, same architecture
    assert pc.model_signature(a) != pc.model_signature(nn.Linear(4, 9))
    assert pc.model_signature(a) != pc.model_signature(nn.Linear(4, 8).to(torch.float64))
    with torch.device("meta"):  # the CLI signs the full model without allocating it
        assert pc.model_signature(nn.Linear(4, 8)) == pc.model_signature(a)


def test_cache_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv(pc.CACHE_ENV, str(tmp_path / "env"))
    assert pc.default_cache_dir() == tmp_path / "env"
    assert pc.profile_path(_key(), tmp_path / "arg").parent == tmp_path / "arg"
    monkeypatch.delenv(pc.CACHE_ENV)
    assert pc.default_cache_dir().parts[-3:] == (".cache", "lightning-dcp", "profiles")


def test_store_then_hit_and_miss_on_another_key(tmp_path):
    key = _key()
    assert pc.load_cached(key, tmp_path).status == pc.MISS
    path = pc.store(_profile(key), tmp_path)
    assert path == tmp_path / key.filename()
    hit = pc.load_cached(key, tmp_path)
    assert hit.hit and hit.profile["entries"] == _profile(key)["entries"]
    assert pc.load_cached(_key(world_size=2), tmp_path).status == pc.MISS
    assert pc.load_cached(_key(dtype="bf16-mixed"), tmp_path).status == pc.MISS
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write left nothing behind


@pytest.mark.parametrize("content", ["{not json", "", json.dumps([1, 2]), json.dumps({"schema": PROFILE_SCHEMA})])
def test_corrupt_file_is_reported_and_ignored(tmp_path, content):
    key = _key()
    path = pc.profile_path(key, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    with pytest.warns(pc.ProfileCacheWarning, match=str(path.name)):
        lookup = pc.load_cached(key, tmp_path)
    assert lookup.status == pc.CORRUPT and lookup.profile is None
    pc.store(_profile(key), tmp_path)  # the next store replaces it
    assert pc.load_cached(key, tmp_path).hit


def test_invalid_profile_values_are_corrupt(tmp_path):
    key = _key()
    bad = _profile(key)
    bad["entries"][0]["forward_s"] = -1.0
    path = pc.profile_path(key, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(bad))
    with pytest.warns(pc.ProfileCacheWarning, match="forward_s"):
        assert pc.load_cached(key, tmp_path).status == pc.CORRUPT


def test_foreign_file_is_reported_and_ignored(tmp_path):
    key, other = _key(), _key(device="NVIDIA H100 80GB HBM3")
    path = pc.profile_path(key, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_profile(other)))  # valid profile under the wrong name
    with pytest.warns(pc.ProfileCacheWarning, match="foreign"):
        lookup = pc.load_cached(key, tmp_path)
    assert lookup.status == pc.FOREIGN and lookup.profile is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pc.load_cached(other, tmp_path).status == pc.MISS
