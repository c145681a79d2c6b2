"""Planning policies, one family per module (``dcp``, ``bucket``, ``packed``, ``static``) and
their shared parts (``costs``: cached cost-model view, ``dispatch``: LPT across groups,
``packing``: micro-batches inside a group). The registry is
:data:`lightning_dcp.planning.planner.POLICIES`."""
