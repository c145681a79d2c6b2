"""Deprecated: its names moved to :mod:`lightning_dcp.runtime.sampler`, :mod:`lightning_dcp.runtime.loader`, :mod:`lightning_dcp.runtime.lengths` in 0.2.0; this module is removed in 0.3.0."""

from lightning_dcp._moved import warn_moved
from lightning_dcp.runtime.sampler import DCPBatchSampler  # noqa: F401
from lightning_dcp.runtime.loader import DCPDataLoader, StepDataset, collate_step  # noqa: F401
from lightning_dcp.runtime.lengths import check_lengths, resolve_lengths, LENGTHS_HELP  # noqa: F401

__all__ = ['DCPBatchSampler', 'DCPDataLoader', 'LENGTHS_HELP', 'StepDataset', 'check_lengths', 'collate_step', 'resolve_lengths']

warn_moved(__name__, {"lightning_dcp.runtime.sampler": "DCPBatchSampler", "lightning_dcp.runtime.loader": "DCPDataLoader, StepDataset, collate_step", "lightning_dcp.runtime.lengths": "check_lengths, resolve_lengths, LENGTHS_HELP"})
