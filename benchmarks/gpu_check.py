"""What one GPU should tell us, in one call sized for under 10 minutes (issue #24, item 6).

Needs only torch, Lightning and transformers (no DeepSpeed, no diffusers, no internet; one GPU, so
every plan is SP 1). Sections, each timed, each written to the JSON as soon as it ends:

1. ``attention``: :func:`lightning_dcp.sp.attention.varlen_attention` on every backend
   (``sdpa``; ``torch-varlen`` = ``torch.nn.attention.varlen.varlen_attn``; ``flash`` = flash-attn
   when importable) in bf16 against an fp32 per-sample reference (explicit softmax attention per
   packed sample, on the same bf16-rounded inputs), several packed length mixes, causal and not:
   max abs error of the output and of dq/dk/dv, forward time, and the kernels the profiler saw.
2. ``profile``: a fit of ``tiny-1d`` and ``tiny-2d`` (:mod:`lightning_dcp.models`) under
   ``DCPStrategy`` on one device with :class:`~lightning_dcp.profiling.DCPProfiler` (a fresh
   dual-layer profile, no cache); every executed step's plan simulated on the fitted
   :class:`~lightning_dcp.planning.profiled.ProfiledCostModel`: predicted vs measured step time
   (``on_train_batch_start`` -> ``on_train_batch_end``, CUDA synchronised).
3. ``memory``: in the same fits, ``torch.cuda.max_memory_allocated`` per step (reset at each step's
   start) vs the memory model's prediction (the largest ``item_memory`` of the step's micro-batches).
4. ``mfu``: one ``transformer-1d`` decoder layer (bf16 weights and activations) forward + backward on
   packed lengths; FLOPs counted analytically (``3 x (2 x layer_params x tokens + 4 h sum(l^2) / 2)``,
   causal attention halved; the GEMM part cross-checked by ``torch.utils.flop_counter``) / median time
   / the GPU's dense bf16 peak (:data:`PEAK_BF16`; other GPUs: unknown, no MFU).
5. ``fit``: a short bf16-mixed fit of a tiny random-weight Llama (transformers' ``LlamaConfig``,
   :class:`lightning_dcp.hf.CausalLMModule`) and, only when diffusers imports, of a tiny Wan
   (:class:`lightning_dcp.diffusers.VideoDiffusionModule`; else skipped with the reason), each under
   ``DCPStrategy`` on one device: losses per step, finite or not.
6. ``hsdp``: ``sharding="hsdp"`` fits on two ranks, bf16 on NCCL and ``offload=True``
   (:mod:`benchmarks.hsdp_check`; skipped with the reason on one GPU, a gloo dry run on the CPU).

Run::

    python benchmarks/gpu_check.py                      # full (sized for < 10 min; not yet timed on a GPU)
    python benchmarks/gpu_check.py --quick              # smaller shapes, fewer steps
    python benchmarks/gpu_check.py --sections attention,mfu --out /tmp/gc

Results: ``benchmarks/results/<gpu-name-slug>/gpu_check.json`` and ``gpu_check.md`` (``--out`` to
change), also printed. Without CUDA the script says so and runs a dry run of every section's code
path on the CPU (tiny shapes, fp32) into a temporary directory (or ``--out``); exit 0 when no
section failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.hsdp_check import section_hsdp, summary as hsdp_summary  # noqa: E402

SCHEMA = "lightning-dcp/gpu-check/v1"
SECTIONS = ("attention", "profile", "memory", "mfu", "fit", "hsdp")

#: Dense bf16 tensor-core peaks (FLOP/s) by device-name substring; the first row whose ``needle``
#: is in ``torch.cuda.get_device_name()`` and none of whose ``unless`` is, wins. Other GPUs: unknown.
PEAK_BF16: tuple[tuple[str, tuple[str, ...], float, str], ...] = (
    ("H100", ("PCIe", "NVL"), 989.4e12, "NVIDIA H100 SXM datasheet: 989.4 TFLOP/s dense bf16"),
    ("H200", ("NVL",), 989.4e12, "NVIDIA H200 SXM datasheet: 989 TFLOP/s dense bf16 (H100 SXM's tensor cores)"),
)


def peak_bf16(device_name: str) -> tuple[float | None, str]:
    """``(peak FLOP/s, source)`` for ``device_name``; ``(None, "unknown ...")`` for a GPU not in :data:`PEAK_BF16`."""
    for needle, unless, peak, source in PEAK_BF16:
        if needle in device_name and not any(u in device_name for u in unless):
            return peak, source
    return None, f"unknown: {device_name!r} is not in PEAK_BF16 (H100 SXM, H200 SXM); no MFU"


def slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


# ------------------------------------------------------------------------------------------ sizes

@dataclass(frozen=True)
class Sizes:
    """Every shape and count the sections use; one set per mode (:data:`MODES`)."""

    attn_heads: int
    attn_head_dim: int
    attn_mixes: tuple[tuple[int, ...], ...]
    attn_repeats: int
    plan_samples: int
    plan_max_len: int
    plan_max_frames: int
    plan_global_batch: int
    plan_warmup_steps: int
    plan_steps: int
    profile_budget_s: float
    profile_micro_batches: tuple[int, ...] | None  # None: the profiler's default (1, 2)
    mfu_model: str
    mfu_mixes: tuple[tuple[int, ...], ...]
    mfu_repeats: int
    llama: tuple[int, int, int, int, int, int]  # vocab, hidden, intermediate, layers, heads, kv heads
    fit_samples: int
    fit_max_len: int
    fit_global_batch: int
    fit_steps: int


MODES: dict[str, Sizes] = {
    "full": Sizes(16, 128, ((4096,), (1024,) * 4, (128,) * 32, (17, 4000, 333, 1500, 64), (2048, 100, 100, 7, 900)), 10,
                  512, 4096, 16, 32, 3, 8, 40.0, None,
                  "transformer-1d", ((4096,), (16384,), (1024,) * 8, (8192, 4096, 2048, 1024, 512, 256)), 10,
                  (1024, 256, 704, 4, 8, 4), 256, 1024, 16, 20),
    "quick": Sizes(16, 128, ((2048,), (512,) * 4, (17, 1000, 333, 64)), 5,
                   256, 2048, 8, 16, 2, 4, 15.0, None,
                   "transformer-1d", ((4096,), (1024,) * 4), 5,
                   (1024, 256, 704, 2, 8, 4), 128, 512, 8, 8),
    "dry": Sizes(2, 8, ((8,), (3, 5, 9), (1, 16, 2)), 2,
                 32, 64, 3, 4, 1, 2, 1.0, (1,),
                 "tiny-1d", ((16,), (5, 11)), 2,
                 (128, 32, 64, 2, 4, 2), 24, 32, 4, 2),
}


@dataclass
class Ctx:
    """What every section shares."""

    device: torch.device
    dtype: torch.dtype          # attention / MFU dtype: bf16 on CUDA, fp32 in the dry run
    precision: str              # Lightning precision of the fits
    accelerator: str
    sizes: Sizes
    out: Path
    device_name: str
    fits: dict | None = None     # the profile section's fits, reused by the memory section

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _median_s(fn: Callable[[], Any], ctx: Ctx, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, ``perf_counter`` on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if ctx.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


_KERNEL_WORDS = ("flash", "fmha", "attn", "attention", "sdpa", "cutlass")


def _kernels(fn: Callable[[], Any], ctx: Ctx) -> list[str]:
    """Attention kernels (CUDA) or ops (CPU) a profiler sees during ``fn()``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    try:
        with profile(activities=acts) as prof:
            fn()
            ctx.sync()
    except Exception as err:  # noqa: BLE001 - no CUPTI etc.: the numbers still count
        return [f"torch.profiler failed: {type(err).__name__}: {err}"[:200]]
    wanted = "CUDA" if ctx.cuda else "CPU"
    names = {e.name for e in prof.events() if str(e.device_type).endswith(wanted)
             and any(w in e.name.lower() for w in _KERNEL_WORDS)}
    return sorted(n[:160] for n in names)[:8]


