"""Video samples in the token-first form DCP packs: patchify, :func:`video_sample`, unpatchify.

A DCP sample is a dict whose sequence tensors have the token dimension first
(:func:`lightning_dcp.sp.packing.pack_samples` concatenates them and the strategy shards them
over the SP group). A video latent ``[C, F, H, W]`` becomes ``(F/pt)*(H/ph)*(W/pw)`` tokens (the
dataset's ``lengths``), each the flattened ``C x pt x ph x pw`` patch under it, in the order the
model's ``Conv3d`` patch embedding reads it (its weight ``[D, C, pt, ph, pw]`` flattened), so the
patch embedding of a token is one matrix product with the same parameters.

Sample keys made by :func:`video_sample`:

* :data:`LATENTS` ``[tokens, C*pt*ph*pw]`` -- the clean latent patches (input layout);
* :data:`VIDEO_POS` ``[tokens, 3]`` int64 -- each token's (frame, row, column) on the patch grid,
  for the rotary embedding (sharded with the tokens);
* :data:`GRID` -- ``(F/pt, H/ph, W/pw)``, per-sample metadata;
* :data:`TEXT` ``(embeds,)`` -- the text encoder's embeddings ``[text_tokens, text_dim]``,
  zero-padded to ``text_len`` tokens as Wan does, in a 1-tuple: the packer keeps tuples per sample
  (a bare tensor would be concatenated as a token tensor whenever a video happens to have as many
  tokens as its first dimension);
* optional :data:`IMAGE` ``(embeds,)`` ``[image_tokens, image_dim]`` (Wan 2.1 I2V's CLIP image embeddings),
  :data:`CONDITION` ``[tokens, C_cond*pt*ph*pw]`` (extra input channels concatenated after
  noising, e.g. I2V's mask + first-frame latents) and :data:`SAMPLE_INDEX` (the dataset index,
  which the flow-matching noise is keyed on under a plain DataLoader).

The model's output patches are in diffusers' *output layout* ``pt x ph x pw x C`` (channels
last, how ``proj_out`` is unpatchified); :func:`unpatchify` turns them back into ``[C, F, H, W]``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from lightning_dcp.sp.context import SAMPLE_INDICES
from lightning_dcp.sp.packing import pack_samples

__all__ = ["CONDITION", "GRID", "IMAGE", "LATENTS", "SAMPLE_INDEX", "TEXT", "VIDEO_POS", "check_latent_shape",
           "collate_video", "grid_positions", "input_to_output_layout", "patchify", "per_sample_embeds", "sample_labels",
           "unpack_output", "unpatchify",
           "video_sample"]

#: Clean latent patches ``[tokens, C*pt*ph*pw]`` (input layout: channel-major, as the Conv3d weight).
LATENTS = "latents"
#: Per-token (frame, row, column) on the patch grid, int64 ``[tokens, 3]``.
VIDEO_POS = "video_pos"
#: Per-sample ``(F/pt, H/ph, W/pw)``.
GRID = "video_grid"
#: Per-sample text embeddings, a 1-tuple ``(tensor [text_tokens, text_dim],)``.
TEXT = "encoder_hidden_states"
#: Per-sample image embeddings, a 1-tuple ``(tensor [image_tokens, image_dim],)`` (Wan 2.1 I2V), optional.
IMAGE = "encoder_hidden_states_image"
#: Extra input channels ``[tokens, C_cond*pt*ph*pw]`` concatenated after noising (I2V), optional.
CONDITION = "condition_latents"
#: The sample's dataset index (per-sample int), optional.
SAMPLE_INDEX = "sample_index"


def _patch(patch_size: Sequence[int]) -> tuple[int, int, int]:
    p = tuple(int(v) for v in patch_size)
    if len(p) != 3 or min(p) < 1:
        raise ValueError(f"patch_size must be (t, h, w) of positive ints, got {tuple(patch_size)}")
    return p  # type: ignore[return-value]


def _where(index: int | None) -> str:
    return "a sample" if index is None else f"sample {index}"


def check_latent_shape(shape: Sequence[int], patch_size: Sequence[int], index: int | None = None) -> tuple[int, int, int]:
    """The patch grid ``(F/pt, H/ph, W/pw)`` of a latent ``[C, F, H, W]``; raises naming the sample and the fix."""
    pt, ph, pw = _patch(patch_size)
    if len(shape) != 4:
        raise ValueError(f"{_where(index)}: latents must be [channels, frames, height, width] (one video, no batch "
                         f"dimension), got shape {tuple(shape)}")
    _, f, h, w = (int(d) for d in shape)
    bad = [(name, n, p) for name, n, p in (("frames", f, pt), ("height", h, ph), ("width", w, pw)) if n % p or n < p]
    if bad:
        what = ", ".join(f"latent {name} {n} is not a positive multiple of the patch {name} {p}" for name, n, p in bad)
        raise ValueError(
            f"{_where(index)}: {what} (latent shape {tuple(shape)}, patch {(pt, ph, pw)}). Crop or resize the video so "
            f"every latent size is a multiple of its patch size (in pixels: height and width multiples of the VAE's "
            f"spatial stride x the patch, e.g. 8 x {ph} = {8 * ph} with Wan 2.1's VAE, 16 x {ph} = {16 * ph} with "
            f"Wan 2.2 TI2V-5B's), or drop the sample.")
    return f // pt, h // ph, w // pw


def patchify(latent: torch.Tensor, patch_size: Sequence[int], index: int | None = None) -> torch.Tensor:
    """``[C, F, H, W]`` -> ``[tokens, C*pt*ph*pw]``, tokens frame-major (as diffusers flattens the patch grid),
    each token's features channel-major (the Conv3d weight's order)."""
    grid = check_latent_shape(latent.shape, patch_size, index)
    pt, ph, pw = _patch(patch_size)
    c = latent.shape[0]
    x = latent.reshape(c, grid[0], pt, grid[1], ph, grid[2], pw)
    return x.permute(1, 3, 5, 0, 2, 4, 6).reshape(math.prod(grid), c * pt * ph * pw)


def unpatchify(tokens: torch.Tensor, grid: Sequence[int], patch_size: Sequence[int], layout: str = "output") -> torch.Tensor:
    """``[tokens, features]`` of one sample -> ``[C, F, H, W]``.

    ``layout="output"`` (default): features ``pt x ph x pw x C`` as the model's ``proj_out``
    produces them (diffusers' unpatchify); ``"input"``: ``C x pt x ph x pw`` as :func:`patchify` makes them.
    """
    pt, ph, pw = _patch(patch_size)
    f, h, w = (int(v) for v in grid)
    n, feat = tokens.shape
    if n != f * h * w or feat % (pt * ph * pw):
        raise ValueError(f"unpatchify: {n} tokens of {feat} features do not fit the grid {(f, h, w)} with patch "
                         f"{(pt, ph, pw)}")
    c = feat // (pt * ph * pw)
    if layout == "output":
        x = tokens.reshape(f, h, w, pt, ph, pw, c).permute(6, 0, 3, 1, 4, 2, 5)
    elif layout == "input":
        x = tokens.reshape(f, h, w, c, pt, ph, pw).permute(3, 0, 4, 1, 5, 2, 6)
    else:
        raise ValueError(f"layout must be 'output' or 'input', got {layout!r}")
    return x.reshape(c, f * pt, h * ph, w * pw)


def input_to_output_layout(tokens: torch.Tensor, patch_size: Sequence[int]) -> torch.Tensor:
    """Per-token features ``C x pt x ph x pw`` -> ``pt x ph x pw x C`` (any number of tokens, e.g. a shard)."""
    pt, ph, pw = _patch(patch_size)
    n, feat = tokens.shape
    return tokens.reshape(n, feat // (pt * ph * pw), pt * ph * pw).transpose(1, 2).reshape(n, feat)


def grid_positions(grid: Sequence[int]) -> torch.Tensor:
    """int64 ``[F*H*W, 3]``: (frame, row, column) of every token of a patch grid, frame-major."""
    f, h, w = (int(v) for v in grid)
    return torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 3)


def video_sample(latents: torch.Tensor, encoder_hidden_states: torch.Tensor | None, patch_size: Sequence[int] = (1, 2, 2),
                 *, text_len: int | None = 512, index: int | None = None,
                 encoder_hidden_states_image: torch.Tensor | None = None,
                 condition_latents: torch.Tensor | None = None) -> dict[str, Any]:
    """One training sample for :mod:`lightning_dcp.diffusers`, token-first (see the module docstring).

    Args:
        latents: the VAE latent of one video ``[C, F, H, W]`` (an image is ``F = 1``); any size whose
            F/H/W divide by the patch size.
        encoder_hidden_states: the text encoder's embeddings ``[text_tokens, text_dim]`` (or
            ``[1, text_tokens, text_dim]``); required -- an unconditional sample takes an empty
            prompt's embeddings.
        patch_size: the model's ``config.patch_size``.
        text_len: zero-pad the text to this many tokens (512: Wan's T5 length, which its pipeline
            pads to and the model attends over; Wan 2.1 I2V needs exactly 512); ``None`` keeps it.
        index: the sample's index in the dataset the DataLoader reads (the ``i`` of its
            ``__getitem__(i)``; for a ``ConcatDataset``, the index in the concatenation): named in
            errors, and stored as :data:`SAMPLE_INDEX` (the flow-matching noise is keyed on it when
            no DCP sampler gives the indices; under DCPStrategy a different index is refused).
        encoder_hidden_states_image: Wan 2.1 I2V image embeddings ``[image_tokens, image_dim]``.
        condition_latents: ``[C_cond, F, H, W]`` extra input channels (same F/H/W), not noised.

    Raises:
        ValueError: a size that does not divide by the patch size, a missing or malformed text,
            text longer than ``text_len`` -- each naming the sample index and the fix.
    """
    where = _where(index)
    if not isinstance(latents, torch.Tensor) or not latents.is_floating_point():
        raise ValueError(f"{where}: latents must be a floating tensor [C, F, H, W], got {type(latents).__name__}")
    grid = check_latent_shape(latents.shape, patch_size, index)
    out: dict[str, Any] = {LATENTS: patchify(latents, patch_size, index), VIDEO_POS: grid_positions(grid), GRID: grid}
    out[TEXT] = _per_sample_embeds(encoder_hidden_states, "encoder_hidden_states", where, text_len, required=True)
    if encoder_hidden_states_image is not None:
        out[IMAGE] = _per_sample_embeds(encoder_hidden_states_image, "encoder_hidden_states_image", where, None)
    if condition_latents is not None:
        if condition_latents.dim() != 4 or tuple(condition_latents.shape[1:]) != tuple(latents.shape[1:]):
            raise ValueError(f"{where}: condition_latents {tuple(condition_latents.shape)} must be [C_cond, F, H, W] with "
                             f"the latents' F, H, W {tuple(latents.shape[1:])}")
        out[CONDITION] = patchify(condition_latents, patch_size, index)
    if index is not None:
        out[SAMPLE_INDEX] = int(index)
    return out


def _per_sample_embeds(x: Any, name: str, where: str, pad_to: int | None, required: bool = False) -> tuple | None:
    if x is None:
        if required:
            raise ValueError(f"{where} has no {name} (text embeddings): Wan is text-conditioned and cross-attends to "
                             "them in every block. Pass the text encoder's output [text_tokens, text_dim]; for "
                             "unconditional training (classifier-free guidance dropout) pass an empty prompt's embeddings.")
        return None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() not in (2, 3) \
            or (x.dim() == 3 and x.shape[0] != 1) or x.shape[-2] < 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{where}: {name} must be a floating tensor [tokens, dim] (or [1, tokens, dim]) with at least "
                         f"one token, got {shape}")
    x = x.reshape(*x.shape[-2:])
    if pad_to is not None:
        n = x.shape[0]
        if n > pad_to:
            raise ValueError(f"{where}: {name} has {n} tokens, more than text_len={pad_to}; truncate the prompt's "
                             f"embeddings to {pad_to} tokens (as Wan's pipeline does) or raise text_len")
        if n < pad_to:
            x = torch.cat([x, x.new_zeros(pad_to - n, x.shape[1])])
    return (x,)


def collate_video(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``collate_fn`` for a plain DataLoader over :func:`video_sample` dicts (:func:`~lightning_dcp.sp.packing.pack_samples`)."""
    return pack_samples(samples)


