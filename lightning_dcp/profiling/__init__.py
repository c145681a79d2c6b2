"""Dual-layer profiling (DCP paper §3.5): measure two repeated layers, write a v1 profile.

Rooms:

* :mod:`~lightning_dcp.profiling.grid` — which ``(length, micro-batch, SP)`` points to measure
  (pure Python);
* :mod:`~lightning_dcp.profiling.layers` — where the model keeps its repeated layers
  (:class:`~lightning_dcp.sp.recompute.RecomputeLayers` or a ``dcp_repeated_layers()`` method);
* :mod:`~lightning_dcp.profiling.measure` — timers, saved-bytes counters, one grid point, the
  constant parts, the collectives that make ranks agree;
* :mod:`~lightning_dcp.profiling.harness` — driving a user's module without changing it;
* :mod:`~lightning_dcp.profiling.assemble` — :func:`profile_module`, the sequence and the v1 dict;
* :mod:`~lightning_dcp.profiling.callback` — :class:`DCPProfiler`, the Lightning callback;
* :mod:`~lightning_dcp.profiling.deadline` — the time budget of the whole profile, what it skipped (pure Python);
* :mod:`~lightning_dcp.profiling.forecast` — how long a grid point will take, from those measured;
* :mod:`~lightning_dcp.profiling.cache` — the on-disk cache (pure Python);
* :mod:`~lightning_dcp.profiling.budget` — :func:`measure_budget`: profile, then report the memory
  budget per SP size and the dataset's thresholds (:mod:`lightning_dcp.planning.budget`).

Names are imported lazily (``from lightning_dcp.profiling import DCPProfiler`` imports Lightning;
``from lightning_dcp.profiling.cache import ProfileKey`` does not import torch).

What one grid point ``(seq_len l, micro_batch b, sp p)`` measures, generically:

1. **Input.** ``b`` dataset samples of length exactly ``l`` (the grid lengths are taken *from*
   the dataset's lengths; with fewer than ``b`` such samples the same samples repeat; a requested
   length the data lacks is replaced by the nearest length it has, and the entry records the
   length actually run). They are packed with :func:`lightning_dcp.sp.packing.pack_samples`
   (``pad_to_multiple=p``), sharded for this rank of its SP group, and moved to the device.
2. **Capture.** The module's own step (``training_step`` by default) runs under the SP context
   until the :class:`~lightning_dcp.sp.recompute.RecomputeLayers` is called (or, for a model that
   exposes ``dcp_repeated_layers()``, its first layer); a forward pre-hook records that call's
   ``(args, kwargs)`` and stops the step. Nothing else about the model is assumed.
3. **Two layers**, no checkpointing, the SP context of the group active: ``layers[0]`` forward +
   backward (warm-up), ``layers[1]`` forward with saved-tensor hooks (activation count) +
   backward, then ``layers[1]`` forward and backward timed separately, repeated (at least 3
   times and until 50 ms were measured, at most 10): the medians are kept, on every device (training
   runs at the typical time: on a shared CPU the minimum predicted micro-batches 7-15% too fast).
   Then ``layers[1]`` once more, fwd + bwd under
   :class:`~lightning_dcp.sp.recompute.RecomputeLayers` checkpointing (as a recomputed layer runs
   in training; for ``dcp_repeated_layers()`` models, ``torch.utils.checkpoint.checkpoint(...,
   use_reentrant=False)`` under the same SP context): ``recompute_s`` (added optional field) = that time - ``forward_s`` -
   ``backward_s``, the real extra cost of recomputing one layer (its forward again plus the
   checkpoint machinery; paper eq. 5 approximates it by ``forward_s``). Inputs: a detached,
   grad-requiring copy of the captured ``x`` (and of any other floating tensor argument that
   required grad); the backward seeds a random gradient of the output's shape. Timing:
   ``torch.cuda.Event`` on CUDA, ``time.perf_counter`` on CPU.
4. **Memory.** ``activation_bytes``: the bytes of the unique storages (deduplicated by
   ``untyped_storage().data_ptr()``, each counted at ``untyped_storage().nbytes()``) that
   ``layers[1]``'s forward saves for backward, excluding parameters, buffers, the layer input
   ``x`` and every tensor of the captured arguments (the batch). ``input_bytes``:
   ``x.numel() * x.element_size()``. So paper eq. 6 reads
   ``M = (L - r) * activation_bytes + L * input_bytes + M_C``. ``peak_bytes`` (CUDA only):
   ``torch.cuda.max_memory_allocated`` during the point, absolute (model states included).
5. **Agreement.** On ``W > 1`` ranks every rank runs every point in the same order (the grid is
   built on rank 0 and broadcast); the ranks of each aligned block of ``p`` form the SP group and
   run the same micro-batch; the numbers are ``all_reduce(MAX)``-ed over the world, so every rank
   ends with the same entries.

Constant parts, measured once at SP 1 (``constant`` section):

* ``time_s`` / ``time_per_token_s`` (added optional field): the module's step forward + backward
  with the repeated layers *bypassed* (``layers`` returns its input), timed at the smallest and
  the largest grid length; a two-point line ``c0 + c1 * local_tokens`` (both clamped >= 0).
  ``time_s = c0``, the per-micro-batch cost; ``time_per_token_s = c1`` (embedding, head, loss
  grow with tokens). ``activation_bytes_per_token`` (added optional field): bytes saved for
  backward outside the repeated layers in that run, per local token.
* ``host_s`` / ``host_per_token_s`` (added optional fields): the host's work for one micro-batch
  as the runtime does it (load and pack the samples, ``dcp_prepare_batch``, token weights, shard,
  copy to the device), timed at the same two lengths (median of 5): a two-point line over the
  micro-batch's tokens. The planner charges it per micro-batch.
* ``optimizer_s``: a fresh optimizer of the same class and defaults steps over *clones* of
  ``layers[1]``'s trainable parameters with random gradients (two untimed steps create the
  state, then the median of three), scaled by ``total trainable numel / layer numel``. The real
  weights and optimizer state are never touched. 0 without an optimizer.
* ``allreduce_s``: ``all_reduce`` of a flat buffer of the gradient bytes over the world (at most
  256 MiB, time scaled linearly to the full size); 0 on one rank.
* ``memory_bytes``: parameter + buffer bytes + gradient bytes (trainable parameters) + optimizer
  state bytes (the real state when it exists; else an estimate: 2x trainable parameter bytes for
  Adam-like optimizers, 1x for SGD with momentum, 0 for plain SGD, 2x otherwise).
* ``param_bytes``: gradient bytes reduced per step.
* ``weight_bytes``, ``buffer_bytes``, ``optimizer_bytes`` (added optional fields): the parts of
  ``memory_bytes`` (which is their sum plus ``param_bytes``), so a planner can tell what a sharding
  mode frees (:mod:`lightning_dcp.planning.sharding`). All of them count the *full* model, whatever
  ``DCPStrategy(sharding=...)`` runs (a sharded parameter counts its global size): one profile serves
  every mode, and the runtime tells the planner its mode's share.

``device.memory_limit_bytes``: on CUDA ``total_memory * memory_fraction`` (0.9 default), on CPU
8 GiB by default; either overridden by ``memory_limit_bytes``.

Everything runs under :func:`lightning.pytorch.utilities.seed.isolate_rng`, with the module's
train/eval modes, buffers and ``.grad`` restored afterwards: a fit that profiles and one that hits
the cache continue identically.

"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # grid
    "DENSITIES": "grid", "GridPoint": "grid", "ProfileGrid": "grid", "build_grid": "grid", "select_lengths": "grid",
    # layers
    "LayerStack": "layers", "NoRepeatedLayersError": "layers", "find_layer_stack": "layers", "layer_stack": "layers",
    # measuring and assembly
    "make_sp_groups": "harness", "profile_module": "assemble", "CPU_MEMORY_LIMIT": "assemble",
    # callback
    "DCPProfiler": "callback",
    # cache
    "CACHE_ENV": "cache", "CacheLookup": "cache", "ProfileCacheWarning": "cache", "ProfileKey": "cache",
    "default_cache_dir": "cache", "device_name": "cache", "load_cached": "cache", "more_time": "cache", "model_signature": "cache",
    "profile_path": "cache", "resolve_cache_dir": "cache", "store": "cache", "describe_sample": "cache",
    "inputs_signature": "cache",
    # the time budget and the forecast it is kept with
    "ProfileDeadline": "deadline", "skipped_line": "deadline", "PointForecast": "forecast",
    # the budget helper
    "measure_budget": "budget", "resolve_budget": "budget",
    # the cost model a profile is read with (defined by the planner, which stays free of torch)
    "ProfiledCostModel": "lightning_dcp.planning.profiled",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module if "." in module else f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
