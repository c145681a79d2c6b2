"""The dual-layer profile: schema ``lightning-dcp/profile/v1``, its validation and files.

Written by :class:`lightning_dcp.DCPProfiler` (or ``lightning-dcp profile``), read by
:class:`~lightning_dcp.planning.profiled.ProfiledCostModel`. Sections: ``key`` (model signature, device, dtype,
world size, package version), ``model`` (``num_layers``, ``num_heads``; optional ``hidden_size``,
``num_kv_heads``, ``per_sample_cost``), ``device`` (``memory_limit_bytes``, ``gpus_per_node``), ``constant`` (per
micro-batch ``time_s``, per step ``optimizer_s`` and ``allreduce_s``, one replica's ``memory_bytes``; optional
``param_bytes``, ``weight_bytes``, ``buffer_bytes``, ``optimizer_bytes``, ``time_per_token_s``, ``host_s``,
``host_per_token_s``, ``activation_bytes_per_token``), ``entries`` (one per measured ``seq_len``, ``micro_batch``,
``sp``: one layer's per-rank ``forward_s``, ``backward_s``, ``activation_bytes``, ``input_bytes``, optional
``recompute_s``, ``peak_bytes``) and ``meta``. Every field with its meaning: docs/cost-models.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

PROFILE_SCHEMA = "lightning-dcp/profile/v1"

_ENTRY_FIELDS = ("seq_len", "micro_batch", "sp", "forward_s", "backward_s", "activation_bytes", "input_bytes")
_CONSTANT_FIELDS = ("time_s", "optimizer_s", "allreduce_s", "memory_bytes")
_OPTIONAL_CONSTANT_FIELDS = ("time_per_token_s", "activation_bytes_per_token", "param_bytes", "host_s",
                             "host_per_token_s", "weight_bytes", "buffer_bytes", "optimizer_bytes")


class ProfileError(ValueError):
    """A profile file is corrupt, foreign or incomplete."""


def _positive_number(value: Any, where: str, allow_zero: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where} must be a finite number, got {value!r}")
    if value < 0 or (not allow_zero and value == 0):
        raise ProfileError(f"{where} must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")
    return float(value)


def validate_profile(data: Any) -> dict:
    """Return ``data`` if it is a well-formed v1 profile, else raise :class:`ProfileError`."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"a profile is a JSON object, got {type(data).__name__}")
    if data.get("schema") != PROFILE_SCHEMA:
        raise ProfileError(f"profile schema is {data.get('schema')!r}; expected {PROFILE_SCHEMA!r}")
    for section in ("key", "model", "device", "constant", "entries"):
        if section not in data:
            raise ProfileError(f"profile lacks the section {section!r}")
    model = data["model"]
    for f in ("num_layers", "num_heads"):
        if not isinstance(model.get(f), int) or model[f] <= 0:
            raise ProfileError(f"profile model.{f} must be a positive integer, got {model.get(f)!r}")
    _positive_number(data["device"].get("memory_limit_bytes"), "device.memory_limit_bytes", allow_zero=False)
    for f in _CONSTANT_FIELDS:
        _positive_number(data["constant"].get(f), f"constant.{f}")
    entries = data["entries"]
    if not isinstance(entries, list) or not entries:
        raise ProfileError("profile has no entries: nothing was measured")
    for i, e in enumerate(entries):
        if not isinstance(e, Mapping):
            raise ProfileError(f"entries[{i}] is not an object")
        for f in _ENTRY_FIELDS:
            if f not in e:
                raise ProfileError(f"entries[{i}] lacks {f!r}")
        for f in ("seq_len", "micro_batch", "sp"):
            if not isinstance(e[f], int) or e[f] <= 0:
                raise ProfileError(f"entries[{i}].{f} must be a positive integer, got {e[f]!r}")
        for f in ("forward_s", "backward_s", "activation_bytes", "input_bytes"):
            _positive_number(e[f], f"entries[{i}].{f}")
        if e.get("recompute_s") is not None:
            _positive_number(e["recompute_s"], f"entries[{i}].recompute_s")
    for f in _OPTIONAL_CONSTANT_FIELDS:
        if data["constant"].get(f) is not None:
            _positive_number(data["constant"][f], f"constant.{f}")
    return dict(data)


def load_profile(path: str | Path) -> dict:
    """Read and validate a profile file; raise :class:`ProfileError` naming the file on any problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"profile file {path} does not exist; run `lightning-dcp profile --out {path}` first") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProfileError(f"profile file {path} is not readable JSON: {err}") from err
    try:
        return validate_profile(data)
    except ProfileError as err:
        raise ProfileError(f"profile file {path}: {err}") from None


def save_profile(data: Mapping[str, Any], path: str | Path) -> Path:
    """Validate and write atomically (write to a temp file, then rename)."""
    validate_profile(data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    return path
