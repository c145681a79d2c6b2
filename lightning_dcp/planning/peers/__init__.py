"""The field's planners, each as its own system does it (one module per peer) on one tuned-policy base
(:mod:`~lightning_dcp.planning.peers.base`): ``verl``, ``megatron`` (Megatron-Core hybrid context parallel),
``hydraulis``, ``flexsp``. A new peer is one module here and one line in
:data:`lightning_dcp.planning.planner.POLICIES`."""
