"""The settings of one video fine-tuning run, as ``lightning-dcp train-video`` reads them: :class:`VideoTrainConfig`.

A YAML file (``--config``) with these sections; every key is optional but ``model`` and ``data``, and a
command-line flag or ``--set section.key=value`` overrides the file::

    model: tiny-wan              # a tiny offline model, a diffusers pipeline folder, or a Hub id
    family: wan                  # optional check: wan, ltx, cogvideox or hunyuan
    data: encoded/               # a `lightning-dcp encode` output folder
    out: runs/video              # checkpoints/, logs/, validation videos
    lora: {rank: 16, alpha: null, targets: null}   # rank 0 (or `lora: null`): full fine-tune
    train: {steps: 200, global_batch_size: 8, lr: 1.0e-4, weight_decay: 0.0, shift: 5.0, seed: 0,
            devices: auto, accelerator: auto, precision: auto, sharding: none, checkpoint_every: 100,
            drop_last: false}        # false: an epoch's remainder trains as a smaller last step
    budget: auto                 # per-device memory in MiB the planner may use; auto: the device's; none: no profile
    profile_seconds: 60          # wall seconds for the whole profile at fit start (null: no limit)
    ema: {enabled: true, decay: 0.999}
    validation: {prompts: [], seeds: [0], every_n_steps: 100, num_frames: 17, height: 256, width: 256,
                 num_inference_steps: 30, guidance_scale: null, fps: null}   # fps null: the encoded set's (else 16)
    logger: csv                  # csv, tensorboard, wandb or none

Pure Python (no torch): a misspelled key is an error naming the closest valid one.
"""

from __future__ import annotations

import difflib
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from lightning_dcp.planning.sharding.registry import DEFAULT_MODE, MODES

__all__ = ["FAMILY_NAMES", "LOGGERS", "EMASettings", "LoRASettings", "TrainSettings", "ValidationSettings",
           "VideoTrainConfig", "load_config"]

#: ``family`` values and the diffusers class each names.
FAMILY_NAMES = {"wan": "WanTransformer3DModel", "ltx": "LTXVideoTransformer3DModel",
                "cogvideox": "CogVideoXTransformer3DModel", "hunyuan": "HunyuanVideoTransformer3DModel"}
#: ``logger`` values.
LOGGERS = ("csv", "tensorboard", "wandb", "none")
_SHARDING = tuple(MODES)  # the sharding modes (the one registry)


@dataclass(frozen=True)
class LoRASettings:
    """``rank`` 0: no adapter (full fine-tune); ``alpha`` default the rank; ``targets`` default the family's."""

    rank: int = 16
    alpha: float | None = None
    targets: list[str] | None = None


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 200
    global_batch_size: int = 8
    lr: float = 1e-4
    weight_decay: float = 0.0
    shift: float = 5.0
    seed: int = 0
    devices: int | str = "auto"
    accelerator: str = "auto"
    precision: str = "auto"
    sharding: str = DEFAULT_MODE
    checkpoint_every: int = 100
    drop_last: bool = False  # False: an epoch's remainder trains as a smaller last step (a few clips still train)


@dataclass(frozen=True)
class EMASettings:
    enabled: bool = True
    decay: float = 0.999


@dataclass(frozen=True)
class ValidationSettings:
    prompts: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0])
    every_n_steps: int = 100
    num_frames: int = 17
    height: int = 256
    width: int = 256
    num_inference_steps: int = 30
    guidance_scale: float | None = None
    fps: float | None = None  # None: the frame rate the data was encoded at (meta.json's settings.fps), else 16


