"""Joint-attention video DiTs (CogVideoX, HunyuanVideo): samples, packed rows and attention.

In a joint-attention DiT each sample's text tokens join its video tokens in one self-attention
sequence. DCP packs them that way: a joint sample's *rows* are its text tokens and its video
tokens, in the family's order (``[text; video]`` for CogVideoX, ``[video; text]`` for
HunyuanVideo), so

* the sample's length (the dataset's ``lengths``, what the planner, the cost models and the
  profiler see) is ``text tokens + video tokens`` -- the attention length;
* the packed micro-batch's ``cu_seqlens`` are the joint segments, and Ulysses SP shards text and
  video rows alike in contiguous chunks: a video's text may land on any rank of the SP group,
  and :func:`~lightning_dcp.sp.ulysses.ulysses_attention` joins every row of a sample in its
  segment after the all-to-all, whatever rank held it. Nothing is replicated across the group;
* per-row weights follow the row's *role*: HunyuanVideo's dual-stream blocks project text rows
  with their context weights (``add_q_proj``, ``ff_context``, ...), CogVideoX's expert adaptive
  norms modulate text rows with the text half of the norm (``enc_shift``, ...), exactly as the
  diffusers blocks treat their ``encoder_hidden_states``.

Sample keys (:func:`joint_sample`), token-first over the rows:
:data:`~lightning_dcp.diffusers.samples.LATENTS` (zeros on text rows),
:data:`~lightning_dcp.diffusers.samples.VIDEO_POS` (zeros on text rows), :data:`JOINT_TEXT`
(``0`` on video rows, ``k + 1`` on the row of text token ``k``) and ``labels`` (``-100`` on text
rows, so :func:`~lightning_dcp.sp.packing.pack_samples`' loss mask -- and the ``"token"`` /
``"sample"`` loss reductions -- count video tokens only); per sample the text embeddings
(:data:`~lightning_dcp.diffusers.samples.TEXT`, whole on every rank: each text row looks its
embedding up there) and the grid.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from lightning_dcp.diffusers.samples import (
    CONDITION,
    GRID,
    LATENTS,
    SAMPLE_INDEX,
    TEXT,
    VIDEO_POS,
    _per_sample_embeds,
    _where,
    check_latent_shape,
    grid_positions,
    patchify,
    per_sample_embeds,
    unpatchify,
)
from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, SEGMENT_IDS
from lightning_dcp.sp.packing import IGNORE_INDEX
from lightning_dcp.sp.ulysses import ulysses_attention

__all__ = ["JOINT_TEXT", "JointRows", "by_role", "check_row_width", "joint_attention", "joint_sample", "per_sample_timesteps",
           "per_token", "rotate", "row_roles", "text_rows_input", "unpack_joint_output", "video_rows"]

#: Per row of a joint sample: ``0`` on video rows, ``k + 1`` on the row of the sample's text token ``k``.
JOINT_TEXT = "joint_text_index"
#: Per row: ``-100`` on text rows (no loss), ``0`` on video rows; read by ``pack_samples`` for the loss mask.
LABELS = "labels"


def joint_sample(latents: torch.Tensor, encoder_hidden_states: torch.Tensor, patch_size: Sequence[int], *,
                 text_first: bool, index: int | None = None, condition_latents: torch.Tensor | None = None,
                 text_len: int | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One joint-attention training sample, its rows ``[text; video]`` (``text_first``) or ``[video; text]``.

    Args:
        latents: the VAE latent ``[C, F, H, W]`` of one video (F/H/W multiples of the patch).
        encoder_hidden_states: the text encoder's output ``[text_tokens, text_dim]`` (or ``[1, ...]``),
            exactly the tokens the model attends to (at least one).
        patch_size: ``(pt, ph, pw)``.
        text_first: the family's order (CogVideoX: text first; HunyuanVideo: video first).
        index: the sample's dataset index (named in errors; keys the flow-matching noise).
        condition_latents: ``[C_cond, F, H, W]`` extra input channels, not noised.
        text_len: zero-pad the text to this many tokens (``None``: keep it as given).
        extra: further per-sample values (e.g. HunyuanVideo's pooled projection), stored as given.
    """
    where = _where(index)
    if not isinstance(latents, torch.Tensor) or not latents.is_floating_point():
        raise ValueError(f"{where}: latents must be a floating tensor [C, F, H, W], got {type(latents).__name__}")
    grid = check_latent_shape(latents.shape, patch_size, index)
    (text,) = _per_sample_embeds(encoder_hidden_states, "encoder_hidden_states", where, text_len, required=True)
    video = patchify(latents, patch_size, index)
    n, m = video.shape[0], text.shape[0]
    text_rows = torch.arange(1, m + 1, dtype=torch.int64)

    def rows(video_part: torch.Tensor, text_part: torch.Tensor) -> torch.Tensor:
        return torch.cat([text_part, video_part] if text_first else [video_part, text_part])

    out: dict[str, Any] = {
        LATENTS: rows(video, video.new_zeros(m, video.shape[1])),
        VIDEO_POS: rows(grid_positions(grid), torch.zeros(m, 3, dtype=torch.int64)),
        JOINT_TEXT: rows(torch.zeros(n, dtype=torch.int64), text_rows),
        LABELS: rows(torch.zeros(n, dtype=torch.int64), torch.full((m,), IGNORE_INDEX, dtype=torch.int64)),
        GRID: grid, TEXT: (text,)}
    if condition_latents is not None:
        if condition_latents.dim() != 4 or tuple(condition_latents.shape[1:]) != tuple(latents.shape[1:]):
            raise ValueError(f"{where}: condition_latents {tuple(condition_latents.shape)} must be [C_cond, F, H, W] with "
                             f"the latents' F, H, W {tuple(latents.shape[1:])}")
        cond = patchify(condition_latents, patch_size, index)
        out[CONDITION] = rows(cond, cond.new_zeros(m, cond.shape[1]))
    for key, value in (extra or {}).items():
        out[key] = value
    if index is not None:
        out[SAMPLE_INDEX] = int(index)
    return out