# ------------------------------------------------------------------------------------------ 1. attention

def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...], causal: bool) -> torch.Tensor:
    """fp32 softmax attention per packed sample, written out (no fused kernel)."""
    outs, start = [], 0
    scale = q.shape[-1] ** -0.5
    for n in lengths:
        qs, ks, vs = (t[start:start + n].float().transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
        scores = (qs @ ks.transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


def _guarded(fn: Callable[[], dict], **row: Any) -> dict:
    """``fn()``, or ``row`` with ``status="error"`` and the exception's last traceback line: one failing
    case must not lose the others' figures (the section is then marked failed)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return {**row, "status": "error", "error": traceback.format_exc().strip().splitlines()[-1][:300]}


def _failed(rows: list[dict]) -> list[str]:
    return [f"{ {k: v for k, v in r.items() if k not in ('status', 'error')} }: {r['error']}"
            for r in rows if r.get("status") == "error"]


def _attention_case(ctx: Ctx, lengths: tuple[int, ...], causal: bool, backend: str) -> dict:
    from lightning_dcp.sp.attention import varlen_attention

    s = ctx.sizes
    total = sum(lengths)
    g = torch.Generator(device="cpu").manual_seed(len(lengths) * 7919 + total)
    q, k, v = (torch.randn(total, s.attn_heads, s.attn_head_dim, generator=g).to(ctx.device, ctx.dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=ctx.device)
    grad = torch.randn(total, s.attn_heads, s.attn_head_dim, generator=g).to(ctx.device)
    row: dict[str, Any] = {"lengths": list(lengths), "causal": causal, "backend": backend}

    def call(qq=q, kk=k, vv=v):
        return varlen_attention(qq, kk, vv, cu, max(lengths), causal=causal, backend=backend)

    try:
        call()
    except RuntimeError as err:  # the backend is missing here (no flash-attn, no torch varlen, not CUDA)
        return {**row, "status": "unavailable", "reason": str(err).splitlines()[0]}
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = _reference(*leaves, lengths, causal)
    ref.backward(grad)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out = call(qq, kk, vv)
    out.backward(grad.to(out.dtype))
    err = {"out": (out.float() - ref).abs().max().item()}
    for name, mine, theirs in zip(("dq", "dk", "dv"), (qq, kk, vv), leaves):
        err[name] = (mine.grad.float() - theirs.grad).abs().max().item()
    with torch.no_grad():
        fwd_s = _median_s(call, ctx, s.attn_repeats)
        kernels = _kernels(call, ctx)
    return {**row, "status": "ok", "max_abs_err": err, "ref_max_abs": ref.abs().max().item(),
            "forward_ms": fwd_s * 1e3, "kernels": kernels}


def section_attention(ctx: Ctx) -> dict:
    from lightning_dcp.sp.attention import attention_backend

    rows = [_guarded(lambda: _attention_case(ctx, lengths, causal, backend), lengths=list(lengths), causal=causal,
                     backend=backend)
            for lengths in ctx.sizes.attn_mixes for causal in (False, True)
            for backend in ("sdpa", "torch-varlen", "flash")]
    return {"dtype": str(ctx.dtype).replace("torch.", ""), "heads": ctx.sizes.attn_heads,
            "head_dim": ctx.sizes.attn_head_dim, "auto_backend": attention_backend(ctx.device, ctx.dtype),
            "reference": "fp32 softmax(q k^T * d^-0.5) v per sample on the same rounded inputs", "cases": rows,
            "failed": _failed(rows)}


# ------------------------------------------------------------------------------------------ 2./3. planned fits

def _step_recorder(ctx: Ctx):
    import lightning.pytorch as pl
    from typing_extensions import override

    class StepRecorder(pl.Callback):
        """Wall time (CUDA synchronised), CUDA peak memory and the executed plan of every step."""

        def __init__(self) -> None:
            self.rows: list[dict] = []
            self._t0 = 0.0

        @override
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            ctx.sync()
            if ctx.cuda:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            self._t0 = time.perf_counter()

        @override
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            ctx.sync()
            seconds = time.perf_counter() - self._t0
            m = trainer.strategy.last_step_metrics
            self.rows.append({"step_s": seconds, "plan": trainer.strategy.last_step_plan,
                              "peak_bytes": torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None,
                              "loss": None if m is None else m.loss})

    return StepRecorder()


def _trainer(ctx: Ctx, strategy: Any, steps: int, callbacks: list) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(accelerator=ctx.accelerator, devices=1, strategy=strategy, precision=ctx.precision,
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)


def _profiler(ctx: Ctx) -> Any:
    """A fresh measurement every run (no cache reads), within the mode's time budget."""
    from lightning_dcp.profiling import DCPProfiler

    return DCPProfiler(cache_dir=str(ctx.out / "profile_cache"), use_cache=False, time_budget_s=ctx.sizes.profile_budget_s,
                       micro_batch_sizes=ctx.sizes.profile_micro_batches)


def _planned_fit(ctx: Ctx, model: str) -> dict:
    from torch.utils.data import DataLoader

    from lightning_dcp import DCPStrategy
    from lightning_dcp.data import SyntheticTokenDataset, SyntheticVideoDataset, plain_collate, tiny_lengths
    from lightning_dcp.models.module import DCPTransformerModule

    s = ctx.sizes
    torch.manual_seed(0)
    module = DCPTransformerModule(model)
    if module.spec.kind == "1d":
        data = SyntheticTokenDataset(tiny_lengths(s.plan_samples, max_len=s.plan_max_len), vocab_size=module.spec.vocab_size)
    else:
        data = SyntheticVideoDataset(num_samples=s.plan_samples, in_channels=module.spec.in_channels,
                                     max_frames=s.plan_max_frames)
    profiler = _profiler(ctx)
    recorder = _step_recorder(ctx)
    strategy = DCPStrategy(global_batch_size=s.plan_global_batch, loss_reduction="token", shuffle=False)
    t0 = time.perf_counter()
    trainer = _trainer(ctx, strategy, s.plan_warmup_steps + s.plan_steps, [profiler, recorder])
    trainer.fit(module, DataLoader(data, batch_size=1, collate_fn=plain_collate))
    (ctx.out / f"profile_{model}.json").write_text(json.dumps(profiler.profile, indent=1))
    return {"model": model, "fit_s": time.perf_counter() - t0, "cost_model": strategy.cost_model,
            "profile": profiler.profile, "rows": recorder.rows[s.plan_warmup_steps:],
            "warmup_steps": s.plan_warmup_steps, "max_len": max(data.lengths), "samples": len(data)}


def _fits(ctx: Ctx) -> list[dict]:
    if ctx.fits is None:
        ctx.fits = {m: _planned_fit(ctx, m) for m in ("tiny-1d", "tiny-2d")}
    return list(ctx.fits.values())


def _items(plan: dict) -> list:
    from lightning_dcp.planning.plan import StepPlan

    return list(StepPlan.from_dict(plan).items)


def section_profile(ctx: Ctx) -> dict:
    from lightning_dcp.planning.plan import Plan, StepPlan
    from lightning_dcp.planning.simulator import simulate

    out = []
    for fit in _fits(ctx):
        cm, prof = fit["cost_model"], fit["profile"]
        steps = []
        for row in fit["rows"]:
            pred = simulate(Plan("executed", 1, (StepPlan.from_dict(row["plan"]),)), cm).step_times[0]
            items = _items(row["plan"])
            steps.append({"measured_s": row["step_s"], "predicted_s": pred, "error": pred / row["step_s"] - 1,
                          "micro_batches": len(items), "tokens": sum(it.tokens for it in items),
                          "recompute": [it.recompute for it in items], "loss": row["loss"]})
        errors = [abs(st["error"]) for st in steps]
        out.append({"model": fit["model"], "cost_model": type(cm).__name__, "fit_s": fit["fit_s"],
                    "profile_meta": prof.get("meta") if prof else None,
                    "profile_entries": len(prof["entries"]) if prof else 0,
                    "constant": prof.get("constant") if prof else None, "samples": fit["samples"],
                    "max_len": fit["max_len"], "warmup_steps": fit["warmup_steps"], "steps": steps,
                    "mean_abs_error": statistics.fmean(errors) if errors else None})
    return {"precision": ctx.precision, "fits": out}


def section_memory(ctx: Ctx) -> dict:
    out = []
    for fit in _fits(ctx):
        cm = fit["cost_model"]
        steps = []
        for row in fit["rows"]:
            items = _items(row["plan"])
            pred = max(cm.item_memory(it.lengths, it.sp_size, it.recompute) for it in items)
            meas = row["peak_bytes"]
            steps.append({"measured_bytes": meas, "predicted_bytes": pred,
                          "error": None if not meas else pred / meas - 1, "tokens": sum(it.tokens for it in items)})
        out.append({"model": fit["model"], "memory_limit_bytes": cm.memory_limit, "steps": steps})
    return {"measured": "torch.cuda.max_memory_allocated, reset at each step's start" if ctx.cuda else
            "nothing (no CUDA): predictions only", "fits": out}


# ------------------------------------------------------------------------------------------ 4. layer MFU

def layer_flops(spec: Any, lengths: tuple[int, ...]) -> dict[str, float]:
    """Training FLOPs (forward + 2x backward) of one ``DecoderLayer``: GEMMs ``2 x params x tokens`` and
    attention ``4 h sum(l^2)`` per forward, halved when causal."""
    tokens, sq = sum(lengths), sum(n * n for n in lengths)
    gemm = 3 * 2.0 * spec.layer_params() * tokens
    attention = 3 * 4.0 * spec.hidden_size * sq * (0.5 if spec.causal else 1.0)
    return {"gemm": gemm, "attention": attention, "total": gemm + attention}


def _counted_gemm_flops(layer: Any, x: torch.Tensor, batch: dict) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        layer(x, batch).backward(torch.ones_like(x))
    ops = counter.get_flop_counts().get("Global", {})
    return float(sum(v for op, v in ops.items() if str(op).split(".")[1] in ("mm", "addmm", "bmm")))


def _mfu_case(ctx: Ctx, layer: Any, spec: Any, lengths: tuple[int, ...], peak: float | None) -> dict:
    from lightning_dcp.data import SyntheticTokenDataset, pack_samples
    from lightning_dcp.sp.context import CU_SEQLENS, MAX_SEQLEN, POSITION_IDS

    packed = pack_samples([SyntheticTokenDataset(list(lengths))[i] for i in range(len(lengths))])
    batch = {key: packed[key].to(ctx.device) if isinstance(packed[key], torch.Tensor) else packed[key]
             for key in (CU_SEQLENS, MAX_SEQLEN, POSITION_IDS)}
    x = torch.randn(sum(lengths), spec.hidden_size, device=ctx.device, dtype=ctx.dtype, requires_grad=True)
    grad = torch.randn_like(x)
    flops = layer_flops(spec, lengths)
    counted = _counted_gemm_flops(layer, x, batch)

    def step():
        layer(x, batch).backward(grad)

    def forward():
        with torch.no_grad():
            layer(x, batch)

    seconds = _median_s(step, ctx, ctx.sizes.mfu_repeats)
    fwd_s = _median_s(forward, ctx, ctx.sizes.mfu_repeats)
    layer.zero_grad(set_to_none=True)
    achieved = flops["total"] / seconds
    return {"lengths": list(lengths), "tokens": sum(lengths), "flops": flops, "gemm_flops_counted": counted,
            "fwd_bwd_ms": seconds * 1e3, "forward_ms": fwd_s * 1e3, "tflops": achieved / 1e12,
            "forward_tflops": flops["total"] / 3 / fwd_s / 1e12, "mfu": None if peak is None else achieved / peak}


def section_mfu(ctx: Ctx) -> dict:
    from lightning_dcp.models.transformer1d import DecoderLayer
    from lightning_dcp.planning.models import get_model
    from lightning_dcp.sp.attention import attention_backend

    spec = get_model(ctx.sizes.mfu_model)
    torch.manual_seed(0)
    layer = DecoderLayer(spec).to(ctx.device, ctx.dtype)
    peak, source = peak_bf16(ctx.device_name) if ctx.cuda else (None, "no CUDA: dry run, no MFU")
    cases = [_guarded(lambda: _mfu_case(ctx, layer, spec, lengths, peak), lengths=list(lengths))
             for lengths in ctx.sizes.mfu_mixes]
    return {"layer": f"{spec.name} DecoderLayer (h={spec.hidden_size}, ffn={spec.ffn_hidden_size}, "
                     f"heads={spec.num_heads}, causal={spec.causal})", "layer_params": spec.layer_params(),
            "dtype": str(ctx.dtype).replace("torch.", ""), "attention_backend": attention_backend(ctx.device, ctx.dtype),
            "peak_flops": peak, "peak_source": source, "cases": cases, "failed": _failed(cases)}


# ------------------------------------------------------------------------------------------ 5. short fits

class _InputsOnly(torch.utils.data.Dataset):
    """A :class:`~lightning_dcp.data.SyntheticTokenDataset`'s inputs only (CausalLMModule shifts them itself)."""

    def __init__(self, base: Any) -> None:
        self.base, self.lengths = base, base.lengths

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.base[i]["input_ids"]}


def _fit_summary(name: str, rows: list[dict], seconds: float) -> dict:
    losses = [r["loss"] for r in rows]
    finite = bool(losses) and all(v is not None and math.isfinite(v) for v in losses)
    return {"model": name, "status": "ok" if finite else "error", "steps": len(rows), "fit_s": seconds,
            "losses": losses, "finite": finite, "step_s": [r["step_s"] for r in rows]}


def _fit_llama(ctx: Ctx) -> dict:
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_dcp import DCPStrategy
    from lightning_dcp.data import SyntheticTokenDataset, tiny_lengths
    from lightning_dcp.hf import CausalLMModule

    s = ctx.sizes
    vocab, hidden, inter, layers, heads, kv = s.llama
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=s.fit_max_len)
    module = CausalLMModule(LlamaForCausalLM(config), lr=1e-3)  # fp32 weights; bf16-mixed autocast on the GPU
    data = _InputsOnly(SyntheticTokenDataset(tiny_lengths(s.fit_samples, max_len=s.fit_max_len), vocab_size=vocab))
    recorder = _step_recorder(ctx)
    profiler = _profiler(ctx)
    t0 = time.perf_counter()
    trainer = _trainer(ctx, DCPStrategy(global_batch_size=s.fit_global_batch, loss_reduction="token"), s.fit_steps,
                       [profiler, recorder])
    trainer.fit(module, DataLoader(data, batch_size=1, collate_fn=CausalLMModule.collate))
    return {**_fit_summary("llama (random weights)", recorder.rows, time.perf_counter() - t0),
            "config": {"vocab": vocab, "hidden": hidden, "intermediate": inter, "layers": layers, "heads": heads,
                       "kv_heads": kv}}


