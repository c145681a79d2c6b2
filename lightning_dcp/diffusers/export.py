"""A diffusers folder from a training checkpoint: :func:`export_checkpoint` (``lightning-dcp export CKPT --out DIR``).

Reads any checkpoint a :class:`~lightning_dcp.diffusers.VideoDiffusionModule` fit wrote -- Lightning's single
file, or the sharded directory of ``DCPStrategy(sharding="zero2" | "fsdp" | "hsdp")`` (its model weights read
offline with ``torch.distributed.checkpoint``: only the weights, no process group, none of the optimizer
state) -- and writes what the family's diffusers pipeline loads:

* a full fine-tune: the transformer's ``save_pretrained`` folder (``config.json`` +
  ``diffusion_pytorch_model.safetensors``); load it with ``WanTransformer3DModel.from_pretrained(DIR)`` and
  hand it to the pipeline (``WanPipeline.from_pretrained(BASE, transformer=...)``);
* a LoRA run: the adapter as the pipeline's ``save_lora_weights`` writes it
  (``pytorch_lora_weights.safetensors``); load it with ``pipe.load_lora_weights(DIR)``;
* with ``pipeline=BASE`` (a diffusers pipeline folder, hub id or tiny model name): the whole pipeline, the
  trained transformer in it (a LoRA fused into the base's weights), for ``WanPipeline.from_pretrained(DIR)``.

The weights are the EMA's when the checkpoint has an :class:`~lightning_dcp.callbacks.EMA` state (``ema=None``),
else the trained ones. The transformer is rebuilt from the checkpoint's
:class:`~lightning_dcp.diffusers.record.ModelRecord` (its class, config and adapter config), so neither the
training script nor a download is needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from lightning_dcp.diffusers.record import RECORD_KEY, ModelRecord, module_weights

__all__ = ["EXPORT_INFO", "ExportResult", "export_checkpoint", "read_checkpoint"]

#: The file describing the export, written beside it.
EXPORT_INFO = "lightning_dcp_export.json"


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote.

    Attributes:
        out: the folder.
        kind: ``"transformer"`` (a ``save_pretrained`` folder), ``"lora"`` (the pipeline's LoRA file) or
            ``"pipeline"`` (a whole pipeline folder).
        weights: ``"ema"`` or ``"raw"``.
        record: the transformer's class, config and adapter config.
        step: the checkpoint's global step.
    """

    out: Path
    kind: str
    weights: str
    record: ModelRecord
    step: int