@dataclass(frozen=True)
class VideoTrainConfig:
    """One run's settings (see the module docstring); :meth:`check` says what is wrong with them."""

    model: str = ""
    data: str = ""
    out: str = "runs/video"
    family: str | None = None
    lora: LoRASettings = field(default_factory=LoRASettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    budget: float | str = "auto"
    profile_seconds: float | None = 60.0
    ema: EMASettings = field(default_factory=EMASettings)
    validation: ValidationSettings = field(default_factory=ValidationSettings)
    logger: str = "csv"

    @property
    def memory_limit_mib(self) -> float | None:
        """The profiler's per-device budget: MiB, or ``None`` for the device's (``budget: auto``)."""
        return None if isinstance(self.budget, str) else float(self.budget)

    @property
    def profile(self) -> bool:
        return not (isinstance(self.budget, str) and self.budget == "none")

    def check(self) -> "VideoTrainConfig":
        """``self``, or a ``ValueError`` listing every bad setting and its fix."""
        bad = []
        if not self.model:
            bad.append("model: missing (a tiny model such as tiny-wan, a diffusers pipeline folder or a Hub id)")
        if not self.data:
            bad.append("data: missing (the folder `lightning-dcp encode --out` wrote)")
        if self.family is not None and self.family not in FAMILY_NAMES:
            bad.append(f"family: {self.family!r} is not one of {', '.join(FAMILY_NAMES)}")
        if not isinstance(self.lora.rank, int) or self.lora.rank < 0:
            bad.append(f"lora.rank: {self.lora.rank!r} must be an int >= 0 (0: full fine-tune)")
        t = self.train
        for name in ("steps", "global_batch_size", "checkpoint_every"):
            value = getattr(t, name)
            if not isinstance(value, int) or value < 1:
                bad.append(f"train.{name}: {value!r} must be an int >= 1")
        if not isinstance(t.lr, (int, float)) or t.lr <= 0:
            bad.append(f"train.lr: {t.lr!r} must be a number > 0")
        if t.sharding not in _SHARDING:
            bad.append(f"train.sharding: {t.sharding!r} is not one of {', '.join(_SHARDING)}")
        if isinstance(self.budget, str) and self.budget not in ("auto", "none"):
            bad.append(f"budget: {self.budget!r} must be MiB per device (a number), auto or none")
        elif not isinstance(self.budget, str) and float(self.budget) <= 0:
            bad.append(f"budget: {self.budget!r} MiB must be > 0")
        if self.profile_seconds is not None and (isinstance(self.profile_seconds, bool) or not isinstance(
                self.profile_seconds, (int, float)) or self.profile_seconds < 0):
            bad.append(f"profile_seconds: {self.profile_seconds!r} must be seconds >= 0, or null (no limit)")
        if not 0.0 <= float(self.ema.decay) < 1.0:
            bad.append(f"ema.decay: {self.ema.decay!r} must be in [0, 1)")
        if self.logger not in LOGGERS:
            bad.append(f"logger: {self.logger!r} is not one of {', '.join(LOGGERS)}")
        if not all(isinstance(p, str) and p for p in self.validation.prompts):
            bad.append(f"validation.prompts: {self.validation.prompts!r} must be a list of prompts")
        if bad:
            raise ValueError("bad train-video settings:\n  " + "\n  ".join(bad))
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _closest(key: str, valid: Sequence[str]) -> str:
    near = difflib.get_close_matches(key, list(valid), n=1)
    return f" (did you mean {near[0]!r}?)" if near else f" (valid: {', '.join(valid)})"


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where or 'the config'}: expected a mapping of settings, got {data!r}")
    names = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"unknown setting {where + str(key)!r}{_closest(str(key), list(names))}")
        spec = names[key]
        default = spec.default_factory() if spec.default_factory is not MISSING else spec.default
        if is_dataclass(default):
            if value is None:  # `lora: null`: a full fine-tune; another section: its defaults
                value = {"rank": 0} if key == "lora" else {}
            value = _build(type(default), value, f"{where}{key}.")
        kwargs[key] = _coerce(value, str(spec.type))
    return cls(**kwargs)


def _coerce(value: Any, annotation: str) -> Any:
    """A number written as a string (YAML reads ``1e-4`` as one) as the number its field takes."""
    if not isinstance(value, str):
        return value
    for kind, cast in (("int", int), ("float", float)):
        if kind in annotation:
            try:
                return cast(value)
            except ValueError:
                pass
    return value


def _parse_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
                sets: Sequence[str] = ()) -> VideoTrainConfig:
    """The settings of a YAML file (optional), then ``overrides`` (``{"train.steps": 20, "model": "tiny-wan"}``: the
    command line's flags), then ``sets`` (``["train.lr=3e-4", ...]``: its ``--set``), checked.

    Raises:
        ValueError: an unreadable file, an unknown key (naming the closest), or bad values (every one listed).
    """
    import yaml

    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a YAML mapping of settings, got {type(loaded).__name__}")
        data = loaded
    pairs = list((overrides or {}).items())
    for item in sets:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: write section.key=value, e.g. --set train.lr=3e-4")
        key, value = item.split("=", 1)
        pairs.append((key.strip(), _parse_value(value)))
    for key, value in pairs:
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"setting {key!r}: {part!r} is not a section")
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = {**node[parts[-1]], **value}  # a section's keys merge
        else:
            node[parts[-1]] = value
    config = _build(VideoTrainConfig, data, "")
    if isinstance(config.budget, (int, float)) and not isinstance(config.budget, bool):
        config = replace(config, budget=float(config.budget))
    return config.check()
