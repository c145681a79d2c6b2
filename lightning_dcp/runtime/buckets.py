"""Flat gradient buckets: the step's gradients parked after the micro-batch loop, reduced once.

Ranks run different numbers of micro-batches, so no gradient may be reduced per micro-batch (a
collective inside the loop would hang). The executor parks every parameter's accumulated gradient
in a few flat buffers after its last micro-batch; once per step the buffers are SUM all-reduced over
the world (one collective per bucket) and scaled by ``1 / global loss units``, and each parameter's
``.grad`` becomes a view of its slice (:class:`GradBuckets`).

With sharded weights (``sharding="zero2"`` / ``"fsdp"``, :mod:`lightning_dcp.runtime.sharding.gathered`) the same
step end is one SUM *reduce-scatter* per bucket into ``fully_shard``'s layout, and each sharded
DTensor parameter's ``.grad`` becomes a DTensor over its rank's slice (:class:`ShardedGradBuckets`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GradBuckets", "ShardedGradBuckets"]


class GradBuckets:
    """Flat gradient buckets for one SUM all-reduce per bucket.

    ``begin`` (before the first micro-batch) zeroes the buckets and makes each parameter's ``.grad``
    a view of its slice, so backward accumulates straight into the buckets (the step holds one copy
    of the gradients, not the buckets plus autograd's own); a post-accumulate hook records which
    parameters received a gradient. ``park`` drops ``.grad`` (copying a gradient that is not the view,
    e.g. one set by hand; zeros where a rank has none); ``reduce`` all-reduces and hands each parameter
    a view of its slice (``None`` when no rank produced a gradient for it, like single-process training).
    """

    def __init__(self, params: list[torch.nn.Parameter], cap_bytes: int) -> None:
        self.params = params
        self.slots: list[tuple[int, int, int]] = []  # (bucket, offset, numel) per param
        self.buffers: list[Tensor] = []
        sizes: list[int] = []
        keys: list[tuple[torch.dtype, torch.device]] = []
        for p in params:
            key = (p.dtype, p.device)
            n = p.numel()
            b = next((i for i in range(len(keys)) if keys[i] == key and sizes[i] * p.element_size() + n * p.element_size() <= cap_bytes), None)
            if b is None:
                keys.append(key)
                sizes.append(0)
                b = len(keys) - 1
            self.slots.append((b, sizes[b], n))
            sizes[b] += n
        self.buffers = [torch.zeros(n, dtype=k[0], device=k[1]) for n, k in zip(sizes, keys)]
        self.has_grad = torch.zeros(len(params), dtype=torch.float64)
        accumulated = self._accumulated = torch.zeros(len(params), dtype=torch.bool)
        # the hooks hold the flags only (not the buckets), and go with the buckets
        self._hooks = [p.register_post_accumulate_grad_hook(lambda _p, i=i: accumulated.__setitem__(i, True))
                       for i, p in enumerate(params)]

    def __del__(self) -> None:
        for handle in getattr(self, "_hooks", ()):
            handle.remove()

    def _view(self, i: int) -> Tensor:
        b, off, n = self.slots[i]
        return self.buffers[b][off:off + n].view_as(self.params[i])

    def begin(self) -> None:
        """Before the step's first micro-batch: zero buckets, each ``.grad`` a view of its slice."""
        for buf in self.buffers:
            buf.zero_()
        self._accumulated.zero_()
        for i, p in enumerate(self.params):
            p.grad = self._view(i)

    def park(self) -> None:
        for i, (p, (b, off, n)) in enumerate(zip(self.params, self.slots)):
            dst = self.buffers[b][off:off + n]
            g = p.grad
            in_place = g is not None and g.data_ptr() == dst.data_ptr()
            if g is None or (in_place and not self._accumulated[i]):  # no gradient, or the untouched zero view
                dst.zero_()
                self.has_grad[i] = 0.0
            else:
                if not in_place:
                    dst.copy_(g.reshape(-1))
                self.has_grad[i] = 1.0
            p.grad = None

    def set_aside(self) -> list[Tensor | None]:
        """The gradients the parameters hold now (copies of those that are views of the buckets, which the next
        :meth:`begin` zeroes), to be added back after the next :meth:`reduce` with :meth:`add_back` (manual
        optimization: a loop over the micro-batches starts on top of gradients an earlier loop left;
        :mod:`~lightning_dcp.runtime.manual`)."""
        kept: list[Tensor | None] = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None and g.data_ptr() == self._view(i).data_ptr():
                g = g.clone()
            kept.append(g)
        return kept

    def add_back(self, kept: list[Tensor | None]) -> None:
        """Add :meth:`set_aside`'s gradients to the reduced ones (linear: as if they had been reduced together)."""
        for p, g in zip(self.params, kept):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)

    def reduce(self, world_has_grad: Tensor | None, group: Any = None, world: int = 1, scale: float = 1.0) -> None:
        if world > 1:
            handles = [dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True) for buf in self.buffers]
            for h in handles:
                h.wait()
        if scale != 1.0:
            for buf in self.buffers:
                buf.mul_(scale)
        has = world_has_grad if world_has_grad is not None else self.has_grad
        for i, p in enumerate(self.params):
            p.grad = self._view(i) if has[i] > 0 else None


