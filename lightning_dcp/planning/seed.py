"""The seed of the data order and the planner: ``DCPStrategy(seed=...)`` when given, else Lightning's global seed.

Lightning's own distributed sampler takes its seed from ``PL_GLOBAL_SEED``, the variable
``lightning.pytorch.seed_everything`` sets (and spawned or launched ranks inherit), so after
``seed_everything(42)`` DDP draws the data order seeded 42. :func:`data_seed` gives DCP the same rule:
``DCPStrategy(seed=None)`` (the default) reads it when the train loader is built, and ``lightning-dcp plan`` /
``simulate`` read it for their ``--seed`` default, so ``plan`` writes the plans that a fit in the same
environment trains. Pure Python: no torch, no Lightning.
"""

from __future__ import annotations

import os

__all__ = ["SEED_VARIABLE", "data_seed"]

#: The environment variable ``seed_everything`` sets and Lightning's distributed sampler reads.
SEED_VARIABLE = "PL_GLOBAL_SEED"


def data_seed(seed: int | None = None) -> int:
    """``seed`` when given, else ``$PL_GLOBAL_SEED`` (``seed_everything``), else 0 -- as DDP's sampler seeds.

    Raises:
        ValueError: ``seed`` is not an int, or ``PL_GLOBAL_SEED`` holds something that is not one.
    """
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int (or None: follow seed_everything / ${SEED_VARIABLE}), got {seed!r}")
        return seed
    value = os.environ.get(SEED_VARIABLE)
    if value is None or value == "":
        return 0
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${SEED_VARIABLE}={value!r} is not an integer seed; call lightning.pytorch.seed_everything"
                         f"(<int>) or pass DCPStrategy(seed=<int>) / --seed <int>") from None
