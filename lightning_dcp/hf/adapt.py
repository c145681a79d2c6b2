"""Prepare a Hugging Face causal LM for DCP in place: :func:`adapt`."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_dcp.hf.attention import ATTN_IMPLEMENTATION, register_attention
from lightning_dcp.sp.contract import install_contract
from lightning_dcp.sp.recompute import LayerRecompute, install_layer_recompute

__all__ = ["TESTED_MODEL_TYPES", "adapt", "find_decoder_layers", "is_adapted", "is_tested_family"]

#: ``config.model_type`` of the families whose packed forward equals the per-sample forward and
#: whose training under DCPStrategy (SP 2, recompute) equals plain single-process training, in
#: ``tests/test_hf.py`` (tiny random configs of transformers' own config classes). Any other
#: model with transformers' attention interface is adapted too, untested.
TESTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "gpt_neox", "olmo", "olmo2")


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a transformers model (``model.model.layers`` for Llama and kin).

    Looks at ``get_decoder().layers``, ``base_model.layers``, then ``model.layers``; raises a
    ``ValueError`` naming what was looked for when none is a non-empty ``ModuleList``.
    """
    candidates: list[tuple[str, Any]] = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            candidates.append(("get_decoder().layers", getattr(get_decoder(), "layers", None)))
        except Exception:  # some models raise when they have no decoder  # noqa: BLE001
            pass
    base = getattr(model, "base_model", None)
    candidates.append(("base_model.layers", getattr(base, "layers", None)))
    candidates.append(("layers", getattr(model, "layers", None)))
    for _, layers in candidates:
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    raise ValueError(
        f"lightning_dcp.hf.adapt: no decoder layer list found in {type(model).__name__} (looked for a non-empty "
        f"nn.ModuleList at {', '.join(name for name, _ in candidates)}); supported are transformers causal LMs "
        f"whose base model keeps its decoder layers in `.layers` (tested: {', '.join(TESTED_MODEL_TYPES)}).")


def _check_supported(model: nn.Module, layers: nn.ModuleList) -> None:
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"lightning_dcp.hf.adapt expects a transformers PreTrainedModel (e.g. LlamaForCausalLM), got "
                        f"{name}; for your own nn.Module use lightning_dcp.ulysses_attention and RecomputeLayers.")
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"lightning_dcp.hf.adapt: {name}'s attention modules do not use transformers' attention "
                         "interface (its class sets no `_supports_attention_backend`), so the 'lightning_dcp' "
                         "attention function cannot be plugged in; use a model family that does (tested: "
                         f"{', '.join(TESTED_MODEL_TYPES)}).")
    bad = [type(layer).__name__ for layer in layers if not isinstance(layer, GradientCheckpointingLayer)]
    if bad:
        raise ValueError(f"lightning_dcp.hf.adapt: decoder layers of {name} ({sorted(set(bad))}) do not subclass "
                         "transformers' GradientCheckpointingLayer, which the per-layer recompute switch needs; "
                         "upgrade transformers (>= 4.56) or use a supported model family.")
    config = model.config
    for attr in ("num_attention_heads", "hidden_size"):
        if not isinstance(getattr(config, attr, None), int):
            raise ValueError(f"lightning_dcp.hf.adapt: {type(config).__name__} has no integer {attr!r}; "
                             "cannot tell the attention head count the SP sizes must divide.")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise ValueError(f"lightning_dcp.hf.adapt: config.attention_dropout={config.attention_dropout} is not "
                         "supported by the varlen kernels; set it to 0.0 before adapting.")


def is_tested_family(model: nn.Module) -> bool:
    """Whether ``model.config.model_type`` is one of :data:`TESTED_MODEL_TYPES`."""
    return getattr(getattr(model, "config", None), "model_type", None) in TESTED_MODEL_TYPES


def adapt(model: nn.Module, *, recompute_override: int | None = None) -> nn.Module:
    """Prepare a transformers causal LM for DCP, in place.

    Tested families (:data:`TESTED_MODEL_TYPES`): Llama, Qwen2, Qwen3, Mistral, Gemma, Gemma 2
    (attention logit soft-capping included), Phi-3, GPT-NeoX, OLMo, OLMo 2.

    * attention: registers :func:`~lightning_dcp.hf.attention.dcp_attention` in transformers'
      ``AttentionInterface`` as ``"lightning_dcp"`` and switches the model to it (Ulysses over
      the active SP group, varlen causal attention per packed sample, GQA/MQA with fewer
      key/value heads than SP ranks, attention logit soft-capping). No model class is patched;
      no dense mask is built.
    * recompute: every decoder layer gets the per-call switch of one
      :class:`~lightning_dcp.sp.recompute.LayerRecompute` through transformers' own
      ``GradientCheckpointingLayer`` hook: layer ``i`` recomputes iff ``i < active_context().recompute``
      (or ``model.dcp_recompute.recompute_override`` when set), decided at each forward in
      training mode. Module paths and ``state_dict`` keys are unchanged.
    * ``model.dcp_num_heads``: the query head count (the strategy caps SP sizes at its divisors);
      ``model.dcp_repeated_layers()``: the decoder layers in call order (for the profiler);
      ``model.dcp_recompute``: the shared switch.

    Do not call ``model.gradient_checkpointing_enable()``/``_disable()`` afterwards: they replace
    the per-layer switch (call :func:`adapt` again to reinstall it).

    Call it with packed inputs: ``input_ids``/``position_ids`` of shape ``[1, local_tokens]`` and
    ``cu_seq_lens_q``/``max_length_q`` (see :mod:`lightning_dcp.hf.attention`), ``use_cache=False``.
    Calling it again is a no-op apart from a new ``recompute_override``.

    Raises:
        ValueError / TypeError: the model is not supported; the message names what is missing.
    """
    layers = find_decoder_layers(model)
    _check_supported(model, layers)
    register_attention()
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        setter = getattr(model, "set_attn_implementation", None)
        if callable(setter):
            setter(ATTN_IMPLEMENTATION)
        else:  # older transformers: the config attribute is what the attention modules read
            model.config._attn_implementation = ATTN_IMPLEMENTATION
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"lightning_dcp.hf.adapt: {type(model).__name__}.set_attn_implementation({ATTN_IMPLEMENTATION!r}) "
                         f"left it at {model.config._attn_implementation!r}; the model cannot switch attention "
                         "functions dynamically.")
    install_contract(model, layers, num_heads=model.config.num_attention_heads, recompute_override=recompute_override,
                     make_switch=lambda override: install_layer_recompute(layers, recompute_override=override))
    return model


def is_adapted(model: nn.Module) -> bool:
    """Whether :func:`adapt` has prepared ``model`` (and its attention is still ``"lightning_dcp"``)."""
    config = getattr(model, "config", None)
    return (isinstance(getattr(model, "dcp_recompute", None), LayerRecompute)
            and getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION)
