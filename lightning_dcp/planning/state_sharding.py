"""Model-state memory per rank under each mode of ``DCPStrategy(sharding=...)``: the one place the formulas live.

The planner's memory limit is what is left of a device after the model states (weights, buffers,
gradients, optimizer state) and the workspace; sharding those states over the ``N`` ranks of the
world frees memory the planner can give to activations. Every user of these numbers calls
:func:`state_bytes`: the analytic cost model (states estimated from the model shape), the profiled
one (states a profile records), and the runtime (:class:`lightning_dcp.runtime.states.ModelStates`,
states measured on the module it trains).

Per rank, with ``W``, ``B``, ``G``, ``O`` the full model's (one replica's) weight, buffer, gradient
and optimizer-state bytes (``O`` includes an fp32 master copy when the optimizer keeps one)::

    mode    in the micro-batch loop (what the planner budgets)   between steps
    none    W + B + G + O                                         the same
    zero1   W + B + G + O/N                                       the same
    zero2   W + W/N + B + G + O/N                                 W + W/N + B + G/N + O/N
    fsdp    W + W/N + B + G + O/N                                 (W + G + O)/N + B
    hsdp    (W + G + O)/K + B + 2R + 4L                           (W + G + O)/K + B
    hsdp, offload   B + 2R + 4L                                   B

``hsdp`` (per-layer sharding inside the loop, over shard groups of ``K`` ranks; ``K = N``: ZeRO-3)
is planned by :class:`~lightning_dcp.planning.shard_group.ShardGroupCostModel`: ``R`` the weight
bytes outside the repeated layers, ``L`` the largest layer's; with ``offload`` the shards live on
the host. ``DCPStrategy(sharding=...)`` accepts :data:`PLANNED_SHARDING_MODES` (the runtime runs
``hsdp``: :mod:`lightning_dcp.runtime.hsdp`); the analytic and profiled cost models take
:data:`SHARDING_MODES` and are wrapped in ``ShardGroupCostModel`` for ``hsdp``.

These are the runtime's, measured (``benchmarks/sharding_memory.py``). On one rank the runtime runs
``"none"`` whatever was asked: every mode holds ``W + B + G + O``. Buffers are never sharded.

What each mode does in this runtime (:mod:`lightning_dcp.runtime.fsdp`):

- ``none``: full replicas; one bucketed all-reduce of the gradients after the micro-batch loop.
- ``zero1``: ``ZeroRedundancyOptimizer`` shards the optimizer state (and its update) over the world;
  gradients are all-reduced as under ``none``, and each rank's updated shard of the weights is sent
  to the others after the step.
- ``zero2``: ``fully_shard`` (FSDP2) units with gradient sync off inside the loop: the weights stay
  full during the step (FSDP keeps each rank's shard beside them: ``W/N``), each rank accumulates
  its full local gradients, one reduce-scatter after the loop leaves each rank its gradient shard,
  the optimizer steps the shard, and one all-gather per unit right after the step makes the weights
  full again.
- ``fsdp``: as ``zero2``, but the weights are all-gathered once per step *before* the loop and
  freed after the step, so between steps a rank holds only its shards.

No world collective runs inside the micro-batch loop: per step there is one all-gather of the
weights (``fsdp`` before the loop, ``zero2`` after the optimizer step) and one reduce-scatter of the
gradients after the loop -- together the bytes of the all-reduce the other modes do. So ``zero2``
and ``fsdp`` have the same peak in the loop, ``W/N`` above ``zero1``'s: ``zero1`` leaves the most
room for activations during a step; ``zero2`` and ``fsdp`` save memory between steps (evaluation,
co-resident models) and write sharded checkpoints.

Per-layer ZeRO-3 (``hsdp``): each layer's weights gathered just before its forward and backward, its
gradients reduce-scattered after its backward, which is what weights that do not fit one device
*during* a step need. Its collectives run inside the micro-batch loop, where ranks run different
numbers of micro-batches in per-step SP groups, so inside a shard group every rank must run the same
number of aligned micro-batch rounds (each SP item in the same round on all its ranks, zero-weight
dummy micro-batches where a rank has none): :mod:`lightning_dcp.planning.rounds` builds them and
:class:`~lightning_dcp.planning.shard_group.ShardGroupCostModel` prices them; the runtime runs them
(:mod:`lightning_dcp.runtime.hsdp`).

Pure Python.
"""

from __future__ import annotations

from typing import Any, Mapping

SHARDING_MODES = ("none", "zero1", "zero2", "fsdp")
"""Names accepted by ``sharding=`` (``DCPStrategy`` and both cost models), from least to most sharded."""

