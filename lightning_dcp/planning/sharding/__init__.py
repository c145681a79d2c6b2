"""The sharding modes of ``DCPStrategy(sharding=...)`` as the planner sees them: one pure counterpart per mode.

- :mod:`~lightning_dcp.planning.sharding.registry` -- THE registry of modes (``MODES``), read by the
  strategy, ``lightning-dcp plan`` / ``simulate``, the checks and the cost models;
- :mod:`~lightning_dcp.planning.sharding.base` -- what a mode answers: memory per phase, the step's
  collectives, its rounds, the cost model to plan with; the state bytes and collective prices;
- one file per mode: :mod:`.none`, :mod:`.zero1`, :mod:`.zero2`, :mod:`.fsdp`, :mod:`.hsdp` (with
  :mod:`.hsdp_cost`, its cost view, and :mod:`.shard_group_size`, which ``K`` when none is given);
- :mod:`~lightning_dcp.planning.rounds` -- how a step's items run (free-running or lockstep
  rounds), with the round planner's one entry point.

Per rank, with ``W``, ``B``, ``G``, ``O`` the full model's (one replica's) weight, buffer, gradient and
optimizer-state bytes (``O`` includes an fp32 master copy when the optimizer keeps one), ``N`` ranks,
``K`` the shard group, ``R`` / ``L`` the root unit's / largest layer's weights::

    mode    in the micro-batch loop (what the planner budgets)   between steps
    none    W + B + G + O                                         the same
    zero1   W + B + G + O/N                                       the same
    zero2   W + W/N + B + G + O/N                                 W + W/N + B + G/N + O/N
    fsdp    W + W/N + B + G + O/N                                 (W + G + O)/N + B
    hsdp    (W + G + O)/K + B + 2R + 4L                           (W + G + O)/K + B
    hsdp, offload   B + 2R + 4L                                   B

These are the runtime's, measured (``benchmarks/sharding_memory.py``). On one rank the runtime runs
``"none"`` whatever was asked. Buffers are never sharded. Pure Python.
"""
