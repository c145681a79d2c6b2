"""The one batch cutter (``planning/batches.py``) and the one length check (``planning/lengths.py``): their rule,
and that the sampler and the planner cut the same batches from the same order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_dcp.planning.batches import cut_batches, step_key
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.lengths import check_lengths

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def runs(draw):
    """Lengths, an order (a permutation of a random subset of the indices) and one of the two batch sizes."""
    lengths = draw(st.lists(st.integers(1, 50), min_size=0, max_size=60))
    order = draw(st.permutations(range(len(lengths))))
    order = order[: draw(st.integers(0, len(order)))]
    by_tokens = draw(st.booleans())
    budget = draw(st.integers(1, 120)) if by_tokens else draw(st.integers(1, 12))
    return lengths, order, by_tokens, budget


@SETTINGS
@given(run=runs(), drop_last=st.booleans())
def test_every_sample_at_most_once_in_order_within_the_budget(run, drop_last):
    lengths, order, by_tokens, budget = run
    key = "global_batch_tokens" if by_tokens else "global_batch_size"
    batches = cut_batches(lengths, order, drop_last=drop_last, **{key: budget})
    flat = [i for b in batches for i in b]
    assert flat == order[: len(flat)]  # in order, each at most once, only a tail left out
    assert all(batches)  # at least one sample per batch
    size = (lambda b: sum(lengths[i] for i in b)) if by_tokens else len
    for k, b in enumerate(batches):
        assert size(b) <= budget or len(b) == 1  # a sample over the budget goes alone
        nxt = order[len([i for c in batches[: k + 1] for i in c])] if k + 1 < len(batches) else None
        if nxt is not None:  # a batch closes only before the sample that does not fit
            assert size(b + [nxt]) > budget
    left = order[len(flat):]
    if drop_last:
        assert size(left) < budget if left else True  # only an incomplete last batch is dropped
        assert not left or not batches or size(batches[-1] + left[:1]) > budget
    else:
        assert left == []


def test_the_token_rule_closes_before_exceeding_and_keeps_a_full_tail():
    lengths = [4, 4, 4, 9, 3, 3]
    assert cut_batches(lengths, global_batch_tokens=8) == [[0, 1], [2], [3], [4, 5]]
    assert cut_batches(lengths, global_batch_tokens=8, drop_last=True) == [[0, 1], [2], [3]]  # 6 < 8 tokens
    assert cut_batches([5, 5], global_batch_tokens=10, drop_last=True) == [[0, 1]]  # full: kept
    assert cut_batches(lengths, [5, 4, 0], global_batch_size=2, drop_last=True) == [[5, 4]]
    assert cut_batches(lengths, [5, 4, 0], global_batch_size=2) == [[5, 4], [0]]


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one of global_batch_size"),
    ({"global_batch_size": 2, "global_batch_tokens": 8}, "exactly one of"),
    ({"global_batch_tokens": 0}, "global_batch_tokens must be an integer >= 1, got 0"),
    ({"global_batch_size": 2.5}, "global_batch_size must be an integer >= 1, got 2.5"),
    ({"global_batch_size": 2, "order": [0, 0]}, r"each of the 3 samples at most once .*; got \[0, 0\]"),
    ({"global_batch_size": 2, "order": [3]}, r"each of the 3 samples at most once .*; got \[3\]"),
])
def test_bad_batch_arguments_are_named(kwargs, match):
    with pytest.raises(PlanningError, match=match):
        cut_batches([1, 2, 3], **kwargs)


def test_the_sampler_and_the_planner_cut_the_same_batches():
    """Before this cutter, ``Planner.batches`` closed a batch once it reached the budget (the crossing sample in)
    and kept the tail; the sampler closed before exceeding it and dropped the tail."""
    from lightning_dcp.planning.default_cost import DefaultCostModel
    from lightning_dcp.planning.planner import Planner
    from lightning_dcp.runtime.sampler import DCPBatchSampler, epoch_order

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=200).tolist()
    planner = Planner(2, DefaultCostModel(4, 4, 10_000))
    for drop_last in (True, False):
        sampler = DCPBatchSampler(lengths, planner=planner, global_batch_tokens=1000, seed=5, drop_last=drop_last)
        for epoch in (0, 3):
            order = epoch_order(len(lengths), 5, epoch)
            assert planner.batches(lengths, global_batch_tokens=1000, order=order, drop_last=drop_last) == \
                sampler.global_batches(epoch)
    g = torch.Generator()
    g.manual_seed(5 + 3)
    assert epoch_order(len(lengths), 5, 3) == torch.randperm(len(lengths), generator=g).tolist()  # DistributedSampler's
    assert epoch_order(4, 5, 3, shuffle=False) == [0, 1, 2, 3]
    assert step_key(2, 7) == 2 * 1_000_003 + 7


# ------------------------------------------------------------------------------------------------ lengths
@pytest.mark.parametrize("values, match", [
    ([4, 152.7], r"^ds.lengths\[1\] is 152.7, not an integer; lengths are token counts: round them"),
    ([4, "abc"], r"^ds.lengths\[1\] is 'abc' \(str\), not an integer"),
    ([True], r"^ds.lengths\[0\] is True \(bool\), not an integer"),
    ([3, 0], r"^ds.lengths\[1\] is 0; every sample needs >= 1 token"),
    ([float("nan")], r"^ds.lengths\[0\] is nan, not an integer"),
    ([np.array([1, 2])], r"^ds.lengths\[0\] is array\(\[1, 2\]\) \(ndarray\), not an integer"),
    ([], r"^ds.lengths is empty; give at least one sample length"),
    (7, r"^ds.lengths must be a sequence of ints"),
])
def test_one_length_check_names_the_entry_and_its_source(values, match):
    with pytest.raises(PlanningError, match=match):
        check_lengths(values, "ds.lengths")


def test_integer_like_lengths_are_accepted_without_torch_in_planning():
    assert check_lengths([2.0, np.int64(3), np.float32(4.0), torch.tensor(5), torch.tensor([6])]) == [2, 3, 4, 5, 6]
    assert check_lengths([], allow_empty=True) == []
    import subprocess
    import sys

    code = ("import sys; import lightning_dcp.planning.lengths, lightning_dcp.planning.batches, "
            "lightning_dcp.planning.planner; assert 'torch' not in sys.modules, 'planning imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_planner_sampler_and_commands_share_the_check(tmp_path):
    from lightning_dcp.cli import CLIError
    from lightning_dcp.commands.plan import read_lengths
    from lightning_dcp.planning.budget import budget_report
    from lightning_dcp.planning.default_cost import DefaultCostModel
    from lightning_dcp.planning.planner import Planner
    from lightning_dcp.runtime.sampler import DCPBatchSampler

    with pytest.raises(PlanningError, match=r"^lengths\[1\] is 2.5, not an integer"):
        Planner(2, DefaultCostModel(4, 4, 100)).plan_batch([0, 1], [3, 2.5])
    with pytest.raises(PlanningError, match=r"^dataset_lengths\[0\] is 0;"):
        Planner(2, DefaultCostModel(4, 4, 100), dataset_lengths=[0])
    with pytest.raises(ValueError, match=r"^lengths\[2\] is -1;"):
        DCPBatchSampler([1, 2, -1], planner=None, global_batch_size=1)
    with pytest.raises(PlanningError, match=r"^lengths\[0\] is 1.5"):
        budget_report(DefaultCostModel(4, 4, 100), 2, [1.5])
    path = tmp_path / "lengths.json"
    path.write_text("[3, 7.5]")
    with pytest.raises(CLIError, match=rf"^lengths file {path}\[1\] is 7.5, not an integer"):
        read_lengths(path)
