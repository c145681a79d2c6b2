"""Flat gradient buckets: the step's gradients parked after the micro-batch loop, reduced once.

Ranks run different numbers of micro-batches, so no gradient may be reduced per micro-batch (a
collective inside the loop would hang). The executor parks every parameter's accumulated gradient
in a few flat buffers after its last micro-batch; once per step the buffers are SUM all-reduced over
the world (one collective per bucket) and scaled by ``1 / global loss units``, and each parameter's
``.grad`` becomes a view of its slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GradBuckets"]


class GradBuckets:
    """Flat gradient buckets for one SUM all-reduce per bucket.

    ``park`` copies the parameters' gradients into the buckets (zeros where a rank has none)
    and drops ``.grad``; ``reduce`` all-reduces and hands each parameter a view of its slice
    (``None`` when no rank produced a gradient for it, like single-process training).
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

    def park(self) -> None:
        for i, (p, (b, off, n)) in enumerate(zip(self.params, self.slots)):
            dst = self.buffers[b][off:off + n]
            g = p.grad
            if g is None:
                dst.zero_()
                self.has_grad[i] = 0.0
            else:
                if g.data_ptr() != dst.data_ptr():
                    dst.copy_(g.reshape(-1))
                self.has_grad[i] = 1.0
                p.grad = None

    def reduce(self, world_has_grad: Tensor | None, group: Any = None, world: int = 1, scale: float = 1.0) -> None:
        if world > 1:
            handles = [dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True) for buf in self.buffers]
            for h in handles:
                h.wait()
        if scale != 1.0:
            for buf in self.buffers:
                buf.mul_(scale)
        has = world_has_grad if world_has_grad is not None else self.has_grad
        for i, (p, (b, off, n)) in enumerate(zip(self.params, self.slots)):
            p.grad = self.buffers[b][off:off + n].view_as(p) if has[i] > 0 else None
