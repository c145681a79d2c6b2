"""Cross-rank agreement: every rank must train on the same lengths, settings, cost model and plans.

DCP never broadcasts a plan: every rank plans the same global batch from the same inputs. If the
inputs differ -- a dataset filtered or transformed per rank, a seed taken from the rank, a cost
model measured separately on each node -- ranks run different plans: at SP 1 that trains each
rank on different samples (silently wrong), with SP > 1 two ranks wait on each other in
different collectives (a hang). This module turns such inputs into fingerprints (52-bit integers
held exactly in the float64 columns the strategy already gathers) and turns a disagreement into
one :class:`AgreementError` that every rank raises at the same point, naming the ranks, what
differs and the likely cause.

What is compared, and when (see :mod:`lightning_dcp.runtime.strategy` and
:mod:`lightning_dcp.runtime.executor` for the collectives):

- at setup (the train dataloader is built): sample count, token total and a hash of every
  sample length; the planner's settings; the cost model (its signature and a few probed costs);
- per step: the hash of the plan the step runs and of the next step's plan, on the step-end
  all-gather that exists anyway.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from array import array
from typing import Any, Mapping, Sequence

__all__ = ["AgreementError", "SETUP_FIELDS", "check_column", "check_setup", "cost_model_fingerprint", "fingerprint",
           "lengths_fingerprint", "plan_fingerprint", "planner_settings", "setup_row"]

_MASK = (1 << 52) - 1  # exact in float64

#: The columns of the setup comparison, in order, with the likely cause of a difference.
SETUP_FIELDS: dict[str, str] = {
    "sample count": "rank-dependent dataset filtering (e.g. a filter that reads rank-local files or state)",
    "token total": "rank-dependent dataset filtering or transforms (lengths computed after a per-rank random crop?)",
    "sample lengths": "rank-dependent dataset transforms or ordering (lengths must not depend on the rank or a "
                      "per-rank seed; build the dataset and its lengths identically on every rank)",
    "planner settings": "different DCPStrategy / planner arguments per rank (e.g. seed=rank, or a planner built "
                        "from rank-local values)",
    "cost model": "different cost models per rank (a profile measured or cached separately per node, a different "
                  "memory limit); load the same profile on every rank",
}

STEP_CAUSE = ("the planner's output depends on something rank-local (a per-rank seed or random state, the time, a "
              "rank-local cost model): a plan must be a pure function of the lengths, the seed and the step")


class AgreementError(RuntimeError):
    """Ranks disagree on an input every rank must share; raised on every rank at the same point."""


def fingerprint(obj: Any) -> float:
    """A 52-bit hash of a JSON-able object (``repr`` for the rest), exact as a float64."""
    text = json.dumps(obj, sort_keys=True, default=repr, separators=(",", ":"))
    return float(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK)


def lengths_fingerprint(lengths: Sequence[int]) -> float:
    """Hash of the sample lengths in order."""
    data = array("q", lengths).tobytes()
    return float(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK)


def plan_fingerprint(plan: Mapping[str, Any], epoch: int, step: int) -> float:
    """Hash of one step plan (``StepPlan.to_dict()``) with its position in the run; never 0."""
    items = [(list(it["ranks"]), list(it["samples"]), list(it["lengths"]), int(it["recompute"])) for it in plan["items"]]
    return fingerprint([int(epoch), int(step), items]) or 1.0


def planner_settings(planner: Any, **settings: Any) -> dict:
    """The planner's type and plain settings (numbers, strings, flags of it and of a planner it wraps) and ``settings``."""
    out: dict[str, Any] = dict(settings)
    layer, depth = planner, 0
    while layer is not None and depth < 3:
        attrs = getattr(layer, "__dict__", {})
        plain = {k: v for k, v in sorted(attrs.items()) if isinstance(v, (numbers.Number, str, bool, type(None)))}
        out[f"planner{depth}"] = [type(layer).__qualname__, plain]
        layer, depth = getattr(layer, "planner", None), depth + 1
    return out


def cost_model_fingerprint(cost_model: Any) -> float:
    """Hash of the cost model's signature and of a few probed costs (catches per-rank measurements)."""
    if cost_model is None:
        return 0.0
    probes: list[Any] = []
    try:
        sig = cost_model.signature()
    except Exception:  # noqa: BLE001 - a user cost model without a signature still gets probed
        sig = type(cost_model).__qualname__
    for n in (1, 257, 65537):
        for sp in (1, 2):
            try:
                cost = cost_model.item_cost([n], sp, 0)
                probes.append([n, sp, float(cost.total), float(cost_model.item_memory([n], sp, 0))])
            except Exception:  # noqa: BLE001 - an SP size the model does not support
                probes.append([n, sp, None])
    return fingerprint([sig, float(getattr(cost_model, "memory_limit", 0.0)), probes])


def setup_row(lengths: Sequence[int], settings: Mapping[str, Any], cost_model: Any) -> list[float]:
    """This rank's values for :data:`SETUP_FIELDS`."""
    return [float(len(lengths)), float(sum(lengths)), lengths_fingerprint(lengths), fingerprint(dict(settings)),
            cost_model_fingerprint(cost_model)]


def _by_value(values: Sequence[float], show: bool) -> str:
    groups: dict[float, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    parts = []
    for v, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        parts.append(f"{who} {'has' if len(ranks) == 1 else 'have'} {int(v) if show else f'hash {int(v):013x}'}")
    return "; ".join(parts)


def check_column(values: Sequence[float], what: str, cause: str, where: str, show_values: bool = False) -> None:
    """Raise :class:`AgreementError` unless every rank has the same value.

    Args:
        values: one value per rank (a gathered column).
        what: what the value is ("sample lengths", "the plan of step 3 of epoch 0"...).
        cause: the likely cause, for the message.
        where: when the check ran ("at setup", "at the end of step 2 of epoch 0"...).
        show_values: print the values themselves (counts) rather than hashes.
    """
    if len(set(values)) <= 1:
        return
    raise AgreementError(f"ranks disagree on {what} ({where}): {_by_value(values, show_values)}. Every rank must plan "
                         f"from the same inputs, or ranks train different samples or wait on each other forever. "
                         f"Likely cause: {cause}. The run stops on every rank")


def check_setup(table: Sequence[Sequence[float]], where: str = "at setup, when the train dataloader was built") -> None:
    """Check a gathered ``world x len(SETUP_FIELDS)`` table (rows from :func:`setup_row`), run ``where``."""
    for col, (what, cause) in enumerate(SETUP_FIELDS.items()):
        check_column([row[col] for row in table], f"the train dataset's {what}" if col < 3 else f"the {what}",
                     cause, where, show_values=col < 2)
