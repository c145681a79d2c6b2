"""Ulysses sequence parallelism over the active SP group.

Each rank of an SP group of size ``P`` holds a contiguous ``1/P`` chunk of the packed token
dimension. Before attention, an all-to-all trades that for *all* tokens of ``heads / P`` heads;
attention runs locally over the whole packed sequence (segment boundaries from the full
``cu_seqlens``); a second all-to-all trades back. The all-to-all is DeepSpeed's differentiable
``deepspeed.sequence.layer._SeqAllToAll``, which takes the group per call, so one function serves
every SP group the strategy switches between; the group is recorded on the autograd node at
forward time, so backward (which runs after the strategy has moved on to another context) talks
to the right ranks.

Any group size works, not only powers of two (3, 5, 6, 7, 12 ...): the heads must divide by ``P`` and
the packed tokens are padded to a multiple of ``P`` (:func:`~lightning_dcp.sp.tokens.pad_multiple`), so
every rank's chunk is equal; DeepSpeed's all-to-all splits both evenly (tested at SP 3 and 6 in
``tests/test_ring.py`` and in fits on 3 and 6 processes). A ring item
(:class:`~lightning_dcp.sp.context.RingGrid` in the active context) runs this all-to-all inside its
Ulysses subgroup and ring attention between the subgroups (:mod:`lightning_dcp.sp.ring`).

DeepSpeed layout notes (deepspeed 0.19.8, checked in ``deepspeed/sequence/layer.py``):

* ``_SeqAllToAll.apply(group, input, scatter_idx, gather_idx, batch_dim_idx)`` handles 4-D
  tensors only: ``[batch, seq, heads, dim]`` (``batch_dim_idx=0``) or ``[seq, batch, heads, dim]``
  (``batch_dim_idx=1``); "scatter heads, gather seq" is ``scatter_idx >= 2`` and
  "scatter seq, gather heads" is ``scatter_idx < 2`` (the exact index values are not used beyond
  that test). Our packed ``[tokens, heads, dim]`` gets a leading batch dim of 1.
* A head count not divisible by ``P`` silently switches it to an uneven-heads path that reads a
  *global* sequence-parallel rank (``deepspeed.utils.groups``), wrong for our per-step groups, so
  we reject indivisible counts ourselves before calling it.
* It communicates through ``deepspeed.comm``, which must be initialised on top of the existing
  ``torch.distributed`` group: :func:`ensure_deepspeed_comm` does that (on CPU, DeepSpeed JIT-builds
  a small shared-memory op the first time on a machine, ~30 s, then caches it). It is a local,
  non-collective call, but a strategy should still call it once at setup so the first micro-batch
  does not pay for it.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
import torch.distributed as dist

from lightning_dcp.sp.attention import varlen_attention
from lightning_dcp.sp.comm_timer import active_timer
from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, active_context

__all__ = ["SUPPORTED_DEEPSPEED", "ensure_deepspeed_comm", "kv_repeat_before_all_to_all", "seq_all_to_all",
           "ulysses_attention"]

#: DeepSpeed versions whose private ``_SeqAllToAll`` (signature ``(group, input, scatter_idx,
#: gather_idx, batch_dim_idx, ...)``) and ``deepspeed.comm`` set-up this module is tested with
#: (0.15.0 and 0.19.8 checked); pyproject.toml pins the same range.
SUPPORTED_DEEPSPEED = ">=0.15,<0.20"


def _deepspeed_version() -> str:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:  # noqa: BLE001 - metadata missing or odd install
        return "unknown"


class _DropMessage(logging.Filter):
    """Logging filter dropping records whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _quiet_deepspeed_on_nonzero_ranks() -> None:
    """DeepSpeed warns on every rank that it fell back to the CPU accelerator; keep rank 0's copy."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        ds_logger = logging.getLogger("DeepSpeed")  # deepspeed.utils.logger; filters survive its set-up
        if not any(isinstance(f, _DropMessage) for f in ds_logger.filters):
            ds_logger.addFilter(_DropMessage("Setting accelerator to CPU"))


def _import_deepspeed(what: str) -> Any:
    """``importlib.import_module(what)`` for a DeepSpeed module, with errors that name the fix.

    DeepSpeed is imported only here, when an all-to-all actually runs (an SP group > 1): the
    package imports and trains at SP size 1 without it.
    """
    import importlib

    _quiet_deepspeed_on_nonzero_ranks()
    try:
        importlib.import_module("deepspeed")
    except ImportError as err:
        raise ImportError(
            f"sequence parallelism (an SP group of more than 1 rank) needs DeepSpeed{SUPPORTED_DEEPSPEED}, which is not "
            f"installed ({err}); install it with pip install 'deepspeed{SUPPORTED_DEEPSPEED}', or plan with SP size 1 "
            "only: DCPStrategy(max_sp_size=1)"
        ) from err
    try:
        return importlib.import_module(what)
    except ImportError as err:
        raise ImportError(
            f"lightning-dcp needs {what} from DeepSpeed{SUPPORTED_DEEPSPEED}, but the installed deepspeed "
            f"{_deepspeed_version()} does not provide it ({err}); install a supported version: "
            f"pip install 'deepspeed{SUPPORTED_DEEPSPEED}'"
        ) from err


def _seq_all_to_all_op() -> Any:
    """DeepSpeed's private ``_SeqAllToAll``, checked for the signature this module calls."""
    import inspect

    layer = _import_deepspeed("deepspeed.sequence.layer")
    op = getattr(layer, "_SeqAllToAll", None)
    params = list(inspect.signature(op.forward).parameters)[1:6] if op is not None else []
    if params[:2] != ["group", "input"] or len(params) < 5:
        found = "no _SeqAllToAll" if op is None else f"_SeqAllToAll.forward{tuple(params)}"
        raise ImportError(
            f"deepspeed {_deepspeed_version()} has {found} in deepspeed.sequence.layer; lightning-dcp calls the private "
            f"_SeqAllToAll.apply(group, input, scatter_idx, gather_idx, batch_dim_idx) of DeepSpeed{SUPPORTED_DEEPSPEED}; "
            f"install a supported version: pip install 'deepspeed{SUPPORTED_DEEPSPEED}'"
        )
    return op


