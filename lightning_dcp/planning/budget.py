"""The memory budget a model and a dataset need, read off a cost model: no guessing.

For a cost model (usually :class:`~lightning_dcp.planning.profiled.ProfiledCostModel`, fitted to a
measured profile) and a world size, :func:`budget_report` says, per SP size:

* the longest single sample that fits the cost model's budget with no layer recomputed and with
  every layer recomputed (:meth:`~lightning_dcp.planning.cost_model.CostModel.max_length`);
* for a dataset's lengths, the bytes per device its longest sample needs alone with no recompute
  and with every layer recomputed (``item_memory``).

From those: below :attr:`BudgetReport.needs_sp_below` bytes the dataset needs SP > 1 (SP 1 cannot
hold its longest sample even with every layer recomputed); below
:attr:`BudgetReport.needs_recompute_below` SP 1 needs recomputation for it; below
:attr:`BudgetReport.min_budget` no SP size up to the world holds it. These are the planner's own
numbers: a budget is checked as ``item_memory <= memory_limit``, so at ``needs_sp_below`` bytes the
planner runs every sample at SP 1 if it wants to, and one byte less forces SP > 1.

SP sizes a profile did not measure (one process measures SP 1 only) are *estimated* from SP 1:
Ulysses leaves each rank ``1/p`` of a sample's tokens, so SP ``p`` holds what SP 1 holds for
``ceil(l / p)`` tokens; rows marked ``estimated`` say so. The planner itself uses measured sizes only.

Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from lightning_dcp.planning.cost_model import CostModel
from lightning_dcp.planning.errors import PlanningError
from lightning_dcp.planning.lengths import check_lengths
from lightning_dcp.planning.units import describe_limit, format_bytes

__all__ = ["BudgetReport", "SPBudget", "budget_report", "capacity_line"]

#: What ``max_length`` returns when memory does not grow with length (no real bound).
UNBOUNDED = 1 << 40


@dataclass(frozen=True)
class SPBudget:
    """One SP size: the longest sample at the cost model's budget, and what the dataset's longest needs."""

    sp: int
    measured: bool
    """False: estimated from SP 1 (``1/sp`` of the tokens per rank); the planner does not use this size."""
    longest_no_recompute: int
    """Tokens of the longest single sample that fits with no layer recomputed (0: none; :data:`UNBOUNDED`)."""
    longest_full_recompute: int
    """Tokens of the longest single sample that fits with every layer recomputed."""
    need_no_recompute: float | None
    """Bytes per device the dataset's longest sample needs alone, no layer recomputed (``None``: no dataset)."""
    need_full_recompute: float | None
    """Bytes per device it needs with every layer recomputed."""


@dataclass(frozen=True)
class BudgetReport:
    """:func:`budget_report`'s answer; :meth:`lines` prints it."""

    budget: float
    budget_text: str
    """The cost model's budget with its source (``describe_limit``)."""
    world_size: int
    num_layers: int
    per_sp: tuple[SPBudget, ...]
    num_samples: int = 0
    shortest: int | None = None
    longest: int | None = None

    def _row(self, sp: int) -> SPBudget:
        return next(r for r in self.per_sp if r.sp == sp)

    @property
    def needs_sp_below(self) -> float | None:
        """Bytes per device below which the dataset needs SP > 1 (SP 1 holds its longest sample from here on)."""
        return self._row(1).need_full_recompute

    @property
    def needs_recompute_below(self) -> float | None:
        """Bytes per device below which SP 1 recomputes layers for the dataset's longest sample."""
        return self._row(1).need_no_recompute

    @property
    def min_budget(self) -> float | None:
        """Bytes per device below which no SP size up to the world holds the longest sample (measured sizes)."""
        needs = [r.need_full_recompute for r in self.per_sp if r.measured and r.need_full_recompute is not None]
        return min(needs) if needs else None

    def lines(self) -> list[str]:
        """The report as text: a table per SP size, then the dataset's thresholds."""
        L = self.num_layers
        out = [f"memory budget {self.budget_text}; {L} layers, world size {self.world_size}",
               f"{'SP':>4}  {'longest, no recompute':>22}  {f'longest, all {L} recomputed':>26}" + (
                   f"  {'longest sample needs: no recompute':>34}  {'all recomputed':>15}" if self.longest else "")
               + "  row"]
        for r in self.per_sp:
            row = f"{r.sp:>4}  {_tokens(r.longest_no_recompute):>22}  {_tokens(r.longest_full_recompute):>26}"
            if self.longest:
                row += f"  {format_bytes(r.need_no_recompute):>34}  {format_bytes(r.need_full_recompute):>15}"
            out.append(row + ("  measured" if r.measured else "  estimated from SP 1"))
        if self.longest is None:
            return out
        out.append(f"dataset: {self.num_samples} samples of {self.shortest}-{self.longest} tokens")
        out.append(f"  needs SP > 1 below {format_bytes(self.needs_sp_below)} per device "
                   f"({self.needs_sp_below:.0f} bytes: SP 1 holds {self.longest} tokens with all {L} layers recomputed)")
        out.append(f"  needs recompute at SP 1 below {format_bytes(self.needs_recompute_below)} per device "
                   f"({self.needs_recompute_below:.0f} bytes)")
        low = self.min_budget
        if low is not None:
            line = f"  fits no measured SP size up to {self.world_size} ranks below {format_bytes(low)} per device"
            guess = [r for r in self.per_sp if not r.measured and r.need_full_recompute is not None
                     and r.need_full_recompute < low]
            if guess:
                best = min(guess, key=lambda r: r.need_full_recompute)
                line += (f"; SP {best.sp}, estimated from SP 1, would hold it from "
                         f"{format_bytes(best.need_full_recompute)} (measure it under torchrun to plan with it)")
            out.append(line)
        return out


