"""Which files one optimizer step's batch passes through, from the sampler's ``__iter__`` to the optimizer step.

A one-process CPU fit of ``DCPTransformerModule("tiny-1d")`` runs a few steps under ``sys.setprofile``;
for step ``--step`` the script keeps two windows: the DataLoader fetch that yields that step (the
sampler, the loader) and everything from the strategy's ``batch_to_device`` of that batch to the end
of its ``optimizer_step``. Two paths are reported:

- **batch path**: the ``lightning_dcp`` functions outside ``planning/`` (and outside ``runtime/step.py``,
  the typed carrier's own methods) that receive, yield or return the step's carrier
  (the typed :mod:`lightning_dcp.runtime.step` values, or the dict forms of earlier versions), in
  call order, with a return to the caller's file recorded each time one returns;
- **call-backs**: the pairs of ``lightning_dcp/runtime/`` files (and ``sp/context.py``) that call
  each other in the same windows (a call from A into B and one from B into A).

For the batch path: the file sequence (consecutive repeats merged), the number of files, the
number of *returns* (entries of a file already left earlier in the sequence) and the visits per
file::

    python benchmarks/step_path.py            # step 1 of a 3-step fit
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Any

PKG = os.sep + "lightning_dcp" + os.sep


def _is_carrier(value: Any) -> bool:
    """The step's carrier in any of its forms: typed (``runtime/step.py``, the planning ``StepPlan``) or
    the dicts of 0.2 (the batch, its descriptor, a descriptor item, the plan's ``to_dict()``)."""
    if type(value).__module__ == "lightning_dcp.runtime.step" or type(value).__name__ == "StepPlan":
        return True
    if isinstance(value, list) and len(value) == 1:
        return _is_carrier(value[0])
    if isinstance(value, dict):
        keys = value.keys()
        plan = "items" in keys and isinstance(value["items"], list) and all(
            isinstance(it, dict) and "ranks" in it for it in value["items"])
        return ({"items", "meta"} <= keys or {"epoch", "plan", "items"} <= keys
                or {"sp_rank", "samples", "ranks"} <= keys or plan)
    return False


def _short(path: str) -> str:
    return path.split(PKG, 1)[1] if PKG in path else path


class Tracer:
    """Records (window, file) transitions of the batch path and the runtime path."""

    def __init__(self) -> None:
        self.fetch = -1  # index of the DataLoader fetch in progress (-1: none)
        self.fetch_depth = 0
        self.step_call = -1  # batch_to_device calls seen
        self.in_step = False
        self.tracked: list[Any] = []  # frames on the batch path, innermost last
        self.batch: list[tuple[tuple, str]] = []
        self.edges: set[tuple[str, str]] = set()
        self.stack: list[str] = []  # runtime-path files of the live frames

    def window(self) -> tuple | None:
        if self.fetch_depth:
            return ("fetch", self.fetch)
        if self.in_step:
            return ("step", self.step_call)
        return None

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        code = frame.f_code
        path = code.co_filename
        if code.co_name == "__next__" and path.endswith(os.path.join("torch", "utils", "data", "dataloader.py")):
            if event == "call":
                if self.fetch_depth == 0:
                    self.fetch += 1
                self.fetch_depth += 1
            else:
                self.fetch_depth -= 1
            return
        if PKG not in path:
            return
        name = _short(path)
        if name == "runtime/strategy.py" and code.co_name == "batch_to_device" and event == "call" and not self.in_step:
            self.step_call += 1
            self.in_step = True
        self._runtime_path(frame, event, name)
        self._batch_path(frame, event, arg, name)
        if name == "runtime/strategy.py" and code.co_name == "optimizer_step" and event == "return":
            self.in_step = False

    def _runtime_path(self, frame: Any, event: str, name: str) -> None:
        if not (name.startswith("runtime/") or name == "sp/context.py"):
            return
        where = self.window()
        if event == "call":
            if where is not None and self.stack and self.stack[-1] != name:
                self.edges.add((self.stack[-1], name))
            self.stack.append(name)
        elif self.stack:
            self.stack.pop()

    def _batch_path(self, frame: Any, event: str, arg: Any, name: str) -> None:
        if name.startswith("planning/") or name == "runtime/step.py":
            return  # the planner builds the plan (the path starts where the runtime holds it); step.py: the value's own methods
        where = self.window()
        if event == "call":
            if any(_is_carrier(v) for v in frame.f_locals.values()):
                self.tracked.append(frame)
                if where is not None:
                    self.batch.append((where, name))
            return
        tracked = bool(self.tracked) and self.tracked[-1] is frame
        if tracked:
            self.tracked.pop()
        elif _is_carrier(arg) and where is not None:  # built or yielded the carrier without receiving it
            self.batch.append((where, name))
        if (tracked or _is_carrier(arg)) and self.tracked and where is not None:
            self.batch.append((where, _short(self.tracked[-1].f_code.co_filename)))


def _summary(label: str, seq: list[str]) -> str:
    merged = [f for i, f in enumerate(seq) if i == 0 or seq[i - 1] != f]
    seen: set[str] = set()
    returns = 0
    for f in merged:
        returns += f in seen
        seen.add(f)
    visits = Counter(merged)
    lines = [f"{label}: {len(seen)} files, {returns} returns",
             "  " + " -> ".join(merged),
             "  visits: " + ", ".join(f"{f} {n}" for f, n in visits.most_common())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=1, help="which optimizer step to report (0-based)")
    args = parser.parse_args()
    import lightning.pytorch as pl
    import torch

    from lightning_dcp import DCPStrategy
    from lightning_dcp.data import SyntheticTokenDataset
    from lightning_dcp.models.module import DCPTransformerModule

    torch.manual_seed(0)
    dataset = SyntheticTokenDataset([8, 12, 16, 20, 24, 28, 32, 36] * 4, vocab_size=64, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    strategy = DCPStrategy(global_batch_size=4, profile=False, plan_ahead=False, log_metrics=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=args.step + 2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    tracer = Tracer()
    sys.setprofile(tracer)
    try:
        trainer.fit(DCPTransformerModule("tiny-1d"), loader)
    finally:
        sys.setprofile(None)
    events = tracer.batch
    seq = [f for w, f in events if w == ("fetch", args.step)] + [f for w, f in events if w == ("step", args.step)]
    print(_summary("batch path", seq))
    mutual = sorted((a, b) for a, b in tracer.edges if (b, a) in tracer.edges and a < b)
    print(f"call-backs: {len(mutual)} pairs of files calling each other: "
          + ", ".join(f"{a} <-> {b}" for a, b in mutual))


if __name__ == "__main__":
    main()
