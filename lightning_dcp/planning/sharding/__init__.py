"""The sharding modes of ``DCPStrategy(sharding=...)`` as the planner sees them: one pure counterpart per mode.

:mod:`.registry` is THE registry of modes, :mod:`.base` what a mode answers, one file per mode (:mod:`.hsdp` with
:mod:`.hsdp_cost`, its cost view, and :mod:`.shard_group_size`). Each mode's docstring gives its state bytes per rank,
the runtime's as measured (``benchmarks/sharding_memory.py``; the table: docs/sharding.md), from one replica's weight,
buffer, gradient and optimizer-state bytes ``W``, ``B``, ``G``, ``O`` (``O`` with an fp32 master copy when the
optimizer keeps one; buffers are never sharded), ``N`` ranks, shard groups of ``K``, and ``R`` / ``L`` the weights
outside the repeated layers / of the largest layer. On one rank the runtime runs ``"none"`` whatever was asked. Pure
Python.
"""
