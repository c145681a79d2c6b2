"""What the packed forwards of the cross-attention families (Wan, LTX-Video) share: the input keys, the
shard's sample segments and one check of a packed micro-batch (:func:`check_packed_inputs`).

Each family's own packed forward lives in :mod:`lightning_dcp.diffusers.families`; every family, looked
up: :func:`~lightning_dcp.diffusers.dispatch.packed_forward`.

Batch keys read (besides :func:`~lightning_dcp.sp.packing.pack_samples`' ``cu_seqlens``/``max_seqlen``):
:data:`HIDDEN_STATES` and :data:`TIMESTEP` (per token; :class:`~lightning_dcp.diffusers.VideoDiffusionModule`
adds them from the clean latents), :data:`~lightning_dcp.diffusers.samples.VIDEO_POS` (per token),
:data:`~lightning_dcp.diffusers.samples.GRID` and :data:`~lightning_dcp.diffusers.samples.TEXT`
(per sample, whole on every SP rank), optionally :data:`~lightning_dcp.diffusers.samples.IMAGE`.
Shards are contiguous token chunks (:func:`lightning_dcp.sp.tokens.shard_batch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dcp.diffusers.samples import IMAGE, TEXT, VIDEO_POS, per_sample_embeds

__all__ = ["HIDDEN_STATES", "TIMESTEP", "PackedInputs", "check_packed_inputs", "concat_tokens", "embed_patches",
           "local_segments"]

#: The model's input tokens ``[tokens, in_channels*pt*ph*pw]`` (input layout): noisy latents (+ condition channels).
HIDDEN_STATES = "hidden_states"
#: Per-token diffusion timestep (float ``[tokens]``, in the scheduler's ``[0, num_train_timesteps]`` units).
TIMESTEP = "timestep"


def local_segments(lengths: list[int], local: int, sp_size: int, sp_rank: int) -> list[tuple[int, int, int]]:
    """``(sample, start, end)`` in this shard's local token indices, for every sample with tokens here."""
    lo, out, start = sp_rank * local, [], 0
    for j, n in enumerate(lengths):
        a, b = max(start, lo), min(start + n, lo + local)
        if b > a:
            out.append((j, a - lo, b - lo))
        start += n
    return out


