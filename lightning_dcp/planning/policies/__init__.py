"""Planning policies, one family per module (``dcp``, ``algorithm_one``: dcp-inter/intra, ``bucket``,
``packed``, ``static``), dcp's parts (``dcp_schedule``: one block of ranks, ``dcp_tree``: buddy-tree
search) and the shared parts (``costs``: cached cost-model view, ``dispatch``: LPT across groups,
``packing``: micro-batches inside a group). The registry is
:data:`lightning_dcp.planning.planner.POLICIES`."""
