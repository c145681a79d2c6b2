"""Prepare a diffusers Wan transformer for DCP in place: :func:`adapt_wan`.

Every family, looked up: :func:`~lightning_dcp.diffusers.dispatch.adapt`.
"""

from __future__ import annotations

from torch import nn

from lightning_dcp.diffusers.attention import DCPWanAttnProcessor
from lightning_dcp.sp.recompute import LayerRecompute, RepeatedLayers

__all__ = ["adapt_wan", "is_wan_adapted"]


def _check_supported(model: nn.Module) -> None:
    name = type(model).__name__
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as err:  # pragma: no cover - diffusers too old to have Wan
        raise ImportError(f"lightning_dcp.diffusers needs diffusers>=0.35 (WanTransformer3DModel): {err}; "
                          'pip install "lightning-dcp[diffusers]"') from err
    if not isinstance(model, WanTransformer3DModel):
        raise TypeError(f"adapt_wan takes a WanTransformer3DModel, got {name}; use lightning_dcp.diffusers.adapt")
    config = model.config
    if getattr(config, "pos_embed_seq_len", None):
        raise NotImplementedError(
            f"lightning_dcp.diffusers.adapt: {name} with pos_embed_seq_len={config.pos_embed_seq_len} (Wan 2.1 FLF2V, "
            "first-last-frame) pairs the image embeddings of two images per sample inside its image embedder, which "
            "the packed forward does not do yet; T2V, I2V and TI2V Wan models are supported.")
    heads, dim = int(config.num_attention_heads), int(config.attention_head_dim)
    if dim % 2 or heads < 1:
        raise ValueError(f"lightning_dcp.diffusers.adapt: {name} has {heads} heads of dim {dim}; rotary embeddings "
                         "need an even head dim")
    for i, block in enumerate(model.blocks):
        for attn in (block.attn1, block.attn2):
            processor = attn.processor
            if isinstance(processor, DCPWanAttnProcessor):
                continue
            if not callable(processor) or type(processor).__name__ != "WanAttnProcessor":
                raise ValueError(f"lightning_dcp.diffusers.adapt: block {i} of {name} uses the attention processor "
                                 f"{type(processor).__name__}, not diffusers' WanAttnProcessor; the packed processor "
                                 "replaces that one only (reset it with model.set_attn_processor(WanAttnProcessor()) "
                                 "before adapting)")


def adapt_wan(model: nn.Module, *, recompute_override: int | None = None) -> nn.Module:
    """Prepare a diffusers ``WanTransformer3DModel`` (Wan 2.1 / 2.2) for DCP, in place.

    * attention: every ``WanAttention`` gets a :class:`~lightning_dcp.diffusers.attention.DCPWanAttnProcessor`:
      in :func:`~lightning_dcp.diffusers.dispatch.packed_forward` it runs Ulysses self-attention over the SP
      group of the micro-batch and per-sample cross-attention; any other call (the model's own
      ``forward``, a diffusers pipeline) goes to the processor it had, so inference is unchanged.
    * recompute: ``model.dcp_recompute`` (a :class:`~lightning_dcp.sp.recompute.LayerRecompute`)
      checkpoints block ``i`` in the packed forward iff ``i < active_context().recompute`` (or its
      ``recompute_override``), non-reentrant; no module is wrapped or moved, so ``state_dict`` keys
      are unchanged.
    * ``model.dcp_num_heads`` (SP sizes must divide it) and ``model.dcp_repeated_layers()`` (the blocks
      in call order, for the profiler and the strategy).
    * ``model.dcp_cost_per_sample = True``: every sample's cross-attention projects its text whatever the
      video's length, so the profile's time fit gets a per-sample term
      (:class:`~lightning_dcp.planning.profiled.ProfiledCostModel`).

    Calling it again is a no-op apart from a new ``recompute_override``.

    Raises:
        NotImplementedError: Wan FLF2V -- the message says what is missing.
        TypeError: not a ``WanTransformer3DModel``.
        ValueError: a Wan model with a custom attention processor.
    """
    _check_supported(model)
    for block in model.blocks:
        for attn in (block.attn1, block.attn2):
            if not isinstance(attn.processor, DCPWanAttnProcessor):
                attn.set_processor(DCPWanAttnProcessor(attn.processor))
    switch = getattr(model, "dcp_recompute", None)
    if isinstance(switch, LayerRecompute) and len(switch) == len(model.blocks):
        switch.recompute_override = recompute_override
    else:
        switch = LayerRecompute(len(model.blocks), recompute_override=recompute_override)
    model.dcp_recompute = switch
    model.dcp_num_heads = int(model.config.num_attention_heads)
    # every sample's cross-attention projects its text (text_len tokens) whatever the video's length:
    # the profiled cost model fits a per-sample term for it (lightning_dcp.planning.profiled)
    model.dcp_cost_per_sample = True
    model.dcp_repeated_layers = RepeatedLayers(model.blocks)
    return model


def is_wan_adapted(model: nn.Module) -> bool:
    """Whether :func:`adapt_wan` has prepared ``model`` (its recompute switch and packed processors are in place)."""
    blocks = getattr(model, "blocks", None)
    return (isinstance(getattr(model, "dcp_recompute", None), LayerRecompute) and isinstance(blocks, nn.ModuleList)
            and all(isinstance(b.attn1.processor, DCPWanAttnProcessor) and isinstance(b.attn2.processor, DCPWanAttnProcessor)
                    for b in blocks))