class _Videos(torch.utils.data.Dataset):
    """Random latent videos ``(frames, h, w)`` with random text embeddings; ``lengths`` from the shapes."""

    def __init__(self, shapes: list[tuple[int, int, int]], channels: int, text_dim: int) -> None:
        self.shapes, self.channels, self.text_dim = shapes, channels, text_dim
        self.lengths = [f * (h // 2) * (w // 2) for f, h, w in shapes]

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int) -> dict:
        from lightning_dcp.diffusers import video_sample

        g = torch.Generator().manual_seed(i)
        latent = torch.randn(self.channels, *self.shapes[i], generator=g)
        return video_sample(latent, torch.randn(8, self.text_dim, generator=g), (1, 2, 2), text_len=16, index=i)


def _fit_wan(ctx: Ctx) -> dict:
    try:
        from diffusers import WanTransformer3DModel

        from lightning_dcp.diffusers import VideoDiffusionModule
    except Exception as err:  # noqa: BLE001 - any failure to import means: no Wan here
        return {"model": "wan (random weights)", "status": "skipped", "reason": f"diffusers does not import: {err}"}
    from torch.utils.data import DataLoader

    from lightning_dcp import DCPStrategy, DefaultCostModel

    s = ctx.sizes
    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                  out_channels=4, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2,
                                  rope_max_seq_len=64)
    module = VideoDiffusionModule(model, lr=1e-4)
    shapes = [(1 + i % 3, 4 + 4 * (i % 2), 4 + 4 * (i % 3 == 0)) for i in range(s.fit_samples)]
    recorder = _step_recorder(ctx)
    strategy = DCPStrategy(global_batch_size=s.fit_global_batch, loss_reduction="token",
                           cost_model=DefaultCostModel(num_layers=2, num_heads=4))
    t0 = time.perf_counter()
    trainer = _trainer(ctx, strategy, s.fit_steps, [recorder])
    trainer.fit(module, DataLoader(_Videos(shapes, 4, 32), batch_size=1, collate_fn=VideoDiffusionModule.collate))
    return _fit_summary("wan (random weights)", recorder.rows, time.perf_counter() - t0)


