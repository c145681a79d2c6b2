"""Cost model fitted to a measured dual-layer profile (schema ``lightning-dcp/profile/v1``).

Per SP size in the profile, one layer's forward and backward times are fitted as ``a * sum(l^2) + b * tokens + c``
(Hydraulis App. B.2, on packed micro-batches; ``+ d * samples`` with ``model.per_sample_cost``: a video DiT's text
projection per sample) and its activation and input bytes as ``k * tokens + m``, all coefficients non-negative; item
time and memory follow the DCP paper's eqs. 4-6 (:mod:`~lightning_dcp.planning.linear`). Pure Python + numpy.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from lightning_dcp.planning.analytic import _positive_int
from lightning_dcp.planning.cost_model import keep_class
from lightning_dcp.planning.hardware import HardwareSpec, get_hardware
from lightning_dcp.planning.linear import LinearCost, LinearCostModel, Terms
from lightning_dcp.planning.profile import ProfileError, load_profile, validate_profile
from lightning_dcp.planning.prices import CollectivePrices
from lightning_dcp.planning.sharding.base import StateParts
from lightning_dcp.planning.sharding.registry import get_mode, resolve_sharding
from lightning_dcp.planning.sp_sizes import kv_repeat
from lightning_dcp.planning.tensor_parallel import TPTerms

FALLBACK_ALLREDUCE_BW = 45e9
"""All-reduce bus bandwidth a one-device profile (it measured none) predicts a larger world's with: the h100
entry's inter-node figure (estimate)."""

# Column subsets the non-negative fit tries, preferred first (ties: a single entry fits every one-term model).
_SUBSETS_3 = ((0, 1, 2), (0, 1), (1, 2), (0, 2), (1,), (0,), (2,))
_SUBSETS_2 = ((0, 1), (0,), (1,))


def nonneg_fit(X: np.ndarray, y: np.ndarray, *, relative: bool = True,
               subsets: Sequence[Sequence[int]] | None = None) -> np.ndarray:
    """Least-squares ``X @ coef ~= y`` with ``coef >= 0``, for a handful of columns: exact NNLS by enumeration (the
    optimum is the unconstrained solution on some subset of columns: every full-rank subset is solved, the feasible
    one with the smallest residual wins, ties to the earlier subset). ``relative``: rows weighted by ``1/y`` so short
    and long measurements count alike. Columns scaled to unit norm (``l^2`` and ``1`` differ by ~1e10). Zeros if
    ``y`` is all zero."""
    X = np.asarray(X, dtype=float)
    y = np.asarray(y, dtype=float)
    ncol = X.shape[1]
    if subsets is None:
        subsets = _SUBSETS_3 if ncol == 3 else [s for k in range(ncol, 0, -1) for s in itertools.combinations(range(ncol), k)]
    if not np.any(y > 0):
        return np.zeros(ncol)
    if relative:
        w = 1.0 / np.maximum(y, np.mean(y) * 1e-3)
        Xw, yw = X * w[:, None], y * w
    else:
        Xw, yw = X, y
    norms = np.linalg.norm(Xw, axis=0)
    norms[norms == 0] = 1.0
    Xs = Xw / norms
    scale = float(yw @ yw) or 1.0
    best: tuple[float, int, np.ndarray] | None = None
    for rank_order, cols in enumerate(subsets):
        cols = list(cols)
        A = Xs[:, cols]
        if np.linalg.matrix_rank(A, tol=1e-10 * max(A.shape)) < len(cols):
            continue
        sol, *_ = np.linalg.lstsq(A, yw, rcond=None)
        if np.any(sol < -1e-12 * np.max(np.abs(sol), initial=1.0)):
            continue
        sol = np.maximum(sol, 0.0)
        res = yw - A @ sol
        sse = float(res @ res)
        if best is None or sse < best[0] - 1e-9 * scale:
            full = np.zeros(ncol)
            full[cols] = sol
            best = (sse, rank_order, full)
    if best is None:  # every column is zero: nothing to explain the data with
        raise ProfileError("profile fit failed: no non-negative model explains the measurements")
    return best[2] / norms


