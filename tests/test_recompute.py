"""RecomputeLayers: same gradients for every n, recomputation really happens, and it sees the forward's SP context."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, SPContext, active_context, sp_context
from lightning_dcp.sp.recompute import RecomputeLayers, find_recompute_layers
from lightning_dcp.sp.ulysses import ulysses_attention

try:
    from _dist import run_distributed
except ImportError:  # tests/ imported as a package
    from tests._dist import run_distributed


class Block(nn.Module):
    """A small residual MLP with dropout, an extra positional and a keyword argument; counts its calls."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim, dtype=torch.float64)
        self.drop = nn.Dropout(0.3)
        self.calls = 0

    def forward(self, x, bias, *, gain=1.0):
        self.calls += 1
        return x + gain * self.drop(torch.tanh(self.lin(x))) + bias


def _model(num_layers=4, dim=5):
    torch.manual_seed(0)
    return RecomputeLayers([Block(dim) for _ in range(num_layers)])


def _grads(model, n, use_context):
    model.zero_grad(set_to_none=True)
    for blk in model:
        blk.calls = 0
    x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    bias = torch.full((5,), 0.1, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(123)  # same dropout masks for every n
    if use_context:
        model.recompute_override = None
        with sp_context(SPContext(recompute=n)):
            out = model(x, bias, gain=0.5)
    else:
        model.recompute_override = n
        out = model(x, bias, gain=0.5)
    out.square().sum().backward()
    return [x.grad, bias.grad] + [p.grad for p in model.parameters()], [blk.calls for blk in model]


@pytest.mark.parametrize("use_context", [True, False], ids=["context", "override"])
def test_same_gradients_for_every_n_and_recompute_happens(use_context):
    model = _model()
    ref, calls = _grads(model, 0, use_context)
    assert calls == [1, 1, 1, 1]
    for n in range(0, len(model) + 1):
        grads, calls = _grads(model, n, use_context)
        assert calls == [2] * n + [1] * (len(model) - n), f"n={n}: {calls}"
        for a, b in zip(grads, ref):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_clamp_override_precedence_no_grad_and_find():
    model = _model(num_layers=3)
    model.recompute_override = 10
    assert model.num_recompute() == 3
    model.recompute_override = -2
    assert model.num_recompute() == 0
    model.recompute_override = 1
    with sp_context(SPContext(recompute=3)):
        assert model.num_recompute() == 1  # override wins over the context
        model.recompute_override = None
        assert model.num_recompute() == 3
        with torch.no_grad():
            model(torch.zeros(2, 5, dtype=torch.float64), 0.0)
    assert [b.calls for b in model] == [1, 1, 1]
    assert len(model) == 3 and model[0] is model.layers[0] and list(model) == list(model.layers)

    outer = nn.Sequential(nn.Linear(2, 2), model, nn.ModuleDict({"x": RecomputeLayers([nn.Identity()])}))
    found = find_recompute_layers(outer)
    assert found == [model, outer[2]["x"]] and RecomputeLayers.find(outer) == found


# --- SP context in recomputation (world 2) -----------------------------------------------------


class UlyssesBlock(nn.Module):
    """x + Wo · ulysses_attention(Wq x, Wk x, Wv x); records the SP size it ran under."""

    def __init__(self, heads=2, head_dim=3) -> None:
        super().__init__()
        dim = heads * head_dim
        self.qkv = nn.Linear(dim, 3 * dim, dtype=torch.float64)
        self.out = nn.Linear(dim, dim, dtype=torch.float64)
        self.heads, self.head_dim = heads, head_dim
        self.seen = []

    def forward(self, x, batch):
        self.seen.append(active_context().size)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, self.head_dim)).unbind(1)
        return x + self.out(ulysses_attention(q, k, v, batch, causal=True).flatten(1))


def _recompute_sp_worker(rank, world_size):
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    model = RecomputeLayers([UlyssesBlock() for _ in range(3)])
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)  # 10 tokens: 5 per rank
    batch = {CU_SEQLENS: cu, MAX_SEQLEN: 5}
    full = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    x_local = full[5 * rank : 5 * rank + 5]
    ctx = SPContext(group=group, size=2, rank=rank)

    results = {}
    for n in (0, 2, 3):
        model.zero_grad(set_to_none=True)
        for blk in model:
            blk.seen.clear()
        with sp_context(SPContext(group=ctx.group, size=2, rank=rank, recompute=n)):
            out = model(x_local, batch)
        # Backward (hence the recomputation) runs with the trivial context active: an all-to-all
        # that looked the group up now would be a no-op and break shapes and values.
        assert active_context().size == 1
        out.square().sum().backward()
        results[n] = [p.grad.clone() for p in model.parameters()]
        assert [blk.seen for blk in model][:n] == [[2, 2]] * n, [blk.seen for blk in model]
        assert [blk.seen for blk in model][n:] == [[2]] * (3 - n)
    for n in (2, 3):
        for a, b in zip(results[n], results[0]):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)

    # Single-process reference on the full sequence: grads summed over ranks equal it.
    ref_model = RecomputeLayers([UlyssesBlock() for _ in range(3)])
    ref_model.load_state_dict(model.state_dict())
    ref_model(full, batch).square().sum().backward()
    summed = [g.clone() for g in results[3]]
    for g in summed:
        dist.all_reduce(g, group=group)
    for g, ref_p in zip(summed, ref_model.parameters()):
        torch.testing.assert_close(g, ref_p.grad, atol=1e-10, rtol=1e-10)


def test_recompute_uses_forward_sp_context():
    run_distributed(_recompute_sp_worker, 2)
