"""Local variable-length (packed) attention with a choice of kernels.

A DCP micro-batch packs several samples into one token dimension; ``cu_seqlens`` (int32,
``[num_segments + 1]``, flash-attn's convention) marks where each one starts and ends, and
attention never crosses a segment boundary. :func:`varlen_attention` runs that on the best
kernel available:

* ``"flash"`` — ``flash_attn.flash_attn_varlen_func`` (flash-attn installed, CUDA, fp16/bf16);
* ``"torch-varlen"`` — ``torch.nn.attention.varlen.varlen_attn`` (PyTorch's own flash-backed
  varlen kernel, CUDA, fp16/bf16, present in recent torch releases);
* ``"sdpa"`` — :func:`torch.nn.functional.scaled_dot_product_attention` on every device and
  dtype: segments are grouped by similar length and each group runs as one padded batched
  call (a key-padding mask only where lengths differ), so many short segments cost a few
  kernel calls instead of one per segment, and no block-diagonal ``total x total`` mask is
  ever built.

Logit soft-capping (``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the
softmax, as Gemma 2 does) runs on ``"flash"`` (flash-attn's own ``softcap``) and on ``"sdpa"``,
where it computes the scores explicitly per length group, as transformers' eager attention does
(fp32 softmax; memory ``heads x L x L`` per segment of length ``L``, like SDPA's math kernel);
``"torch-varlen"`` has no soft-capping, so ``"auto"`` skips it then.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "attention_backend", "varlen_attention"]

#: Names accepted by ``backend=``.
BACKENDS = ("auto", "flash", "torch-varlen", "sdpa")

_HALF_DTYPES = (torch.float16, torch.bfloat16)

# Grouping of segments for the SDPA path: a group's padded cost (count * max_len^2) may exceed
# its true cost (sum of len^2) by at most this factor, and holds at most this many tokens
# after padding (bounds the temporary [group, heads, L, L] score tensor of the math kernel).
_SDPA_PAD_OVERHEAD = 1.3
_SDPA_MAX_GROUP_TOKENS = 16384


@functools.lru_cache(maxsize=None)
def _flash_varlen_func() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a broken build raising at import
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=None)
def _flash_varlen_params() -> frozenset[str]:
    fn = _flash_varlen_func()
    try:
        return frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return frozenset()


@functools.lru_cache(maxsize=None)
def _torch_varlen_func() -> Any:
    try:
        import torch.nn.attention.varlen as varlen_mod
    except Exception:
        return None
    return getattr(varlen_mod, "varlen_attn", None)


@functools.lru_cache(maxsize=None)
def _torch_varlen_params() -> frozenset[str]:
    fn = _torch_varlen_func()
    if fn is None:
        return frozenset()
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return frozenset()


def _torch_varlen_usable() -> bool:
    # Causal masking is expressed either as ``is_causal`` (older releases) or as
    # ``window_size=(-1, 0)`` (torch 2.13); without either we cannot ask for it.
    params = _torch_varlen_params()
    return _torch_varlen_func() is not None and ("is_causal" in params or "window_size" in params)


def attention_backend(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> str:
    """The backend ``backend="auto"`` picks for inputs on ``device`` (and of ``dtype``).

    Args:
        device: where q/k/v live; default: ``"cuda"`` when CUDA is available, else ``"cpu"``.
        dtype: their dtype; ``None`` means "a dtype the fused kernels accept" (fp16/bf16), i.e.
            the best backend the device offers. fp32/fp64 inputs always go to ``"sdpa"``.

    Returns:
        ``"flash"``, ``"torch-varlen"`` or ``"sdpa"``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda" or (dtype is not None and dtype not in _HALF_DTYPES):
        return "sdpa"
    if _flash_varlen_func() is not None:
        return "flash"
    if _torch_varlen_usable():
        return "torch-varlen"
    return "sdpa"


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax attention inside each packed segment; no token attends across a boundary.

    Args:
        q, k, v: ``[total_tokens, heads, head_dim]``, the segments laid end to end.
        cu_seqlens: int32 ``[num_segments + 1]``: ``0, len_0, len_0 + len_1, ..., total_tokens``.
            Empty segments (repeated entries) are allowed.
        max_seqlen: the longest segment (int or a 0-d tensor); used by the fused kernels.
        causal: each token attends only to itself and earlier tokens *of its own segment*.
        scale: softmax scale; default ``head_dim ** -0.5``.
        softcap: logit soft-capping: scaled scores ``s`` become ``softcap * tanh(s / softcap)``
            before masking and softmax (Gemma 2's ``attn_logit_softcapping``); ``None`` or 0: none.
        backend: ``"auto"`` (flash > torch-varlen > sdpa, see :func:`attention_backend`; with
            ``softcap``, flash > sdpa), or one of ``"flash"``, ``"torch-varlen"``, ``"sdpa"`` to force it.

    Returns:
        ``[total_tokens, heads, head_dim]``, same dtype and device as ``q``.
    """
    _check_varlen_inputs(q, k, v, cu_seqlens, backend)
    max_seqlen = int(max_seqlen)
    softcap = float(softcap) if softcap else None
    if softcap is not None and softcap < 0:
        raise ValueError(f"varlen_attention: softcap must be positive (or None for no soft-capping), got {softcap}")

    if backend == "auto":
        backend = attention_backend(q.device, q.dtype)
        if softcap is not None and backend == "torch-varlen":
            backend = "sdpa"
    if backend == "flash":
        return _flash_varlen(q, k, v, cu_seqlens, max_seqlen, causal=causal, scale=scale, softcap=softcap)
    if backend == "torch-varlen":
        return _torch_varlen(q, k, v, cu_seqlens, max_seqlen, causal=causal, scale=scale, softcap=softcap)
    return _sdpa_varlen(q, k, v, cu_seqlens, causal=causal, scale=scale, softcap=softcap)


def _check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, backend: str) -> None:
    """:func:`varlen_attention`'s argument checks (``ValueError`` naming the expected shapes)."""
    if backend not in BACKENDS:
        raise ValueError(f"varlen_attention: unknown backend={backend!r}; use one of {BACKENDS}.")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen_attention expects q, k, v of shape [total_tokens, heads, head_dim], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; flatten the batch dimension into tokens "
            f"(q.reshape(-1, heads, head_dim)) and describe the segments with cu_seqlens."
        )
    if q.shape != k.shape or q.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"varlen_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must agree on "
            f"tokens and heads (and q/k on head_dim); grouped-query k/v must be expanded to q's heads first."
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"varlen_attention: cu_seqlens must be 1-D [num_segments + 1], got shape {tuple(cu_seqlens.shape)}."
        )


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                  causal: bool, scale: float | None, softcap: float | None) -> torch.Tensor:
    """:func:`varlen_attention` on flash-attn's ``flash_attn_varlen_func``."""
    fn = _flash_varlen_func()
    if fn is None:
        raise RuntimeError(
            "varlen_attention(backend='flash'): flash_attn is not importable; install flash-attn "
            "(`pip install lightning-dcp[flash]`) or use backend='auto'."
        )
    _require_cuda_half(q, "flash")
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    extra: dict[str, Any] = {}
    if softcap is not None:
        if "softcap" not in _flash_varlen_params():
            raise RuntimeError("varlen_attention(softcap=...): the installed flash_attn.flash_attn_varlen_func has no "
                               "softcap argument; upgrade flash-attn (>= 2.6) or use backend='sdpa'.")
        extra["softcap"] = softcap
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=0.0, softmax_scale=scale, causal=causal, **extra)


