"""Flow-matching training targets as diffusers trains its flow models (Wan, SD3, Flux): :class:`FlowMatching`.

For a clean latent ``x0`` and Gaussian ``noise``: draw ``u`` (uniform, or as
``diffusers.training_utils.compute_density_for_timestep_sampling`` draws it for
``weighting_scheme="logit_normal"``/``"mode"``), take the training timestep and sigma at index
``int(u * num_train_timesteps)`` of a ``FlowMatchEulerDiscreteScheduler(shift=shift)`` schedule
(``sigma = shift*s / (1 + (shift-1)*s)``, ``timestep = sigma * num_train_timesteps``), and train
the model on ``x_t = (1 - sigma) * x0 + sigma * noise`` at that timestep to predict the velocity
``noise - x0``; per-sample loss weights from ``compute_loss_weighting_for_sd3`` (1 unless
``"sigma_sqrt"``/``"cosmap"``). A ``timestep_range`` spreads ``u`` over one block of the schedule
instead (one expert of Wan 2.2 A14B).

**Determinism.** Noise, ``u`` and hence sigma are a pure function of ``(seed, epoch, dataset
index)``: one ``torch.Generator`` per sample, seeded from a hash of the three, on the host. So a
sample gets the same noise whatever rank, micro-batch, SP size or packing it lands in, and
DCP training equals plain single-process training on the same global batches.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from lightning_dcp.diffusers.forward import HIDDEN_STATES, TIMESTEP
from lightning_dcp.diffusers.samples import CONDITION, GRID, LATENTS, SAMPLE_INDEX, input_to_output_layout
from lightning_dcp.sp.context import CU_SEQLENS, LOSS_MASK, SAMPLE_INDICES

__all__ = ["LOSS_SCALE", "TARGET", "WEIGHTING_SCHEMES", "FlowMatching", "check_sample_indices", "sample_seed"]

#: Per-token velocity target ``noise - x0`` in the model's output layout.
TARGET = "target"
#: Per-token loss weight of the sample's sigma (``compute_loss_weighting_for_sd3``; 1 by default).
LOSS_SCALE = "loss_scale"
#: ``weighting_scheme`` values, as diffusers' flow-matching training scripts name them.
WEIGHTING_SCHEMES = ("none", "logit_normal", "mode", "sigma_sqrt", "cosmap")


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit generator seed from ``(seed, epoch, index)`` (a hash: the same in every process)."""
    digest = hashlib.sha256(f"lightning-dcp/flow/{int(seed)}/{int(epoch)}/{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def check_sample_indices(batch: Mapping[str, Any]) -> list[int] | None:
    """The dataset index of each sample of a packed micro-batch: the sampler's ``SAMPLE_INDICES`` when
    present, else the samples' own ``SAMPLE_INDEX``, else ``None``.

    Raises ``ValueError`` when both are present and differ: the noise is keyed on the index, so a
    sample whose ``index=`` is not its index in the DataLoader's dataset (e.g. the inner index of a
    ``ConcatDataset`` of two video datasets) could share its noise with another sample.
    """
    own, true = batch.get(SAMPLE_INDEX), batch.get(SAMPLE_INDICES)
    if true is None:
        return None if own is None else [int(i) for i in own]
    wrong = [(int(a), int(b)) for a, b in zip(own or (), true) if int(a) != int(b)]
    if wrong:
        shown = "; ".join(f"the sample at dataset index {b} was made with index={a}" for a, b in wrong[:3])
        more = f" (and {len(wrong) - 3} more in this micro-batch)" if len(wrong) > 3 else ""
        raise ValueError(
            f"video_sample(..., index=...) disagrees with the dataset index DCPStrategy's sampler drew: {shown}{more}. "
            "The noise is keyed on the index, so different samples could get the same noise. index must be the "
            "sample's index in the dataset the DataLoader reads (the i of that dataset's __getitem__(i)); for a "
            "ConcatDataset, add the sizes of the datasets before it (ConcatDataset.cumulative_sizes), or leave index "
            "out (DCPStrategy keys the noise on the sampler's index).")
    return [int(i) for i in true]


@dataclass
class FlowMatching:
    """The flow-matching noising of a packed video micro-batch (see the module docstring).

    Args:
        patch_size: the model's ``config.patch_size`` (the target is put in its output layout).
        seed: base seed of the per-sample noise.
        shift: the schedule's shift (Wan's pipelines use 5.0 at 720p, 3.0 at 480p).
        num_train_timesteps: the schedule's length (1000 for Wan).
        weighting_scheme: one of :data:`WEIGHTING_SCHEMES`.
        logit_mean, logit_std, mode_scale: parameters of the ``"logit_normal"`` / ``"mode"`` densities.
        timestep_range: ``(lo, hi)``, fractions of ``num_train_timesteps``: only schedule timesteps
            ``t`` with ``lo <= t / num_train_timesteps < hi`` are drawn (``hi = 1`` includes
            ``t = num_train_timesteps``); ``u`` from the density is spread over that block of the
            schedule. For one expert of a two-expert Wan 2.2 model (A14B), whose pipeline switches at
            ``boundary_ratio`` (``transformer`` for ``t >= boundary_ratio * num_train_timesteps``,
            ``transformer_2`` below): ``(boundary_ratio, 1.0)`` for the high-noise expert,
            ``(0.0, boundary_ratio)`` for the low-noise one. Default ``(0.0, 1.0)``: the whole schedule.
        target_layout: the per-token feature order of the model's prediction, which the target is put
            in: ``"output"`` (``pt x ph x pw x C``, Wan) or ``"input"`` (``C x pt x ph x pw``, as the
            latents are patchified: LTX-Video, CogVideoX, HunyuanVideo); the model's family says which
            (:attr:`~lightning_dcp.diffusers.family.VideoFamily.output_layout`).
    """

    patch_size: Sequence[int]
    seed: int = 0
    shift: float = 5.0
    num_train_timesteps: int = 1000
    weighting_scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    timestep_range: tuple[float, float] = (0.0, 1.0)
    target_layout: str = "output"

    def __post_init__(self) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        if self.target_layout not in ("output", "input"):
            raise ValueError(f"target_layout must be 'output' (pt x ph x pw x C per token, Wan) or 'input' "
                             f"(C x pt x ph x pw, LTX-Video / CogVideoX / HunyuanVideo), got {self.target_layout!r}")
        if self.weighting_scheme not in WEIGHTING_SCHEMES:
            raise ValueError(f"weighting_scheme must be one of {WEIGHTING_SCHEMES}, got {self.weighting_scheme!r}")
        shift = self.shift
        if isinstance(shift, bool) or not isinstance(shift, numbers.Real) or not (math.isfinite(shift) and shift > 0):
            raise ValueError(f"shift must be a positive number (sigma = shift*s / (1 + (shift-1)*s); 1 = no shift, "
                             f"Wan's pipelines use 3.0 at 480p and 5.0 at 720p), got {self.shift!r}")
        if isinstance(self.num_train_timesteps, bool) or not isinstance(self.num_train_timesteps, numbers.Integral) \
                or self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be an int >= 1 (the schedule's length: 1000 for Wan and the "
                             f"scheduler configs diffusers ships), got {self.num_train_timesteps!r}")
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=self.num_train_timesteps, shift=self.shift)
        self.timesteps = scheduler.timesteps.clone().float()
        self.sigmas = scheduler.sigmas[: len(self.timesteps)].clone().float()
        self._first, self._count = self._timestep_block()

    def _timestep_block(self) -> tuple[int, int]:
        """``(first index, count)`` of the schedule block inside ``timestep_range`` (timesteps decrease with the index)."""
        try:
            lo, hi = (float(v) for v in self.timestep_range)
        except (TypeError, ValueError):
            raise ValueError(f"timestep_range must be (lo, hi), two fractions of num_train_timesteps, got "
                             f"{self.timestep_range!r}") from None
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"timestep_range must satisfy 0 <= lo < hi <= 1 (fractions of num_train_timesteps), got "
                             f"{self.timestep_range!r}; e.g. (boundary_ratio, 1.0) for Wan 2.2's high-noise expert")
        n = self.num_train_timesteps  # compared as Wan 2.2's pipeline does: t >= boundary_ratio * num_train_timesteps
        inside = (self.timesteps >= lo * n) & ((self.timesteps < hi * n) | (hi >= 1.0))
        where = torch.nonzero(inside).flatten()
        if where.numel() == 0:
            raise ValueError(f"timestep_range={self.timestep_range!r} holds none of the schedule's "
                             f"{len(self.timesteps)} timesteps (num_train_timesteps={self.num_train_timesteps}, "
                             f"shift={self.shift}); widen it")
        return int(where[0]), int(where.numel())  # contiguous: the timesteps are monotonic

    def draw(self, index: int, epoch: int, num_tokens: int, features: int) -> tuple[float, float, float, torch.Tensor]:
        """``(sigma, timestep, loss_weight, noise [num_tokens, features])`` of dataset sample ``index`` in ``epoch``."""
        from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

        g = torch.Generator().manual_seed(sample_seed(self.seed, epoch, index))
        u = compute_density_for_timestep_sampling(self.weighting_scheme, 1, logit_mean=self.logit_mean,
                                                  logit_std=self.logit_std, mode_scale=self.mode_scale, generator=g)
        i = self._first + min(int(u.item() * self._count), self._count - 1)
        sigma = self.sigmas[i]
        weight = compute_loss_weighting_for_sd3(self.weighting_scheme, sigma.reshape(1))
        noise = torch.randn(num_tokens, features, generator=g)
        return float(sigma), float(self.timesteps[i]), float(weight.reshape(-1)[0]), noise

    def prepare(self, batch: Mapping[str, Any], epoch: int) -> dict[str, Any]:
        """Add :data:`~lightning_dcp.diffusers.forward.HIDDEN_STATES`, :data:`~lightning_dcp.diffusers.forward.TIMESTEP`,
        :data:`TARGET` and :data:`LOSS_SCALE` (per token) to a whole packed micro-batch of clean latents.

        Sample indices: the DCP sampler's ``sample_indices`` (the true dataset indices) when present,
        else :data:`~lightning_dcp.diffusers.samples.SAMPLE_INDEX` (``video_sample(..., index=i)``: a
        plain DataLoader); with neither (a plain DataLoader over samples made without ``index=``) the
        noise comes from the global torch RNG instead -- valid training, but not reproducible across
        strategies. When both are present they must agree (:func:`check_sample_indices`). Padding
        tokens get zeros and weight 0.
        """
        x0 = batch[LATENTS]
        total, features = x0.shape
        cu = batch[CU_SEQLENS].tolist()
        indices = check_sample_indices(batch)
        noise = torch.zeros(total, features, dtype=torch.float32)
        sigma = torch.zeros(total, 1, dtype=torch.float32)
        timestep = torch.zeros(total, dtype=torch.float32)
        scale = torch.zeros(total, dtype=torch.float32)
        loss_rows = batch.get(LOSS_MASK)
        for j in range(len(batch[GRID])):  # the real samples; a trailing padding segment keeps zeros
            a, b = int(cu[j]), int(cu[j + 1])
            # noise for the sample's loss rows, in order: all of them for Wan; the video rows of a
            # joint-attention sample, whose text rows carry labels -100 (lightning_dcp.diffusers.joint)
            rows = slice(a, b) if loss_rows is None else a + torch.nonzero(loss_rows[a:b].cpu()).flatten()
            n = b - a if loss_rows is None else int(rows.numel())
            if indices is not None:
                s, t, w, eps = self.draw(int(indices[j]), epoch, n, features)
            else:
                s, t, w, eps = self._draw_global(n, features)
            noise[rows], sigma[a:b], timestep[a:b], scale[a:b] = eps, s, t, w
        noise, sigma, timestep, scale = (v.to(x0.device) for v in (noise, sigma, timestep, scale))
        x0f = x0.float()
        noisy = (1.0 - sigma) * x0f + sigma * noise
        out = dict(batch)
        condition = batch.get(CONDITION)
        out[HIDDEN_STATES] = noisy if condition is None else torch.cat([noisy, condition.float()], dim=-1)
        out[TIMESTEP] = timestep
        velocity = noise - x0f
        out[TARGET] = input_to_output_layout(velocity, self.patch_size) if self.target_layout == "output" else velocity
        out[LOSS_SCALE] = scale
        return out

    def _draw_global(self, num_tokens: int, features: int) -> tuple[float, float, float, torch.Tensor]:
        seed = int(torch.randint(0, 2**62, (1,)).item())
        return self.draw(seed, 0, num_tokens, features)
