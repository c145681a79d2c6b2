"""dcp's scheduler for one block of ranks (steps 1-5 of :mod:`~lightning_dcp.planning.policies.dcp`).

:class:`LayoutScheduler` plans samples on a block of consecutive ranks (the world, or a group's
ranks after its own items; groups go where :mod:`~lightning_dcp.planning.topology` allows): each sample's preferred SP size, candidate layouts of SP groups,
longest-first dispatch (:func:`~lightning_dcp.planning.policies.dispatch.lpt_dispatch`),
time-balanced packing inside each group and, at the top level, refinement by moving samples off
the slowest group. A group runs its own samples first, then the samples that prefer a smaller
SP size as a nested plan on its ranks (*fills*) -- only samples whose SP size every group of its
size holds wherever it is placed (:meth:`~lightning_dcp.planning.policies.costs.CostView.contains`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lightning_dcp.planning.layouts import Layout, allocate, place
from lightning_dcp.planning.policies.base import interleave_items
from lightning_dcp.planning.policies.dispatch import fill_costs, lpt_dispatch
from lightning_dcp.planning.policies.objective import improves, makespan
from lightning_dcp.planning.policies.packing import pack_time_balanced, recompute_for


REFINE_BUDGET = 16
"""Refinement re-plans at most this many times the block's samples (see :meth:`LayoutScheduler._refine`)."""

NESTED_REFINE_ROUNDS = 4
"""Refinement rounds of the nested plan of a group of more than half the world (the top level has ``refine_rounds``)."""

FULL_REPLAN_WEIGHT = 8
"""What one sample of such a group's re-plan costs the top level's refinement budget (its nested plan is planned
in both modes and refined: several flat plans' work)."""


@dataclass
class BlockCosts:
    """One block's samples and their costs, as :meth:`LayoutScheduler._schedule` dispatches them.

    ``Es[k, j]``: local sample ``j``'s estimated time on SP class ``k`` (``<= kmax``); ``C``,
    ``F``: its dispatch cost and fill floor there (:func:`fill_costs`); ``pref[j]``: its
    preferred class; ``bound``: the early-exit threshold of the dispatch (1% over the block's
    lower bound).
    """

    ids: np.ndarray
    L: np.ndarray
    E: np.ndarray
    G: np.ndarray
    Es: np.ndarray
    C: np.ndarray
    F: np.ndarray
    pref: np.ndarray
    classes: list[int]
    size: int
    offset: int
    rng: np.random.Generator
    bound: float


