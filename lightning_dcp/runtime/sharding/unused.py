"""Every rank of a shard group reduce-scatters the same gradients, also for the parameters it did not use.

FSDP2's reduce-scatter after a unit's backward packs the gradients of the unit's parameters that *have* one on
this rank, so its size is a rank's own. Under ``sharding="hsdp"`` the ranks of a shard group run different
inputs in one lockstep round, and a forward may leave parameters out on one rank only: a diffusers Wan block's
cross-attention (``attn2``, ``norm2``) on an SP rank whose shard holds only padding (an SP 2 item of one
token), or any branch a model takes for some inputs only. One rank then sends fewer bytes than the other and
gloo aborts ("Received data size doesn't match expected size"); NCCL would hang or reduce garbage.
:func:`reduce_scatter_unused_params` makes each unit send a zero gradient for every trainable parameter this
rank did not use, as DDP's ``find_unused_parameters`` does -- torch's own
:meth:`~torch.distributed.fsdp.FSDPModule.set_reduce_scatter_unused_params` (torch >= 2.13), or on an older
torch the same zeros put on the unused parameters just before FSDP's post-backward reads them.

The gradients stay exact: a parameter a rank did not use adds 0 to the sum. A parameter no rank uses in a
step gets a zero gradient instead of none, as it already did in any step with a dummy round
(:mod:`~lightning_dcp.runtime.sharding.dummy` touches every trainable parameter).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["reduce_scatter_unused_params"]


def reduce_scatter_unused_params(unit: nn.Module, *, use_torch_api: bool = True) -> None:
    """Make ``unit`` (a ``fully_shard`` unit, its own parameters only) reduce-scatter zeros for unused parameters.

    Args:
        unit: the unit.
        use_torch_api: use torch's setter where it exists (``False``: the fallback of older torch versions,
            which the tests run on a torch that has both).

    Raises:
        RuntimeError: a torch without the setter whose FSDP internals the fallback does not know (names the fix).
    """
    setter = getattr(unit, "set_reduce_scatter_unused_params", None)
    if use_torch_api and setter is not None:
        setter(True, recurse=False)
        return
    group = _param_group(unit)
    if group is None:  # a unit without parameters of its own: it reduce-scatters nothing
        return
    post_backward = group.post_backward

    def zeros_then_post_backward(*args: Any) -> Any:
        for fsdp_param in group.fsdp_params:
            param = getattr(fsdp_param, "_unsharded_param", None)  # made at the first all-gather
            if (param is not None and param.requires_grad and param.grad is None
                    and getattr(fsdp_param, "unsharded_accumulated_grad", None) is None):
                param.grad = torch.zeros_like(param)
        return post_backward(*args)

    group.post_backward = zeros_then_post_backward


def _param_group(unit: nn.Module) -> Any:
    """The unit's FSDP parameter group, checked for what the fallback uses."""
    try:
        group = unit._get_fsdp_state()._fsdp_param_group
    except (AttributeError, AssertionError) as err:
        raise _unknown(err) from err
    if group is not None and not (callable(getattr(group, "post_backward", None)) and hasattr(group, "fsdp_params")):
        raise _unknown(AttributeError("FSDPParamGroup has no post_backward / fsdp_params"))
    return group


def _unknown(err: BaseException) -> RuntimeError:
    return RuntimeError(f"sharding='hsdp' needs every rank of a shard group to reduce-scatter zeros for parameters it "
                        f"did not use; torch {torch.__version__} has no FSDPModule.set_reduce_scatter_unused_params and "
                        f"its FSDP internals are not the ones this package's fallback knows ({err}). Install torch >= "
                        "2.13, or use sharding='fsdp' (no per-layer collectives inside the micro-batch loop)")
