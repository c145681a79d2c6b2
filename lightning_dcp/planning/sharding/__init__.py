"""The sharding modes of ``DCPStrategy(sharding=...)`` as the planner sees them: one pure counterpart per mode.

:mod:`.registry` is THE registry of modes; :mod:`.base` what a mode answers; one file per mode (:mod:`.hsdp` with
:mod:`.hsdp_cost`, its cost view, and :mod:`.shard_group_size`, which ``K`` when none is given). Per rank, with
``W``, ``B``, ``G``, ``O`` one replica's weight, buffer, gradient and optimizer-state bytes (``O`` with an fp32
master copy when the optimizer keeps one), ``N`` ranks, ``K`` the shard group, ``R`` / ``L`` the root unit's /
largest layer's weights::

    mode    in the micro-batch loop (what the planner budgets)   between steps
    none    W + B + G + O                                         the same
    zero1   W + B + G + O/N                                       the same
    zero2   W + W/N + B + G + O/N                                 W + W/N + B + G/N + O/N
    fsdp    W + W/N + B + G + O/N                                 (W + G + O)/N + B
    hsdp    (W + G + O)/K + B + 2R + 4L                           (W + G + O)/K + B
    hsdp, offload   B + 2R + 4L                                   B

These are the runtime's, measured (``benchmarks/sharding_memory.py``). On one rank the runtime runs ``"none"``
whatever was asked. Buffers are never sharded. Pure Python.
"""