def fit_entries(p: int, entries: Sequence[Mapping[str, Any]], per_sample: bool) -> dict[str, tuple[float, ...] | None]:
    """Fits of one SP size's profile entries: ``forward``/``backward``/``recompute`` ``(a, b, c, d)`` (``recompute``
    None unless every entry has ``recompute_s``; ``d`` 0 unless ``per_sample``), ``activation``/``input`` ``(k, m)``."""
    sq = np.array([e["micro_batch"] * float(e["seq_len"]) ** 2 for e in entries])
    tok = np.array([float(e["micro_batch"] * e["seq_len"]) for e in entries])
    X3 = np.stack([sq, tok, np.ones_like(tok)], axis=1)
    X2 = X3[:, 1:]
    if per_sample:  # (a, b, c, d): d per sample of the micro-batch
        X4 = np.concatenate([X3, np.array([[float(e["micro_batch"])] for e in entries])], axis=1)
        time_fit = lambda y: tuple(float(v) for v in nonneg_fit(X4, y))  # noqa: E731
    else:
        time_fit = lambda y: tuple(float(v) for v in nonneg_fit(X3, y)) + (0.0,)  # noqa: E731
    f = np.array([float(e["forward_s"]) for e in entries])
    b = np.array([float(e["backward_s"]) for e in entries])
    if not np.any(f > 0) or not np.any(b > 0):
        raise ProfileError(f"profile entries for sp={p} have all-zero forward_s or backward_s: nothing was timed; "
                           "re-run the profiler (on CUDA, timings need torch.cuda.synchronize)")
    act = np.array([float(e["activation_bytes"]) for e in entries])
    inp = np.array([float(e["input_bytes"]) for e in entries])
    return {
        "forward": time_fit(f),
        # measured extra time of one checkpointed layer when every entry has it, else t_f (eq. 5)
        "recompute": (time_fit(np.array([float(e["recompute_s"]) for e in entries]))
                      if all(e.get("recompute_s") is not None for e in entries) else None),
        "backward": time_fit(b),
        "activation": tuple(float(v) for v in nonneg_fit(X2, act, subsets=_SUBSETS_2)),
        "input": tuple(float(v) for v in nonneg_fit(X2, inp, subsets=_SUBSETS_2)),
    }


