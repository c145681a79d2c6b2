"""Lightning callbacks for training under DCP: :class:`~lightning_dcp.callbacks.ema.EMA`, the exponential moving
average of the trained weights (sharded the way the strategy shards them); :class:`~lightning_dcp.callbacks.progress.
StepProgressBar`, Lightning's tqdm bar over the run's optimizer steps."""

from lightning_dcp.callbacks.ema import EMA, trained_parameters
from lightning_dcp.callbacks.progress import StepProgressBar

__all__ = ["EMA", "StepProgressBar", "trained_parameters"]
