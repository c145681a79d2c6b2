"""The dual-layer profile: schema ``lightning-dcp/profile/v1``.

Written by :class:`lightning_dcp.DCPProfiler` (or ``lightning-dcp profile``), read by
:class:`~lightning_dcp.planning.profiled.ProfiledCostModel`. Shape::

    {
      "schema": "lightning-dcp/profile/v1",
      "key": {"model_signature": "...", "device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16",
              "world_size": 8, "package_version": "0.1.0"},
      "model": {"num_layers": 42, "num_heads": 48, "hidden_size": 3072},
      "device": {"memory_limit_bytes": 80e9, "gpus_per_node": 8},
      "constant": {
        "time_s": 0.004,            # embedding + head + loss, per micro-batch (fwd+bwd)
        "optimizer_s": 0.02,        # optimizer step, once per step
        "allreduce_s": 0.05,        # gradient all-reduce over world_size, once per step (0 if world 1)
        "memory_bytes": 3.1e10,     # model states + buffers of one full replica (M_C of eq. 6)
        "param_bytes": 1.0e10,      # gradient bytes reduced per step (= trainable weight bytes)
        "weight_bytes": 1.0e10,     # optional: bytes of every parameter, trainable or frozen
        "buffer_bytes": 1.0e6,      # optional: the module's buffers
        "optimizer_bytes": 2.0e10,  # optional: one replica's optimizer states (fp32 master included)
        "time_per_token_s": 2e-8,   # optional: embedding + head + loss time per local token (fwd+bwd)
        "host_s": 1e-4,             # optional: host work per micro-batch (pack, shard, copy)
        "host_per_token_s": 1e-8,   # optional: host work per token of the whole micro-batch
        "activation_bytes_per_token": 6.0e4  # optional: bytes saved for backward outside the
                                    #   repeated layers, per local token
      },
      "entries": [                  # one per (seq_len, micro_batch, sp) measured
        {"seq_len": 4096, "micro_batch": 2, "sp": 1,
         "forward_s": 0.0031,       # one layer forward, per rank, including its all-to-alls
         "backward_s": 0.0062,      # one layer backward, per rank
         "activation_bytes": 1.2e9, # bytes saved for backward by one un-checkpointed layer, per rank
         "input_bytes": 5.0e7,      # bytes of one layer's input, per rank (kept when checkpointed)
         "recompute_s": 0.0034,     # optional: extra time of one checkpointed layer vs forward_s +
                                    #   backward_s, per rank (its recomputed forward + machinery)
         "peak_bytes": null}        # peak allocated during the two layers (CUDA only), optional
      ],
      "meta": {"created": "2026-11-22T10:00:00Z", "profiling_s": 12.5, "grid": 24, "host": "..."}
    }

An entry with ``micro_batch`` b and ``seq_len`` l is a packed micro-batch of b samples of length
l: ``b*l`` tokens and ``b*l**2`` attention work. Times are per layer and per rank. A profile is
made for one world size; the fit generalizes across lengths, not across SP sizes it lacks.

Optional fields (absent, or ``null``, in older profiles; non-negative numbers when present):
``entries[].recompute_s`` -- the cost model charges it per recomputed layer instead of
``forward_s`` when every entry of an SP size has it; ``constant.time_per_token_s`` and
``constant.activation_bytes_per_token`` -- added per local token (``tokens / sp``) to every
micro-batch's time and memory; ``constant.host_s`` and ``constant.host_per_token_s`` -- the
host's work per micro-batch (pack, prepare, weight, shard, copy to the device), ``host_s +
host_per_token_s * tokens`` over the *whole* micro-batch's tokens (every SP rank builds it);
``constant.weight_bytes``, ``constant.buffer_bytes`` and ``constant.optimizer_bytes`` -- the
split of ``memory_bytes`` (``weight_bytes + buffer_bytes + param_bytes + optimizer_bytes`` in
profiles :class:`~lightning_dcp.DCPProfiler` writes), from which
``ProfiledCostModel(sharding=...)`` knows what sharding the states frees; ``memory_bytes`` stays
one full replica's states whatever sharding the profiled run used.
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
