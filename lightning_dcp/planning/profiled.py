"""Cost model fitted to a measured dual-layer profile (schema ``lightning-dcp/profile/v1``).

Per SP size present in the profile, the per-layer forward and backward times are fitted as
``t = a * sum(l^2) + b * tokens + c`` (the Hydraulis latency model, App. B.2, on packed
micro-batches) -- plus ``d * samples`` for a model that does work per sample whatever its length
(``model.per_sample_cost`` in the profile: a video DiT's cross-attention projects each sample's
text) -- and the per-layer activation and input bytes as ``k * tokens + m``; all coefficients
non-negative. Item time and memory then follow the DCP paper's eqs. 4-6.

Pure Python + numpy: no torch.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from lightning_dcp.planning.analytic import _positive_int
from lightning_dcp.planning.cost_model import CostModel, ItemCost, keep_class
from lightning_dcp.planning.profile import ProfileError, load_profile, validate_profile
from lightning_dcp.planning.prices import CollectivePrices
from lightning_dcp.planning.sharding.base import StateParts
from lightning_dcp.planning.sharding.registry import get_mode, resolve_sharding
from lightning_dcp.planning.ring import RingPriced, RingTerms, hardware_ring_terms
from lightning_dcp.planning.sp_sizes import kv_repeat

# All-reduce bus bandwidth assumed when a profile made on one device must predict the gradient
# reduction of a larger world (it measured none): 45 GB/s, the inter-node figure of the h100
# entry in hardware.py (estimate).
FALLBACK_ALLREDUCE_BW = 45e9

# Column subsets tried by the non-negative fit, most preferred first (used to break ties between
# equally good fits, e.g. a single measured entry, which every one-term model matches exactly).
_SUBSETS_3 = ((0, 1, 2), (0, 1), (1, 2), (0, 2), (1,), (0,), (2,))
_SUBSETS_2 = ((0, 1), (0,), (1,))


def nonneg_fit(X: np.ndarray, y: np.ndarray, *, relative: bool = True,
               subsets: Sequence[Sequence[int]] | None = None) -> np.ndarray:
    """Least-squares ``X @ coef ~= y`` with ``coef >= 0``, for a handful of columns.

    Exact non-negative least squares by enumeration: the NNLS optimum is the unconstrained
    least-squares solution on some subset of columns, so every subset whose design matrix has full
    column rank is solved and the feasible (non-negative) one with the smallest residual wins;
    ties (e.g. underdetermined grids, where several subsets fit exactly) go to the earlier subset
    in ``subsets``. With ``relative``, rows are weighted by ``1/y`` so short and long measurements
    count alike. Columns are scaled to unit norm before solving (``l^2`` and ``1`` differ by ~1e10).
    Returns zeros if ``y`` is all zero.
    """
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
    fit = {
        "forward": time_fit(f),
        # measured extra time of one checkpointed layer when every entry has it, else t_f (eq. 5)
        "recompute": (time_fit(np.array([float(e["recompute_s"]) for e in entries]))
                      if all(e.get("recompute_s") is not None for e in entries) else None),
        "backward": time_fit(b),
        "activation": tuple(float(v) for v in nonneg_fit(X2, act, subsets=_SUBSETS_2)),
        "input": tuple(float(v) for v in nonneg_fit(X2, inp, subsets=_SUBSETS_2)),
    }
    return fit


class ProfiledCostModel(RingPriced, CostModel):
    """Cost model fitted to a measured dual-layer profile.

    Per SP size ``p`` in the profile, from its entries (micro-batch ``b`` of length ``l``: ``b*l``
    tokens and ``sum l^2 = b*l^2``), non-negative least squares (rows weighted by ``1/t`` so every
    length counts) of::

        t_f, t_b = a * sum(l^2) + b * tokens + c        # one layer, per rank, all-to-alls included
                   (+ d * samples with model.per_sample_cost)
        act, inp = k * tokens + m                       # bytes per layer, per rank

    Small grids work: with fewer distinct points than terms the fit drops terms (a single entry
    gives a time proportional to tokens). Then for a micro-batch on ``p`` ranks with ``r``
    recomputed layers (paper eqs. 4-6)::

        time   = L * (t_f + t_b) + r * t_rc + constant.time_s + constant.time_per_token_s * tokens / p
                 + constant.host_s + constant.host_per_token_s * tokens   # the host builds the whole micro-batch
        memory = constant.memory_bytes + L * inp + (L - r) * act + act     # + one layer's transient
                 + constant.activation_bytes_per_token * tokens / p

    ``t_rc`` is the fit of the entries' optional ``recompute_s`` (measured extra time of one
    checkpointed layer) when every entry of that SP size has it, else ``t_f`` (paper eq. 5). The
    optional ``constant.time_per_token_s`` / ``constant.activation_bytes_per_token`` (embedding,
    head, loss per local token) count as 0 when absent.

    Sharding (``sharding=``, default ``"none"``: the profile as measured, one full replica of the
    model states per rank): the profile's ``constant.memory_bytes`` holds one replica's weights,
    buffers, gradients and optimizer states; under ``zero1`` / ``zero2`` / ``fsdp`` what that mode
    leaves a rank in the micro-batch loop over ``world_size`` ranks
    (:mod:`~lightning_dcp.planning.sharding`) replaces it: the difference is
    :attr:`freed_bytes`, which the planner then has for activations (``zero1``: ``O - O/N``;
    ``zero2``/``fsdp``: ``O - O/N - W/N``, the weights' shard sitting beside the full weights).
    The state bytes come from ``state_parts`` when given (the runtime's measured bytes:
    :meth:`with_sharding`), else from the profile's ``constant.weight_bytes`` (every parameter),
    ``buffer_bytes``, ``param_bytes`` (trainable = gradient bytes) and ``optimizer_bytes`` (fp32
    master included); a sharded mode needs ``optimizer_bytes``, and ``zero2``/``fsdp`` also
    ``weight_bytes`` (gradients and buffers are held in full in the loop, so they free nothing
    there): a profile without them raises :class:`ProfileError`. Time: the sharded modes step the
    optimizer on ``1/W`` of the weights (``optimizer_s / W``); ``zero2``/``fsdp``'s one
    reduce-scatter of the gradients and one all-gather of the weights per step move the bytes of
    the measured all-reduce, so the step end costs ``allreduce_s`` in every mode; nothing is
    charged per micro-batch.

    Communication is inside the measured layer times, so :class:`ItemCost` reports ``comm = 0``
    and counts it in ``compute``. ``ideal`` is the sp=1 fit's ``L * (t_f + t_b)`` for these samples
    without the fit's constant term (a per-micro-batch constant), divided by ``p`` (if sp=1 was not
    measured: the smallest measured ``p0``'s, times ``p0``); no recompute, no constant time.
    Only measured SP sizes are usable: :meth:`sp_sizes` returns those and item methods raise for others.

    Ring attention (``ring > 1``): estimated from the measured terms of the ring's Ulysses size
    ``u = sp / ring`` (the fitted item on ``1/ring`` of the tokens, attention per step from the fitted
    ``a`` coefficients) and ``hardware``'s P2P bandwidth (:mod:`~lightning_dcp.planning.ring`); needs
    ``hardware`` and the profile's ``model.hidden_size`` (``model.num_kv_heads`` for grouped-query
    attention, ``key.dtype`` for the element size: bf16 when absent). Without them the model prices
    no ring (:attr:`prices_ring` is False) and the planner uses Ulysses sizes only.

    Args:
        profile: a v1 profile dict (see :mod:`lightning_dcp.planning.profile`).
        memory_limit: bytes per device the planner may use; default ``device.memory_limit_bytes``.
        sharding: ``"none"`` (default), ``"zero1"``, ``"zero2"`` or ``"fsdp"``, as ``DCPStrategy(sharding=...)``.
        world_size: ranks the states are sharded over; default the profile's ``key.world_size`` (or 1).
        state_parts: the full model's ``weights``, ``buffers``, ``gradients`` and ``optimizer`` bytes
            measured elsewhere (the runtime's :class:`~lightning_dcp.runtime.sharding.states.ModelStates`), used
            instead of the profile's constant fields; ``None`` (default): the profile's.
        memory_limit_source: where ``memory_limit`` came from, printed in errors (default:
            ``"memory_limit="`` when given, else the profile's ``device.memory_limit_bytes``).
        hardware: a :class:`~lightning_dcp.planning.hardware.HardwareSpec` (or its name) whose P2P
            bandwidth prices ring attention; None (default): no ring.
    """

    def __init__(self, profile: dict, *, memory_limit: float | None = None, sharding: str | None = None,
                 world_size: int | None = None, state_parts: Mapping[str, float] | None = None,
                 memory_limit_source: str | None = None, hardware: Any = None) -> None:
        data = validate_profile(profile)
        self.profile = data
        model, device, const = data["model"], data["device"], data["constant"]
        self.num_layers = int(model["num_layers"])
        self.num_heads = int(model["num_heads"])
        self.per_sample = bool(model.get("per_sample_cost", False))
        """Whether the fit has a per-sample time term (see the module docstring)."""
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
        # optional (profiler >= the recompute/per-token fields): per local token, outside the layers
        self.time_per_token = float(const.get("time_per_token_s") or 0.0)
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
        self._build_coefficients()
        self._init_ring(hardware)

    def _init_ring(self, hardware: Any) -> None:
        """Ring pricing from ``hardware`` and the profile's model shape (see the class docstring)."""
        from lightning_dcp.planning.hardware import get_hardware

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

    def ring_terms(self, sp: int, ring: int) -> RingTerms:
        """The ring's per-step terms at the measured Ulysses size ``sp / ring`` (see the class docstring)."""
        if not self.prices_ring:
            raise ValueError("this profiled cost model prices no ring: give ProfiledCostModel(hardware=...) and a "
                             "profile with model.hidden_size, or plan with ring=1")
        u = sp // ring
        c = self._c(u)
        kv = self._kv_bytes * kv_repeat(self.num_heads, self.num_kv_heads, u) / u
        return hardware_ring_terms(self.hardware, sp, c[0], c[3], kv, self.num_layers)

    def _build_coefficients(self) -> None:
        """The ideal's coefficients and, per measured SP size, the closed forms' coefficients (``self._coef``)."""
        p0 = self.measured_sp[0]
        f0, b0 = self.fits_by_sp[p0]["forward"], self.fits_by_sp[p0]["backward"]
        L = self.num_layers
        # ideal on one device: L*(t_f + t_b) of the smallest measured SP size, times p0, without
        # the fit's constant term (a per-micro-batch constant, not the samples' compute)
        # (plus the per-token time outside the layers, when the profile has it)
        self._ideal = (L * (f0[0] + b0[0]) * p0, L * (f0[1] + b0[1]) * p0 + self.time_per_token, 0.0,
                       L * (f0[3] + b0[3]) * p0)
        self._coef: dict[int, tuple] = {}
        for p, fit in self.fits_by_sp.items():
            fa, fb, fc, fd = fit["forward"]
            ba, bb, bc, bd = fit["backward"]
            ra, rb, rc, rd = fit["recompute"] or fit["forward"]
            ka, ma = fit["activation"]
            ki, mi = fit["input"]
            self._coef[p] = (
                fa, fb, fc, ba, bb, bc,
                # item time: (A0 + r A1) sq + (B0 + r B1) T + (C0 + r C1)
                L * (fa + ba), L * (fb + bb) + self.time_per_token / p + self.host_per_token,
                L * (fc + bc) + self.constant_time + self.host_time, ra, rb, rc,
                # memory: base0 + T*m0 - r*(ma + T*ka)   with the transient layer counted
                self.constant_memory + L * mi + (L + 1) * ma, L * ki + (L + 1) * ka + self.memory_per_token / p, ma, ka,
                # ideal / p
                self._ideal[0] / p, self._ideal[1] / p, self._ideal[2] / p,
                # per sample: item time (D0 + r D1) n, ideal / p
                L * (fd + bd), rd, self._ideal[3] / p,
            )

    @classmethod
    def from_file(cls, path: str | Path, *, memory_limit: float | None = None, sharding: str | None = None,
                  world_size: int | None = None, memory_limit_source: str | None = None,
                  hardware: Any = None) -> "ProfiledCostModel":
        """Load, validate and fit a profile file; :class:`ProfileError` names the file on problems."""
        data = load_profile(path)
        if memory_limit is None and memory_limit_source is None:
            memory_limit_source = f"device.memory_limit_bytes of profile {path}"
        try:
            return cls(data, memory_limit=memory_limit, sharding=sharding, world_size=world_size,
                       memory_limit_source=memory_limit_source, hardware=hardware)
        except ProfileError as err:
            raise ProfileError(f"profile file {path}: {err}") from None

    # ------------------------------------------------------------------ helpers

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
        # gradients and buffers are held in full in the loop (they cancel in what is freed there)
        return {"weights": float(const.get("weight_bytes") or 0.0), "buffers": float(const.get("buffer_bytes") or 0.0),
                "gradients": float(const.get("param_bytes") or 0.0), "optimizer": float(const["optimizer_bytes"])}

    def _freed_by_sharding(self) -> float:
        """Bytes per rank that ``self.sharding`` takes off one replica's states in the micro-batch loop."""
        parts = self.state_parts
        if parts is None:
            return 0.0
        return sum(parts.values()) - self.mode.state_bytes(StateParts(**parts))

    def with_sharding(self, states: Mapping[str, Any]) -> "ProfiledCostModel":
        """This profile and memory limit planned for the runtime's ``states["sharding"]`` on
        ``states["world_size"]`` ranks, from the runtime's measured ``weights``/``buffers``/``gradients``/
        ``optimizer`` bytes when ``states`` has them (so a profile without the state fields works under
        the runtime), else from the profile's. ``states`` is
        :meth:`lightning_dcp.runtime.sharding.states.ModelStates.to_dict`."""
        rebuilt = ProfiledCostModel(self.profile, memory_limit=self.memory_limit, sharding=states["sharding"],
                                    world_size=int(states["world_size"]),
                                    state_parts=StateParts.from_mapping(states, required=False),
                                    memory_limit_source=self.memory_limit_source, hardware=self.hardware)
        return keep_class(self, rebuilt)  # a user's subclass keeps its overrides

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

    def _c(self, sp: int) -> tuple:
        c = self._coef.get(sp)
        if c is None:
            raise ValueError(f"sp={sp!r} was not measured in this profile; measured SP sizes: {list(self.measured_sp)} "
                             "(re-profile with that size, or plan with sp_sizes())")
        return c

    @staticmethod
    def attention_work(length: int) -> float:
        """Attention work the fit uses for one sample: ``l^2``."""
        return float(length) * length

    # ------------------------------------------------------------------ fast paths (same API as AnalyticCostModel)

    def item_time_sum(self, tokens: int, sq_sum: float, n: int, sp: int, recompute: int, ring: int = 1,
                      ring_exposed: bool = True) -> float:
        """Item time from ``tokens = sum(l)`` and ``sq_sum = sum(l^2)`` of the ``n`` samples (``ring_exposed=False``:
        a ring's transfers counted as hidden, a lower bound)."""
        if ring != 1:
            return self._ring_time_sum(tokens, sq_sum, n, sp, recompute, ring, ring_exposed)
        c = self._c(sp)
        r = recompute
        return (c[6] + r * c[9]) * sq_sum + (c[7] + r * c[10]) * tokens + c[8] + r * c[11] + (c[19] + r * c[20]) * n

    def item_memory_tokens(self, tokens: int, sp: int, recompute: int, ring: int = 1) -> float:
        """Peak bytes per device of a micro-batch of ``tokens`` total tokens."""
        if ring != 1:
            return self._ring_memory_tokens(tokens, sp, recompute, ring)
        c = self._c(sp)
        return c[12] + tokens * c[13] - recompute * (c[14] + tokens * c[15])

    def min_recompute_tokens(self, tokens: int, sp: int) -> int | None:
        """:meth:`min_recompute` for a micro-batch of ``tokens`` total tokens."""
        c = self._c(sp)
        L, limit = self.num_layers, self.memory_limit
        mem = lambda r: c[12] + tokens * c[13] - r * (c[14] + tokens * c[15])  # noqa: E731
        if mem(L) > limit:
            return None
        per_layer = c[14] + tokens * c[15]
        if per_layer <= 0:
            return 0
        r = min(max(math.ceil((mem(0) - limit) / per_layer), 0), L)
        while r > 0 and mem(r - 1) <= limit:
            r -= 1
        while r < L and mem(r) > limit:
            r += 1
        return r

    # ------------------------------------------------------------------ CostModel

    def sp_sizes(self, world_size: int) -> list[int]:
        """Measured SP sizes (divisors of the heads) up to ``world_size``."""
        return [p for p in super().sp_sizes(world_size) if p in self._coef]

    def item_time(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        tokens = 0
        sq = 0
        for n in lengths:
            tokens += n
            sq += n * n
        return self.item_time_sum(tokens, sq, len(lengths), sp, recompute, ring)

    def item_memory(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> float:
        return self.item_memory_tokens(sum(lengths), sp, recompute, ring)

    def item_cost(self, lengths: Sequence[int], sp: int, recompute: int, ring: int = 1) -> ItemCost:
        if not 0 <= recompute <= self.num_layers:
            raise ValueError(f"recompute must be in [0, {self.num_layers}] (the model's layers), got {recompute!r}")
        T = sum(lengths)
        W = sum(n * n for n in lengths)
        if ring != 1:
            return self._ring_cost(T, W, len(lengths), sp, recompute, ring)
        return self._cost_sums(T, W, len(lengths), sp, recompute)

    def _ring_time_sum(self, tokens, sq_sum, n, sp, recompute, ring, exposed=True):  # type: ignore[override]
        # the host builds the whole micro-batch on every rank, ring or not
        base = super()._ring_time_sum(tokens, sq_sum, n, sp, recompute, ring, exposed)
        return base + self.host_per_token * tokens * (1.0 - 1.0 / ring)

    def _ring_cost(self, tokens, work, n, sp, recompute, ring) -> ItemCost:  # type: ignore[override]
        cost = super()._ring_cost(tokens, work, n, sp, recompute, ring)
        return replace(cost, overhead=cost.overhead + self.host_per_token * tokens * (1.0 - 1.0 / ring))

    def _cost_sums(self, T: float, W: float, n: int, sp: int, recompute: int) -> ItemCost:
        """:meth:`item_cost` (ring 1) from the sums: ``T`` tokens, ``W = sum l^2``, ``n`` samples."""
        c = self._c(sp)
        fwd = c[0] * W + c[1] * T + c[2]
        bwd = c[3] * W + c[4] * T + c[5]
        rec = c[9] * W + c[10] * T + c[11] + c[20] * n
        return ItemCost(
            compute=self.num_layers * (fwd + bwd) + c[19] * n,
            recompute=recompute * rec,
            comm=0.0,
            overhead=self.constant_time + self.time_per_token * T / sp + self.host_time + self.host_per_token * T,
            ideal=c[16] * W + c[17] * T + c[18] + c[21] * n,
        )

    def step_overhead(self, world_size: int) -> float:
        """Measured ``allreduce_s + optimizer_s``, rescaled when ``world_size`` differs from the profile's.

        Ring reduction volume scales with ``(W-1)/W``; a profile made on one device (no all-reduce
        measured) uses ``2 (W-1)/W * param_bytes / FALLBACK_ALLREDUCE_BW`` when ``param_bytes`` is
        recorded. ``zero2``/``fsdp`` reduce-scatter the gradients and all-gather the weights once per
        step instead: the same bytes, the same time. The optimizer time is kept as measured for
        ``sharding="none"`` and divided by ``world_size`` for the sharded modes (each rank steps its shard).
        """
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
        return {
            "source": "profile",
            "key": dict(self.profile.get("key", {})),
            "model": dict(self.profile["model"]),
            "memory_limit": self.memory_limit,
            "measured_sp": list(self.measured_sp),
            "sharding": self.sharding,
            "world_size": self.world_size,
            "freed_bytes": self.freed_bytes,
        }

    # ------------------------------------------------------------------ closed forms

    def min_recompute(self, lengths: Sequence[int], sp: int, ring: int = 1) -> int | None:
        """Fewest recomputed layers that fit (closed form of eq. 6), ``None`` if full recompute does not."""
        if ring != 1:
            return CostModel.min_recompute(self, lengths, sp, ring)
        return self.min_recompute_tokens(sum(lengths), sp)

    def max_length(self, sp: int, recompute: int | None = None, ring: int = 1) -> int:
        """Longest single sequence that fits on ``sp`` ranks with ``recompute`` layers (default all); 0 if none."""
        if ring != 1:
            return CostModel.max_length(self, sp, recompute, ring)
        r = self.num_layers if recompute is None else recompute
        c = self._c(sp)
        base = c[12] - r * c[14]
        per_token = c[13] - r * c[15]
        limit = self.memory_limit
        if base + sp * per_token > limit:
            return 0
        if per_token <= 0:
            return 1 << 40  # memory does not grow with length: the base class's cap
        n = int((limit - base) / per_token)
        while n > 0 and self.item_memory_tokens(n, sp, r) > limit:
            n -= 1
        while self.item_memory_tokens(n + 1, sp, r) <= limit:
            n += 1
        return n if n >= sp else 0

    def fit_summary(self) -> dict[int, dict[str, Any]]:
        """The fitted coefficients per SP size: ``forward``/``backward``/``recompute`` ``(a, b, c, d)`` (``d``, per
        sample, is 0 unless the profile has ``model.per_sample_cost``), ``activation``/``input`` ``(k, m)``."""
        return {p: dict(fit) for p, fit in self.fits_by_sp.items()}