class LayoutScheduler:
    """Mixin of :class:`~lightning_dcp.planning.policies.dcp.DCPPolicy`: layouts, dispatch, packing, refinement.

    Uses the policy's ``classes`` (SP sizes), ``maxlens`` (longest sample per class),
    ``candidates`` (the dataset's layouts per largest SP size), ``view``, ``budget`` (token
    budget per class), ``trials``, ``dispatch_chunk``, ``refine_rounds``, its per-step caches
    (``_Ll``, ``_Wl``, ``_E``, ``_ET``, ``_Erows``, ``_packs``, ``_nested``) and ``_alone_times``.
    """

    # -- one block of ranks (the world, or a group's ranks after its own items) -------------
    def _schedule(self, ids: np.ndarray, L: np.ndarray, E: np.ndarray, G: np.ndarray, size: int, offset: int,
                  kmax: int, rng: np.random.Generator, top: bool = False, full: bool = False):
        """Plan samples ``ids`` on ranks ``offset .. offset+size-1`` using SP classes ``<= kmax`` (below the
        top: only those every group of ``size`` ranks holds, :meth:`CostView.contains`). ``full`` (implied by
        ``top``): plan with fills on sub-blocks and refine, as the top level does.

        Returns ``(per-group item lists, estimated span, layout)``; an item is ``(ranks, sample
        indices, recompute)``. A group of ``P`` ranks runs its *own* samples (those cheapest on
        ``P`` ranks) as ``P``-rank micro-batches first, then its *fill* samples (those that prefer
        a smaller SP size) on a nested plan of the same ``P`` ranks with SP sizes ``< P``: a
        long sample gets the large group it needs and the group's ranks are not left idle or
        spent on short samples at a large, communication-heavy SP size afterwards.
        """
        if not top and not full and len(ids) == 1 and self.view.speeds is None:
            return self._schedule_one(int(ids[0]), L, E, size, offset, kmax)
        classes = self.classes[: kmax + 1]
        Es, Gs = E[: kmax + 1][:, ids], G[: kmax + 1][:, ids]
        n = len(ids)
        cols = np.arange(n)
        minidx = np.searchsorted(self.maxlens[: kmax + 1], L[ids], side="left")
        if self._round_cap is not None and n:  # lockstep rounds: a sample's first SP size is the first it may use
            minidx = np.maximum(minidx, np.argmax(np.isfinite(Es), axis=0))
        if not top:
            barred = [k for k, c in enumerate(classes) if not self.view.contains(size, c)]
            if barred:  # a group of `size` ranks cannot always hold these: plan without them
                Es, Gs = Es.copy(), Gs.copy()
                Es[barred] = np.inf
                Gs[barred] = np.inf
                minidx = np.argmax(np.isfinite(Es), axis=0)
        pref, mean_load, needed = self._preferred(ids, L, Es, Gs, size, classes)
        must = classes[max(int(minidx.max()), int(pref.max()))]
        gp = Gs[pref, cols]
        # dispatch cost: a sample on a group of class k either runs on all its ranks, or (when it
        # prefers a smaller SP size) as fill, costing its GPU-seconds spread over the group
        fill_ok = self.view.fill_ok(len(classes))
        C, F, ep = fill_costs(Es, pref, cols, gp, classes, fill_ok=fill_ok)
        cands = self._layout_candidates(pref, gp, ep, mean_load, size, offset, classes, must, top)
        need = max(int(minidx.max()), needed)
        if classes[need] < must:
            # the largest SP size the samples *need* (memory, the mean load) is smaller than the one a sample
            # prefers for its GPU-seconds: also the layouts without that group, the samples that preferred a
            # larger size on their cheapest one up to the need (a group of most of the world otherwise leaves
            # the rest of the step to its nested plan)
            alt = pref.copy()
            over = alt > need
            alt[over] = np.argmin(Gs[: need + 1][:, over], axis=0)
            _, _, ep_alt = fill_costs(Es, alt, cols, Gs[alt, cols], classes, fill_ok=fill_ok)
            for lay in self._layout_candidates(alt, Gs[alt, cols], ep_alt, mean_load, size, offset, classes,
                                               classes[need], top):
                if lay not in cands:
                    cands.append(lay)
        # early exit: a dispatch estimate within 1% of the lower bound (mean rank load at the
        # preferred sizes, or the longest sample's best time) cannot be beaten by much
        bound = max(mean_load, float(np.min(Es, axis=0).max()) if n else 0.0) * 1.01
        speeds = self.view.speeds
        if speeds is not None:  # the block's ranks at their own pace
            blk = speeds[offset:offset + size]
            bound = max(mean_load * size / math.fsum(blk), float(np.min(Es, axis=0).max()) / max(blk) if n else 0.0) * 1.01
        block = BlockCosts(ids, L, E, G, Es, C, F, pref, classes, size, offset, rng, bound)
        result = None
        # two modes, each with its best layout by dispatch estimate: nested (groups may run fill
        # samples on sub-blocks) and flat (every sample on all ranks of its group); the one with
        # the lower exact span wins
        # (only the top level nests; a nested sub-plan is flat and unrefined, which keeps the
        # planner's time linear in the samples)
        full = full or top
        for nested in ((True, False) if full else (False,)):
            got = self._dispatch_mode(block, cands, nested)
            if result is None or improves(got[1], result[1]):
                result = got
            if not np.any(F) or got[1] <= bound:  # nothing can be a fill (the flat plan is the same), or close enough
                break
        plans, span, layout, groups, members, ctx = result  # type: ignore[misc]
        if self.refine_rounds and full:  # refine the winner only (a nested block: a few rounds)
            plans = self._refine(plans, groups, members, ctx, self.refine_rounds if top else NESTED_REFINE_ROUNDS)
            span = makespan(t for _, t in plans)
        return [items for items, _ in plans], span, layout

    def _schedule_one(self, i: int, L: np.ndarray, E: np.ndarray, size: int, offset: int, kmax: int):
        """:meth:`_schedule` of a block with one sample (most nested blocks of a step of about a sample per rank):
        the SP size up to ``classes[kmax]`` (one every group of ``size`` ranks holds) that runs it fastest, exact
        time; ties to the smaller size. The sample alone wastes the rest of the block whatever the layout."""
        best = None
        for k in range(kmax + 1):
            c = self.classes[k]
            if not math.isfinite(E[k, i]) or not self.view.contains(size, c):
                continue
            (idx, rec, t), = self._pack([i], c, L, E)
            if best is None or improves(t, best[0]):
                best = (t, c, idx, rec)
        assert best is not None, "a nested sample fits no SP size of its block"
        t, c, idx, rec = best
        ranks = place((c,), self.view.topology, offset, size)
        assert ranks is not None
        return [[(ranks[0], idx, rec)]], t, (c,)

    def _preferred(self, ids: np.ndarray, L: np.ndarray, Es: np.ndarray, Gs: np.ndarray, size: int,
                   classes: Sequence[int]) -> tuple[np.ndarray, float, int]:
        """Each local sample's preferred SP class (fewest GPU-seconds, promoted when too long), the mean rank
        load, and the largest class a promotion needed (0 if none)."""
        n = len(ids)
        cols = np.arange(n)
        pref = np.argmin(Gs, axis=0)
        # A sample longer (in time) than the mean rank load cannot be balanced on its preferred
        # SP size: promote it to the smallest SP size on which it takes at most that long.
        mean_load = float(Gs[pref, cols].sum()) / size
        # With no more samples than ranks, such a sample runs in a micro-batch of its own, so it is
        # judged by its time *alone* (its own recompute, the whole per-micro-batch constant), not
        # by its share of a full micro-batch, which understates constant-heavy SP sizes.
        over = np.nonzero(Es[pref, cols] > mean_load)[0]
        alone = n <= size  # so few samples that each may get a micro-batch (and group) of its own
        needed = 0
        for i in over.tolist():
            t = np.maximum(Es[:, i], self._alone_times(int(L[ids[i]]), classes)) if alone else Es[:, i]
            ok = np.nonzero(t <= mean_load)[0]
            k = int(ok[0]) if len(ok) else int(np.argmin(t))
            pref[i] = max(int(pref[i]), k) if len(ok) else k
            needed = max(needed, k)
        return pref, mean_load, needed

    def _layout_candidates(self, pref: np.ndarray, gp: np.ndarray, ep: np.ndarray, mean_load: float, size: int,
                           offset: int, classes: Sequence[int], must: int, top: bool) -> list[Layout]:
        """Candidate layouts of the block: the rounded split of its work over the SP sizes and its neighbours
        (Hydraulis §7), with and without a minimum group count per size; at the top, the dataset's layouts."""
        w = np.bincount(pref, weights=gp, minlength=len(classes))
        work = {p: float(w[k]) for k, p in enumerate(classes)}
        min_groups = _min_groups(pref, ep > 0.5 * mean_load, size, classes)
        topo = self.view.topology
        cands: list[Layout] = []
        for bias in (0.0, 0.35, -0.35):  # the rounded layout and its neighbours (Hydraulis §7)
            lay = allocate(work, topo, classes, must, bias=bias, start=offset, size=size)
            if lay not in cands:
                cands.append(lay)
            if min_groups:
                lay = allocate(work, topo, classes, must, min_groups=min_groups, bias=bias, start=offset, size=size)
                if lay not in cands:
                    cands.append(lay)
        if top:
            for lay in self.candidates.get(must, []):
                if lay not in cands:
                    cands.append(lay)
        return cands

    def _dispatch_mode(self, block: BlockCosts, cands: list[Layout], nested: bool):
        """The best candidate layout by dispatch estimate in one mode (``nested``: groups may run fills),
        realized: ``(per-group (items, time), exact span, layout, groups, members, group context)``."""
        ids, Es, C, F, classes = block.ids, block.Es, block.C, block.F, block.classes
        key = block.L[ids].astype(np.float64)
        if nested:
            cost, floor = C, F
            costT, floorT = C.T.tolist(), F.T.tolist()
        else:
            cost, floor = Es, None
            # rows of the step's E.T (cached once per step)
            costT = Es.T.tolist() if self._ET is None else [self._ET[i] for i in ids.tolist()]
            floorT = None
        best = None
        chunk_cache: dict = {}  # the same chunks of small samples for every candidate
        done = False
        for lay in cands:
            for groups in self._placements(lay, block):
                gs = None if self.view.speeds is None else [self.view.speed(g) for g in groups]
                members, loads, span = lpt_dispatch(cost, lay, classes, key, self.trials, block.rng, floor=floor,
                                                    costT=costT, floorT_all=floorT, chunk=self.dispatch_chunk,
                                                    chunk_groups=len(cands[0]), chunk_cache=chunk_cache,
                                                    fills_after_own=True,
                                                    cutoff=best[3] * (1 - 1e-9) if best is not None else math.inf,
                                                    group_speed=gs)
                if best is None or improves(span, best[3]):
                    best = (lay, members, groups, span)
                if span <= block.bound:
                    done = True
                    break
            if done:
                break
        layout, members, groups, _ = best  # type: ignore[misc]
        # fill[k][j]: sample j runs as a fill (on a sub-block) on a group of class k
        isfill = (Es > C).tolist() if nested else None
        ctx = (ids, block.L, block.E, block.G, Es, C if nested else Es, block.pref, block.rng, isfill, ids.tolist())
        plans = [self._group(list(members[g]), groups[g], ctx) for g in range(len(groups))]
        span = makespan(t for _, t in plans)
        return plans, span, layout, groups, members, ctx

    def _placements(self, layout: Layout, block: BlockCosts) -> list[list[tuple[int, ...]]]:
        """Rank tuples of ``layout``'s groups on the block (in layout order): the first-fit placement, and
        with uneven rank speeds also its mirror image (the large groups on the block's other end) when the
        placement rule allows it, so the dispatch can keep the slow ranks out of the long samples' groups."""
        topo = self.view.topology
        groups = place(layout, topo, block.offset, block.size)
        assert groups is not None
        out = [groups]
        speeds = self.view.speeds
        lo, hi = block.offset, block.offset + block.size
        if speeds is not None and len(set(speeds[lo:hi])) > 1:
            mirror = [tuple(range(hi - (g[0] - lo) - len(g), hi - (g[0] - lo))) for g in groups]
            if all(topo.legal(g[0], len(g)) for g in mirror) and \
                    [self.view.speed(g) for g in mirror] != [self.view.speed(g) for g in out[0]]:
                out.append(mirror)
        return out

    def _group(self, mem: list[int], ranks: tuple[int, ...], ctx) -> tuple[list, float]:
        """Items and estimated time of one group running the (local) samples ``mem``."""
        ids, L, E, G, Es, C, pref, rng, isfill, idl = ctx
        if not mem:
            return [], 0.0
        P = len(ranks)
        k = self.classes.index(P)
        if k > 0 and isfill is not None:
            fk = isfill[k]
            own = [j for j in mem if not fk[j]]
            fill = [j for j in mem if fk[j]]
        else:
            own, fill = list(mem), []
        items, t = [], 0.0
        if own:
            speed = self.view.speed(ranks)
            for idx, rec, ti in self._pack([idl[j] for j in own], P, L, E):
                items.append((ranks, idx, rec))
                t += ti / speed
        if fill:
            # a group of most of the world (its long samples want most ranks): what follows its own items is most
            # of the step, planned as the top level is (both modes, refined)
            key = (tuple(idl[j] for j in fill), P, ranks[0]) if self.trials == 1 and self._E is E else None
            got = self._nested.get(key) if key is not None else None
            if got is None:  # the same fills on the same ranks plan the same way (refinement moves own samples too)
                sub, span, _ = self._schedule(ids[fill], L, E, G, P, ranks[0], k - 1, rng, full=self._full(P))
                got = (interleave_items(sub), span)
                if key is not None:
                    self._nested[key] = got
            items.extend(got[0])
            t += got[1]
        return items, t

    def _pack(self, idx: list[int], sp: int, L: np.ndarray, E: np.ndarray) -> list[tuple[list[int], int, float]]:
        """Micro-batches ``(sample indices, recompute, time)`` of ``sp`` ranks running samples ``idx``."""
        if not idx:
            return []
        k = self.classes.index(sp)
        live = self._E is E and len(self._Ll) == len(L)
        if live:  # the same samples on the same SP size pack the same way (refinement repeats them)
            ckey = (sp, tuple(idx))
            got = self._packs.get(ckey)
            if got is not None:
                return got
        if live:
            Ll = self._Ll
            Ek = self._Erows.get(k)
            if Ek is None:
                Ek = self._Erows[k] = E[k].tolist()
            lens = [Ll[i] for i in idx]
            est = [Ek[i] for i in idx]
            Wl = self._Wl if self.view._time_fast is not None else None
        else:
            lens = [int(L[i]) for i in idx]
            est = [float(E[k, i]) for i in idx]
            Wl = None
        fast = self.view._time_fast
        caps = self.view.capacities(sp)
        cap_max = caps[-1]
        out = []
        for pack in pack_time_balanced(lens, est, self.budget[k]):
            pl = [lens[j] for j in pack]
            tok = sum(pl)
            # fewest recomputed layers that fit (recompute_for, inlined)
            rec = bisect.bisect_left(caps, tok) if tok <= cap_max else recompute_for(self.view, tok, sp)
            members = [idx[j] for j in pack]
            if Wl is not None:  # same sum, in the same order, as CostView.time
                t = fast(tok, float(sum([Wl[i] for i in members])), len(pl), sp, rec)
            else:
                t = self.view.time(pl, sp, rec)
            out.append((members, rec, t))
        if live:
            self._packs[ckey] = out
        return out

    def _full(self, size: int) -> bool:
        """Whether a group of ``size`` ranks plans what follows its own items as the top level does: a group
        of more than half the world (its long samples want most ranks; the rest of the step is its nested plan)."""
        return 2 * size > self.world_size

    def _replan_weight(self, ranks: Sequence[int]) -> int:
        """Refinement budget one sample of a group's re-plan costs (a fully planned nested plan: several)."""
        return FULL_REPLAN_WEIGHT if self._full(len(ranks)) else 1

    def _refine(self, plans, groups, members, ctx, rounds: int):
        """Move samples off the slowest group while that lowers the makespan (exact times).

        Each round looks at the moves of one sample from the slowest group to one of the three
        least-loaded groups that can hold it, ranked by the estimated makespan of the pair
        afterwards (``max(slow - its cost there, dst + its cost here)``: the move that evens
        the pair best, not merely the smallest sample), and makes the first of the best four
        that lowers the makespan when both groups are re-planned exactly (the destination first: a
        move it already makes too slow is dropped without re-planning the source). Re-planning stops
        once it has handled ``REFINE_BUDGET`` times the block's samples (deterministic: counted in
        samples, not seconds).
        """
        ids, L, E, G, Es, C, pref, rng, isfill, idl = ctx
        members = [list(m) for m in members]
        budget = REFINE_BUDGET * sum(len(m) for m in members)
        times = [t for _, t in plans]
        sizes = [len(g) for g in groups]
        kidx = [self.classes.index(p) for p in sizes]
        gsp = [self.view.speed(g) for g in groups]
        tried: set[tuple[int, int]] = set()
        for _ in range(rounds):
            slow = max(range(len(times)), key=times.__getitem__)
            span = times[slow]
            moves = self._refine_moves(slow, span, members, times, kidx, C, L, ids, gsp)
            moved = False
            for _, j, g in moves:
                if (slow, j) in tried:
                    continue
                tried.add((slow, j))
                src = [x for x in members[slow] if x != j]
                dst = members[g] + [j]
                budget -= len(dst) * self._replan_weight(groups[g])
                new_dst = self._group(dst, groups[g], ctx)
                if not improves(new_dst[1], span):
                    continue
                budget -= len(src) * self._replan_weight(groups[slow])
                new_src = self._group(src, groups[slow], ctx)
                if improves(makespan((new_src[1], new_dst[1])), span):
                    plans[slow], plans[g] = new_src, new_dst
                    times[slow], times[g] = new_src[1], new_dst[1]
                    members[slow], members[g] = src, dst
                    moved = True
                    break
            if not moved or budget <= 0:
                break
        return plans

    @staticmethod
    def _refine_moves(slow, span, members, times, kidx, C, L, ids, gsp, top=4):
        """Candidate moves ``(estimated pair makespan, sample, destination)``, best first (``gsp``: group paces)."""
        mem = np.asarray(members[slow], dtype=np.int64)
        if len(mem) == 0:
            return []
        here = C[kidx[slow], mem] / gsp[slow]
        order = sorted((g for g in range(len(times)) if g != slow), key=lambda g: (times[g], g))[:3]
        out = []
        lens = L[ids[mem]]
        for g in order:
            there = C[kidx[g], mem] / gsp[g]
            est = np.maximum(span - here, times[g] + there)
            ok = np.isfinite(there) & (est < span)
            if not ok.any():
                continue
            cand = np.nonzero(ok)[0]
            best = cand[np.lexsort((lens[cand], est[cand]))[:top]]
            out.extend((float(est[i]), int(mem[i]), g) for i in best)
        out.sort(key=lambda m: (m[0], int(L[ids[m[1]]]), m[2]))
        return out[:top]


def _min_groups(pref: np.ndarray, big: np.ndarray, size: int, classes: Sequence[int]) -> dict[int, int] | None:
    """Samples over half the mean rank load (``big``) cannot share a group without making it the
    slowest: each class gets at least one group per such sample it prefers (as far as the block of
    ``size`` ranks holds them), so many equally long samples do not queue up on too few large groups."""
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