def section_fit(ctx: Ctx) -> dict:
    runs = [_guarded(lambda: _fit_llama(ctx), model="llama (random weights)"),
            _guarded(lambda: _fit_wan(ctx), model="wan (random weights)")]
    failed = [f"{r['model']}: " + (r["error"] if "error" in r else f"non-finite losses {r['losses']}")
              for r in runs if r["status"] == "error"]
    return {"precision": ctx.precision, "runs": runs, "failed": failed}


SECTION_FNS: dict[str, Callable[[Ctx], dict]] = {
    "attention": section_attention, "profile": section_profile, "memory": section_memory, "mfu": section_mfu,
    "fit": section_fit, "hsdp": section_hsdp,
}


# ------------------------------------------------------------------------------------------ driver

def _versions() -> dict:
    import importlib

    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cpus": os.cpu_count()}
    for name in ("lightning", "transformers", "diffusers", "deepspeed", "flash_attn"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "present")
        except Exception as err:  # noqa: BLE001 - record why it is missing
            out[name] = f"not importable ({type(err).__name__})"
    return out


def _markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device']}", "",
             f"- date: {report['date']}", f"- command: `{report['command']}`", f"- mode: {report['mode']}",
             f"- versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}", "",
             "| section | status | seconds | summary |", "|---|---|---:|---|"]
    for name, sec in report["sections"].items():
        lines.append(f"| {name} | {sec['status']} | {sec['seconds']:.1f} | {_summary(name, sec)} |")
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _summary(name: str, sec: dict) -> str:
    """One table cell per section: the figures to read first."""
    if sec["status"] == "error":
        return sec["error"].splitlines()[-1][:200]
    r = sec.get("results", {})
    if name == "attention":
        ok = [c for c in r["cases"] if c["status"] == "ok"]
        worst: dict[str, float] = {}
        for c in ok:
            worst[c["backend"]] = max(worst.get(c["backend"], 0.0), *c["max_abs_err"].values())
        missing = sorted({c["backend"] for c in r["cases"] if c["status"] != "ok"})
        return (f"auto={r['auto_backend']}; worst max abs err (out, dq, dk, dv) "
                + ", ".join(f"{b} {e:.2e}" for b, e in worst.items()) + (f"; unavailable: {missing}" if missing else ""))
    if name == "profile":
        return "; ".join(f"{f['model']}: mean abs step-time error {_pct(f['mean_abs_error'])} over {len(f['steps'])} steps"
                         for f in r["fits"])
    if name == "memory":
        parts = []
        for f in r["fits"]:
            errs = [s["error"] for s in f["steps"] if s["error"] is not None]
            parts.append(f"{f['model']}: predicted/measured - 1 in [{_pct(min(errs))}, {_pct(max(errs))}]" if errs
                         else f"{f['model']}: predicted only")
        return "; ".join(parts)
    if name == "mfu":
        best = max(r["cases"], key=lambda c: c["tflops"])
        return (f"{r['layer']}: best {best['tflops']:.1f} TFLOP/s at {best['tokens']} tokens, MFU "
                + ("unknown" if best["mfu"] is None else f"{100 * best['mfu']:.1f}%"))
    if name == "hsdp":
        return hsdp_summary(r)
    if name == "fit":
        return "; ".join(f"{x['model']}: {x['status']}" + (f" ({x['reason'][:80]})" if "reason" in x else
                         f", loss {x['losses'][0]:.3f} -> {x['losses'][-1]:.3f} in {x['steps']} steps") for x in r["runs"])
    return ""


