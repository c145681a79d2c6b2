"""LoRA on a diffusers video transformer, the way diffusers' own training scripts add it: :func:`add_lora`,
:func:`lora_state_dict`, :func:`save_lora`.

* :func:`lora_config` builds peft's ``LoraConfig`` with the family's default target modules
  (:attr:`~lightning_dcp.diffusers.family.VideoFamily.lora_targets`: the attention projections
  ``to_q``, ``to_k``, ``to_v``, ``to_out.0``, as diffusers' scripts for these models target) and
  ``init_lora_weights="gaussian"``, ``lora_alpha = rank``;
* :func:`add_lora` is ``transformer.add_adapter(config)`` (diffusers' ``PeftAdapterMixin``): peft
  wraps the targeted ``nn.Linear`` s, and only the adapter weights require gradients. The packed
  forward calls those modules as the model's own forward does, so it needs nothing else; the
  adapter can go on before or after :func:`~lightning_dcp.diffusers.adapt`;
* :func:`lora_state_dict` is peft's ``get_peft_model_state_dict`` (the keys ``load_lora_weights``
  expects, without the adapter name);
* :func:`save_lora` writes them with the family pipeline's ``save_lora_weights``
  (``pytorch_lora_weights.safetensors``, ``transformer.``-prefixed keys, the adapter's config as
  metadata), which ``<Pipeline>.from_pretrained(...).load_lora_weights(folder)`` reads back;
* :func:`check_adapter` refuses what the packed forward cannot train exactly: peft's ``target_parameters``
  (``ParamWrapper``), which reparametrises a module's parameter only inside that module's own ``forward``. Every
  module peft wraps (``target_modules``: Linear and Conv layers, the patch embedding included -- a LoRA, DoRA or
  ``modules_to_save`` wrapper) is run through its wrapper, so it trains as under diffusers' own forward.

Needs ``peft`` (``pip install "lightning-dcp[diffusers]"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from lightning_dcp.diffusers.family import family_of

__all__ = ["ADAPTER_NAME", "LORA_WEIGHTS_FILE", "add_lora", "check_adapter", "has_lora", "lora_config", "lora_state_dict",
           "save_lora", "trainable_state"]

#: The adapter name :func:`add_lora` uses (peft's default).
ADAPTER_NAME = "default"
#: The file ``save_lora_weights`` writes (diffusers' ``LORA_WEIGHT_NAME_SAFE``).
LORA_WEIGHTS_FILE = "pytorch_lora_weights.safetensors"


def _peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise ImportError('LoRA training needs peft, which is not installed: pip install "lightning-dcp[diffusers]" '
                          '(or pip install "peft>=0.17")') from err
    return peft


def lora_config(model: nn.Module, rank: int = 16, alpha: float | None = None,
                target_modules: Sequence[str] | None = None, dropout: float = 0.0,
                init_lora_weights: bool | str = "gaussian") -> Any:
    """peft's ``LoraConfig`` for ``model``'s family: ``r=rank``, ``lora_alpha=alpha`` (default ``rank``),
    ``target_modules`` (default the family's :attr:`~lightning_dcp.diffusers.family.VideoFamily.lora_targets`).

    Raises:
        ValueError: ``rank`` below 1, or ``dropout`` outside ``[0, 1)``.
        TypeError: a model of no supported family (naming them).
    """
    peft = _peft()
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA rank must be an int >= 1, got {rank!r}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    targets = list(target_modules) if target_modules is not None else list(family_of(model).lora_targets)
    return peft.LoraConfig(r=rank, lora_alpha=float(alpha if alpha is not None else rank), target_modules=targets,
                           lora_dropout=float(dropout), init_lora_weights=init_lora_weights)


def add_lora(model: nn.Module, config: Any = 16) -> nn.Module:
    """Add a LoRA adapter to a diffusers transformer in place, as diffusers' training scripts do
    (``model.add_adapter(config)``): only the adapter weights require gradients afterwards.

    Args:
        model: a diffusers video transformer (adapted for DCP or not).
        config: peft's ``LoraConfig``, or an int: the rank of :func:`lora_config`'s default for the family.

    Raises:
        ValueError: the model has a LoRA adapter already, or the config's target modules match nothing.
    """
    _peft()
    if isinstance(config, int) and not isinstance(config, bool):
        config = lora_config(model, rank=config)
    if has_lora(model):
        raise ValueError(f"{type(model).__name__} has a LoRA adapter already ({sorted(model.peft_config)}); add one "
                         "adapter per run")
    parameters = sorted(getattr(config, "target_parameters", None) or ())
    if parameters:
        raise ValueError(_parameter_refusal(model, parameters))
    try:
        model.add_adapter(config, adapter_name=ADAPTER_NAME)
    except ValueError as err:
        raise ValueError(f"LoRA on {type(model).__name__}: {err}. Target modules {sorted(config.target_modules)}; the "
                         f"family's default is {list(family_of(model).lora_targets)}") from err
    check_adapter(model)
    return model


def _parameter_refusal(model: nn.Module, parameters: Sequence[str]) -> str:
    return (f"LoRA on {type(model).__name__}: target_parameters {list(parameters)} cannot train under the packed "
            "forward (peft's ParamWrapper applies the adapter only inside the module's own forward, which the packed "
            "forward does not call; the adapter would get no gradient). Target modules instead (target_modules=[...], "
            f"the family's default: {list(family_of(model).lora_targets)}), or train those parameters in a full "
            "fine-tune (lora rank 0)")


def check_adapter(model: nn.Module) -> None:
    """Refuse a peft adapter the packed forward would not train exactly (see the module docstring): raises
    ``ValueError`` naming each wrapped parameter and the fix. Called by :func:`add_lora` and by
    :class:`~lightning_dcp.diffusers.VideoDiffusionModule` (at construction and at fit start), so an adapter added
    with ``model.add_adapter`` directly is checked too."""
    wrapped = [f"{name}.{m.parameter_name}" if name else str(m.parameter_name) for name, m in model.named_modules()
               if type(m).__name__ == "ParamWrapper" and hasattr(m, "parameter_name")]
    if wrapped:
        raise ValueError(_parameter_refusal(model, wrapped))


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries a peft adapter (:func:`add_lora` or ``add_adapter``)."""
    return bool(getattr(model, "_hf_peft_config_loaded", False)) and bool(getattr(model, "peft_config", None))


def lora_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights of ``model`` keyed as ``load_lora_weights`` expects (peft's ``get_peft_model_state_dict``):
    ``blocks.0.attn1.to_q.lora_A.weight``, ... With ``state`` (e.g. the EMA of the adapter weights, keyed as
    ``model.named_parameters()``), its values instead of the model's."""
    from peft.utils import get_peft_model_state_dict

    if not has_lora(model):
        raise ValueError(f"{type(model).__name__} has no LoRA adapter (add_lora / VideoDiffusionModule(lora=...))")
    return {k: v.detach() for k, v in get_peft_model_state_dict(model, state_dict=dict(state) if state is not None
                                                                 else None, adapter_name=ADAPTER_NAME).items()}


def save_lora(model: nn.Module, out: str | Path, state: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write ``model``'s adapter (or ``state``'s values for it, see :func:`lora_state_dict`) to the folder ``out``
    with the family pipeline's ``save_lora_weights``; load it with ``<Pipeline>.load_lora_weights(out)``.

    Returns:
        The written ``.safetensors`` file.
    """
    import diffusers

    family = family_of(model)
    pipeline = getattr(diffusers, family.pipeline)
    weights = {k: v.to("cpu", copy=True).contiguous() for k, v in lora_state_dict(model, state).items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pipeline.save_lora_weights(out, transformer_lora_layers=weights, safe_serialization=True,
                               transformer_lora_adapter_metadata=model.peft_config[ADAPTER_NAME].to_dict())
    return out / LORA_WEIGHTS_FILE


def trainable_state(module: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a ``state_dict`` of ``module`` that belong to parameters requiring gradients (a LoRA run's
    adapter weights): what a checkpoint of a run with a frozen base keeps."""
    keep = {n for n, p in module.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in keep}
