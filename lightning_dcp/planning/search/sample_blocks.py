"""dcp's rules for the block engine (:mod:`~lightning_dcp.planning.search.blocks`): units are samples.

- *Preference*: each sample's fewest-GPU-seconds SP size; a sample longer (in time) than the block's mean rank load
  is promoted to the smallest size on which it takes at most that long (judged alone when the block has no more
  samples than ranks: it will run in a micro-batch of its own).
- *Candidates*: the work split over the sizes (biases 0, +0.35, -0.35), with and without a minimum group count per
  size for samples over half the mean load; at the top also once with the work of a size that gets no group moved
  to the next smaller size (:func:`~lightning_dcp.planning.search.layouts.allocate`'s ``spill``) and the dataset's
  layouts; and, when the largest size the
  samples need is below the one a sample prefers, the same without that group.
- *Own units*: a group packs its samples into time-balanced micro-batches (:meth:`StepProblem.pack`).
- *Refinement* (the top block, and nested blocks of more than half the world): samples move off the slowest group
  while that lowers the makespan, both groups re-planned exactly (:func:`~lightning_dcp.planning.search.climb.climb`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from lightning_dcp.planning.search.blocks import Block, BlockPlan, Blocks, GroupPlan, Mode, Preference
from lightning_dcp.planning.search.climb import climb
from lightning_dcp.planning.search.dispatch import fill_costs
from lightning_dcp.planning.search.layouts import Layout, allocate, place
from lightning_dcp.planning.search.objective import improves, makespan
from lightning_dcp.planning.search.problem import Placed, SearchSpace, StepProblem

__all__ = ["SampleBlocks", "REFINE_BUDGET", "NESTED_REFINE_ROUNDS", "FULL_REPLAN_WEIGHT"]

REFINE_BUDGET = 16
"""Refinement re-plans at most this many times the block's samples."""

NESTED_REFINE_ROUNDS = 4
"""Refinement rounds of the nested plan of a group of more than half the world (the top has ``refine_rounds``)."""

FULL_REPLAN_WEIGHT = 8
"""What one sample of such a group's re-plan costs the top level's refinement budget."""


