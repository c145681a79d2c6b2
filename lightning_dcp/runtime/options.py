"""The checks of ``DCPStrategy(...)``'s option values, run when the strategy is built (before any process starts).

A misspelled name (``policy="dpc"``, ``sharding="zero-2"``, ``planner_options={"trails": 4}``) or a value of
the wrong type fails in ``DCPStrategy.__init__`` with the values and the closest valid one, instead of
after the launch, once per rank. :class:`~lightning_dcp.runtime.settings.DCPSettings` calls
:func:`check_options`; the misspelled argument *names* are :func:`~lightning_dcp.runtime.settings.split_strategy_kwargs`'.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import numbers
from typing import Any, Iterable, Mapping

__all__ = ["TP_REFUSAL", "check_bool", "check_choice", "check_options", "check_planner_options", "did_you_mean"]

TP_REFUSAL = ("{what}: DCPStrategy cannot train tensor-parallel items yet (its runtime runs Ulysses and ring items "
              "only); tensor parallelism is priced for planning and simulation (Planner(max_tp_size=...), "
              "`lightning-dcp simulate --tp`): train with max_tp_size=1 (the default)")
"""The error for a tensor-parallel plan that reached the runtime (``{what}``: the option or item that asked for it)."""

def did_you_mean(value: Any, choices: Iterable[str]) -> str:
    """`` (did you mean 'dcp'?)`` for the closest of ``choices`` to ``value`` (``""`` when none is close)."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower().replace("_", "-"): c for c in choices}
        close = [lowered[value.lower().replace("_", "-")]] if value.lower().replace("_", "-") in lowered else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(name: str, value: Any, choices: Iterable[str], *, none: str | None = None) -> None:
    """``value`` is one of ``choices`` (or ``None`` when ``none`` says what ``None`` means); else ``ValueError``
    ``"{name} must be one of (...), got 'x' (did you mean 'y'?)"``."""
    choices = tuple(choices)
    if value is None and none is not None:
        return
    if isinstance(value, str) and value in choices:
        return
    also = f" (or None {none})" if none is not None else ""
    raise ValueError(f"{name} must be one of {choices}{also}, got {value!r}{did_you_mean(value, choices)}")


def check_bool(name: str, value: Any, *, none: str | None = None) -> None:
    """``value`` is ``True`` or ``False`` (or ``None`` when ``none`` says what it means)."""
    if isinstance(value, bool) or (value is None and none is not None):
        return
    also = f", or None {none}" if none is not None else ""
    raise ValueError(f"{name} must be True or False{also}, got {value!r}")


def _check_number(name: str, value: Any, *, low: float, strict: bool, none: bool = False, integer: bool = False) -> None:
    if value is None and none:
        return
    kind = numbers.Integral if integer else numbers.Real
    ok = not isinstance(value, bool) and isinstance(value, kind) and (value > low if strict else value >= low)
    if not ok:
        what = "an int" if integer else "a number"
        raise ValueError(f"{name} must be {what} {'>' if strict else '>='} {low:g}{' or None' if none else ''}, "
                         f"got {value!r}")


def check_planner_options(policy: str, options: Mapping[str, Any]) -> None:
    """Every key of ``planner_options`` is a :class:`~lightning_dcp.planning.planner.Planner` argument or an option
    of ``policy``; else ``ValueError`` naming the closest valid one."""
    from lightning_dcp.planning.planner import POLICIES, Planner

    params = inspect.signature(Planner.__init__).parameters
    planner_args = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    taken = {"seed", "dataset_lengths", "sample_name"}  # DCPStrategy passes these itself
    policy_args = set(POLICIES[policy].option_names())
    valid = sorted((planner_args - taken) | policy_args)
    for key in options:
        if key in taken:
            raise ValueError(f"planner_options[{key!r}]: DCPStrategy sets {key} itself"
                             + (" (pass DCPStrategy(seed=...))" if key == "seed" else ""))
        if key not in valid:
            raise ValueError(f"planner_options has {key!r}{did_you_mean(key, valid)}, which is neither a Planner "
                             f"argument nor an option of policy {policy!r}; valid keys: {', '.join(valid)}")


def check_options(settings: Any) -> None:
    """The option values of a :class:`~lightning_dcp.runtime.settings.DCPSettings` (the names of the choices,
    the types); raises ``ValueError`` naming the value and the fix."""
    from lightning_dcp.planning.planner import POLICIES

    s = settings
    check_choice("policy", s.policy, POLICIES)
    refusal = POLICIES[s.policy].runtime_refusal
    if refusal and s.planner is None:
        raise ValueError(f"policy {s.policy!r} cannot train: {refusal}; use it with `lightning-dcp plan` / `simulate`, "
                         "and train with policy='dcp'")
    if s.planner is not None and not callable(getattr(s.planner, "plan_batch", None)):
        raise ValueError(f"planner must have a plan_batch(samples, lengths, step=0) method (a "
                         f"lightning_dcp.planning.Planner, or your own); got {type(s.planner).__name__}")
    cost = s.cost_model
    if cost is not None and not all(callable(getattr(cost, m, None)) for m in ("item_cost", "item_memory")):
        raise ValueError(f"cost_model must be a lightning_dcp.planning.cost_model.CostModel (item_cost, item_memory, "
                         f"...); got {type(cost).__name__}")
    check_bool("profile", s.profile, none="(profile when no cost model or planner is given)")
    for f in dataclasses.fields(s):
        if f.type in ("bool", bool):  # the plain flags (``profile`` is checked above)
            check_bool(f.name, getattr(s, f.name))
    if s.seed is not None and (isinstance(s.seed, bool) or not isinstance(s.seed, numbers.Integral)):
        raise ValueError(f"seed must be an int (the same on every rank) or None (Lightning's global seed), "
                         f"got {s.seed!r}")
    lengths = s.lengths
    if lengths is not None and (isinstance(lengths, (str, bytes, Mapping)) or not (
            callable(lengths) or hasattr(lengths, "__len__"))):
        raise ValueError(f"lengths must be a sequence of ints (one per sample) or a callable taking the dataset, got "
                         f"{type(lengths).__name__}")
    _check_number("bucket_cap_mb", s.bucket_cap_mb, low=0, strict=True)
    _check_number("sigterm_grace_s", s.sigterm_grace_s, low=0, strict=False, none=True)
    _check_number("max_oom_replans", s.max_oom_replans, low=0, strict=False, integer=True)
    if not isinstance(s.planner_options, Mapping):
        raise ValueError(f"planner_options must be a mapping of Planner keyword arguments, got "
                         f"{type(s.planner_options).__name__}")
    if s.planner is None:
        check_planner_options(s.policy, s.planner_options)
        tp = s.planner_options.get("max_tp_size")
        if tp is not None and not isinstance(tp, bool) and isinstance(tp, numbers.Integral) and tp > 1:
            raise ValueError(TP_REFUSAL.format(what=f"planner_options['max_tp_size']={tp}"))
