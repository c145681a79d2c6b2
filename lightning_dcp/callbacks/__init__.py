"""Lightning callbacks for training under DCP: :class:`~lightning_dcp.callbacks.ema.EMA`, the exponential moving
average of the trained weights (sharded the way the strategy shards them)."""

from lightning_dcp.callbacks.ema import EMA, trained_parameters

__all__ = ["EMA", "trained_parameters"]