def _torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                  causal: bool, scale: float | None, softcap: float | None) -> torch.Tensor:
    """:func:`varlen_attention` on ``torch.nn.attention.varlen.varlen_attn``."""
    if softcap is not None:
        raise RuntimeError("varlen_attention(backend='torch-varlen') has no logit soft-capping (softcap="
                           f"{softcap}); use backend='auto', 'flash' or 'sdpa'.")
    if not _torch_varlen_usable():
        raise RuntimeError(
            f"varlen_attention(backend='torch-varlen'): torch {torch.__version__} has no usable "
            f"torch.nn.attention.varlen.varlen_attn; upgrade torch or use backend='auto'."
        )
    _require_cuda_half(q, "torch-varlen")
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    kwargs: dict[str, Any] = {"scale": scale}
    if causal:
        if "window_size" in _torch_varlen_params():
            kwargs["window_size"] = (-1, 0)
        else:
            kwargs["is_causal"] = True
    return _torch_varlen_func()(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _require_cuda_half(q: torch.Tensor, name: str) -> None:
    if q.device.type != "cuda" or q.dtype not in _HALF_DTYPES:
        raise RuntimeError(
            f"varlen_attention(backend={name!r}) needs CUDA fp16/bf16 inputs, got device={q.device}, "
            f"dtype={q.dtype}; cast to bf16 on GPU or use backend='sdpa' (or 'auto')."
        )


def _group_segments(lengths: list[int]) -> list[list[int]]:
    """Indices of non-empty segments, grouped so each group pads cheaply to its longest member."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: lengths[i], reverse=True)
    groups: list[list[int]] = []
    current: list[int] = []
    true_cost = 0
    for i in order:
        n = lengths[i]
        if current:
            longest = lengths[current[0]]  # sorted descending: the first is the longest
            padded = (len(current) + 1) * longest * longest
            if (
                padded > _SDPA_PAD_OVERHEAD * (true_cost + n * n)
                or (len(current) + 1) * longest > max(_SDPA_MAX_GROUP_TOKENS, longest)
            ):
                groups.append(current)
                current, true_cost = [], 0
        current.append(i)
        true_cost += n * n
    if current:
        groups.append(current)
    return groups


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
               scale: float | None, softcap: float | None) -> torch.Tensor:
    """``[B, H, L, d]`` attention with a boolean ``mask`` (True = attend): SDPA, or without a fused
    kernel for soft-capping, the scores written out as transformers' eager attention computes them."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        tril = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = tril if mask is None else mask & tril
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return torch.matmul(probs, v)


def _sdpa_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    total = q.shape[0]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(
            f"varlen_attention: cu_seqlens must rise from 0 to total_tokens={total} without decreasing, "
            f"got {bounds if len(bounds) <= 16 else bounds[:8] + ['...'] + bounds[-4:]}."
        )
    if len(bounds) == 2:  # one segment: plain SDPA, no gather
        out = _attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            None, causal, scale, softcap,
        )
        return out.squeeze(0).transpose(0, 1)

    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    device = q.device
    outs: list[torch.Tensor] = []
    index_parts: list[torch.Tensor] = []
    for group in _group_segments(lengths):
        lens = torch.tensor([lengths[i] for i in group], device=device)
        starts = torch.tensor([bounds[i] for i in group], device=device)
        width = int(lengths[group[0]])
        pos = torch.arange(width, device=device)
        valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [G, L]
        # Padding slots gather the segment's last token: finite values, masked out as keys and
        # dropped as queries, so they get exactly zero gradient.
        gather = (starts.unsqueeze(1) + torch.minimum(pos.unsqueeze(0), lens.unsqueeze(1) - 1)).reshape(-1)
        qg, kg, vg = (t.index_select(0, gather).unflatten(0, (len(group), width)).transpose(1, 2) for t in (q, k, v))
        if lengths[group[-1]] == width:  # sorted descending: every segment of the group is full (no device sync)
            mask, is_causal = None, causal
        else:
            mask = valid[:, None, None, :]  # [G, 1, 1, L] key padding
            if causal:
                mask = mask & torch.ones(width, width, dtype=torch.bool, device=device).tril()
            is_causal = False
            # Every query row keeps >= 1 key (its own segment's first token), so no NaN rows.
        og = _attention(qg, kg, vg, mask, is_causal, scale, softcap)
        og = og.transpose(1, 2).reshape(len(group) * width, q.shape[1], v.shape[2])
        keep = valid.reshape(-1)
        outs.append(og[keep])
        index_parts.append(gather[keep])
    if not outs:  # every segment empty: total == 0
        return q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    packed = torch.cat(outs)
    src = torch.cat(index_parts)
    inverse = torch.empty_like(src)
    inverse[src] = torch.arange(src.numel(), device=device)
    return packed.index_select(0, inverse)