def video_rows(batch: Mapping[str, Any]) -> torch.Tensor:
    """Bool per row of a (whole or sharded) packed joint batch: a real video token (not text, not padding)."""
    return (batch[JOINT_TEXT] == 0) & (batch[SEGMENT_IDS] >= 0)


def unpack_joint_output(output: torch.Tensor, batch: Mapping[str, Any], patch_size: Sequence[int]) -> list[torch.Tensor]:
    """The packed output ``[rows, C*pt*ph*pw]`` (channel-major) of a whole joint micro-batch -> ``[C, F, H, W]`` per sample."""
    keep = video_rows(batch).to(output.device)
    seg = batch[SEGMENT_IDS].to(output.device)
    return [unpatchify(output[keep & (seg == j)], grid, patch_size, layout="input") for j, grid in enumerate(batch[GRID])]


class JointRows(NamedTuple):
    """What every packed joint block receives as its second argument: the local rows' roles and conditioning.

    A NamedTuple of tensors, so checkpointing and the profiler's fresh inputs see its tensors.
    """

    video: torch.Tensor  #: int64 row indices of the video role (real video tokens and padding)
    text: torch.Tensor  #: int64 row indices of text tokens
    inverse: torch.Tensor  #: int64 ``[rows]``: row ``r``'s position in ``cat([video, text])``
    sample: torch.Tensor  #: int64 ``[rows]``: the row's sample in the micro-batch (padding: 0)
    role_sample: torch.Tensor  #: int64 ``[rows]``: ``sample`` for video rows, ``samples + sample`` for text rows
    temb: torch.Tensor  #: ``[samples, dim]``: each sample's conditioning embedding (timestep, ...)
    cos: torch.Tensor | None  #: ``[rows, head_dim]`` rotary cosines (1 on text and padding rows), or None
    sin: torch.Tensor | None  #: same, sines (0 on text and padding rows)
    cu_seqlens: torch.Tensor  #: joint segments over the whole padded micro-batch
    max_seqlen: int