def per_sample_embeds(value: Any) -> torch.Tensor:
    """``[1, tokens, dim]`` from a sample's :data:`TEXT` / :data:`IMAGE` entry (a 1-tuple, or a bare
    ``[tokens, dim]`` / ``[1, tokens, dim]`` tensor)."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor) or value.dim() not in (2, 3):
        raise ValueError("expected per-sample embeddings (a 1-tuple holding a [tokens, dim] tensor), got "
                         f"{type(value).__name__}")
    return value.reshape(1, *value.shape[-2:])


def sample_labels(batch: Mapping[str, Any]) -> list[str]:
    """How errors name each sample of a packed micro-batch: its dataset index when known, else its position."""
    num = len(batch[GRID]) if GRID in batch else 0
    indices = batch.get(SAMPLE_INDEX) or batch.get(SAMPLE_INDICES)
    if indices is not None and len(indices) == num:
        return [f"sample {int(i)}" for i in indices]
    return [f"sample #{j} of the micro-batch" for j in range(num)]


def unpack_output(output: torch.Tensor, batch: Mapping[str, Any], patch_size: Sequence[int],
                  layout: str = "output") -> list[torch.Tensor]:
    """The model's packed output ``[tokens, features]`` of a whole (unsharded) micro-batch -> ``[C, F, H, W]`` per sample.

    ``layout``: the output's per-token feature order (:func:`unpatchify`): ``"output"`` for Wan, ``"input"`` for
    LTX-Video, CogVideoX and HunyuanVideo (its family's
    :attr:`~lightning_dcp.diffusers.family.VideoFamily.output_layout`)."""
    out, start = [], 0
    for grid in batch[GRID]:
        n = math.prod(int(v) for v in grid)
        out.append(unpatchify(output[start:start + n], grid, patch_size, layout))
        start += n
    return out
