"""Parts the peer policies (``verl``, ``megatron-hcp``, ``hydraulis``, ``flexsp``) share.

- :func:`karmarkar_karp`: the largest differencing method for balanced k-way partitioning (verl's
  micro-batch and data-parallel balancer).
- :func:`aligned_starts`: where groups of power-of-two sizes go on the world's aligned blocks (the
  peers place their own groups, largest first, so every group is an aligned block the runtime and
  the plan contract accept).
- :func:`tuning_batches` and :class:`Tuner`: the small per-dataset search each peer's users would
  run by hand -- every candidate setting planned on the same few global batches drawn from the
  dataset, simulated on the cost model (:func:`~lightning_dcp.planning.step_time.step_time`),
  the fastest kept.

Pure Python + numpy.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.step_time import ItemPrices, step_time
from lightning_dcp.planning.layouts import world_blocks
from lightning_dcp.planning.plan import StepPlan

TUNE_TOKENS_PER_GPU = 65536
"""Tuning batches hold this many tokens per GPU unless the planner is told the run's global batch (``tune_tokens=``)."""

TUNE_BATCHES = 2
"""Global batches each candidate setting is simulated on while tuning."""


def karmarkar_karp(values: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of ``values`` split into ``k`` parts of near-equal sums (Karmarkar-Karp's largest differencing method).

    Every value starts as its own partial solution (``equal_size``: every ``k`` consecutive values of
    the sorted list form one, one per part, so each part gets the same count); repeatedly the two
    partial solutions with the largest spread (largest minus smallest part) are merged, the largest
    part of one joined to the smallest of the other. ``equal_size`` needs ``len(values) % k == 0``.
    Deterministic (ties by index). Parts may be empty when there are fewer values than parts.
    """
    n = len(values)
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs len(values) ({n}) divisible by k ({k})")
    order = sorted(range(n), key=lambda i: (values[i], i))
    heap: list[tuple] = []
    counter = 0

    def push(parts: list[tuple[float, list[int]]]) -> None:
        nonlocal counter
        parts.sort(key=lambda p: (-p[0], p[1][:1]))
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), -parts[0][0], counter, parts))
        counter += 1

    if equal_size:
        for off in range(0, n, k):
            push([(float(values[i]), [i]) for i in order[off:off + k]])
    else:
        for i in order:
            push([(float(values[i]), [i])] + [(0.0, []) for _ in range(k - 1)])
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        a = heapq.heappop(heap)[3]
        b = heapq.heappop(heap)[3]
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        push(merged)
    return [sorted(p[1]) for p in heap[0][3]]


def aligned_starts(sizes: Sequence[int], world_size: int, topology: Any = None) -> list[int] | None:
    """Start rank of each group of ``sizes`` (powers of two), placed largest first at the next free
    offset of the world's aligned blocks; ``None`` when they do not fit. Same order as ``sizes``.
    With a :class:`~lightning_dcp.planning.topology.Topology`: groups of any size where its rule puts them
    (the same places for powers of two)."""
    if topology is not None:
        order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
        groups = topology.place([sizes[i] for i in order])
        if groups is None:
            return None
        out = [0] * len(sizes)
        for i, g in zip(order, groups):
            out[i] = g[0]
        return out
    free = [[s, s + b] for s, b in world_blocks(world_size)]
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    out = [0] * len(sizes)
    for i in order:
        p = sizes[i]
        for blk in free:
            if blk[1] - blk[0] >= p:
                out[i] = blk[0]
                blk[0] += p
                break
        else:
            return None
    return out


def tuning_batches(dataset_lengths: Sequence[int], tokens: int, count: int = TUNE_BATCHES,
                   seed: int = 0) -> list[list[int]]:
    """``count`` global batches of ``tokens`` tokens drawn from the dataset (a seeded shuffle cut in order):
    the data a peer's settings are tuned on."""
    lengths = np.asarray(list(dataset_lengths), dtype=np.int64)
    if not len(lengths):
        return []
    rng = np.random.default_rng([seed & 0xFFFFFFFF, 0x7E4E])
    shuffled = lengths[rng.permutation(len(lengths))]
    ends = np.searchsorted(np.cumsum(shuffled), tokens * np.arange(1, count + 1), side="left")
    out, start = [], 0
    for e in ends.tolist():
        e = min(int(e) + 1, len(shuffled))
        if e > start:
            out.append(shuffled[start:e].tolist())
        start = e
    return out


def default_tune_tokens(world_size: int, dataset_lengths: Sequence[int]) -> int:
    """Tokens of a tuning batch when the planner is not told the run's: 65,536 per GPU, at least 4 longest samples."""
    return max(world_size * TUNE_TOKENS_PER_GPU, 4 * max(dataset_lengths))


class Tuner:
    """Picks the fastest of a peer's candidate settings on tuning batches.

    Args:
        cost_model: prices the plans (:func:`~lightning_dcp.planning.step_time.step_time`).
        world_size: ranks.
        batches: the tuning batches (lists of lengths).
        overhead: the step overhead added to every simulated step.
    """

    def __init__(self, cost_model: CostModel, world_size: int, batches: Sequence[Sequence[int]], overhead: float = 0.0):
        self.cm = cost_model
        self.world_size = world_size
        self.batches = [list(b) for b in batches]
        self.overhead = overhead
        self.prices = ItemPrices(cost_model)
        self.trials: list[tuple[Any, float]] = []
        """``(setting, seconds per token)`` of every candidate tried, in order (inf: it could not plan)."""

    @classmethod
    def for_policy(cls, policy: Any) -> "Tuner":
        """The tuner of a peer policy: its cost model and world, tuning batches of its ``tune_tokens`` option (default
        :func:`default_tune_tokens`) drawn from its dataset with its seed, its cost model's step overhead."""
        tokens = int(policy.options.get("tune_tokens") or default_tune_tokens(policy.world_size, policy.dataset_lengths))
        cm = policy.view.cm
        return cls(cm, policy.world_size, tuning_batches(policy.dataset_lengths, tokens, seed=policy.seed),
                   cm.step_overhead(policy.world_size))

    def time(self, plan_batch: Callable[[list[int], list[int]], list[StepPlan]]) -> float:
        """Seconds per token of ``plan_batch`` (samples, lengths -> steps) on the tuning batches."""
        total, tokens = 0.0, 0
        for batch in self.batches:
            for step in plan_batch(list(range(len(batch))), batch):
                total += step_time(step, self.cm, self.world_size, prices=self.prices).span + self.overhead
            tokens += sum(batch)
        return total / tokens if tokens else math.inf

    def best(self, candidates: Iterable[Any], plan_with: Callable[[Any], Callable]) -> Any:
        """The candidate whose planner (``plan_with(candidate)``) runs the tuning batches fastest; the
        first on ties; a candidate that raises ``ValueError`` is skipped."""
        best, best_t = None, math.inf
        for cand in candidates:
            try:
                t = self.time(plan_with(cand))
            except ValueError:
                t = math.inf
            self.trials.append((cand, t))
            if t < best_t * (1 - 1e-9):
                best, best_t = cand, t
        return best
