"""What a checkpoint must say about its transformer to rebuild it without the training script: :class:`ModelRecord`.

:class:`~lightning_dcp.diffusers.VideoDiffusionModule` writes one into every checkpoint (key :data:`RECORD_KEY`):
the diffusers class, its config and, for a LoRA run, the adapter's peft config. With it, export
(:mod:`lightning_dcp.diffusers.export`) and validation videos on sharded weights
(:mod:`lightning_dcp.diffusers.validation`) build a plain transformer of the same shape (random weights,
then the checkpoint's or the gathered weights loaded into it) -- no download, no pretrained path.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["RECORD_KEY", "ModelRecord", "module_weights"]

#: Checkpoint key of the :class:`ModelRecord`.
RECORD_KEY = "lightning_dcp_video_model"
#: The LightningModule attribute holding the transformer (``VideoDiffusionModule.model``): its state-dict prefix.
PREFIX = "model."


def _plain(value: Any) -> Any:
    """JSON-like copy of a config value (sets and tuples as lists, enums as their values, anything else not JSON as
    text): the record loads with ``torch.load(weights_only=True)`` and prints."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in (sorted(value, key=str) if isinstance(value, (set, frozenset)) else value)]
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass(frozen=True)
class ModelRecord:
    """A diffusers transformer's class, config and LoRA adapter config (``None``: no adapter).

    Attributes:
        class_name: the diffusers class, e.g. ``"WanTransformer3DModel"``.
        config: its ``model.config`` as a dict.
        lora: the adapter's ``LoraConfig.to_dict()``, or ``None``.
    """

    class_name: str
    config: dict
    lora: dict | None = None

    @classmethod
    def of(cls, model: nn.Module) -> "ModelRecord":
        """The record of a live transformer (with its adapter, if any)."""
        from lightning_dcp.diffusers.lora import ADAPTER_NAME, has_lora

        config = {k: v for k, v in dict(model.config).items() if not str(k).startswith("_")}
        lora = _plain(model.peft_config[ADAPTER_NAME].to_dict()) if has_lora(model) else None
        return cls(type(model).__name__, _plain(config), lora)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelRecord":
        return cls(str(data["class_name"]), dict(data["config"]), dict(data["lora"]) if data.get("lora") else None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def build(self) -> nn.Module:
        """A new transformer of this class and config (random weights), with the same LoRA adapter (if any)."""
        import diffusers

        cls = getattr(diffusers, self.class_name, None)
        if cls is None:
            raise ValueError(f"diffusers {diffusers.__version__} has no {self.class_name}; install the diffusers "
                             "version the checkpoint was trained with")
        model = cls.from_config(self.config)
        if self.lora is not None:
            from peft import LoraConfig

            from lightning_dcp.diffusers.lora import add_lora

            fields = {k: v for k, v in self.lora.items() if k in LoraConfig.__dataclass_fields__}
            if isinstance(fields.get("target_modules"), list):
                fields["target_modules"] = set(fields["target_modules"])
            add_lora(model, LoraConfig(**fields))
        return model


def module_weights(state: Mapping[str, torch.Tensor], overlay: Mapping[str, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
    """The transformer's weights out of a LightningModule ``state`` (keys ``model.<name>``), with ``overlay``'s
    entries (e.g. the EMA of the trained ones, same keys) in place of theirs."""
    merged = dict(state)
    merged.update(overlay or {})
    return {k[len(PREFIX):]: v for k, v in merged.items() if k.startswith(PREFIX)}