class ShardedGradBuckets:
    """One SUM reduce-scatter per bucket, from full local gradients into ``fully_shard``'s DTensor gradients.

    ``fully_shard`` splits dim 0 of each parameter into ``world`` chunks of ``c = ceil(d0 / world)``
    rows (rank ``r`` holds rows ``[r c, min((r + 1) c, d0))``, possibly none). A bucket's input is a
    ``[world, width]`` buffer whose row ``r`` holds, for each of its parameters, rank ``r``'s chunk
    padded to ``c`` rows; the reduce-scatter leaves row ``rank``, summed over the world, on this rank,
    and each sharded parameter's ``.grad`` becomes a DTensor (``Shard(0)``) over its slice of it.
    Input buffers are allocated per bucket at the step end and each full gradient is freed as soon as
    it is copied in, so the reduction needs one bucket of memory beyond the gradients themselves.

    ``park`` only records which parameters have a gradient (the full gradients stay on the unsharded
    parameters until ``reduce``): the same interface as :class:`GradBuckets`.

    Args:
        params: the unsharded parameters (those forward and backward use).
        sharded: the matching sharded DTensor parameters (what the optimizer steps), same order.
        cap_bytes: bytes of one bucket's input buffer (all ranks' rows; one larger parameter gets its own).
    """

    def __init__(self, params: list[torch.nn.Parameter], sharded: list[torch.nn.Parameter], cap_bytes: int) -> None:
        from torch.distributed.tensor import Shard

        if len(params) != len(sharded):
            raise ValueError(f"{len(params)} unsharded but {len(sharded)} sharded parameters")
        self.params = params
        self.sharded = sharded
        self.mesh = sharded[0].device_mesh if sharded else None
        self.world = self.mesh.size() if self.mesh is not None else 1
        rank = self.mesh.get_local_rank() if self.mesh is not None else 0
        self.slots: list[tuple[int, int, int, int]] = []  # per param: (column offset, chunk rows c, local rows, row numel)
        self.buckets: list[list[int]] = []  # parameter indices per bucket
        self.keys: list[tuple[torch.dtype, torch.device]] = []
        self.widths: list[int] = []  # columns of a bucket's [world, width] input
        for i, (p, s) in enumerate(zip(params, sharded)):
            if tuple(s.placements) != (Shard(0),) or s.shape != p.shape or p.dim() == 0:
                raise RuntimeError(f"unexpected fully_shard layout for a parameter of shape {tuple(p.shape)}: "
                                   f"placements {s.placements}, global shape {tuple(s.shape)} (expected Shard(0))")
            d0 = p.shape[0]
            rest = p[0].numel() if d0 else 0
            c = -(-d0 // self.world)
            rows = max(0, min(c, d0 - rank * c))
            if tuple(s.to_local().shape) != (rows, *p.shape[1:]):
                raise RuntimeError(f"unexpected fully_shard shard of a parameter of shape {tuple(p.shape)} on rank "
                                   f"{rank}: local shape {tuple(s.to_local().shape)}, expected {(rows, *p.shape[1:])}")
            key, width = (p.dtype, p.device), c * rest
            b = next((j for j, k in enumerate(self.keys)
                      if k == key and (self.widths[j] + width) * self.world * p.element_size() <= cap_bytes), None)
            if b is None:
                self.keys.append(key)
                self.widths.append(0)
                self.buckets.append([])
                b = len(self.keys) - 1
            self.slots.append((self.widths[b], c, rows, rest))
            self.buckets[b].append(i)
            self.widths[b] += width
        self.has_grad = torch.zeros(len(params), dtype=torch.float64)

    def begin(self) -> None:
        """Before the step's first micro-batch: no gradient on the unsharded parameters."""
        for p in self.params:
            p.grad = None

    def park(self) -> None:
        for i, p in enumerate(self.params):
            self.has_grad[i] = 0.0 if p.grad is None else 1.0

    def _fill(self, buf: Tensor, b: int) -> None:
        """Copy bucket ``b``'s gradients into ``buf`` (``[world, width]`` of zeros) and drop them."""
        for i in self.buckets[b]:
            p = self.params[i]
            off, c, _, rest = self.slots[i]
            if p.grad is None or not c:
                continue
            g = p.grad.reshape(p.shape[0], rest)
            p.grad = None
            dst = buf[:, off:off + c * rest].unflatten(1, (c, rest))  # [world, c, rest]
            full = g.shape[0] // c
            if full:
                dst[:full].copy_(g[:full * c].view(full, c, rest))
            if g.shape[0] > full * c:
                dst[full, :g.shape[0] - full * c].copy_(g[full * c:])

    def reduce(self, world_has_grad: Tensor | None, group: Any = None, world: int = 1, scale: float = 1.0) -> None:
        """Reduce-scatter every bucket (SUM over the world), scale, and set the sharded ``.grad`` (``None``
        where no rank produced a gradient). ``world`` is taken from the mesh; the argument is ignored."""
        from torch.distributed.tensor import DTensor, Shard

        has = world_has_grad if world_has_grad is not None else self.has_grad
        for b, ((dtype, device), width) in enumerate(zip(self.keys, self.widths)):
            buf = torch.zeros(self.world, width, dtype=dtype, device=device)
            self._fill(buf, b)
            out = torch.empty(width, dtype=dtype, device=device)
            if self.world > 1:
                dist.reduce_scatter_tensor(out, buf.view(-1), op=dist.ReduceOp.SUM, group=group)
            else:
                out.copy_(buf[0])
            del buf
            if scale != 1.0:
                out.mul_(scale)
            for i in self.buckets[b]:
                s = self.sharded[i]
                off, _, rows, rest = self.slots[i]
                if has[i] <= 0:
                    s.grad = None
                    continue
                local = out[off:off + rows * rest].view(rows, *s.shape[1:])
                s.grad = DTensor.from_local(local, self.mesh, (Shard(0),), run_check=False, shape=s.shape,
                                            stride=s.stride())
