"""On-disk cache of dual-layer profiles, keyed by what makes a profile valid.

A profile (schema ``lightning-dcp/profile/v1``, see :mod:`lightning_dcp.planning.profile`) is
valid for one model (architecture and configuration), one kind of input sample (everything but
its length: the text length and width of a video sample, the patch size, the dtypes), one device
type, one precision, one world size and one package version. Those values form the
:class:`ProfileKey`; the file name is a hash of the whole key, so profiles of different keys never
overwrite each other::

    <cache_dir>/<sha256(key)[:16]>.json

``cache_dir`` is, in order: the explicit argument, the ``LIGHTNING_DCP_CACHE`` environment
variable, ``~/.cache/lightning-dcp/profiles``.

The cache holds measurements: a run's memory budget is not part of a cached profile's meaning
(:class:`~lightning_dcp.DCPProfiler` plans with the budget of the run, whatever the file says).

A lookup never trusts a file it cannot verify: a file that is not JSON or fails
:func:`~lightning_dcp.planning.profile.validate_profile` is *corrupt*; a valid profile whose
stored ``key`` differs from the expected one (hash collision, hand-copied file, older package)
is *foreign*. Both are reported with a warning naming the file and treated as a miss; the next
store overwrites them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from lightning_dcp.planning.profile import ProfileError, validate_profile

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

#: Environment variable that overrides the default cache directory.
CACHE_ENV = "LIGHTNING_DCP_CACHE"

HIT, MISS, CORRUPT, FOREIGN, PARTIAL = "hit", "miss", "corrupt", "foreign", "partial"


class ProfileCacheWarning(UserWarning):
    """A cached profile file was corrupt or foreign and is being ignored."""


@dataclass(frozen=True)
class ProfileKey:
    """What a profile is valid for; stored verbatim as the profile's ``key`` section.

    Args:
        model_signature: :func:`model_signature` of the module (hex sha256).
        device: device name (:func:`device_name`).
        dtype: the precision the layers ran in, as Lightning names it (``"32-true"``, ``"bf16-mixed"``...).
        world_size: number of ranks the profile was made on (it holds SP sizes up to this).
        package_version: ``lightning_dcp.__version__``.
        inputs_signature: :func:`inputs_signature` of the profiled samples and the measured layer stack
            (``""``: not recorded, e.g. a profile of synthetic data the key's model fully determines).
    """

    model_signature: str
    device: str
    dtype: str
    world_size: int
    package_version: str
    inputs_signature: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ProfileKey":
        return cls(**{f: data[f] for f in cls.__dataclass_fields__ if f in data or f != "inputs_signature"})

    def digest(self) -> str:
        """sha256 hex of the canonical JSON of the key."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def filename(self) -> str:
        return f"{self.digest()[:16]}.json"


@dataclass
class CacheLookup:
    """Result of :func:`load_cached`: ``status`` is ``"hit"``, ``"miss"``, ``"corrupt"``, ``"foreign"`` or
    ``"partial"`` (a profile its time budget stopped, and this run gives more time: measured again)."""

    status: str
    path: Path
    profile: dict | None = None
    reason: str = ""

    @property
    def hit(self) -> bool:
        return self.status == HIT


#: Configuration fields that name where a model came from, not what it computes.
_CONFIG_NOISE = frozenset({"_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "_diffusers_version",
                           "_use_default_values"})


def _config_dict(config: Any) -> dict | None:
    """A model configuration as a plain dict: a mapping (diffusers' ``FrozenDict``), an object with
    ``to_dict()`` (transformers' ``PretrainedConfig``) or a dataclass; ``None`` for anything else."""
    import dataclasses

    if isinstance(config, Mapping):
        data = dict(config)
    elif callable(getattr(config, "to_dict", None)):
        data = config.to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        data = dataclasses.asdict(config)
    else:
        return None
    return {str(k): v for k, v in data.items() if k not in _CONFIG_NOISE} if isinstance(data, Mapping) else None


def model_signature(module: "torch.nn.Module") -> str:
    """sha256 hex over the module class (``module.qualname``), every parameter's (name, shape, dtype)
    and the configuration of every submodule that has one (a ``config`` attribute: diffusers' and
    transformers' models; the fields naming a checkpoint path or a library version left out).

    Weights' values are not part of it: a profile measures time and memory, which depend on the
    architecture only. Changing a layer width, the layer count, a parameter dtype or a configuration
    value (patch size, attention implementation, text length...) changes it.
    """
    cls = type(module)
    h = hashlib.sha256(f"{cls.__module__}.{cls.__qualname__}".encode())
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        h.update(f"|{name}:{tuple(p.shape)}:{p.dtype}".encode())
    for name, sub in module.named_modules():
        config = _config_dict(getattr(sub, "config", None))
        if config is not None:
            h.update(f"|config {name}:{json.dumps(config, sort_keys=True, default=str)}".encode())
    return h.hexdigest()


def describe_sample(sample: Any, length: int | None = None, _top: bool = True) -> Any:
    """A JSON-able description of one sample without its length: every tensor as (dtype, shape),
    the first dimension of a top-level tensor written ``"L"`` when it equals ``length`` (the
    sample's tokens); lists, tuples and dicts recursively; other values by type name only (a
    sample's index or grid differs from sample to sample without changing the cost per token)."""
    if hasattr(sample, "shape") and hasattr(sample, "dtype"):
        shape = [int(d) for d in sample.shape]
        dims: list = ["L" if _top and i == 0 and length is not None and d == length else d for i, d in enumerate(shape)]
        return ["tensor", str(sample.dtype), dims]
    if isinstance(sample, Mapping):
        return {str(k): describe_sample(v, length, _top) for k, v in sorted(sample.items(), key=lambda kv: str(kv[0]))}
    if isinstance(sample, (list, tuple)):
        if all(not hasattr(v, "shape") and not isinstance(v, (Mapping, list, tuple)) for v in sample):
            return [type(sample).__name__, len(sample)]
        return [describe_sample(v, length, False) for v in sample]
    return type(sample).__name__


def inputs_signature(samples: Sequence[tuple[Any, int]], layers_attr: str | None = None) -> str:
    """sha256 hex of :func:`describe_sample` of each ``(sample, length)`` (the profiler passes the
    dataset's shortest and longest samples) and the measured layer stack's name: what a profiled
    forward depends on besides the sample lengths and the model."""
    described = [describe_sample(s, n) for s, n in samples]
    text = json.dumps({"samples": described, "layers_attr": layers_attr}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def device_name(device: "torch.device | str") -> str:
    """``torch.cuda.get_device_name`` on CUDA; ``"cpu (<processor or machine>)"`` elsewhere."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    proc = platform.processor() or platform.machine() or "unknown"
    return f"{device.type} ({proc})"


def default_cache_dir() -> Path:
    """``$LIGHTNING_DCP_CACHE`` if set, else ``~/.cache/lightning-dcp/profiles``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "lightning-dcp" / "profiles"


def resolve_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The cache directory: ``cache_dir`` if given, else :func:`default_cache_dir`."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def profile_path(key: ProfileKey, cache_dir: str | Path | None = None) -> Path:
    """The file for ``key`` inside the cache directory."""
    return resolve_cache_dir(cache_dir) / key.filename()


def _ignore(status: str, path: Path, reason: str) -> CacheLookup:
    msg = f"ignoring {status} profile cache file {path}: {reason}; re-profiling and overwriting it."
    warnings.warn(msg, ProfileCacheWarning, stacklevel=3)
    log.warning(msg)
    return CacheLookup(status, path, None, reason)


def more_time(profile: Mapping[str, Any], time_budget_s: float | None) -> bool:
    """Whether a run with ``time_budget_s`` (``None``: none) would measure more of ``profile`` than it holds: its
    time budget skipped points, and this budget is larger."""
    meta = profile.get("meta") or {}
    if not meta.get("skipped_points"):
        return False
    stored = meta.get("time_budget_s")
    return time_budget_s is None or (isinstance(stored, (int, float)) and time_budget_s > stored)


def load_cached(key: ProfileKey, cache_dir: str | Path | None = None, time_budget_s: float | None | str = "any") -> CacheLookup:
    """Look ``key`` up. Returns a hit only for a valid v1 profile whose stored key equals ``key`` and, given this
    run's ``time_budget_s``, that a larger budget would not measure further (:func:`more_time`; else ``"partial"``,
    a miss)."""
    path = profile_path(key, cache_dir)
    if not path.exists():
        return CacheLookup(MISS, path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return _ignore(CORRUPT, path, f"not readable JSON ({err})")
    try:
        data = validate_profile(data)
    except ProfileError as err:
        return _ignore(CORRUPT, path, f"not a valid profile ({err})")
    stored = data.get("key")
    if not isinstance(stored, Mapping) or dict(stored) != key.to_dict():
        return _ignore(FOREIGN, path, f"its key {stored!r} is not the expected {key.to_dict()!r}")
    if time_budget_s != "any" and more_time(data, time_budget_s):  # type: ignore[arg-type]
        meta = data.get("meta", {})
        return CacheLookup(PARTIAL, path, None, f"its {meta.get('time_budget_s')} s budget skipped "
                                                f"{len(meta['skipped_points'])} measurements; this run gives more time")
    return CacheLookup(HIT, path, data)


def store(profile: Mapping[str, Any], cache_dir: str | Path | None = None) -> Path:
    """Validate ``profile`` and write it atomically under the key it carries; returns the path.

    The temporary file name holds the process id so concurrent writers never share it.
    """
    validate_profile(profile)
    key = ProfileKey.from_dict(profile["key"])
    path = profile_path(key, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile, indent=1, sort_keys=True))
    tmp.replace(path)
    return path