def row_roles(batch: Mapping[str, Any], num_samples: int) -> dict[str, torch.Tensor]:
    """``video``, ``text``, ``inverse``, ``sample`` and ``role_sample`` (see :class:`JointRows`) of this shard's rows."""
    seg = batch[SEGMENT_IDS]
    is_text = (batch[JOINT_TEXT] > 0) & (seg >= 0)
    video, text = torch.nonzero(~is_text).flatten(), torch.nonzero(is_text).flatten()
    inverse = torch.empty_like(seg)
    inverse[torch.cat([video, text])] = torch.arange(seg.shape[0], device=seg.device)
    sample = seg.clamp_min(0)
    return {"video": video, "text": text, "inverse": inverse, "sample": sample,
            "role_sample": sample + num_samples * is_text.long()}


def per_sample_timesteps(batch: Mapping[str, Any], timestep: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Each sample's timestep (float ``[samples]``): its rows' value (every row of a sample has the same);
    0 for a sample with no row on this shard (its conditioning is then unused)."""
    seg = batch[SEGMENT_IDS].to(timestep.device)
    slot = torch.where(seg >= 0, seg, torch.full_like(seg, num_samples))
    out = torch.zeros(num_samples + 1, dtype=torch.float32, device=timestep.device)
    return out.scatter_reduce(0, slot, timestep.float(), reduce="amax", include_self=True)[:num_samples]


def text_rows_input(batch: Mapping[str, Any], rows: Mapping[str, torch.Tensor], texts: list[torch.Tensor]) -> torch.Tensor:
    """``[text rows, dim]``: row by row, its sample's entry of ``texts`` (one ``[tokens, dim]`` per sample) at its token."""
    bounds = [0]
    for t in texts:
        bounds.append(bounds[-1] + int(t.shape[0]))
    device = texts[0].device
    offsets = torch.tensor(bounds[:-1], dtype=torch.int64, device=device)
    token = batch[JOINT_TEXT][rows["text"]].to(device) - 1
    where = offsets[rows["sample"][rows["text"]].to(device)] + token
    return torch.cat(texts).index_select(0, where)


def check_row_width(x: torch.Tensor, in_channels: int, patch: Sequence[int], family: str, builder: str) -> None:
    """The packed rows must carry ``in_channels x patch`` features (what the model's patch embedding takes)."""
    width = int(in_channels) * math.prod(patch)
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"packed {family} forward: 'hidden_states' has shape {tuple(x.shape)}, but the model takes "
                         f"[rows, in_channels x patch] = [rows, {width}]; build samples with "
                         f"lightning_dcp.diffusers.{builder} for this model's patch size")


def check_texts(batch: Mapping[str, Any], labels: list[str]) -> list[torch.Tensor]:
    """Each sample's text ``[tokens, dim]``; raises naming the samples that have none."""
    texts = batch.get(TEXT)
    missing = [label for j, label in enumerate(labels) if texts is None or j >= len(texts) or texts[j] is None]
    if missing:
        raise ValueError(f"{', '.join(missing)}: no text embeddings ({TEXT!r}); every sample needs its text encoder "
                         "output: build samples with the family's sample function (e.g. "
                         "lightning_dcp.diffusers.cogvideox_sample(latents, encoder_hidden_states, ...))")
    return [per_sample_embeds(t)[0] for t in texts]


def per_token(rows: JointRows, video_table: torch.Tensor, text_table: torch.Tensor | None = None) -> torch.Tensor:
    """``[1, rows, dim]``: each row's entry of its sample in ``video_table`` ``[samples, dim]``, or, for text
    rows when ``text_table`` is given, of ``text_table``."""
    if text_table is None:
        return video_table.index_select(0, rows.sample)[None]
    return torch.cat([video_table, text_table]).index_select(0, rows.role_sample)[None]


