"""The placement rule for SP groups of any size (lightning_dcp.planning.topology), layouts and split trees on it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_dcp.planning.search.layouts import allocate, place
from lightning_dcp.planning.plan import is_aligned_block
from lightning_dcp.planning.search.tree import BuddyTree, best_chain, chains
from lightning_dcp.planning.topology import Topology, group_problem, rank_tuples

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _legal(ranks, topo: Topology, ring: int = 1) -> bool:
    return group_problem(ranks, ring, topo) is None


def test_rank_tuples_of_a_28_head_model_on_two_nodes():
    """16 GPUs in nodes of 8, sizes 2, 7 and 14 (Ulysses) and 16 = 4 rings of 4: runs inside a node up to 8 ranks,
    any run above, ring groups starting at a multiple of their Ulysses size."""
    got = rank_tuples(16, {1: 1, 2: 1, 7: 1, 14: 1, 16: 4}, 8)
    by = {}
    for t in got:
        by.setdefault(len(t), []).append(t)
    assert 1 not in by  # a single rank needs no process group
    assert len(by[2]) == 2 * 7 and all(t[0] // 8 == t[-1] // 8 for t in by[2])
    assert by[7] == [tuple(range(a, a + 7)) for a in (0, 1, 8, 9)]
    assert by[14] == [tuple(range(a, a + 14)) for a in (0, 1, 2)]
    assert by[16] == [tuple(range(16))]
    assert list(got) == sorted(got, key=lambda t: (len(t), t[0]))  # one order on every rank


@SETTINGS
@given(world=st.integers(1, 40), node=st.sampled_from([None, 4, 6, 8]), data=st.data())
def test_rank_tuples_are_exactly_the_legal_runs(world, node, data):
    sizes = data.draw(st.lists(st.integers(1, world), min_size=1, max_size=5, unique=True))
    rings = {s: data.draw(st.sampled_from([r for r in (1, 2, 3, 4) if s % r == 0])) for s in sizes}
    topo = Topology(world, node, None, {s: s // r for s, r in rings.items() if r > 1})
    got = set(rank_tuples(world, rings, node, min_size=1))
    want = {tuple(range(a, a + s)) for s in sizes for a in range(world - s + 1) if _legal(range(a, a + s), topo, rings[s])}
    assert got == want


@SETTINGS
@given(world=st.integers(1, 48), node=st.sampled_from([None, 4, 8]), data=st.data())
def test_place_puts_every_group_on_disjoint_legal_ranks(world, node, data):
    topo = Topology(world, node)
    layout = data.draw(st.lists(st.integers(1, world), min_size=1, max_size=12))
    start = data.draw(st.integers(0, world - 1))
    size = data.draw(st.integers(1, world - start))
    groups = place(layout, topo, start, size)
    if groups is None:
        return
    assert sorted(len(g) for g in groups) == sorted(layout)
    seen = [r for g in groups for r in g]
    assert len(seen) == len(set(seen)) and all(start <= r < start + size for r in seen)
    assert all(_legal(g, topo) for g in groups)


@SETTINGS
@given(world=st.integers(1, 64), data=st.data())
def test_power_of_two_layouts_stay_aligned_blocks(world, data):
    """What the runtime of earlier versions created groups for: every power-of-two layout it could place."""
    layout = data.draw(st.lists(st.sampled_from([p for p in (1, 2, 4, 8, 16, 32, 64) if p <= world]), min_size=1,
                                max_size=16))
    groups = place(layout, Topology(world, 8))
    if groups is not None:
        assert all(is_aligned_block(g) for g in groups)


@SETTINGS
@given(world=st.integers(2, 40), node=st.sampled_from([4, 8]), data=st.data())
def test_allocate_gives_a_layout_place_puts_where_it_counted(world, node, data):
    sizes = sorted(data.draw(st.lists(st.integers(1, world), min_size=1, max_size=5, unique=True)) + [1])
    sizes = sorted(set(sizes))
    topo = Topology(world, node)
    work = {p: data.draw(st.floats(0.0, 10.0)) for p in sizes}
    must = max([p for p in sizes if work[p] > 0] or [sizes[0]])  # as callers give it: the largest size with work
    spill = data.draw(st.booleans())
    lay = allocate(work, topo, sizes, must, spill=spill)
    groups = place(lay, topo)
    assert groups is not None and all(_legal(g, topo) for g in groups)
    if must > sizes[0]:  # the must group whenever the world holds one (the smallest size takes what is left)
        assert must in lay or topo.next_start(0, must, world) is None


def test_spilled_work_makes_the_last_ranks_one_group():
    """Two ~93k-token samples prefer SP 12, and after the 24-group of a 183k-token one only 8 ranks are left: the
    plain allocation keeps a rank for the short samples and splits the 8 into single ranks; with ``spill`` SP 12's work
    moves to SP 8 and the 8 ranks are one group (the 32-GPU ``video`` step at 92% of the bound, now 97%)."""
    topo = Topology(32, 8)
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    work = {24: 65.1, 12: 39.6, 8: 6.0, 3: 0.6, 1: 4.4}
    assert allocate(work, topo, sizes, 24) == (24,) + (1,) * 8
    assert allocate(work, topo, sizes, 24, spill=True) == (24, 8)


def test_groups_of_seven_on_eight_gpu_nodes():
    """28 heads, 16 GPUs: one 7-group per node (never across the boundary), the spare GPU of each node works alone."""
    topo = Topology(16, 8)
    assert place([7, 7, 1, 1], topo) == [tuple(range(7)), tuple(range(8, 15)), (7,), (15,)]
    assert place([7, 7, 2], topo) is None  # the two spare GPUs are in different nodes
    assert allocate({7: 3.0, 1: 1.0}, topo, [1, 7], 7) == (7, 7, 1, 1)
    # a 14-group spans both nodes from rank 0; a group of 7 fits inside it only in its first node
    assert topo.always_contains(14, 7) and topo.always_contains(14, 6) and not topo.always_contains(10, 8)


def test_ring_groups_start_at_a_multiple_of_their_ulysses_size():
    topo = Topology(16, 8, None, {8: 4, 12: 4})
    assert place([12, 2, 2], topo) == [tuple(range(12)), (12, 13), (14, 15)]
    assert place([2, 8], topo) == [tuple(range(8)), (8, 9)]
    assert group_problem(range(2, 10), 2, Topology(16, 8)) is not None  # 4 x 2 ring at rank 2: subgroup crosses
    assert group_problem(range(4, 12), 2, Topology(16, 16)) is None


def test_shard_groups_bound_every_sp_group():
    topo = Topology(32, 8, 16)
    assert place([12, 12], topo) == [tuple(range(12)), tuple(range(16, 28))]
    assert group_problem(range(12, 24), 1, topo) == "ranks [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23] span two shard groups of 16 ranks"


@pytest.mark.parametrize("world", [1, 2, 6, 8, 13, 32])
def test_power_of_two_classes_give_the_binary_buddy_tree(world):
    tree = BuddyTree(world, [1, 2, 4, 8])
    for v in range(len(tree.size)):
        assert is_aligned_block(tree.ranks(v))
        if tree.kids[v]:
            assert len(tree.kids[v]) == 2


@SETTINGS
@given(world=st.integers(1, 40), heads=st.sampled_from([2, 6, 12, 24, 28, 40, 48]), node=st.sampled_from([4, 8]))
def test_split_trees_are_legal_nested_and_cover_every_rank(world, heads, node):
    from lightning_dcp.planning.sp_sizes import sp_splits

    splits = sp_splits(heads, world, node)
    rings = {s: c[-1] for s, c in splits.items()}
    topo = Topology(world, node, None, {s: s // r for s, r in rings.items() if r > 1})
    classes = sorted(rings)
    tree = BuddyTree(topo, classes)
    assert tree.chain in chains(classes, world) and tree.chain == best_chain(classes, topo)
    assert sorted(tree.offset[v] for v in tree.leaves) == list(range(world))  # every rank is one leaf
    for v in range(len(tree.size)):
        ranks = tree.ranks(v)
        if tree.size[v] in rings:
            assert _legal(ranks, topo, rings[tree.size[v]])
        kids = tree.kids[v]
        if kids:  # the children split the node's ranks exactly, each smaller
            assert sorted(r for c in kids for r in tree.ranks(c)) == list(ranks)
            assert all(tree.size[c] < tree.size[v] for c in kids)
    groups = {(0, 7), (8, 4)} if world >= 16 and node == 8 else set()
    if groups:
        forced = BuddyTree(topo, classes, chain=tree.chain, groups=groups)
        assert all(forced.has_group(a, n) for a, n in groups)


@SETTINGS
@given(world=st.integers(1, 48), node=st.sampled_from([None, 4, 8]), domain=st.sampled_from([None, 8, 16]),
       outer=st.integers(1, 24), inner=st.integers(1, 24), al=st.sampled_from([1, 2, 4]))
def test_always_contains_checks_one_period_as_every_start(world, node, domain, outer, inner, al):
    topo = Topology(world, node, domain, {inner: al} if inner % al == 0 else {})
    brute = inner <= outer and all(topo.next_start(a, inner, a + outer) is not None
                                   for a in range(world - outer + 1) if topo.legal(a, outer))
    assert topo.always_contains(outer, inner) == brute