class ProfiledCostModel(LinearCostModel):
    """Cost model fitted to a measured dual-layer profile (the fit and its terms: docs/cost-models.md).

    Per measured SP size, one layer's ``t_f, t_b = a sum(l^2) + b tokens + c (+ d samples)`` and bytes ``act, inp =
    k tokens + m`` (non-negative least squares, rows weighted by ``1/t``), then eqs. 4-6: ``time = L (t_f + t_b) + r
    t_rc + constants``, ``memory = memory_bytes + L inp + (L - r) act + act``. Communication is inside the measured
    times (``ItemCost.comm`` is 0); only measured SP sizes are usable (:meth:`sp_sizes`). Under ``zero1``/``zero2``/
    ``fsdp`` the mode's states replace the profile's replica (:attr:`freed_bytes`; a sharded mode needs
    ``constant.optimizer_bytes``, zero2/fsdp also ``weight_bytes``, or ``state_parts``). Rings need ``hardware`` and
    ``model.hidden_size`` (:attr:`prices_ring`); tensor-parallel items need ``model.hidden_size`` and the profile's
    measured all-reduce or ``hardware`` (:attr:`prices_tp`, :meth:`tp_terms`).

    Args:
        profile: a v1 profile dict (:mod:`lightning_dcp.planning.profile`).
        memory_limit: bytes per device the planner may use; default ``device.memory_limit_bytes``.
        sharding: ``"none"`` (default), ``"zero1"``, ``"zero2"`` or ``"fsdp"``, as ``DCPStrategy(sharding=...)``.
        world_size: ranks the states are sharded over; default the profile's ``key.world_size`` (or 1).
        state_parts: the full model's ``weights``, ``buffers``, ``gradients``, ``optimizer`` bytes measured elsewhere
            (the runtime's), instead of the profile's constant fields.
        memory_limit_source: where ``memory_limit`` came from, printed in errors.
        hardware: a :class:`~lightning_dcp.planning.hardware.HardwareSpec` (or its name) pricing rings; None: no ring.
    """

    no_ring_reason = ("this profiled cost model prices no ring: give ProfiledCostModel(hardware=...) and a profile "
                      "with model.hidden_size, or plan with ring=1")

    def __init__(self, profile: dict, *, memory_limit: float | None = None, sharding: str | None = None,
                 world_size: int | None = None, state_parts: Mapping[str, float] | None = None,
                 memory_limit_source: str | None = None, hardware: HardwareSpec | str | None = None) -> None:
        data = validate_profile(profile)
        self.profile = data
        model, device, const = data["model"], data["device"], data["constant"]
        self.num_layers = int(model["num_layers"])
        self.num_heads = int(model["num_heads"])
        self.per_sample = bool(model.get("per_sample_cost", False))
        """Whether the fit has a per-sample time term."""
        gpn = device.get("gpus_per_node", 8)
        if not isinstance(gpn, int) or gpn < 1:
            raise ProfileError(f"device.gpus_per_node must be a positive integer, got {gpn!r}")
        self.gpus_per_node = gpn
        self.memory_limit = float(device["memory_limit_bytes"] if memory_limit is None else memory_limit)
        if not self.memory_limit > 0:
            raise ValueError(f"memory_limit must be positive, got {memory_limit!r}")
        self.memory_limit_source = memory_limit_source or (
            "the profile's device.memory_limit_bytes" if memory_limit is None else "memory_limit=")
        self.constant_time = float(const["time_s"])
        self.constant_memory = float(const["memory_bytes"])
        self.time_per_token = float(const.get("time_per_token_s") or 0.0)  # per local token, outside the layers
        self.memory_per_token = float(const.get("activation_bytes_per_token") or 0.0)
        self.host_time = float(const.get("host_s") or 0.0)  # per micro-batch, on the host
        self.host_per_token = float(const.get("host_per_token_s") or 0.0)  # per token of the whole micro-batch
        self.optimizer_s = float(const["optimizer_s"])
        self.allreduce_s = float(const["allreduce_s"])
        pb = const.get("param_bytes")
        self.param_bytes = float(pb) if isinstance(pb, (int, float)) and not isinstance(pb, bool) and pb > 0 else None
        ws = data["key"].get("world_size") if isinstance(data["key"], dict) else None
        self.profile_world_size = ws if isinstance(ws, int) and ws >= 1 else None
        self.sharding = resolve_sharding(sharding, default="none")
        self.world_size = _positive_int(world_size if world_size is not None else (self.profile_world_size or 1), "world_size")
        self.mode = get_mode(self.sharding, self.world_size)
        self.state_parts = self._state_parts(const, state_parts)
        """The full model's state bytes the sharding is computed from (``None`` with ``sharding="none"`` and none given)."""
        self.state_bytes = None if self.state_parts is None else self.mode.state_bytes(StateParts(**self.state_parts))
        """Model-state bytes per rank ``item_memory`` counts (``None``: the profile does not split its constant)."""
        self.freed_bytes = self._freed_by_sharding()
        """State bytes per rank that ``sharding`` frees, in the micro-batch loop, from ``constant.memory_bytes``."""
        self.constant_memory -= self.freed_bytes

        by_sp: dict[int, list[dict]] = {}
        for e in data["entries"]:
            by_sp.setdefault(int(e["sp"]), []).append(e)
        bad = [p for p in by_sp if self.num_heads % p]
        if bad:
            raise ProfileError(f"profile entries use sp={sorted(bad)}, which do not divide num_heads={self.num_heads}; "
                               "re-profile with SP sizes that divide the head count")
        self.fits_by_sp: dict[int, dict[str, tuple[float, ...]]] = {
            p: fit_entries(p, entries, self.per_sample) for p, entries in sorted(by_sp.items())}
        self.measured_sp = tuple(sorted(self.fits_by_sp))
        self._init_ring(hardware)
        LinearCostModel.__init__(self)
        self._linear.update({p: self._fitted(p) for p in self.measured_sp})

    def _init_ring(self, hardware: HardwareSpec | str | None) -> None:
        """Ring and TP pricing from ``hardware`` (TP: or the profile's all-reduce) and the profile's model shape (see
        the class docstring)."""
        model, key = self.profile["model"], self.profile.get("key", {})
        hidden = model.get("hidden_size")
        if isinstance(hardware, str):
            hardware = get_hardware(hardware)
        self.hardware = None if hardware is None else replace(hardware, gpus_per_node=self.gpus_per_node)
        self.num_kv_heads = int(model.get("num_kv_heads") or self.num_heads)
        self._kv_bytes = 0.0
        if isinstance(hidden, int) and hidden > 0:
            dtype = str(key.get("dtype", "bfloat16")) if isinstance(key, dict) else "bfloat16"
            size = 4 if "32" in dtype else 1 if "8" in dtype else 2
            self._kv_bytes = 2.0 * hidden * self.num_kv_heads / self.num_heads * size
        self.prices_ring = self.hardware is not None and self._kv_bytes > 0
        self._act_bytes = float(hidden * size) if isinstance(hidden, int) and hidden > 0 else 0.0
        self.prices_tp = self._act_bytes > 0 and self._tp_prices() is not None

    def _tp_prices(self) -> CollectivePrices | None:
        """The TP collectives' prices: the profile's measured all-reduce, else the hardware's."""
        got = self.collective_prices()
        if got is None and self.hardware is not None:
            got = CollectivePrices.from_hardware(self.hardware)
        return got

    def tp_terms(self) -> TPTerms:
        """TP collectives of the profiled model: two all-gather + reduce-scatter pairs per layer forward (attention,
        MLP) of ``model.hidden_size x dtype`` bytes per token, at :meth:`_tp_prices`. The measured times keep the
        measured all-to-all of Ulysses ``sp / ring`` (its share is not separable from the fit): an upper bound."""
        return TPTerms(self._act_bytes, 2, self._tp_prices(), self.num_layers)  # type: ignore[arg-type]

    def _fitted(self, p: int) -> LinearCost:
        """The :class:`LinearCost` of measured SP size ``p`` from its fits."""
        L, fit = self.num_layers, self.fits_by_sp[p]
        p0 = self.measured_sp[0]
        f0, b0 = self.fits_by_sp[p0]["forward"], self.fits_by_sp[p0]["backward"]
        fa, fb, fc, fd = fit["forward"]
        ba, bb, bc, bd = fit["backward"]
        ra, rb, rc, rd = fit["recompute"] or fit["forward"]
        ka, ma = fit["activation"]
        ki, mi = fit["input"]
        return LinearCost(
            time=Terms(L * (fa + ba), L * (fb + bb) + self.time_per_token / p + self.host_per_token,
                       L * (fc + bc) + self.constant_time + self.host_time, L * (fd + bd)),
            time_per_layer=Terms(ra, rb, rc, rd),
            compute=Terms(L * (fa + ba), L * (fb + bb), L * (fc + bc), L * (fd + bd)), recompute=Terms(ra, rb, rc, rd),
            comm=Terms(), comm_per_layer=Terms(),
            overhead=Terms(0.0, self.time_per_token / p + self.host_per_token, self.constant_time + self.host_time),
            # ideal on one device: L (t_f + t_b) of the smallest measured size without the fit's constant, times p0
            ideal=Terms(L * (f0[0] + b0[0]) * p0 / p, (L * (f0[1] + b0[1]) * p0 + self.time_per_token) / p, 0.0 / p,
                        L * (f0[3] + b0[3]) * p0 / p),
            # memory with one layer's transient: base + T m - r (ma + T ka)
            memory=self.constant_memory + L * mi + (L + 1) * ma,
            memory_per_token=L * ki + (L + 1) * ka + self.memory_per_token / p,
            memory_per_layer=ma, memory_per_layer_token=ka, attn_fwd=fa, attn_bwd=ba, whole_tokens=self.host_per_token)

    def linear_cost(self, sp: int) -> LinearCost:
        raise ValueError(f"sp={sp!r} was not measured in this profile; measured SP sizes: {list(self.measured_sp)} "
                         "(re-profile with that size, or plan with sp_sizes())")

    def kv_bytes_per_token(self, u: int) -> float:
        return self._kv_bytes * kv_repeat(self.num_heads, self.num_kv_heads, u) / u

    @classmethod
    def from_file(cls, path: str | Path, *, memory_limit: float | None = None, sharding: str | None = None,
                  world_size: int | None = None, memory_limit_source: str | None = None,
                  hardware: HardwareSpec | str | None = None) -> "ProfiledCostModel":
        """Load, validate and fit a profile file; :class:`ProfileError` names the file on problems."""
        data = load_profile(path)
        if memory_limit is None and memory_limit_source is None:
            memory_limit_source = f"device.memory_limit_bytes of profile {path}"
        try:
            return cls(data, memory_limit=memory_limit, sharding=sharding, world_size=world_size,
                       memory_limit_source=memory_limit_source, hardware=hardware)
        except ProfileError as err:
            raise ProfileError(f"profile file {path}: {err}") from None

    def _state_parts(self, const: Mapping[str, Any], given: Mapping[str, float] | None) -> dict[str, float] | None:
        """The full model's state bytes: ``given`` (measured by the runtime), else the profile's constant fields."""
        if given is not None:
            parts = StateParts.from_mapping(given)
            return {"weights": parts.weights, "buffers": parts.buffers, "gradients": parts.gradients,
                    "optimizer": parts.optimizer}
        if self.sharding == "none":
            return None
        # the fields whose bytes the mode frees in the loop (gradients and buffers are held in full there)
        need = [f for part, f in (("optimizer", "optimizer_bytes"), ("weights", "weight_bytes"))
                if self.mode.state_bytes(StateParts(**{**dict.fromkeys(("weights", "gradients", "optimizer"), 0.0),
                                                      part: 1.0})) != 1.0]
        missing = [f for f in need if const.get(f) is None]
        if missing:
            raise ProfileError(
                f"sharding={self.sharding!r} needs the profile's constant.{', constant.'.join(missing)} (one replica's "
                f"optimizer-state / weight bytes) to know what it frees, and this profile lacks them; re-profile with "
                f"this version's DCPProfiler (it records them), plan with sharding='none', or let DCPStrategy give the "
                f"bytes it measures (ProfiledCostModel.with_sharding)")
        return {"weights": float(const.get("weight_bytes") or 0.0), "buffers": float(const.get("buffer_bytes") or 0.0),
                "gradients": float(const.get("param_bytes") or 0.0), "optimizer": float(const["optimizer_bytes"])}

    def _freed_by_sharding(self) -> float:
        """Bytes per rank that ``self.sharding`` takes off one replica's states in the micro-batch loop."""
        parts = self.state_parts
        if parts is None:
            return 0.0
        return sum(parts.values()) - self.mode.state_bytes(StateParts(**parts))

    def with_sharding(self, states: Mapping[str, Any]) -> "ProfiledCostModel":
        """This profile and memory limit planned for the runtime's ``states["sharding"]`` on ``states["world_size"]``
        ranks, from its measured state bytes when given, else the profile's
        (:meth:`lightning_dcp.runtime.sharding.states.ModelStates.to_dict`)."""
        rebuilt = ProfiledCostModel(self.profile, memory_limit=self.memory_limit, sharding=states["sharding"],
                                    world_size=int(states["world_size"]),
                                    state_parts=StateParts.from_mapping(states, required=False),
                                    memory_limit_source=self.memory_limit_source, hardware=self.hardware)
        return keep_class(self, rebuilt)  # type: ignore[return-value]  # a user's subclass keeps its overrides

    def _allreduce_seconds(self, W: int) -> float:
        """Step-end gradient all-reduce over ``W`` ranks: measured, or rescaled from the profile's world."""
        W0 = self.profile_world_size
        if W == 1:
            return 0.0
        if W0 is None or W0 == W:
            return self.allreduce_s
        if W0 > 1:
            return self.allreduce_s * ((W - 1) / W) / ((W0 - 1) / W0)
        if self.param_bytes is not None:
            return 2.0 * (W - 1) / W * self.param_bytes / FALLBACK_ALLREDUCE_BW
        return self.allreduce_s

    def sp_sizes(self, world_size: int) -> list[int]:
        """Measured SP sizes (divisors of the heads) up to ``world_size``."""
        return [p for p in super().sp_sizes(world_size) if p in self._linear]

    def step_overhead(self, world_size: int) -> float:
        """Measured ``allreduce_s + optimizer_s``: the all-reduce rescaled by ``(W-1)/W`` for another world (a
        one-device profile: ``2 (W-1)/W param_bytes / FALLBACK_ALLREDUCE_BW``); the optimizer divided by ``W`` when
        sharded."""
        W = _positive_int(world_size, "world_size")
        return self._allreduce_seconds(W) + self.optimizer_s * get_mode(self.sharding, W).optimizer_share()

    def collective_prices(self) -> CollectivePrices | None:
        """The bus bandwidth of the profile's measured gradient all-reduce (``None``: not measured on several ranks)."""
        W0, nbytes = self.profile_world_size, self.param_bytes
        if W0 is None or W0 < 2 or nbytes is None or not self.allreduce_s > 0:
            return None
        bw = 2.0 * (W0 - 1) / W0 * nbytes / self.allreduce_s
        return CollectivePrices(bw, bw, gpus_per_node=self.gpus_per_node, source=f"the profile's all-reduce on {W0} ranks")

    def signature(self) -> dict:
        return {"source": "profile", "key": dict(self.profile.get("key", {})), "model": dict(self.profile["model"]),
                "memory_limit": self.memory_limit, "measured_sp": list(self.measured_sp), "sharding": self.sharding,
                "world_size": self.world_size, "freed_bytes": self.freed_bytes}

    def fit_summary(self) -> dict[int, dict[str, Any]]:
        """The fitted coefficients per SP size: ``forward``/``backward``/``recompute`` ``(a, b, c, d)`` (``d`` per
        sample, 0 unless ``model.per_sample_cost``), ``activation``/``input`` ``(k, m)``."""
        return {p: dict(fit) for p, fit in self.fits_by_sp.items()}
