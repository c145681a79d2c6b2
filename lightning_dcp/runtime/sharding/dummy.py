"""Dummy rounds that run only the collectives: what a rank without an item runs in a lockstep round.

Under ``sharding="hsdp"`` every rank of a shard group must issue the same per-layer collectives, in
the same order, in every round (:mod:`~lightning_dcp.planning.rounds`). A rank with no item
in a round used to run a real micro-batch times 0; now it runs :class:`CollectivesOnlyRound`: FSDP's
own hooks around a forward that computes nothing. Every unit gets a forward method (registered with
:func:`torch.distributed.fsdp.register_fsdp_forward_method`, so FSDP's pre- and post-forward hooks run
around it) that adds ``0 x`` one element of each of its own trainable parameters to its input; the
root's forward method calls the layers' in the model contract's call order and adds its own at the
start and the end, as a ``training_step`` uses the embeddings first and the head last. Its backward
then makes FSDP do exactly what a real micro-batch makes it do, unit by unit in the same order: the
root's all-gather for the backward first, then per layer (last to first) the all-gather before its
backward and the reduce-scatter of its gradients (all zeros), the root's reduce-scatter last, and in
the step's last round the replicas' all-reduce. Nothing else runs: no sample is loaded, no activation
is kept (its peak memory is the states and the units in flight), the gradients it adds are exactly 0.

It mirrors a micro-batch whose forward calls every repeated layer once, in the contract's order (as
every model this package adapts does), trainable or frozen (a LoRA run's frozen base and root, its trainable
adapters: ``tests/test_lora.py`` runs Wan, LTX-Video and CogVideoX that way under ``hsdp``). Measured against the cheapest input (8 tokens through the
model, loss times 0) on 2 gloo processes: see ``benchmarks/hsdp_dummy_rounds.py``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["CollectivesOnlyRound", "DUMMY_METHOD"]

#: The forward method each unit gets (an instance attribute, registered with FSDP).
DUMMY_METHOD = "_dcp_dummy_round"


def _own_trainable(unit: nn.Module, units: set[int], skip: set[int]) -> list[tuple[nn.Module, str]]:
    """(submodule, attribute) of every trainable parameter of ``unit`` that no nested unit holds: looked up at
    run time, when FSDP has swapped in the unsharded parameters."""
    out: list[tuple[nn.Module, str]] = []

    def walk(m: nn.Module, top: bool) -> None:
        if (not top and id(m) in units) or id(m) in skip:
            return
        for name, p in m.named_parameters(recurse=False):
            if p.requires_grad:
                out.append((m, name))
        for child in m.children():
            walk(child, False)

    walk(unit, True)
    return out


def _touch(params: Sequence[tuple[nn.Module, str]]) -> Callable[[Tensor], Tensor]:
    """``x + 0 * sum(one element of each parameter)``: a graph edge to every parameter, no compute. Always a new
    tensor (``+ 0.0``), even for a unit with no trainable parameter (a frozen layer, a LoRA run's root): FSDP hooks
    each unit's pre-backward on its output, and two units' hooks on one tensor would fire in forward order."""
    def touch(x: Tensor) -> Tensor:
        for holder, name in params:
            x = x + getattr(holder, name).reshape(-1)[:1].sum() * 0.0
        return x + 0.0

    return touch


class CollectivesOnlyRound:
    """The collectives of one micro-batch round with no compute (see the module docstring).

    Args:
        module: the root unit (the LightningModule, ``fully_shard`` applied).
        layers: the model contract's repeated layers in call order (those that are units are touched).
        units: every ``fully_shard`` unit (the layers' units and the root).
        coresident: modules kept out of the units (not touched).
        device: where the zero the forward starts from lives.
    """

    def __init__(self, module: nn.Module, layers: Sequence[nn.Module], units: Sequence[nn.Module],
                 coresident: Sequence[nn.Module], device: torch.device) -> None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        unit_ids = {id(u) for u in units}
        skip = {id(m) for m in coresident}
        ordered: list[nn.Module] = []
        for layer in layers:
            if id(layer) in unit_ids and layer is not module and all(layer is not u for u in ordered):
                ordered.append(layer)
        for layer in ordered:
            setattr(layer, DUMMY_METHOD, _touch(_own_trainable(layer, unit_ids, skip)))
            register_fsdp_forward_method(layer, DUMMY_METHOD)
        root = _touch(_own_trainable(module, unit_ids, skip))

        def forward() -> Tensor:
            x = root(torch.zeros((), device=device))
            for layer in ordered:
                x = getattr(layer, DUMMY_METHOD)(x)
            return root(x)

        setattr(module, DUMMY_METHOD, forward)
        register_fsdp_forward_method(module, DUMMY_METHOD)
        self.module = module
        self.layers = tuple(ordered)

    def run(self) -> None:
        """One dummy round: the forward's all-gathers, then the backward's all-gathers and zero reduce-scatters."""
        out = getattr(self.module, DUMMY_METHOD)()
        if out.requires_grad:
            out.backward()
