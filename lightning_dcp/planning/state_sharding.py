"""Model-state memory per rank under each sharding mode of ``DCPStrategy(sharding=...)``.

The planner's memory limit is what is left of a device after the model states (weights,
gradients, optimizer states) and the workspace; sharding those states over the ``W`` ranks of
the world frees memory the planner can give to activations (longer samples without recompute,
fuller micro-batches). Both cost models use this module: the analytic one from the model shape,
the profiled one from the state bytes a profile records.

Per rank, with ``w``, ``g``, ``o`` the full (one replica's) weight, gradient and optimizer bytes
(``o`` includes an fp32 master copy of the weights when the model trains in 16-bit)::

    mode    peak during a step (what the planner needs)    between steps (at rest)
    none    w + g + o                                       same
    zero1   w + g + o / W                                   same
    zero2   w + g + o / W                                   w + (g + o) / W
    fsdp    (w + g + o) / W + min(2 u, w + g)               (w + g + o) / W

On one rank nothing is sharded: every mode holds ``w + g + o``.

- ``zero1``: optimizer states (and the fp32 master) sharded; gradients reduce-scattered (or
  all-reduced) at the step end, updated weights all-gathered.
- ``zero2``: as the runtime implements it, gradients accumulate *locally in full size* during
  the step (ranks run different numbers of micro-batches, so no per-micro-batch collective is
  possible) and are reduce-scattered once at the step end: the full gradient buffer is resident
  for the whole step, so zero2's *peak* equals zero1's; only the memory at rest differs.
- ``fsdp``: weights, gradients and optimizer states sharded at rest; each FSDP unit (one
  repeated layer; the embedding and head form the root unit) is all-gathered before its forward
  and again before its backward, its gradient reduce-scattered after its backward, per
  micro-batch. ``u`` is the largest unit's full weight + gradient bytes; two units are resident
  at once (the running one and the prefetched next), hence ``2 u`` (at most the whole model).
  So fsdp's peak is below zero1's only when ``2 u <= (w + g) (1 - 1/W)``: many small units (a
  7B model's layer is 3% of it), not a model of two layers on two ranks. The per-micro-batch traffic
  (two all-gathers and one reduce-scatter of every weight) is time, charged by the cost models
  per micro-batch (:func:`fsdp_micro_batch_seconds`), so the planner prefers fewer, larger
  micro-batches under fsdp.

Pure Python.
"""

from __future__ import annotations

SHARDING_MODES = ("none", "zero1", "zero2", "fsdp")
"""Names accepted by ``sharding=``, from least to most sharded."""

ZERO_STAGE_ALIASES = {0: "none", 1: "zero1", 2: "zero2"}
"""``zero_stage=`` (the analytic model's older argument) to ``sharding=``."""

FSDP_COLLECTIVES_PER_MICRO_BATCH = 3
"""All-gather before forward, all-gather before backward, reduce-scatter after backward."""


def resolve_sharding(sharding: str | None, zero_stage: int | None = None, *, default: str = "zero1") -> str:
    """The sharding mode from ``sharding=`` and/or the ``zero_stage=`` alias (``default`` if neither).

    Raises ``ValueError`` for unknown names, stages other than 0-2, or the two disagreeing.
    """
    if sharding is not None and sharding not in SHARDING_MODES:
        raise ValueError(f"sharding must be one of {', '.join(SHARDING_MODES)}, got {sharding!r}")
    if zero_stage is not None:
        if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGE_ALIASES:
            raise ValueError(f"zero_stage must be 0, 1 or 2 (aliases of sharding='none', 'zero1', 'zero2'), got "
                             f"{zero_stage!r}; for parameters sharded per layer (ZeRO-3) use sharding='fsdp'")
        alias = ZERO_STAGE_ALIASES[zero_stage]
        if sharding is not None and sharding != alias:
            raise ValueError(f"zero_stage={zero_stage} means sharding={alias!r} but sharding={sharding!r} was given; "
                             "pass only sharding=")
        return alias
    return default if sharding is None else sharding


def state_bytes(mode: str, world_size: int, *, weights: float, grads: float, optimizer: float,
                unit: float = 0.0, at_rest: bool = False) -> float:
    """Model-state bytes per rank under ``mode`` (see the module docstring's table).

    Args:
        mode: one of :data:`SHARDING_MODES`.
        world_size: ranks the states are sharded over (the whole world: SP groups are data
            parallel replicas of one model).
        weights, grads, optimizer: full (one replica's) bytes; ``optimizer`` includes an fp32
            master copy of 16-bit weights.
        unit: fsdp only: the largest FSDP unit's full weight + gradient bytes.
        at_rest: between steps instead of the peak during a step.
    """
    if mode not in SHARDING_MODES:
        raise ValueError(f"sharding must be one of {', '.join(SHARDING_MODES)}, got {mode!r}")
    W = float(world_size)
    if mode == "none" or world_size <= 1:
        return weights + grads + optimizer
    if mode == "zero1" or (mode == "zero2" and not at_rest):
        return weights + grads + optimizer / W
    if mode == "zero2":
        return weights + (grads + optimizer) / W
    sharded = (weights + grads + optimizer) / W
    return sharded if at_rest else sharded + min(2.0 * unit, weights + grads)


def fsdp_micro_batch_seconds(weight_bytes: float, world_size: int, bus_bandwidth: float, latency: float,
                             units: int) -> float:
    """Time of one micro-batch's fsdp traffic: :data:`FSDP_COLLECTIVES_PER_MICRO_BATCH` collectives
    of all ``weight_bytes`` over ``world_size`` ranks (each moves ``(W-1)/W`` of the bytes per rank
    at ``bus_bandwidth``) plus one ``latency`` per unit per collective. Not overlapped with
    compute (an upper bound: FSDP's prefetch hides part of it behind large micro-batches).
    Zero on one rank.
    """
    if world_size <= 1:
        return 0.0
    per = (world_size - 1) / world_size * weight_bytes / bus_bandwidth + units * latency
    return FSDP_COLLECTIVES_PER_MICRO_BATCH * per
