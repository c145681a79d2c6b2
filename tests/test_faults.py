"""Bad inputs and faults: clear errors, never a hang, never silently wrong (issue #9).

Unit checks run in this process. Whole-Trainer fault runs (2-3 spawned gloo processes each)
run ``tests/_fault_runs.py`` in a subprocess with a hard time-out, so a regression that hangs
fails the test instead of blocking CI.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.sampler import DCPBatchSampler, check_lengths, resolve_lengths
from lightning_dcp.strategy import DCPStrategy, DefaultCostModel


class _Lengths(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {}


# ---------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("lengths,match", [
    ([4, 152.7], r"_Lengths.lengths\[1\] is 152.7, not an integer"),
    ([4, 5, "abc"], r"_Lengths.lengths\[2\] is 'abc' \(str\), not an integer"),
    ([True, 3], r"_Lengths.lengths\[0\] is True \(bool\), not an integer"),
    ([3, 0], r"_Lengths.lengths\[1\] is 0; every sample needs >= 1 token"),
    ([float("nan")], r"_Lengths.lengths\[0\] is nan, not an integer"),
    ([], r"the train dataset _Lengths is empty"),
])
def test_bad_lengths_name_index_and_source(lengths, match):
    with pytest.raises(ValueError, match=match):
        resolve_lengths(_Lengths(lengths))


def test_integer_like_lengths_are_accepted():
    import numpy as np

    assert resolve_lengths(_Lengths([2.0, torch.tensor(3), np.int64(4)])) == [2, 3, 4]
    with pytest.raises(ValueError, match=r"lengths\[1\] is 2.5"):
        resolve_lengths(_Lengths([1, 2]), [3, 2.5])
    with pytest.raises(ValueError, match="empty"):
        DCPBatchSampler([], planner=None, global_batch_size=1)
    assert check_lengths(range(1, 4)) == [1, 2, 3]


def test_heads_without_power_of_two_factor_cap_sp_once_and_errors_do_not_suggest_max_sp_size():
    s = DCPStrategy()
    s.num_heads = 3
    with pytest.warns(UserWarning, match="the model has 3 attention heads: SP sizes must divide it, so SP is capped at 1"):
        s._resolve_max_sp(world_size=2)
    assert s.max_sp_size == 1
    s.support = "sp"
    s._cost_model = DefaultCostModel(num_layers=2, num_heads=3, max_tokens=100)
    with pytest.raises(PlanningError) as info:
        s._make_planner([10, 1000])
    msg = str(info.value)
    assert "sample 1 has length 1000" in msg and "capped by the model's 3 attention heads" in msg
    assert "max_sp_size" not in msg and "more ranks" not in msg