class SampleBlocks(Blocks):
    """The block engine on one step's samples (:class:`StepProblem`)."""

    early_exit = True

    def __init__(self, space: SearchSpace, problem: StepProblem) -> None:
        view = space.view
        super().__init__(view, space.world_size, problem.E, speeds=view.speeds, trials=space.trials, rng=problem.rng)
        self.space, self.problem = space, problem

    def solve(self, ids: np.ndarray, size: int, offset: int, kmax: int, *, top: bool = False,
              full: bool = False) -> BlockPlan:
        if not top and not full and len(ids) == 1 and self.speeds is None:
            return self._one(int(ids[0]), size, offset, kmax)
        return super().solve(ids, size, offset, kmax, top=top, full=full)

    def _one(self, i: int, size: int, offset: int, kmax: int) -> BlockPlan:
        """A block of one sample (most nested blocks of a step of about a sample per rank): the size up to
        ``classes[kmax]`` that runs it fastest, exactly; ties to the smaller."""
        best = None
        for k in range(kmax + 1):
            c = self.classes[k]
            if not math.isfinite(self.cost[k, i]) or not self.view.contains(size, c):
                continue
            (pk,) = self.problem.pack([i], c)
            if best is None or improves(pk.time, best[0]):
                best = (pk.time, c, pk)
        assert best is not None, "a nested sample fits no SP size of its block"
        t, c, pk = best
        ranks = place((c,), self.view.topology, offset, size)
        assert ranks is not None
        return BlockPlan([[Placed(ranks[0], pk.members, pk.recompute, pk.ring, pk.tp)]], t, (c,))

    def prefer(self, Es: np.ndarray, ids: np.ndarray, size: int, offset: int, classes: list[int], top: bool,
               barred: bool) -> Preference:
        space, L = self.space, self.problem.L
        n = len(ids)
        cols = np.arange(n)
        parr = space.class_arr[: len(classes)]
        Gs = Es * parr[:, None]
        minidx = np.searchsorted(space.maxlens[: len(classes)], L[ids], side="left")
        if space.round_cap is not None and n:  # lockstep rounds: a sample's first size is the first it may use
            minidx = np.maximum(minidx, np.argmax(np.isfinite(Es), axis=0))
        if barred:
            minidx = np.argmax(np.isfinite(Es), axis=0)
        pref = np.argmin(Gs, axis=0)
        mean_load = float(Gs[pref, cols].sum()) / size
        # a sample longer (in time) than the mean rank load cannot be balanced on its preferred size; with no more
        # samples than ranks it runs alone, so it is judged by its time alone (constants included)
        alone = n <= size
        need = 0
        for i in np.nonzero(Es[pref, cols] > mean_load)[0].tolist():
            t = np.maximum(Es[:, i], self.problem.alone_times(int(L[ids[i]]))[: len(classes)]) if alone else Es[:, i]
            ok = np.nonzero(t <= mean_load)[0]
            k = int(ok[0]) if len(ok) else int(np.argmin(t))
            pref[i] = max(int(pref[i]), k) if len(ok) else k
            need = max(need, k)
        must = max(int(minidx.max()), int(pref.max()))
        need = max(int(minidx.max()), need)
        # early exit: a dispatch estimate within 1% of the block's lower bound (mean load, or the longest sample)
        longest = float(np.min(Es, axis=0).max()) if n else 0.0
        bound = max(mean_load, longest) * 1.01
        if self.speeds is not None:  # the block's ranks at their own pace
            blk = self.speeds[offset: offset + size]
            bound = max(mean_load * size / math.fsum(blk), longest / max(blk) if n else 0.0) * 1.01
        return Preference(pref, Gs[pref, cols], mean_load, must, need, bound)

    def order_key(self, block: Block) -> np.ndarray:
        return self.problem.L[block.ids].astype(np.float64)

    def modes(self, block: Block, full: bool) -> tuple[bool, ...]:
        return (True, False) if full else (False,)

    def candidates(self, block: Block, top: bool) -> list[Layout]:
        p = block.prefs
        classes = block.classes
        cands = self._layouts(block, p.pref, p.gpu_s, block.own_time, classes[p.must], top)
        if p.need < p.must:
            # the largest size the samples need (memory, the mean load) is below one a sample prefers for its
            # GPU-seconds: also the layouts without that group, those samples on their cheapest size up to the need
            Gs = block.Es * self.space.class_arr[: len(classes), None]
            cols = np.arange(len(block.ids))
            alt = p.pref.copy()
            over = alt > p.need
            alt[over] = np.argmin(Gs[: p.need + 1][:, over], axis=0)
            _, _, ep_alt = fill_costs(block.Es, alt, cols, Gs[alt, cols], classes, fill_ok=self.view.fill_ok(len(classes)))
            for lay in self._layouts(block, alt, Gs[alt, cols], ep_alt, classes[p.need], top):
                if lay not in cands:
                    cands.append(lay)
        return cands

    def _layouts(self, block: Block, pref: np.ndarray, gp: np.ndarray, ep: np.ndarray, must: int,
                 top: bool) -> list[Layout]:
        classes, size, offset = block.classes, block.size, block.offset
        w = np.bincount(pref, weights=gp, minlength=len(classes))
        work = {q: float(w[k]) for k, q in enumerate(classes)}
        min_groups = _min_groups(pref, ep > 0.5 * block.prefs.mean_load, size, classes)
        topo = self.view.topology
        cands: list[Layout] = []
        for bias in (0.0, 0.35, -0.35):
            lay = allocate(work, topo, classes, must, bias=bias, start=offset, size=size)
            if lay not in cands:
                cands.append(lay)
            if min_groups:
                lay = allocate(work, topo, classes, must, min_groups=min_groups, bias=bias, start=offset, size=size)
                if lay not in cands:
                    cands.append(lay)
        if top:
            lay = allocate(work, topo, classes, must, start=offset, size=size, spill=True)
            if lay not in cands:
                cands.append(lay)
            for lay in self.space.candidates.get(must, []):
                if lay not in cands:
                    cands.append(lay)
        return cands

    def own(self, block: Block, units: list[int], ranks: tuple[int, ...], k: int) -> GroupPlan:
        ids = block.ids
        speed = self.view.speed(ranks)
        items, t = [], 0.0
        for pk in self.problem.pack([int(ids[j]) for j in units], len(ranks)):
            items.append(Placed(ranks, pk.members, pk.recompute, pk.ring, pk.tp))
            t += pk.time / speed
        return GroupPlan(items, t)

    def nested(self, units: np.ndarray, size: int, offset: int, kmax: int) -> BlockPlan:
        """A group's fills, memoized per step (the same fills on the same ranks plan the same way); a group of more
        than half the world plans them as the top level does."""
        key = (tuple(units.tolist()), size, offset) if self.trials == 1 else None
        got = self.problem.nested.get(key) if key is not None else None
        if got is None:
            got = self.solve(units, size, offset, kmax, full=2 * size > self.world_size)
            if key is not None:
                self.problem.nested[key] = got
        return got

    # -- refinement --------------------------------------------------------------------------
    def refine(self, block: Block, mode: Mode, top: bool, full: bool) -> tuple[list[GroupPlan], float]:
        if not (self.space.refine_rounds and (top or full)):
            return mode.plans, mode.span
        plans = _Refinement(self, block, mode).run(self.space.refine_rounds if top else NESTED_REFINE_ROUNDS)
        return plans, makespan(p.time for p in plans)