def _load_sharded_states(path: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of a sharded (``torch.distributed.checkpoint``) directory whose flattened keys start with one of
    ``prefixes``, read whole on this process (``no_dist``)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata) and k.startswith(prefixes)}
    load(flat, checkpoint_id=str(path), no_dist=True)
    return flat


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint as a dict: a file (``torch.load`` on the CPU), or a sharded directory (its
    ``meta.pt`` with ``"state_dict"`` filled from the shards, whole)."""
    from lightning_dcp.runtime.checkpoint import METADATA_FILENAME, SHARDED_STATE, is_sharded_checkpoint

    path = Path(path)
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=False)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is neither a checkpoint file nor a sharded checkpoint directory (with "
                                f"{METADATA_FILENAME}); pass a .ckpt file or a directory DCPStrategy(sharding=...) wrote")
    checkpoint = torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=False)
    prefix = "state_dict."
    sharded = {s[SHARDED_STATE]: s for s in (checkpoint.get("callbacks") or {}).values()
               if isinstance(s, dict) and SHARDED_STATE in s}  # callback states with entries in the shards (EMA)
    flat = _load_sharded_states(path, (prefix, *(f"{name}." for name in sharded)))
    checkpoint["state_dict"] = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
    for name, state in sharded.items():
        for key, value in flat.items():
            if key.startswith(f"{name}."):
                entry, _, inner = key[len(name) + 1:].partition(".")  # e.g. "shadow", "model.blocks.0...."
                state.setdefault(entry, {})[inner] = value
    return checkpoint


def _ema_state(checkpoint: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    """The EMA callback's averages in ``checkpoint`` (keys like the module's parameters), or None."""
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if str(key).startswith("EMA") and isinstance(state, Mapping) and state.get("shadow"):
            return dict(state["shadow"])
    return None


def _lora_layers(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's weights keyed as ``load_lora_weights`` expects (peft's state dict: the adapter name dropped)."""
    from lightning_dcp.diffusers.lora import ADAPTER_NAME

    tag = f".{ADAPTER_NAME}."
    return {k.replace(tag, "."): v.contiguous() for k, v in weights.items() if ".lora_" in k}


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, ema: bool | None = None,
                      pipeline: str | Path | None = None, dtype: torch.dtype | None = None) -> ExportResult:
    """Write the diffusers folder of ``checkpoint`` to ``out`` (see the module docstring).

    Args:
        checkpoint: a ``.ckpt`` file or a sharded checkpoint directory of a ``VideoDiffusionModule`` fit.
        out: the output folder (created; files of the same names are replaced).
        ema: ``True``: the EMA averages (an error if the checkpoint has none); ``False``: the trained weights;
            ``None``: the averages when there are some.
        pipeline: also write the whole pipeline: its other components from this pipeline folder, hub id or tiny
            model name (a LoRA is fused into the base's transformer).
        dtype: cast the exported weights (e.g. ``torch.bfloat16``); default as trained.

    Raises:
        ValueError: not a ``VideoDiffusionModule`` checkpoint, or ``ema=True`` without averages.
    """
    data = read_checkpoint(checkpoint)
    if RECORD_KEY not in data:
        raise ValueError(f"{checkpoint} has no {RECORD_KEY!r} entry: not written by lightning_dcp.diffusers."
                         "VideoDiffusionModule (or by a version before export existed); export rebuilds the "
                         "transformer from it")
    record = ModelRecord.from_dict(data[RECORD_KEY])
    averages = _ema_state(data) if ema is not False else None
    if ema and averages is None:
        raise ValueError(f"{checkpoint} holds no EMA averages (train with the lightning_dcp.EMA callback), so "
                         "ema=True cannot be exported; export the trained weights with ema=False")
    weights = module_weights(data["state_dict"], averages)
    if dtype is not None:
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(out=out, weights="ema" if averages is not None else "raw", record=record,
                  step=int(data.get("global_step", 0)))
    if pipeline is not None:
        _write_pipeline(record, weights, pipeline, out)
        kind = "pipeline"
    elif record.lora is not None:
        import diffusers

        from lightning_dcp.diffusers.family import FAMILIES

        cls = getattr(diffusers, FAMILIES[record.class_name].pipeline)
        cls.save_lora_weights(out, transformer_lora_layers=_lora_layers(weights), safe_serialization=True,
                              transformer_lora_adapter_metadata=record.lora)
        kind = "lora"
    else:
        _transformer(record, weights).save_pretrained(out, safe_serialization=True)
        kind = "transformer"
    exported = ExportResult(kind=kind, **result)
    info = {"checkpoint": str(checkpoint), "kind": kind, "weights": exported.weights, "step": exported.step,
            "class_name": record.class_name, "lora": record.lora is not None}
    (out / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return exported


def _transformer(record: ModelRecord, weights: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """The record's transformer (no adapter) holding ``weights``, built without initialising random weights."""
    from accelerate import init_empty_weights

    plain = ModelRecord(record.class_name, record.config, None)
    with init_empty_weights():
        model = plain.build()
    model.load_state_dict(dict(weights), assign=True)
    return model


def _write_pipeline(record: ModelRecord, weights: Mapping[str, torch.Tensor], source: str | Path, out: Path) -> None:
    """The whole pipeline of ``source`` with the trained transformer (a LoRA fused into the base's) in ``out``."""
    import diffusers

    from lightning_dcp.diffusers.family import FAMILIES
    from lightning_dcp.diffusers.tiny import is_tiny, tiny_components

    cls = getattr(diffusers, FAMILIES[record.class_name].pipeline)
    if record.lora is None:
        transformer = _transformer(record, weights)
        pipe = (cls(**{**tiny_components(str(source)), "transformer": transformer}) if is_tiny(str(source))
                else cls.from_pretrained(str(source), transformer=transformer))
    else:
        import tempfile

        pipe = cls(**tiny_components(str(source))) if is_tiny(str(source)) else cls.from_pretrained(str(source))
        with tempfile.TemporaryDirectory() as lora:  # the LoRA file (with its alpha) as the pipeline loads it
            cls.save_lora_weights(lora, transformer_lora_layers=_lora_layers(weights), safe_serialization=True,
                                  transformer_lora_adapter_metadata=record.lora)
            pipe.load_lora_weights(lora, adapter_name="trained")
        pipe.fuse_lora(components=["transformer"], adapter_names=["trained"])
        pipe.unload_lora_weights()
    pipe.save_pretrained(out, safe_serialization=True)
