"""``bucket``: bucket parallel, the baseline of the DCP paper and Open-Sora's bucket sampler.

Setting (fixed for the run, as a static system must): one SP size, the smallest that holds the
longest sample, and one recompute count, the fewest layers that hold it (:class:`FixedSPPolicy`).

Buckets: samples are grouped by length, ``per_octave`` buckets per doubling (default 4, about
19% wide, like Open-Sora's resolution x frame buckets). Each bucket ``k`` gets a per-GPU
micro-batch size ``b_k``, set once from the cost model (Open-Sora's users hand-tune these;
here they are tuned as a careful user would, with the cost model as the stopwatch):

1. ``b_max(k)``: the most samples of the bucket's upper edge length that fit in memory;
2. ``t_k = T(b_max(k))``: each bucket's step time at full batch;
3. a target step time ``t*`` (default: the median of the ``t_k``, the paper's recipe);
   every bucket takes the largest ``b <= b_max(k)`` whose step time stays within ``t*``
   (at least 1);
4. with ``dataset_lengths`` and ``target="auto"`` (default), ``t*`` is tuned: the candidate
   targets are the 25/50/75/90/100th percentiles of the ``t_k``, each is scored by the
   throughput it gives on the dataset (tokens / (sum over steps of slowest micro-batch +
   all-reduce)), the best wins.

Steps: a bucket's samples (shuffled, seeded) are cut into micro-batches of ``b_k``; all
micro-batches are shuffled (seeded) and dealt out, one per SP group per step, with no gradient
accumulation — so a set of samples takes ``ceil(micro-batches / groups)`` optimizer steps, each
paying the gradient all-reduce. ``plan_batch`` therefore returns several steps.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from lightning_dcp.planning.plan import StepNotes, StepPlan, WorkItem
from lightning_dcp.planning.policies.base import FixedSPPolicy, log_buckets
from lightning_dcp.planning.search.objective import makespan


class BucketPolicy(FixedSPPolicy):
    """Bucket parallel with per-bucket micro-batch sizes balanced to a tuned target step time."""

    name = "bucket"
    one_step_per_batch = False

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("sp", "recompute", "per_octave", "target", "batch_sizes")

    def __init__(self, world_size: int, view, **kw: Any):
        super().__init__(world_size, view, **kw)
        self.per_octave = int(self.options.get("per_octave", 4))
        self._target: float | None = None
        if self._fixed is not None and self.dataset_lengths:
            self._tune(self.dataset_lengths)

    # -- per-bucket micro-batch sizes -----------------------------------------------------
    def _edge(self, key: int) -> int:
        return int(math.floor(2 ** ((key + 1) / self.per_octave)))

    def _b_max(self, key: int, sp: int, rec: int) -> int:
        return max(1, self.view.capacities(sp)[rec] // max(self._edge(key), 1))

    def _bucket_time(self, key: int, mean_len: float, b: int, sp: int, rec: int) -> float:
        return self.view.time_uniform(mean_len, b, sp, rec)

    def _batch_size(self, key: int, mean_len: float, sp: int, rec: int, target: float | None) -> int:
        fixed = self.options.get("batch_sizes")
        if fixed and key in fixed:
            return int(fixed[key])
        bmax = self._b_max(key, sp, rec)
        if target is None or self._bucket_time(key, mean_len, bmax, sp, rec) <= target:
            return bmax
        lo, hi = 1, bmax  # largest b with time <= target (time grows with b)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._bucket_time(key, mean_len, mid, sp, rec) <= target:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _stats(self, lengths: Sequence[int]) -> dict[int, tuple[float, int]]:
        return {k: (float(np.mean([lengths[i] for i in idx])), len(idx)) for k, idx in log_buckets(lengths, self.per_octave).items()}

    def _full_times(self, stats, sp: int, rec: int) -> list[float]:
        return [self._bucket_time(k, m, self._b_max(k, sp, rec), sp, rec) for k, (m, _) in stats.items()]

    def _tune(self, lengths: Sequence[int]) -> None:
        sp, rec = self._fixed  # type: ignore[misc]
        lengths = list(lengths)
        if len(lengths) > 50000:
            idx = self.rng(0, 7).choice(len(lengths), 50000, replace=False)
            lengths = [lengths[i] for i in sorted(idx.tolist())]
        stats = self._stats(lengths)
        times = self._full_times(stats, sp, rec)
        target = self.options.get("target", "auto")
        if isinstance(target, (int, float)):
            self._target = float(target)
            return
        if target == "median" or target is None:
            self._target = float(np.median(times))
            return
        if target != "auto":
            raise ValueError(f"bucket target must be 'auto', 'median' or seconds; got {target!r}")
        best = None
        for q in (25, 50, 75, 90, 100):
            cand = float(np.percentile(times, q))
            score = self._score(lengths, stats, cand, sp, rec)
            if best is None or score > best[0] * (1 + 1e-9):
                best = (score, cand)
        self._target = best[1]  # type: ignore[index]

    def _score(self, lengths, stats, target: float, sp: int, rec: int) -> float:
        """Throughput (tokens/s) of bucket parallel with ``target`` on ``lengths``."""
        groups = len(self.groups(sp))
        times = []
        for key, idx in log_buckets(lengths, self.per_octave).items():
            b = self._batch_size(key, stats[key][0], sp, rec, target)
            full, rest = divmod(len(idx), b)
            t_full = self._bucket_time(key, stats[key][0], b, sp, rec)
            times += [t_full] * full
            if rest:
                times.append(self._bucket_time(key, stats[key][0], rest, sp, rec))
        arr = np.array(times)
        self.rng(0, 11).shuffle(arr)
        steps = math.ceil(len(arr) / groups)
        arr = np.concatenate([arr, np.zeros(steps * groups - len(arr))]).reshape(steps, groups)
        total = math.fsum(makespan(row) for row in arr.tolist()) + steps * self.view.cm.step_overhead(self.world_size)
        return sum(lengths) / total

    # -- planning -------------------------------------------------------------------------
    def plan_batch(self, samples: Sequence[int], lengths: Sequence[int], step: int = 0) -> list[StepPlan]:
        sp, rec = self.fixed(lengths)
        target = self._target
        if target is None:  # no dataset given: the paper's recipe, on this batch
            target = float(np.median(self._full_times(self._stats(lengths), sp, rec)))
        groups = self.groups(sp)
        cap = self.view.capacities(sp)[rec]
        rng = self.rng(step, 1)
        micro: list[list[int]] = []
        for key, idx in sorted(log_buckets(lengths, self.per_octave).items()):
            mean_len = float(np.mean([lengths[i] for i in idx]))
            b = self._batch_size(key, mean_len, sp, rec, target)
            idx = [idx[j] for j in rng.permutation(len(idx)).tolist()]
            cur: list[int] = []
            tok = 0
            for i in idx:
                if cur and (len(cur) >= b or tok + lengths[i] > cap):
                    micro.append(cur)
                    cur, tok = [], 0
                cur.append(i)
                tok += lengths[i]
            if cur:
                micro.append(cur)
        micro = [micro[j] for j in rng.permutation(len(micro)).tolist()]
        steps = []
        for s in range(0, len(micro), len(groups)):
            items = tuple(
                WorkItem(groups[g], tuple(samples[i] for i in mb), tuple(lengths[i] for i in mb), rec, self.view.ring_of(sp))
                for g, mb in enumerate(micro[s:s + len(groups)])
            )
            steps.append(StepPlan(items, StepNotes(setting={"sp": sp})))
        return steps