class _Refinement:
    """Samples off the slowest group of a layout plan: each round, the moves of one of its samples to one of the three
    least-loaded groups that can hold it, ranked by the pair's estimated makespan afterwards; the first of the best
    four that lowers the makespan when both groups are re-planned exactly (the destination first). At most
    ``REFINE_BUDGET`` times the block's samples re-planned."""

    def __init__(self, blocks: SampleBlocks, block: Block, mode: Mode) -> None:
        self.blocks, self.block, self.mode = blocks, block, mode
        self.members = [list(m) for m in mode.members]
        self.plans = list(mode.plans)
        self.times = [p.time for p in mode.plans]
        self.budget = REFINE_BUDGET * sum(len(m) for m in self.members)
        self.kidx = [blocks.classes.index(len(g)) for g in mode.groups]
        self.gsp = [blocks.view.speed(g) for g in mode.groups]
        self.cost = block.C if mode.nested else block.Es
        self.tried: set[tuple[int, int]] = set()

    def run(self, rounds: int) -> list:
        climb(self, lambda st: max(st.times), self.moves, self.attempt, rounds=rounds)
        return self.plans

    def weight(self, g: int) -> int:
        return FULL_REPLAN_WEIGHT if 2 * len(self.mode.groups[g]) > self.blocks.world_size else 1

    def moves(self, _state: "_Refinement") -> list[tuple[float, int, int, int]]:
        """Candidate moves ``(estimated pair makespan, sample, source, destination)``, best first."""
        if self.budget <= 0:
            return []
        times = self.times
        slow = max(range(len(times)), key=times.__getitem__)
        span = times[slow]
        mem = np.asarray(self.members[slow], dtype=np.int64)
        if len(mem) == 0:
            return []
        L, ids, C = self.blocks.problem.L, self.block.ids, self.cost
        here = C[self.kidx[slow], mem] / self.gsp[slow]
        order = sorted((g for g in range(len(times)) if g != slow), key=lambda g: (times[g], g))[:3]
        out = []
        lens = L[ids[mem]]
        for g in order:
            there = C[self.kidx[g], mem] / self.gsp[g]
            est = np.maximum(span - here, times[g] + there)
            ok = np.isfinite(there) & (est < span)
            if not ok.any():
                continue
            cand = np.nonzero(ok)[0]
            best = cand[np.lexsort((lens[cand], est[cand]))[:4]]
            out.extend((float(est[i]), int(mem[i]), slow, g) for i in best)
        out.sort(key=lambda m: (m[0], int(L[ids[m[1]]]), m[3]))
        return out[:4]

    def attempt(self, _state: "_Refinement", move: tuple[float, int, int, int]):
        _, j, slow, g = move
        if (slow, j) in self.tried:
            return None
        self.tried.add((slow, j))
        span = self.times[slow]
        groups, blocks, block, nested = self.mode.groups, self.blocks, self.block, self.mode.nested
        src = [x for x in self.members[slow] if x != j]
        dst = self.members[g] + [j]
        self.budget -= len(dst) * self.weight(g)
        new_dst = blocks.group(block, dst, groups[g], nested)
        if not improves(new_dst.time, span):
            return None
        self.budget -= len(src) * self.weight(slow)
        new_src = blocks.group(block, src, groups[slow], nested)

        def take() -> "_Refinement":
            self.plans[slow], self.plans[g] = new_src, new_dst
            self.times[slow], self.times[g] = new_src.time, new_dst.time
            self.members[slow], self.members[g] = src, dst
            return self

        return makespan((new_src.time, new_dst.time)), take


def _min_groups(pref: np.ndarray, big: np.ndarray, size: int, classes: Sequence[int]) -> dict[int, int] | None:
    """Samples over half the mean rank load (``big``) cannot share a group without making it the slowest: each class
    gets at least one group per such sample it prefers (as far as the block holds them)."""
    if not big.any():
        return None
    nbig = np.bincount(pref[big], minlength=len(classes))
    min_groups, used = {}, 0
    for k in range(len(classes) - 1, 0, -1):
        if nbig[k] > 1:
            c = int(min(nbig[k], (size - used) // classes[k]))
            if c > 1:
                min_groups[classes[k]] = c
                used += c * classes[k]
    return min_groups or None
