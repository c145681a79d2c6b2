"""The model side of sequence parallelism: what a model calls inside a DCP micro-batch.

- :mod:`~lightning_dcp.sp.context`: the active SP group and recompute count (set by the runtime
  per work item), and the keys of the packed-batch contract;
- :mod:`~lightning_dcp.sp.packing`: samples -> one variable-length micro-batch;
- :mod:`~lightning_dcp.sp.tokens`: a packed micro-batch -> this SP rank's shard, token weights,
  :func:`~lightning_dcp.sp.tokens.weighted_loss`;
- :mod:`~lightning_dcp.sp.attention`: local variable-length attention (flash-attn, torch varlen, SDPA);
- :mod:`~lightning_dcp.sp.ulysses`: the Ulysses all-to-all and :func:`ulysses_attention` (any SP size
  dividing the heads; a ring item goes on to :mod:`~lightning_dcp.sp.ring`);
- :mod:`~lightning_dcp.sp.ring`: ring attention over packed samples, past the head count (USP);
- :mod:`~lightning_dcp.sp.groups`: the SP process groups of any rank tuple a plan names;
- :mod:`~lightning_dcp.sp.recompute`: :class:`RecomputeLayers`, the per-layer recompute switch;
- :mod:`~lightning_dcp.sp.contract`: what the runtime and the profiler read off the model (its
  repeated layers, heads, hooks), once, and the one path from a micro-batch to an SP rank's part.

Nothing here decides anything: the runtime (:mod:`lightning_dcp.runtime`) sets the context from the
step plan, and these helpers read it.
"""