def concat_tokens(parts: list[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Concatenate ``[1, n_i, d]`` tensors along tokens; also the running offsets (``len(parts) + 1``)."""
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + int(p.shape[1]))
    if not parts:
        return like[:, :0], bounds
    return torch.cat(parts, dim=1), bounds


def embed_patches(proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``[rows, dim]``: patch rows ``x`` (``[rows, C*kt*kh*kw]``, channel-major, as the conv's weight flattens)
    through the model's patch projection ``proj``, as its own forward computes it on the whole latent.

    A plain ``Conv2d`` / ``Conv3d`` (kernel = stride, as every family's patch embedding) is the equivalent linear
    map on the flattened patches (one matrix product). Anything else -- a ``Linear`` (CogVideoX 1.5), or a conv
    wrapped by peft (a LoRA / DoRA adapter on the patch embedding, several adapters, a merged or disabled one) -- is
    called as a module, the conv on each patch as an image of exactly one patch, so the wrapper's own forward
    runs and its adapter trains.
    """
    if type(proj) in (nn.Conv2d, nn.Conv3d):
        return F.linear(x, proj.weight.flatten(1), proj.bias)
    base = _base_layer(proj)
    if isinstance(base, nn.Linear):
        return proj(x)
    if not isinstance(base, (nn.Conv2d, nn.Conv3d)):
        raise TypeError(f"the patch projection is a {type(base).__name__}; the packed forward takes an nn.Conv2d, "
                        "nn.Conv3d or nn.Linear (diffusers' own), optionally wrapped by peft")
    kernel = tuple(base.kernel_size)
    if (tuple(base.stride) != kernel or any(base.padding) or any(d != 1 for d in base.dilation) or base.groups != 1
            or x.shape[-1] != base.in_channels * math.prod(kernel)):
        raise ValueError(f"the patch projection {base} is not a patchify conv (kernel = stride, no padding) over rows "
                         f"of {x.shape[-1]} features; the packed forward cannot embed patch rows with it")
    return proj(x.reshape(x.shape[0], base.in_channels, *kernel)).flatten(1)


def _base_layer(module: nn.Module) -> nn.Module:
    """The module a peft wrapper wraps (a LoRA layer's ``base_layer``, ``modules_to_save``'s original), unwrapped."""
    for _ in range(8):
        inner = (module.get_base_layer() if hasattr(module, "get_base_layer")
                 else getattr(module, "original_module", None))
        if not isinstance(inner, nn.Module) or inner is module:
            return module
        module = inner
    return module


@dataclass(frozen=True)
class PackedInputs:
    """What one family's packed forward takes, for :func:`check_packed_inputs` and its messages.

    Args:
        family: the family's name in messages (``"Wan"``, ``"LTX"``).
        width: the features per token of :data:`HIDDEN_STATES`.
        takes: how the model's token width is made, e.g. ``"[tokens, in_channels x patch] = [tokens, 16 x 4]"``.
        builder: the sample function, e.g. ``"lightning_dcp.diffusers.video_sample"``.
        builder_hint: what else to say about the samples' width (patch size, condition channels).
        text_dim: the text embeddings' width and the config name of it (``(4096, "text_dim")``), or ``None``.
        image_model: the model cross-attends to image embeddings (Wan 2.1 I2V): every sample needs them;
            else the batch must have none.
        no_image: why the model takes no image embeddings (the end of that error).
        rope_limit: the rotary table's positions per axis (a grid side may reach it), or ``None``.
    """

    family: str
    width: int
    takes: str
    builder: str
    builder_hint: str = ""
    text_dim: tuple[int, str] | None = None
    image_model: bool = False
    no_image: str = "has no image cross-attention; drop them"
    rope_limit: int | None = None


def check_packed_inputs(spec: PackedInputs, batch: Mapping[str, Any], x: torch.Tensor,
                        grids: list[tuple[int, int, int]], labels: list[str], sp_size: int) -> None:
    """Refuse a malformed packed micro-batch before it reaches the model, naming the samples and the fix.

    Raises:
        ValueError: a token width other than ``spec.width``, a per-token key with another row count, a grid past
            the rotary table, more grid tokens than the SP group holds, a sample without text or with text of the
            wrong width, image embeddings missing or unexpected.
    """
    name = f"packed {spec.family} forward"
    if x.dim() != 2 or x.shape[1] != spec.width:
        raise ValueError(f"{name}: {HIDDEN_STATES!r} has shape {tuple(x.shape)}, but the model takes {spec.takes}; build "
                         f"samples with {spec.builder}{spec.builder_hint}")
    for key in (VIDEO_POS, TIMESTEP):
        value = batch.get(key)
        if not isinstance(value, torch.Tensor) or value.shape[0] != x.shape[0]:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name}: {key!r} must be a per-token tensor with {x.shape[0]} rows like "
                             f"{HIDDEN_STATES!r}, got {got}")
    if spec.rope_limit is not None:  # table rows 0..limit-1: a grid side of exactly limit fits, as in diffusers
        for label, grid in zip(labels, grids):
            if max(grid) > spec.rope_limit:
                raise ValueError(f"{label}: patch grid (frames, rows, columns) = {grid} is longer than the model's "
                                 f"rotary table (rope_max_seq_len={spec.rope_limit} positions per axis); use a smaller "
                                 "video or a model configured with a larger rope_max_seq_len")
    total = sum(math.prod(g) for g in grids)
    if total > x.shape[0] * sp_size:
        raise ValueError(f"{name}: the samples' grids {grids} hold {total} tokens but the SP group holds "
                         f"{x.shape[0]} x {sp_size}; the batch must be packed from these samples (pack_samples) and "
                         "sharded in contiguous chunks (lightning_dcp.sp.tokens.shard_batch)")
    texts = batch.get(TEXT)
    missing = [label for j, label in enumerate(labels) if texts is None or j >= len(texts) or texts[j] is None]
    if missing:
        raise ValueError(f"{', '.join(missing)}: no text embeddings ({TEXT!r}); every sample needs its text encoder "
                         "output (an empty prompt's for unconditional samples): build samples with "
                         f"{spec.builder}(latents, encoder_hidden_states, ...)")
    if spec.text_dim is not None:
        dim, config_name = spec.text_dim
        wrong = [label for j, label in enumerate(labels) if per_sample_embeds(texts[j]).shape[-1] != dim]
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: text embeddings must have {config_name}={dim} features (the text "
                             "encoder's width)")
    images = batch.get(IMAGE)
    if spec.image_model and (images is None or any(im is None for im in images)):
        raise ValueError(f"the {spec.family} model is image-conditioned (Wan 2.1 I2V: image_dim/added_kv_proj_dim set) "
                         f"but {', '.join(labels)} carry no image embeddings; pass encoder_hidden_states_image to "
                         f"{spec.builder} for every sample")
    if not spec.image_model and images is not None:
        raise ValueError(f"the batch has image embeddings ({IMAGE!r}) but the {spec.family} model {spec.no_image}")
