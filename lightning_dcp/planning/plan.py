"""The step plan: what the planner promises and the runtime executes.

The JSON form is the contract ``lightning-dcp/plan/v1`` of DESIGN.md. Tools outside the
package read it, so the fields written here never change meaning; new fields may be added.

Pure Python: no torch, no torch.distributed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence, TypeVar


PLAN_SCHEMA = "lightning-dcp/plan/v1"

T = TypeVar("T")


class PlanError(ValueError):
    """A plan (or its JSON form) breaks the v1 contract."""


@dataclass(frozen=True)
class WorkItem:
    """One micro-batch, run together by ``ranks`` (increasing; their count is the SP size) as one SP group.

    ``samples``: dataset indices in packing order, ``lengths`` their tokens; ``recompute``: repeated layers run with
    activation checkpointing; ``ring``: the ring-attention degree ``r`` (1: Ulysses only, the JSON default). The group
    is an ``r x u`` grid: ``ranks[j*u:(j+1)*u]`` is Ulysses subgroup ``j``, and position ``i`` of subgroup ``j``
    exchanges key/value blocks with position ``i`` of subgroups ``j +- 1``. ``tp``: the tensor-parallel degree ``t``
    inside each subgroup (1: none, the JSON default; written only when ``t > 1``): consecutive runs of ``t`` ranks of
    a subgroup are TP groups, the ranks at one position of them its Ulysses group; the subgroup's ``u`` ranks (``t``
    x its Ulysses positions) divide the heads, as a Ulysses group's do.
    Planned and simulated only (``Planner(max_tp_size=...)``); the runtime refuses such items.
    """

    ranks: tuple[int, ...]
    samples: tuple[int, ...]
    lengths: tuple[int, ...]
    recompute: int = 0
    ring: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "samples", tuple(int(s) for s in self.samples))
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        object.__setattr__(self, "recompute", int(self.recompute))
        object.__setattr__(self, "ring", int(self.ring))
        object.__setattr__(self, "tp", int(self.tp))
        if self.ring < 1 or len(self.ranks) % self.ring:
            raise PlanError(f"ring degree {self.ring} must be >= 1 and divide the SP size {len(self.ranks)} "
                            f"(ranks {list(self.ranks)})")
        if self.tp < 1 or (len(self.ranks) // self.ring) % self.tp:
            raise PlanError(f"tensor-parallel degree {self.tp} must be >= 1 and divide the Ulysses subgroup of "
                            f"{len(self.ranks) // self.ring} ranks (SP {len(self.ranks)}, ring {self.ring}; ranks "
                            f"{list(self.ranks)})")

    @property
    def sp_size(self) -> int:
        return len(self.ranks)

    @property
    def ulysses_size(self) -> int:
        """Ranks of one Ulysses subgroup (the heads are split this many ways)."""
        return len(self.ranks) // self.ring

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ranks": list(self.ranks),
            "samples": list(self.samples),
            "lengths": list(self.lengths),
            "recompute": self.recompute,
        }
        if self.ring > 1:
            out["ring"] = self.ring
        if self.tp > 1:
            out["tp"] = self.tp
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "WorkItem":
        missing = [k for k in ("ranks", "samples", "lengths", "recompute") if k not in data]
        if missing:
            raise PlanError(f"work item {dict(data)!r} lacks the field(s) {missing}; v1 items need ranks, samples, lengths, recompute")
        return cls(tuple(data["ranks"]), tuple(data["samples"]), tuple(data["lengths"]), data["recompute"],
                   int(data.get("ring", 1)), int(data.get("tp", 1)))


@dataclass(frozen=True)
class Scheme:
    """One pipeline's parallel scheme ``<tp, pp>`` (Hydraulis §5.1): ``pp`` stages, each split ``tp`` ways."""

    tp: int
    pp: int

    @property
    def size(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"<TP{self.tp},PP{self.pp}>"


@dataclass(frozen=True)
class Pipeline:
    """A placed pipeline: ``scheme`` on the ranks ``start .. start + scheme.size - 1``."""

    start: int
    scheme: Scheme

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.scheme.size))