def _write(report: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(_markdown(report))


def _context(args: argparse.Namespace) -> Ctx:
    cuda = torch.cuda.is_available()
    mode = "dry" if not cuda else ("quick" if args.quick else "full")
    name = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    if args.out:
        out = Path(args.out)
    elif cuda:
        out = ROOT / "benchmarks" / "results" / slug(name)
    else:
        out = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    if not cuda:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    return Ctx(device=torch.device("cuda", 0) if cuda else torch.device("cpu"),
               dtype=torch.bfloat16 if cuda else torch.float32, precision="bf16-mixed" if cuda else "32-true",
               accelerator="gpu" if cuda else "cpu", sizes=MODES[mode], out=out, device_name=name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<gpu-name-slug>/; "
                                                 "without CUDA a new temporary folder)")
    p.add_argument("--quick", action="store_true", help="smaller shapes and fewer steps (GPU; the CPU dry run is always tiny)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = p.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown or not wanted:
        p.error(f"--sections {args.sections!r}: unknown {unknown}; choose among {','.join(SECTIONS)}")
    args.sections = wanted
    return args


def main(argv: list[str] | None = None) -> int:
    import warnings

    args = parse_args(argv)
    ctx = _context(args)
    if not ctx.cuda:
        print("gpu_check: no CUDA device here; dry run of every section's code path on the CPU (tiny shapes, fp32) "
              f"-> {ctx.out}", flush=True)
    warnings.filterwarnings("ignore", message=".*(val_dataloader|does not have many workers|DefaultCostModel).*")
    mode = "dry" if not ctx.cuda else ("quick" if args.quick else "full")
    report: dict[str, Any] = {
        "schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "mode": mode, "device": ctx.device_name, "versions": _versions(), "sizes": asdict(ctx.sizes), "sections": {},
    }
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        report["gpu"] = {"name": props.name, "total_memory_bytes": props.total_memory,
                         "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count}
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            results = SECTION_FNS[name](ctx)
            failed = results.get("failed") or []
            sec: dict[str, Any] = {"status": "error" if failed else "ok", "results": results}
            if failed:
                sec["error"] = "failed: " + "; ".join(failed)
        except Exception:  # noqa: BLE001 - one failing section must not hide the others' results
            sec = {"status": "error", "error": traceback.format_exc()}
        sec["seconds"] = time.perf_counter() - t0
        report["sections"][name] = sec
        _write(report, ctx.out)
        print(f"[{name}] {sec['status']} in {sec['seconds']:.1f} s: {_summary(name, sec)}", flush=True)
    print(_markdown(report))
    print(f"results: {ctx.out / 'gpu_check.json'}, {ctx.out / 'gpu_check.md'}")
    return 1 if any(s["status"] == "error" for s in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