def _tokens(n: int) -> str:
    if n >= UNBOUNDED:
        return "unbounded"
    return f"{n} tokens" if n > 0 else "none"


def _memory_fn(cost_model: CostModel, sp: int, measured: bool) -> Callable[[int, int], float]:
    """``(tokens of one sample, recompute) -> bytes per device`` at ``sp`` (measured, or estimated from SP 1)."""
    if measured:
        return lambda n, r: float(cost_model.item_memory([n], sp, r))
    return lambda n, r: float(cost_model.item_memory([math.ceil(n / sp)], 1, r))


def _sp_row(cost_model: CostModel, sp: int, measured: bool, longest: int | None) -> SPBudget:
    L = cost_model.num_layers
    if measured:
        no_rc, full_rc = int(cost_model.max_length(sp, 0)), int(cost_model.max_length(sp, L))
    else:
        no_rc, full_rc = (min(UNBOUNDED, sp * int(cost_model.max_length(1, r))) for r in (0, L))
    mem = _memory_fn(cost_model, sp, measured)
    need = (None, None) if longest is None else (float(math.ceil(mem(longest, 0))), float(math.ceil(mem(longest, L))))
    return SPBudget(sp, measured, no_rc, full_rc, *need)


def budget_report(cost_model: CostModel, world_size: int, lengths: Sequence[int] | None = None) -> BudgetReport:
    """Per SP size up to ``world_size`` (the divisors of the heads: Ulysses sizes), the longest sample that
    fits ``cost_model.memory_limit`` with and without recompute; with the dataset's ``lengths``, the
    budgets below which it needs SP > 1 or recompute (see the module docstring).

    Raises:
        PlanningError: a non-positive world size, empty or non-positive ``lengths``, or a cost
            model without SP 1 (nothing to estimate other sizes from).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanningError(f"world_size must be a positive integer, got {world_size!r}")
    lens = None if lengths is None else check_lengths(lengths)
    measured = set(cost_model.sp_sizes(world_size))
    if 1 not in measured:
        raise PlanningError(f"the cost model has no SP size 1 (it has {sorted(measured)}); a budget report needs SP 1")
    candidates = CostModel.sp_sizes(cost_model, world_size)  # every divisor of the heads up to the world
    longest = max(lens) if lens else None
    rows = tuple(_sp_row(cost_model, p, p in measured, longest) for p in candidates)
    return BudgetReport(float(cost_model.memory_limit), describe_limit(cost_model), world_size, cost_model.num_layers,
                        rows, len(lens or ()), min(lens) if lens else None, longest)


def capacity_line(cost_model: CostModel, world_size: int) -> str:
    """One line: the longest sample the planner places at each SP size it can use, with no layer and with every layer
    recomputed, at the cost model's budget -- why a sample runs at SP > 1 (a longer one must; a shorter one does
    when the cost model's times say that balances the step better)."""
    report = budget_report(cost_model, world_size)
    L = report.num_layers
    sizes = "; ".join(f"SP {r.sp} {_tokens(r.longest_no_recompute)} ({_tokens(r.longest_full_recompute)} with all {L} "
                      "recomputed)" for r in report.per_sp if r.measured)
    return (f"DCP planning at {report.budget_text}: the longest sample per SP size is {sizes}. A longer sample needs "
            "a larger SP size; a shorter one runs at SP > 1 only where the profile's times say that balances the step")
