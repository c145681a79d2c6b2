"""lightning-dcp: Data-Centric Parallel training for PyTorch Lightning."""

__version__ = "0.1.0"