@dataclass(frozen=True)
class StepNotes:
    """What a policy states about a step beside its items (the step's other JSON fields). Only :attr:`barriers` and
    :attr:`pipelines` change how the step runs (:mod:`~lightning_dcp.planning.step_time`); the rest describe it."""

    estimated_time: float | None = None
    """The policy's own price of the step's compute span (seconds), when it has one."""
    layout: tuple[int, ...] = ()
    """SP sizes of the groups that run items."""
    schedule: str | None = None
    """``"buddy-tree"`` when SP groups split over the step (largest first)."""
    chosen: str | None = None
    """The ablation whose plan dcp kept (its safety net)."""
    rounds: tuple[int, ...] = ()
    """Lockstep rounds of every shard group (``sharding="hsdp"``)."""
    barriers: tuple[int, ...] = ()
    """Item counts after which every rank waits for every other (Megatron's hybrid-CP groups)."""
    pipelines: tuple[Pipeline, ...] = ()
    """``<TP, PP>`` pipelines: an item on a pipeline's ranks is one of its micro-batches (the hydraulis peer)."""
    setting: Mapping[str, Any] = field(default_factory=dict)
    """A tuned policy's setting as it reports it (SP size, recompute, token budgets); descriptive only."""

    def replace(self, **changes: Any) -> "StepNotes":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.estimated_time is not None:
            out["estimated_time"] = self.estimated_time
        for key in ("layout", "rounds", "barriers"):
            if getattr(self, key):
                out[key] = list(getattr(self, key))
        for key in ("schedule", "chosen"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.pipelines:
            out["pipelines"] = [[p.start, p.scheme.tp, p.scheme.pp] for p in self.pipelines]
        if self.setting:
            out["setting"] = dict(self.setting)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StepNotes":
        pipes = []
        for entry in data.get("pipelines") or ():
            start, tp, pp = (int(x) for x in entry)
            if tp < 1 or pp < 1:
                raise PlanError(f"pipeline {list(entry)}: tp and pp must be positive")
            pipes.append(Pipeline(start, Scheme(tp, pp)))
        est = data.get("estimated_time")
        return cls(estimated_time=None if est is None else float(est), layout=tuple(int(x) for x in data.get("layout") or ()),
                   schedule=data.get("schedule"), chosen=data.get("chosen"),
                   rounds=tuple(int(x) for x in data.get("rounds") or ()),
                   barriers=tuple(int(x) for x in data.get("barriers") or ()), pipelines=tuple(pipes),
                   setting=dict(data.get("setting") or {}))


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: the micro-batches of every rank, in execution order, and the policy's notes."""

    items: tuple[WorkItem, ...]
    notes: StepNotes = field(default=StepNotes(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "items", tuple(self.items))
        if not isinstance(self.notes, StepNotes):
            raise TypeError(f"StepPlan notes must be a StepNotes, got {type(self.notes).__name__}")

    def items_for_rank(self, rank: int) -> list[WorkItem]:
        return [item for item in self.items if rank in item.ranks]

    def with_notes(self, **changes: Any) -> "StepPlan":
        return StepPlan(self.items, self.notes.replace(**changes))

    @property
    def samples(self) -> list[int]:
        return [s for item in self.items for s in item.samples]

    @property
    def tokens(self) -> int:
        return sum(item.tokens for item in self.items)

    def digest(self) -> str:
        """A hash of the items, in order: two steps with the same digest train the same way, whatever their notes."""
        text = json.dumps([item.to_dict() for item in self.items], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {"items": [item.to_dict() for item in self.items], **self.notes.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StepPlan":
        if "items" not in data or not isinstance(data["items"], list):
            raise PlanError(f"a step needs a list 'items'; got keys {sorted(data)}")
        return cls(tuple(WorkItem.from_dict(i) for i in data["items"]), StepNotes.from_dict(data))


@dataclass(frozen=True)
class Plan:
    """A sequence of optimizer steps covering a set of samples (``lightning-dcp/plan/v1``)."""

    policy: str
    world_size: int
    steps: tuple[StepPlan, ...]
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))

    def __iter__(self) -> Iterator[StepPlan]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def samples(self) -> list[int]:
        return [s for step in self.steps for s in step.samples]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": PLAN_SCHEMA,
            "policy": self.policy,
            "world_size": self.world_size,
            "steps": [s.to_dict() for s in self.steps],
        }
        for k, v in self.extra.items():
            out.setdefault(k, v)
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan is a JSON object; got {type(data).__name__}")
        if data.get("schema") != PLAN_SCHEMA:
            raise PlanError(f"plan schema is {data.get('schema')!r}; this package reads {PLAN_SCHEMA!r}")
        for key in ("policy", "world_size", "steps"):
            if key not in data:
                raise PlanError(f"plan lacks the field {key!r}")
        extra = {k: v for k, v in data.items() if k not in ("schema", "policy", "world_size", "steps")}
        return cls(str(data["policy"]), int(data["world_size"]), tuple(StepPlan.from_dict(s) for s in data["steps"]), extra)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanError(f"plan is not valid JSON: {err}") from err
        return cls.from_dict(data)


def interleave_items(per_group: list[list[T]]) -> list[T]:
    """Items of disjoint groups listed round by round (group 0's first, group 1's first, ...): any order is
    deadlock-free; round-robin keeps each rank's order and reads as "accumulation step k"."""
    out: list[T] = []
    depth = max((len(g) for g in per_group), default=0)
    for k in range(depth):
        for g in per_group:
            if k < len(g):
                out.append(g[k])
    return out


def is_aligned_block(ranks: Sequence[int]) -> bool:
    """True when ``ranks`` is ``[k*p, k*p+1, ..., k*p+p-1]`` with ``p`` a power of two."""
    p = len(ranks)
    if p == 0 or p & (p - 1):
        return False
    start = ranks[0]
    return start % p == 0 and list(ranks) == list(range(start, start + p))