def ensure_deepspeed_comm() -> None:
    """Point ``deepspeed.comm`` at the already-initialised ``torch.distributed`` default group.

    Idempotent and local (no collective). Raises if ``torch.distributed`` is not initialised.
    """
    ds_comm = _import_deepspeed("deepspeed.comm")
    if ds_comm.is_initialized():
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "seq_all_to_all needs torch.distributed initialised (the DCP strategy does it at setup); "
            "call torch.distributed.init_process_group(...) first, or run with SP size 1."
        )
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        ds_comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)
        return
    # On the CPU accelerator DeepSpeed's TorchBackend JIT-builds and initialises its shared-memory
    # all-reduce op (ShareMemCommBuilder, for CPU inference). Ulysses needs only the all-to-all, and
    # that op costs ~30 s of compilation on first use and was seen to abort processes at exit
    # ("terminate called without an active exception"), so it is not built here.
    import importlib

    # ``import deepspeed.comm.torch as m`` binds the torch package (deepspeed.comm re-exports it).
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    build_shm_op = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        ds_comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)
    finally:
        ds_torch.build_shm_op = build_shm_op


def _group_size(group: Any) -> int:
    if group is None:
        return 1
    return dist.get_world_size(group)


def seq_all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: "dist.ProcessGroup | None" = None
) -> torch.Tensor:
    """Differentiable all-to-all over an SP group: split ``scatter_dim`` ``P`` ways, concatenate ``gather_dim``.

    Rank ``r`` of the group receives chunk ``r`` of every rank's ``scatter_dim``, concatenated
    along ``gather_dim`` in rank order. Backward is the reverse all-to-all on the same group.

    Args:
        x: ``[tokens, heads, dim]`` (``scatter_dim``/``gather_dim`` in ``{0, 1}``) or
            ``[batch, seq, heads, dim]`` (``scatter_dim``/``gather_dim`` in ``{1, 2}``).
        scatter_dim: dimension split across the ranks (its size must divide by ``P``).
        gather_dim: dimension that grows ``P``-fold.
        group: the SP process group; ``None`` means ``active_context().group``. With SP size 1
            the input is returned unchanged.

    Returns:
        ``x`` with ``shape[scatter_dim] / P`` and ``shape[gather_dim] * P``.
    """
    if group is None:
        group = active_context().group
    size = _group_size(group)
    if size == 1:
        return x
    ndim = x.dim()
    scatter_dim, gather_dim = scatter_dim % ndim, gather_dim % ndim
    if ndim == 3 and {scatter_dim, gather_dim} == {0, 1}:
        squeeze, x4 = True, x.unsqueeze(0)
        scatter_dim, gather_dim = scatter_dim + 1, gather_dim + 1
    elif ndim == 4 and {scatter_dim, gather_dim} == {1, 2}:
        squeeze, x4 = False, x
    else:
        raise ValueError(
            f"seq_all_to_all supports [tokens, heads, dim] with scatter/gather dims {{0, 1}} or "
            f"[batch, seq, heads, dim] with {{1, 2}}; got shape {tuple(x.shape)}, scatter_dim={scatter_dim}, "
            f"gather_dim={gather_dim}. Move the sequence and head dims into those places first."
        )
    if x4.shape[scatter_dim] % size != 0:
        what = "heads" if scatter_dim == 2 else "tokens"
        raise ValueError(
            f"seq_all_to_all: {what}={x4.shape[scatter_dim]} (dim {scatter_dim - squeeze} of shape "
            f"{tuple(x.shape)}) is not divisible by the SP size {size}; "
            + (
                "choose a head count divisible by every SP size the plan uses."
                if what == "heads"
                else "pad the packed sequence to a multiple of the SP size."
            )
        )
    timer = active_timer()
    start = timer.mark() if timer is not None else None
    out = _ready_op().apply(group, x4.contiguous(), scatter_dim, gather_dim, 0)
    if timer is not None:
        timer.add(start, timer.mark())
        timer.wrap_backward(out)
    return out.squeeze(0) if squeeze else out


