"""What the user asked of :class:`~lightning_dcp.DCPStrategy`: one frozen, validated settings object.

Every ``DCPStrategy(...)`` argument lands here, checked once, with errors that name the value and the
fix; a misspelled argument is a ``TypeError`` naming the closest valid one (never a run that
silently trains with defaults). The strategy reads its settings from :class:`DCPSettings` and never
changes them; what it derives at run time (the resolved SP cap, the support level, the measured
cost model) lives on the strategy. :meth:`DCPSettings.agreement` is what every rank must share --
the setup agreement check (:mod:`lightning_dcp.runtime.agreement`) compares it across ranks.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Sequence

from lightning_dcp.planning.calibration import MODES as CALIBRATION_MODES
from lightning_dcp.planning.seed import data_seed
from lightning_dcp.planning.sharding.registry import MODES, ZERO_STAGE_ALIASES, get_mode
from lightning_dcp.runtime.options import check_choice, check_options
from lightning_dcp.sp.contract import SUPPORT_LEVELS
from lightning_dcp.sp.tokens import LOSS_REDUCTIONS

__all__ = ["DDP_STRATEGY_ARGS", "DEFAULT_TIMEOUT_S", "DCPSettings", "split_strategy_kwargs"]

DEFAULT_TIMEOUT_S = 300.0
"""Default time-out of every process group the strategy uses (world and SP groups): 5 minutes."""


#: ``DDPStrategy.__init__`` arguments DCPStrategy passes on (launchers, cluster environments, plugins).
DDP_STRATEGY_ARGS = frozenset({
    "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin", "ddp_comm_state",
    "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period", "process_group_backend", "start_method",
})


class _ReadOnlyOptions(Mapping):
    """A read-only (and, unlike ``MappingProxyType``, picklable) copy of the planner options."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self._options = dict(options)

    def __getitem__(self, key: str) -> Any:
        return self._options[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._options)

    def __len__(self) -> int:
        return len(self._options)

    def __repr__(self) -> str:
        return repr(self._options)


