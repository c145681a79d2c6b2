"""The Gantt chart of ``lightning-dcp simulate --plot``: every policy's run on one time axis, bars merged into
runs per rank and SP size so a run of thousands of micro-batches draws as a few collections."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["plot_gantt", "steps_note"]

SP_COLOURS = {1: "#4c72b0", 2: "#55a868", 4: "#dd8452", 8: "#c44e52", 16: "#8172b3", 32: "#937860", 64: "#da8bc3"}
"""Colour of each SP size in the chart (larger sizes cycle through these)."""

IDLE_COLOUR = "#f6e8e8"

NOTE_WIDTH = 150
"""Characters per line of a policy's note under its chart title."""


def steps_note(row: dict[str, Any]) -> str | None:
    """Why a policy ran more optimizer steps than the run has global batches, or ``None``.

    Only ``bucket`` does (``Planner.one_step_per_batch`` is false for it): it plans the run's
    samples as one epoch, cuts each length bucket into micro-batches of that bucket's own batch
    size and deals them out one per SP group per step, with no gradient accumulation -- so the
    same samples take ``ceil(micro-batches / groups)`` optimizer steps, each paying the all-reduce.
    """
    batches = row.get("global_batches")
    if batches is None or row["steps"] <= batches:
        return None
    if row["policy"] == "bucket":
        return (f"bucket: {row['steps']} steps for the samples of {batches} global batches: it deals its micro-batches "
                f"(each length bucket has its own batch size) one per SP group per step, with no gradient accumulation, "
                f"and every step pays the all-reduce")
    return f"{row['policy']}: {row['steps']} steps for the same samples as {batches} global batches"