PLANNED_SHARDING_MODES = SHARDING_MODES + ("hsdp",)
"""What :func:`state_bytes` and the planning commands know: :data:`SHARDING_MODES` plus per-layer ``hsdp``."""

STATE_PARTS = ("weights", "buffers", "gradients", "optimizer")
"""The full model's state bytes :func:`state_bytes` takes (and ``ModelStates.to_dict`` carries)."""

ZERO_STAGE_ALIASES = {0: "none", 1: "zero1", 2: "zero2"}
"""``zero_stage=`` (the analytic model's older argument) to ``sharding=``."""


def resolve_sharding(sharding: str | None, zero_stage: int | None = None, *, default: str = "zero1") -> str:
    """The sharding mode from ``sharding=`` and/or the ``zero_stage=`` alias (``default`` if neither).

    Raises ``ValueError`` for unknown names, stages other than 0-2, or the two disagreeing.
    """
    if sharding is not None and sharding not in SHARDING_MODES:
        raise ValueError(f"sharding must be one of {', '.join(SHARDING_MODES)}, got {sharding!r}")
    if zero_stage is not None:
        if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGE_ALIASES:
            raise ValueError(f"zero_stage must be 0, 1 or 2 (aliases of sharding='none', 'zero1', 'zero2'), got "
                             f"{zero_stage!r}; for weights sharded between steps use sharding='fsdp'")
        alias = ZERO_STAGE_ALIASES[zero_stage]
        if sharding is not None and sharding != alias:
            raise ValueError(f"zero_stage={zero_stage} means sharding={alias!r} but sharding={sharding!r} was given; "
                             "pass only sharding=")
        return alias
    return default if sharding is None else sharding


def state_parts(given: Mapping[str, Any], *, required: bool = True) -> dict[str, float] | None:
    """The :data:`STATE_PARTS` bytes of ``given`` (``state_parts=`` of a cost model, or the runtime's
    ``ModelStates.to_dict()``) as floats; a part missing raises ``ValueError`` naming it, or, with
    ``required=False``, gives ``None`` (plan from the cost model's own bytes)."""
    missing = [k for k in STATE_PARTS if isinstance(given.get(k), bool) or not isinstance(given.get(k), (int, float))]
    if missing and required:
        raise ValueError(f"the model-state bytes need {', '.join(STATE_PARTS)} (of the full model); "
                         f"{', '.join(missing)} missing in {dict(given)!r}")
    return None if missing else {k: float(given[k]) for k in STATE_PARTS}


def state_bytes(mode: str, world_size: int, *, weights: float, buffers: float = 0.0, gradients: float,
                optimizer: float, at_rest: bool = False, shard_group_size: int | None = None,
                layer_bytes: float = 0.0, root_bytes: float = 0.0, offload: bool = False) -> float:
    """Model-state bytes one rank holds under ``mode`` (the module docstring's table).

    Args:
        mode: one of :data:`SHARDING_MODES`.
        world_size: ranks the states are sharded over (the whole world: SP groups are data-parallel
            replicas of one model); ``<= 1`` holds the full replica in every mode.
        weights, buffers, gradients, optimizer: the full model's bytes (``gradients``: of the
            trainable parameters; ``optimizer`` includes an fp32 master copy when there is one).
        at_rest: between steps instead of in the micro-batch loop.
        shard_group_size, layer_bytes, root_bytes, offload: ``hsdp`` only: the ranks ``K`` the states are
            sharded over (default the world), the largest layer's and the non-layer weight bytes, and
            whether the shards live on the host.
    """
    if mode == "hsdp":
        k = float(world_size if shard_group_size is None else shard_group_size)
        held = buffers if offload else (weights + gradients + optimizer) / k + buffers
        return held if at_rest else held + 2.0 * root_bytes + 4.0 * layer_bytes
    if mode not in SHARDING_MODES:
        raise ValueError(f"sharding must be one of {', '.join(PLANNED_SHARDING_MODES)}, got {mode!r}")
    n = float(world_size)
    if mode == "none" or world_size <= 1:
        return weights + buffers + gradients + optimizer
    if mode == "zero1":
        return weights + buffers + gradients + optimizer / n
    if not at_rest:  # zero2 and fsdp: full weights beside this rank's shard, full local gradients
        return weights + weights / n + buffers + gradients + optimizer / n
    if mode == "zero2":
        return weights + weights / n + buffers + (gradients + optimizer) / n
    return (weights + gradients + optimizer) / n + buffers
