"""The SP-size rule (lightning_dcp.planning.sp_sizes) and the plan's ring field."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from lightning_dcp.planning.plan import PlanError, WorkItem
from lightning_dcp.planning.sp_sizes import best_split, divisors, ulysses_sizes


@pytest.mark.parametrize("heads,limit,expected", [
    (28, 32, (1, 2, 4, 7, 14, 28)),
    (12, 16, (1, 2, 3, 4, 6, 12)),
    (40, 16, (1, 2, 4, 5, 8, 10)),
    (24, 8, (1, 2, 3, 4, 6, 8)),
    (None, 3, (1, 2, 3)),
])
def test_ulysses_sizes_are_the_head_divisors_up_to_the_limit(heads, limit, expected):
    assert ulysses_sizes(heads, limit) == expected


@given(st.integers(1, 5000))
def test_divisors_divide_and_are_complete(n):
    ds = divisors(n)
    assert list(ds) == sorted(set(ds)) and all(n % d == 0 for d in ds)
    assert set(ds) == {d for d in range(1, n + 1) if n % d == 0} if n <= 300 else ds[0] == 1 and ds[-1] == n


@given(st.integers(1, 64), st.integers(1, 96))
def test_best_split_is_a_grid_whose_ulysses_size_divides_the_heads(size, heads):
    ring, u = best_split(size, heads)
    assert ring * u == size and heads % u == 0
    assert (ring == 1) == (heads % size == 0)


def test_work_item_ring_round_trips_and_is_checked():
    item = WorkItem((0, 1, 2, 3), (5,), (100,), 0, ring=2)
    assert item.ulysses_size == 2 and item.to_dict()["ring"] == 2
    assert WorkItem.from_dict(item.to_dict()) == item
    assert "ring" not in WorkItem((0, 1), (5,), (100,)).to_dict()  # v1 items without a ring read as ring 1
    assert WorkItem.from_dict({"ranks": [0], "samples": [1], "lengths": [3], "recompute": 0}).ring == 1
    with pytest.raises(PlanError, match="ring degree 3 must be >= 1 and divide the SP size 4"):
        WorkItem((0, 1, 2, 3), (5,), (100,), ring=3)