_SEQ_OP: Any = None  # DeepSpeed's _SeqAllToAll once deepspeed.comm is set up: checked once per process


def _ready_op() -> Any:
    """:func:`ensure_deepspeed_comm` and the checked ``_SeqAllToAll``, done on the first all-to-all
    only (imports, logger filters and the signature check stay off the per-layer path)."""
    global _SEQ_OP
    if _SEQ_OP is None:
        ensure_deepspeed_comm()
        _SEQ_OP = _seq_all_to_all_op()
    return _SEQ_OP


def kv_repeat_before_all_to_all(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times to repeat each key/value head before the all-to-all (1 when none is needed).

    Grouped-query (GQA) and multi-query (MQA) attention have fewer key/value heads than query
    heads; query head ``j`` uses key/value head ``j // (num_heads / num_kv_heads)``. Ulysses gives
    each of the ``sp_size`` ranks whole heads, so the key/value heads must divide by ``sp_size``.
    This is the smallest divisor ``f`` of ``num_heads / num_kv_heads`` with ``num_kv_heads * f``
    divisible by ``sp_size``: every SP rank then receives whole key/value heads, exactly those its
    query heads use, and repeats them locally by the rest, ``num_heads / (num_kv_heads * f)``.

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``num_kv_heads``, or not divisible by ``sp_size``.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"attention heads {num_heads} must be a multiple of the key/value heads {num_kv_heads} "
                         "(query head j uses key/value head j // (heads / kv_heads))")
    if num_heads % sp_size:
        raise ValueError(
            f"ulysses_attention: heads={num_heads} (key/value heads {num_kv_heads}) is not divisible by the SP size "
            f"{sp_size}: Ulysses gives each SP rank whole heads. Cap the SP size at a divisor of {num_heads} "
            f"(DCPStrategy(max_sp_size=...)); the strategy reads the head count from the model's dcp_num_heads / "
            "num_heads.")
    groups = num_heads // num_kv_heads
    for f in range(1, groups + 1):
        if groups % f == 0 and (num_kv_heads * f) % sp_size == 0:
            return f
    return groups  # unreachable: f = groups gives num_heads, divisible by sp_size


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: Mapping[str, Any],
    *,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Variable-length attention over a packed sequence sharded across the active SP group.

    A ring item (the active context's :class:`~lightning_dcp.sp.context.RingGrid`, ``WorkItem.ring > 1``) runs
    Ulysses inside its subgroup and ring attention over the subgroups (:mod:`lightning_dcp.sp.ring`); the
    shards then follow the batch's token layout (:func:`~lightning_dcp.sp.tokens.shard_spans`) and
    ``backend`` is not used (the ring has its own block kernels).

    Args:
        q: this rank's shard ``[local_tokens, heads, head_dim]``; rank ``i`` of the group holds
            tokens ``[i * local_tokens, (i + 1) * local_tokens)`` of the padded packed sequence.
        k, v: ``[local_tokens, kv_heads, head_dim]``, ``kv_heads`` dividing ``heads`` (``kv_heads <
            heads``: grouped-query / multi-query attention, query head ``j`` using key/value head
            ``j // (heads / kv_heads)`` as transformers' ``repeat_kv``). Key/value heads are repeated
            before the all-to-all only as far as the SP size needs
            (:func:`kv_repeat_before_all_to_all`), the rest after it, so fewer key/value heads than
            SP ranks work and cost no more communication than necessary.
        batch: the micro-batch dict; uses ``batch[CU_SEQLENS]`` (boundaries over the *whole*
            padded sequence, padding segment included) and ``batch[MAX_SEQLEN]``.
        causal, scale, softcap, backend: as in :func:`~lightning_dcp.sp.attention.varlen_attention`.

    Returns:
        This rank's shard of the attention output, ``[local_tokens, heads, head_dim]``.

    With SP size 1 this is exactly :func:`~lightning_dcp.sp.attention.varlen_attention` (key/value
    heads repeated to ``heads``).
    """
    try:
        cu_seqlens, max_seqlen = batch[CU_SEQLENS], batch[MAX_SEQLEN]
    except KeyError as err:
        raise KeyError(
            f"ulysses_attention needs batch[{CU_SEQLENS!r}] and batch[{MAX_SEQLEN!r}] (added by the DCP collate "
            f"step); the batch has keys {sorted(batch)}."
        ) from err
    ctx = active_context()
    if ctx.ring is not None:
        return _usp_attention(q, k, v, cu_seqlens, ctx, causal=causal, scale=scale, softcap=softcap)
    group = ctx.group
    size = _group_size(group)
    heads = q.shape[1]
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"ulysses_attention: k has {k.shape[1]} heads but v has {v.shape[1]}; they must agree.")
    pre = kv_repeat_before_all_to_all(heads, k.shape[1], size)
    if pre > 1:
        k, v = k.repeat_interleave(pre, dim=1), v.repeat_interleave(pre, dim=1)
    if size > 1:
        if cu_seqlens.device.type == "cpu":  # cheap check; on GPU it would cost a sync per layer
            total = int(cu_seqlens[-1])
            if total != q.shape[0] * size:
                raise ValueError(
                    f"ulysses_attention: cu_seqlens covers {total} tokens but the shards hold "
                    f"{q.shape[0]} x SP size {size} = {q.shape[0] * size}; cu_seqlens must describe the whole "
                    f"padded packed sequence (trailing padding segment included, batch[{CU_SEQLENS!r}], not this "
                    f"shard's) and every rank must hold an equal 1/{size} chunk."
                )
        # [local, H, d] -> [total, H/P, d]
        q, k, v = (seq_all_to_all(t, scatter_dim=1, gather_dim=0, group=group) for t in (q, k, v))
    post = q.shape[1] // k.shape[1]
    if post > 1:
        k, v = k.repeat_interleave(post, dim=1), v.repeat_interleave(post, dim=1)
    out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, scale=scale, softcap=softcap,
                           backend=backend)
    # [total, H/P, d] -> [local, H, d]
    return seq_all_to_all(out, scatter_dim=0, gather_dim=1, group=group) if size > 1 else out


def _usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, ctx: Any, *,
                   causal: bool, scale: float | None, softcap: float | None) -> torch.Tensor:
    """A ring item (``ctx.ring``): Ulysses inside the subgroup, then :func:`~lightning_dcp.sp.ring.ring_attention`
    over the ring of subgroups, then the all-to-all back (USP)."""
    from lightning_dcp.sp.ring import ring_attention

    grid = ctx.ring
    if softcap:
        raise ValueError(f"ulysses_attention: logit soft-capping (softcap={softcap}) is not supported by ring attention "
                         f"(this item runs SP {ctx.size} as ring {grid.degree} x Ulysses {grid.ulysses}); plan SP sizes "
                         "that divide the heads for this model (DCPStrategy(max_sp_size=...) at a divisor of the heads)")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"ulysses_attention: k has {k.shape[1]} heads but v has {v.shape[1]}; they must agree.")
    u, heads = grid.ulysses, q.shape[1]
    pre = kv_repeat_before_all_to_all(heads, k.shape[1], u)
    if pre > 1:
        k, v = k.repeat_interleave(pre, dim=1), v.repeat_interleave(pre, dim=1)
    if u > 1:  # [local, H, d] -> [ring chunk, H/u, d]
        q, k, v = (seq_all_to_all(t, scatter_dim=1, gather_dim=0, group=grid.ulysses_group) for t in (q, k, v))
    post = q.shape[1] // k.shape[1]
    if post > 1:
        k, v = k.repeat_interleave(post, dim=1), v.repeat_interleave(post, dim=1)
    out = ring_attention(q, k, v, cu_seqlens, grid, ctx.rank // u, causal=causal, scale=scale)
    return seq_all_to_all(out, scatter_dim=0, gather_dim=1, group=grid.ulysses_group) if u > 1 else out