def _runs(rank: np.ndarray, start: np.ndarray, end: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bars merged into maximal runs per rank: back-to-back bars (gap <= ``eps``) become one.

    A rank runs one item at a time, so sorted by (rank, start) its ends increase too.
    """
    if not len(rank):
        return rank, start, end
    order = np.lexsort((start, rank))
    r, s, e = rank[order], start[order], end[order]
    new = np.ones(len(r), dtype=bool)
    new[1:] = (r[1:] != r[:-1]) | (s[1:] > e[:-1] + eps)
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(r)) - 1
    return r[first], s[first], e[last]


def _run_bars(plan: Any, sim: Any, eps: float = 0.0) -> tuple[dict[Any, tuple[np.ndarray, ...]], list[tuple[float, float]], list[float]]:
    """A whole run's bars on one time axis, merged into runs (drawn as one collection each).

    Returns ``({sp: (rank, start, end)}, (rank, start, end) of recomputing micro-batches under
    key ``"recompute"``, [(start, width)] of the step-end all-reduces, step ends)``. Back-to-back
    micro-batches of one rank with the same SP size (or, for ``"recompute"``, that both
    recompute) are one bar: the chart draws no edges, so nothing visible is lost, and a run of
    thousands of tiny micro-batches costs one rectangle instead of thousands.
    """
    parts: dict[Any, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    allreduce: list[tuple[float, float]] = []
    ends, t0 = [], 0.0
    for step, line, t in zip(plan.steps, sim.timeline, sim.charged_step_times or sim.step_times):
        if line:
            rank, start, end, idx, kind = zip(*line)
            item = np.asarray(kind) == "item"
            rank, idx = np.asarray(rank)[item], np.asarray(idx)[item]
            start, end = np.asarray(start)[item] + t0, np.asarray(end)[item] + t0
            sp = np.array([it.sp_size for it in step.items], dtype=np.int64)[idx]
            rec = np.array([it.recompute > 0 for it in step.items], dtype=bool)[idx]
            for p in np.unique(sp).tolist():
                m = sp == p
                parts.setdefault(p, []).append((rank[m], start[m], end[m]))
            if rec.any():
                parts.setdefault("recompute", []).append((rank[rec], start[rec], end[rec]))
            allreduce.extend((t0 + a, b - a) for r, a, b, _, k in line if k == "allreduce" and r == 0)
        t0 += t
        ends.append(t0)
    bars = {k: _runs(*(np.concatenate([v[j] for v in vs]) for j in range(3)), eps) for k, vs in parts.items()}
    return bars, allreduce, ends


def _rects(rank: np.ndarray, start: np.ndarray, end: np.ndarray, height: float = 1.0) -> np.ndarray:
    """Vertices ``(n, 4, 2)`` of rectangles ``[start, end] x [rank - height/2, rank + height/2]``."""
    y0, y1 = rank - height / 2, rank + height / 2
    return np.stack([np.stack([start, y0], -1), np.stack([start, y1], -1),
                     np.stack([end, y1], -1), np.stack([end, y0], -1)], axis=1)


def plot_gantt(rows: list[dict[str, Any]], path: Path, title: str = "") -> int:
    """Every policy's whole run (the same samples) as per-rank Gantt charts on one shared time axis,
    plus a panel of tokens/s and % of the step bound per policy. Returns the number of bars drawn.

    Colour: SP size of the micro-batch (legend); hatched: the micro-batch recomputes layers; dark
    grey: the step-end all-reduce + optimizer step (every rank); pale background: idle; white:
    the policy's run is over; thin vertical lines: step ends. A policy that needs more optimizer
    steps than the run has global batches (bucket) says why under its title (:func:`steps_note`).
    Each (policy, SP size) is one collection of merged bars (:func:`_run_bars`), so drawing
    costs about the same for a hundred micro-batches as for a hundred thousand.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(rows)
    W = rows[0]["_plan"].world_size if rows else 1
    gantt_h, rates_h = min(2.6, 0.9 + 0.05 * W), 2.0
    notes = [textwrap.wrap(steps_note(r) or "", NOTE_WIDTH) for r in rows]
    gap = 0.45 + 0.12 * max((len(x) for x in notes), default=0)  # inches above each panel: title (+ note)
    header = 0.4  # inches for the figure title and the legend, above the first panel's title
    height = n * gantt_h + rates_h + (n + 1) * gap + header + 0.2
    fig = plt.figure(figsize=(11, height))
    left = 0.08
    grid = fig.add_gridspec(n + 1, 1, height_ratios=[gantt_h] * n + [rates_h], left=left, right=0.98,
                            top=1 - (header + gap) / height, bottom=0.6 / height,
                            hspace=gap / ((n * gantt_h + rates_h) / (n + 1)))
    axes = [fig.add_subplot(grid[0, 0])]
    axes += [fig.add_subplot(grid[i, 0], sharex=axes[0]) for i in range(1, n)]
    sizes: set[int] = set()
    horizon = max((r["_sim"].total_time for r in rows), default=1.0) or 1.0
    drawn = 0
    # hatch colour through rcParams, not PolyCollection(hatchcolor=...): that keyword needs matplotlib >= 3.11.
    # The hatched collection gets a transparent face rather than "none": matplotlib < 3.11 draws nothing
    # (hatch included) for a collection whose face and edge are both "none".
    with plt.rc_context({"hatch.linewidth": 0.6, "hatch.color": "black"}):
        for ax, r, note in zip(axes, rows, notes):
            drawn += _draw_run(ax, r, note, W, horizon, sizes)
            if ax is not axes[-1]:
                plt.setp(ax.get_xticklabels(), visible=False)
        axes[-1].set_xlim(0, horizon * 1.01)
        axes[-1].set_xlabel("seconds (whole run, every policy on the same samples)", fontsize=8)
        handles = [Patch(facecolor=SP_COLOURS.get(p, "0.4"), label=f"SP {p}") for p in sorted(sizes)]
        handles += [Patch(facecolor="white", edgecolor="0.3", hatch="////", label="recomputes layers"),
                    Patch(facecolor="0.25", label="all-reduce + optimizer"), Patch(facecolor=IDLE_COLOUR, label="idle"),
                    Patch(facecolor="white", edgecolor="0.6", label="run finished")]
        fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(left, 1 - 0.28 / height), ncol=len(handles),
                   fontsize=7, frameon=False, handlelength=1.5, columnspacing=1.0, borderaxespad=0.0)
        _plot_rates(fig.add_subplot(grid[n, 0]), rows)
        if title:
            fig.text(left, 1 - 0.06 / height, title, fontsize=10, weight="bold", va="top")
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80)  # the layout is set in inches above: one draw, no "tight" second pass
    plt.close(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return drawn


def _draw_run(ax: Any, r: dict[str, Any], note: list[str], W: int, horizon: float, sizes: set[int]) -> int:
    """One policy's Gantt panel (see :func:`plot_gantt`); adds the SP sizes drawn to ``sizes``, returns the bars drawn."""
    from matplotlib.collections import PolyCollection

    drawn = 0
    sim, plan = r["_sim"], r["_plan"]
    ax.set_facecolor(IDLE_COLOUR)  # idle: what no bar covers
    if sim.timeline:
        bars, allreduce, ends = _run_bars(plan, sim, eps=1e-9 * horizon)
        for key in sorted((k for k in bars if k != "recompute"), key=int):
            sizes.add(key)
            verts = _rects(*bars[key])
            ax.add_collection(PolyCollection(verts, facecolors=SP_COLOURS.get(key, "0.4"), edgecolors="none",
                                             linewidths=0), autolim=False)
            drawn += len(verts)
        if "recompute" in bars:
            verts = _rects(*bars["recompute"])
            ax.add_collection(PolyCollection(verts, facecolors=(0, 0, 0, 0), edgecolors="none", hatch="////",
                                             linewidths=0), autolim=False)
            drawn += len(verts)
        if allreduce:
            a = np.asarray(allreduce)
            verts = _rects(np.full(len(a), (W - 1) / 2), a[:, 0], a[:, 0] + a[:, 1], height=W)
            ax.add_collection(PolyCollection(verts, facecolors="0.25", edgecolors="none", linewidths=0), autolim=False)
            drawn += len(verts)
        ax.vlines(ends, -0.5, W - 0.5, colors="black", linewidth=0.4)
        ax.axvspan(sim.total_time, horizon * 1.01, facecolor="white", edgecolor="none")  # run over
    ax.set_ylim(W - 0.5, -0.5)
    ax.set_ylabel("rank", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(f"{r['policy']}: {r['steps']} steps, {r['total_time_s']:.1f} s, idle {100 * r['imbalance']:.0f}%, "
                 f"{100 * r['fraction_of_bound']:.0f}% of step bound", fontsize=9, loc="left",
                 pad=4 + 9 * len(note))
    if note:
        ax.text(0.0, 1.02, "\n".join(note), transform=ax.transAxes, fontsize=7, style="italic", color="0.2",
                va="bottom", linespacing=1.2)
    return drawn


def _plot_rates(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Tokens/s per policy (bars), labelled with % of the step bound and the speedup over the first."""
    names = [r["policy"] for r in rows]
    rates = [r["tokens_per_s"] for r in rows]
    ax.barh(range(len(rows)), rates, color="0.55")
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()
    top = max(rates, default=1.0) or 1.0
    for i, r in enumerate(rows):
        ax.text(r["tokens_per_s"] + 0.01 * top, i, f"{r['tokens_per_s']:,.0f} tokens/s, {100 * r['fraction_of_bound']:.0f}% "
                f"of step bound, {r['speedup']:.2f}x", va="center", fontsize=7)
    ax.set_xlim(0, top * 1.6)
    ax.set_xlabel("tokens/s (label: % of the step bound, speedup over the first policy)", fontsize=8)
    ax.tick_params(labelsize=7)