def by_role(rows: JointRows, x: torch.Tensor, video_fn: Callable[[torch.Tensor], torch.Tensor],
            text_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``[1, rows, ...]``: ``video_fn`` on the video-role rows of ``x`` ``[1, rows, ...]``, ``text_fn`` on the text rows."""
    parts = [video_fn(x[:, rows.video]), text_fn(x[:, rows.text])]
    return torch.cat(parts, dim=1)[:, rows.inverse]


def rotate(x: torch.Tensor, rows: JointRows) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[1, rows, heads, head_dim]`` (identity on text rows), as diffusers' ``apply_rotary_emb``."""
    if rows.cos is None:
        return x
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, (rows.cos, rows.sin), sequence_dim=1)


def joint_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: JointRows) -> torch.Tensor:
    """``[1, rows, heads * head_dim]``: attention of ``q``/``k``/``v`` ``[1, rows, heads, head_dim]`` within each
    sample's joint segment (text and video rows), over the active SP group (Ulysses)."""
    out = ulysses_attention(q[0], k[0], v[0], {CU_SEQLENS: rows.cu_seqlens, MAX_SEQLEN: rows.max_seqlen})
    return out.unsqueeze(0).flatten(2, 3).type_as(q)


def rotary_rows(batch: Mapping[str, Any], rows: Mapping[str, torch.Tensor], tables: list[tuple[torch.Tensor, torch.Tensor]],
                head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[rows, head_dim]`` for this shard: video rows look up their sample's table (``[video
    tokens, head_dim]``, frame-major) at their grid position; text and padding rows get the identity."""
    return position_rows(batch, rows, tables, head_dim, device, identity=True)


def position_rows(batch: Mapping[str, Any], rows: Mapping[str, torch.Tensor], tables: list[Any], dim: int,
                  device: torch.device, identity: bool = False) -> Any:
    """Per-row lookup of per-sample video tables (see :func:`rotary_rows`); one table or a tuple of tables per sample.
    Non-video rows get zeros (or, with ``identity``, cos 1 / sin 0)."""
    grids = [tuple(int(v) for v in g) for g in batch[GRID]]
    pos = batch[VIDEO_POS].to(device)
    seg = batch[SEGMENT_IDS].to(device)
    real = (torch.nonzero(video_rows(batch)).flatten()).to(device)
    bounds = [0]
    for g in grids:
        bounds.append(bounds[-1] + math.prod(g))
    offsets = torch.tensor(bounds[:-1], dtype=torch.int64, device=device)
    hw = torch.tensor([[g[1] * g[2], g[2]] for g in grids], dtype=torch.int64, device=device)
    j = seg[real]
    p = pos[real]
    where = offsets[j] + p[:, 0] * hw[j, 0] + p[:, 1] * hw[j, 1] + p[:, 2]
    single = isinstance(tables[0], torch.Tensor)
    parts = [[t] if single else list(t) for t in tables]
    outs = []
    for i in range(len(parts[0])):
        full = torch.cat([pt[i].to(device) for pt in parts]).index_select(0, where)
        fill = 1.0 if identity and i == 0 else 0.0
        out = torch.full((seg.shape[0], dim), fill, dtype=full.dtype, device=device)
        out[real] = full
        outs.append(out)
    return outs[0] if single else tuple(outs)


def joint_rows(batch: Mapping[str, Any], roles: Mapping[str, torch.Tensor], temb: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device) -> JointRows:
    """The :class:`JointRows` of this shard (roles from :func:`row_roles`)."""
    cos, sin = rotary if rotary is not None else (None, None)
    return JointRows(*(roles[k].to(device) for k in ("video", "text", "inverse", "sample", "role_sample")), temb,
                     cos, sin, batch[CU_SEQLENS].to(device), int(batch[MAX_SEQLEN]))


def swap_block_class(block: nn.Module, packed_cls: type) -> None:
    """Give ``block`` the packed subclass of its diffusers class (same attributes, so the same ``state_dict``
    keys; its ``forward`` runs the packed path when called with :class:`JointRows`, diffusers' otherwise)."""
    if type(block) is not packed_cls:
        if not isinstance(block, packed_cls.__mro__[1]):
            raise TypeError(f"expected a {packed_cls.__mro__[1].__name__}, got {type(block).__name__}")
        block.__class__ = packed_cls