@dataclass(frozen=True)
class DCPSettings:
    """The validated arguments of :class:`~lightning_dcp.DCPStrategy` (see its docstring for each)."""

    policy: str = "dcp"
    cost_model: Any = None
    planner: Any = None
    profile: bool | None = None
    global_batch_size: int | None = None
    global_batch_tokens: int | None = None
    loss_reduction: str = "token"
    zero1: bool = False
    sharding: str = "none"
    seed: int | None = None
    plan_ahead: bool = True
    max_sp_size: int | None = None
    lengths: Sequence[int] | Callable[[Any], Sequence[int]] | None = None
    shuffle: bool = True
    drop_last: bool = True
    planner_options: Mapping[str, Any] = field(default_factory=dict)
    log_metrics: bool = True
    bucket_cap_mb: float = 25.0
    support: str | None = None
    timeout: float | timedelta | None = DEFAULT_TIMEOUT_S
    sigterm_grace_s: float | None = 30.0
    max_oom_replans: int = 3
    oom_checkpoint: bool = True
    layers_attr: str | None = None
    calibration: str = "adaptive"
    calibrate_every: int | None = None
    shard_group_size: int | None = None
    offload: bool = False

    def __post_init__(self) -> None:
        check_options(self)  # names of the choices (with did-you-mean) and types
        timeout = self.timeout
        if timeout is not None and not isinstance(timeout, timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                raise ValueError(f"timeout must be seconds > 0 or a datetime.timedelta, got {timeout!r}")
            object.__setattr__(self, "timeout", timedelta(seconds=float(timeout)))
        data_seed(self.seed)  # an int or None (checked now; None is resolved when the train loader is built)
        check_choice("loss_reduction", self.loss_reduction, LOSS_REDUCTIONS)
        sp = self.max_sp_size
        if sp is not None and (isinstance(sp, bool) or not isinstance(sp, int) or sp < 1):
            raise ValueError(f"max_sp_size must be a positive number of ranks (any size the model's heads allow, or any "
                             f"size with ring attention), got {sp!r}")
        if self.global_batch_size is not None and self.global_batch_tokens is not None:
            raise ValueError(f"give global_batch_size ({self.global_batch_size}) or global_batch_tokens "
                             f"({self.global_batch_tokens}), not both")
        for name in ("global_batch_size", "global_batch_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        check_choice("support", self.support, SUPPORT_LEVELS, none="to detect")
        attr = self.layers_attr
        if attr is not None and (not isinstance(attr, str) or not attr or any(not p for p in attr.split("."))):
            raise ValueError(f"layers_attr must be a dotted attribute path from the LightningModule to its repeated "
                             f"layers (e.g. 'model.layers'), or None to find them; got {attr!r}")
        check_choice("calibration", self.calibration, CALIBRATION_MODES)
        every = self.calibrate_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"calibrate_every must be an int >= 1 (steps between refits) or None, got {every!r}")
        object.__setattr__(self, "planner_options", _ReadOnlyOptions(self.planner_options))
        self._resolve_sharding()

    def _resolve_sharding(self) -> None:
        """``sharding`` checked; ``zero1=True`` is the deprecated spelling of ``sharding="zero1"`` (``zero1``
        then mirrors ``sharding == "zero1"``)."""
        mode = self.sharding
        if mode not in MODES:
            if str(mode).lower() in ("zero3", "zero-3", "full_shard"):
                get_mode(mode, 1)  # raises, naming the registry's modes and ZeRO-3's
            check_choice("sharding", mode, MODES)
        if self.zero1:
            if MODES[mode].zero_stage not in (0, 1):
                raise ValueError(f"zero1=True and sharding={mode!r} contradict each other; zero1=True is the old "
                                 f"spelling of sharding='zero1': pass sharding={mode!r} alone")
            warnings.warn("DCPStrategy(zero1=True) is deprecated: use DCPStrategy(sharding='zero1') (the alias is "
                          "removed in 0.3.0)", FutureWarning, stacklevel=5)
            mode = ZERO_STAGE_ALIASES[1]
        object.__setattr__(self, "sharding", mode)
        object.__setattr__(self, "zero1", MODES[mode].zero_stage == 1)
        k = self.shard_group_size
        if not MODES[mode].options and (k is not None or self.offload):
            with_options = " or ".join(repr(name) for name, m in MODES.items() if m.options)
            raise ValueError(f"shard_group_size={k!r} and offload={self.offload!r} apply to sharding={with_options} only "
                             f"(got sharding={mode!r}); drop them or pass sharding={with_options}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"shard_group_size must be an int >= 1 (a divisor of the world size), got {k!r}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"offload must be True or False, got {self.offload!r}")

    @property
    def data_seed(self) -> int:
        """The seed of the data order and the planner: ``seed``, else Lightning's global seed
        (``seed_everything`` / ``PL_GLOBAL_SEED``, read now), else 0 (:func:`~lightning_dcp.planning.seed.data_seed`)."""
        return data_seed(self.seed)

    @property
    def bucket_cap_bytes(self) -> int:
        """Size of a gradient reduction bucket in bytes."""
        return int(self.bucket_cap_mb * 2**20)

    def agreement(self, **resolved: Any) -> dict[str, Any]:
        """What every rank must share: the data order and batching, the reductions and the policy (a
        user's planner is compared through its own settings), plus the values the strategy resolved at
        run time (``resolved``: the world size, the SP cap, the support level...)."""
        out: dict[str, Any] = {name: getattr(self, name) for name in (
            "seed", "shuffle", "drop_last", "loss_reduction", "global_batch_size", "global_batch_tokens", "sharding",
            "calibration", "calibrate_every", "offload")}
        out["seed"] = self.data_seed  # as resolved on this rank (a per-rank seed_everything is caught here)
        out["policy"] = self.policy if self.planner is None else None
        out.update(resolved)
        return out


def _ddp_wrapper_args() -> frozenset[str]:
    """Keyword arguments of torch's ``DistributedDataParallel`` (DDPStrategy passes them to the wrapper)."""
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return frozenset(name for name in params if name not in ("self", "module"))


def split_strategy_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Split ``DCPStrategy(**kwargs)`` extras into the ``DDPStrategy`` arguments to pass on and the DDP
    *wrapper* arguments to ignore (DCPStrategy runs without the wrapper).

    Raises:
        TypeError: an argument that is neither: a misspelling, named with the closest valid argument.
    """
    wrapper = _ddp_wrapper_args()
    passed = {k: v for k, v in kwargs.items() if k in DDP_STRATEGY_ARGS}
    ignored = sorted(k for k in kwargs if k in wrapper and k not in DDP_STRATEGY_ARGS)
    unknown = sorted(set(kwargs) - set(passed) - set(ignored))
    if unknown:
        valid = sorted({f.name for f in fields(DCPSettings)} | DDP_STRATEGY_ARGS)
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(f"DCPStrategy got unexpected keyword argument(s) {', '.join(hints)}; valid arguments: "
                        f"{', '.join(valid)}")
    return passed, ignored
