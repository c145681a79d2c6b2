"""Length distributions: determinism, positivity, compute dominance, video token formula, real code lengths."""

from __future__ import annotations

import functools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp.planning.analytic import AnalyticCostModel
from lightning_dcp.planning.distributions import (
    BANDS,
    DISTRIBUTIONS,
    CodeDistribution,
    MixtureDistribution,
    VideoDistribution,
    compute_share,
    count_share,
    default_cost,
    get_distribution,
    stdlib_token_counts,
    video_pixels,
    video_tokens,
)
from lightning_dcp.planning.hardware import get_hardware
from lightning_dcp.planning.models import get_model

CM = AnalyticCostModel(get_model("transformer-1d"), get_hardware("h100"), 8)


def cost_1d(n: int) -> float:
    """Compute-only time of one sequence on one H100 (the paper's dominance-by-compute measure)."""
    return CM.item_cost([n], 1, 0).ideal


def test_registry():
    assert {"short", "balanced", "long", "video", "code"} <= set(DISTRIBUTIONS)
    for name, d in DISTRIBUTIONS.items():
        assert d.name == name and d.description
    with pytest.raises(ValueError, match="balanced, code, long, short, video"):
        get_distribution("medium")


@pytest.mark.parametrize("name", ["short", "balanced", "long", "video", "code"])
def test_deterministic_positive_ints(name):
    d = get_distribution(name)
    a, b, c = d.sample(300, 7), d.sample(300, 7), d.sample(300, 8)
    assert a == b and a != c
    assert len(a) == 300 and all(isinstance(x, int) and x > 0 for x in a)
    assert d.sample(0, 1) == []
    with pytest.raises(ValueError, match="non-negative"):
        d.sample(-1, 0)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["short", "balanced", "long"]), st.integers(0, 2**32 - 1), st.integers(1, 200))
def test_mixture_range(name, seed, n):
    xs = get_distribution(name).sample(n, seed)
    assert all(BANDS[0][0] <= x < BANDS[-1][1] for x in xs)


@functools.lru_cache(maxsize=None)
def _shares(name, n=100_000):
    xs = get_distribution(name).sample(n, 0)
    return compute_share(xs, cost_1d), count_share(xs)


def test_long_is_dominated_by_few_long_sequences():
    comp, count = _shares("long")
    assert comp[3] + comp[4] > 0.8  # sequences >= 64k take > 80 % of the compute ...
    assert count[3] + count[4] < 0.1  # ... though they are < 10 % of the sequences
    assert count[0] > 0.5  # short ones are the most numerous


def test_short_is_dominated_by_short_sequences():
    comp, count = _shares("short")
    assert comp[0] == max(comp) and comp[0] + comp[1] > 0.6
    assert count[0] > 0.85
    assert comp[0] > _shares("balanced")[0][0] > _shares("long")[0][0]


def test_balanced_spreads_compute():
    comp, _ = _shares("balanced")
    assert all(0.12 < s < 0.30 for s in comp)


def test_default_cost_tracks_analytic():
    ratios = [default_cost(n) / cost_1d(n) for n in (1024, 4096, 16384, 65536, 262144, 524288)]
    assert max(ratios) / min(ratios) < 1.3


def test_compute_share_edges():
    assert compute_share([1, 10, 100], cost=float, edges=[0, 5, 50, 1000]) == pytest.approx([1 / 111, 10 / 111, 100 / 111])
    assert compute_share([], edges=[0, 1]) == [0.0]
    with pytest.raises(ValueError, match="edges"):
        compute_share([1], edges=[0])


def test_mixture_errors():
    with pytest.raises(ValueError, match="one weight per band"):
        MixtureDistribution("x", [(1, 2)], [0.5, 0.5])
    with pytest.raises(ValueError, match="lo < hi"):
        MixtureDistribution("x", [(5, 2)], [1.0])
    with pytest.raises(ValueError, match="non-negative"):
        MixtureDistribution("x", [(1, 2)], [-1.0])


# ------------------------------------------------------------------ video


def test_video_token_formula():
    assert video_pixels("720p", "16:9") == (720, 1280)
    assert video_pixels("720p", "9:16") == (1280, 720)
    assert video_pixels("144p", "16:9") == (144, 256)
    assert video_tokens(51, 720, 1280) == (13, 45, 80)  # 1 + 50//4 latent frames, 720/16 x 1280/16
    assert video_tokens(1, 144, 256) == (1, 9, 16)
    assert video_tokens(204, 480, 848) == (51, 30, 53)
    with pytest.raises(ValueError, match="positive"):
        video_tokens(0, 10, 10)


def test_video_samples_match_shapes():
    d = get_distribution("video")
    assert isinstance(d, VideoDistribution)
    shapes = d.sample_shapes(500, 3)
    lengths = d.sample(500, 3)
    assert lengths == [f * h * w for f, h, w in shapes]
    assert all(f in (1, 13, 26, 51) for f, _, _ in shapes)
    assert min(lengths) >= 100 and max(lengths) <= 51 * 45 * 80
    assert any(f == 1 for f, _, _ in shapes) and any(f == 51 for f, _, _ in shapes)  # images and long videos


# ------------------------------------------------------------------ code


def test_code_lengths_are_stdlib_files():
    paths, counts = stdlib_token_counts()
    assert len(paths) > 100 and list(paths) == sorted(paths)
    assert not any("site-packages" in p for p in paths)
    xs = get_distribution("code").sample(1000, 0)
    assert set(xs) <= set(counts)
    assert max(counts) > 10 * sorted(counts)[len(counts) // 2]  # a long tail


def test_code_distribution_handles_bad_files(tmp_path):
    (tmp_path / "a.py").write_text("def f(x):\n    return x + 1\n")  # def f ( x ) : return x + 1 -> 10
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("import os\n")
    os.symlink(tmp_path / "nowhere.py", tmp_path / "broken.py")  # unreadable
    paths, counts = stdlib_token_counts(str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["a.py", "b.py"]
    assert counts == (10, 2)
    d = CodeDistribution("mine", root=str(tmp_path))
    assert set(d.sample(50, 1)) == {10, 2}
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="no readable"):
        CodeDistribution("none", root=str(tmp_path / "none")).sample(3, 0)
