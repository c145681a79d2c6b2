"""The DCP runtime: executes step plans inside Lightning, and decides nothing.

One concept per module:

- :mod:`~lightning_dcp.runtime.strategy`: :class:`DCPStrategy`, the Lightning hooks only; its helpers
  :mod:`~lightning_dcp.runtime.checks`, :mod:`~lightning_dcp.runtime.fit_setup`,
  :mod:`~lightning_dcp.runtime.train_loader`, :mod:`~lightning_dcp.runtime.setup_agreement`,
  :mod:`~lightning_dcp.runtime.sharded_state`, :mod:`~lightning_dcp.runtime.run_sharding`;
- :mod:`~lightning_dcp.runtime.settings`: the frozen, validated ``DCPStrategy(...)`` arguments;
- :mod:`~lightning_dcp.runtime.step`: the typed step, from the sampler to the step's result;
- :mod:`~lightning_dcp.runtime.executor`: one step -- prepare on the host, the micro-batch loop, the
  step-end gather (:mod:`~lightning_dcp.runtime.row`), the gradient reduction
  (:mod:`~lightning_dcp.runtime.buckets`) -- built from a :mod:`~lightning_dcp.runtime.rank` runtime;
- :mod:`~lightning_dcp.runtime.sharding`, :mod:`~lightning_dcp.runtime.checkpoint`: one
  :class:`~lightning_dcp.runtime.sharding.protocol.Shards` per sharding mode (step start, rounds, gradient
  reduction, resting state, the bytes it measured), sharded checkpoints;
- :mod:`~lightning_dcp.runtime.oom`: out-of-memory recovery, one object;
- :mod:`~lightning_dcp.runtime.accumulation`, :mod:`~lightning_dcp.runtime.manual`: ``accumulate_grad_batches`` as
  a larger global batch, and manual optimization driving the step's micro-batches (``micro_batches``);
- :mod:`~lightning_dcp.runtime.sampler`, :mod:`~lightning_dcp.runtime.loader`,
  :mod:`~lightning_dcp.runtime.lengths`: steps, their micro-batches, and the sample lengths;
- :mod:`~lightning_dcp.runtime.planner_factory`, :mod:`~lightning_dcp.runtime.model`,
  :mod:`~lightning_dcp.runtime.support`: which planner, the SP cap the heads allow, the support
  level's messages (the module itself is read once, by :func:`lightning_dcp.sp.contract.read_model`);
- :mod:`~lightning_dcp.sp.groups`, :mod:`~lightning_dcp.runtime.agreement`,
  :mod:`~lightning_dcp.runtime.faults`, :mod:`~lightning_dcp.runtime.watchdog`: process groups, ranks
  that must agree, collectives that fail, and SIGTERM;
- :mod:`~lightning_dcp.runtime.metrics`, :mod:`~lightning_dcp.runtime.progress`: what a step did,
  and the progress bar.

Planning lives in :mod:`lightning_dcp.planning` (pure Python); the model side in :mod:`lightning_dcp.sp`.
"""
