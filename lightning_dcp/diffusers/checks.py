"""Check a video dataset against the model before training: :func:`check_video_shapes`, :func:`check_train_data`.

Wrong data otherwise fails late: a latent whose size does not divide by the patch size when the
sample is first drawn (possibly hours in), a text embedding of the wrong width or a latent with the
wrong channels as a raw torch shape error inside the model. :class:`~lightning_dcp.diffusers.VideoDiffusionModule`
calls :func:`check_train_data` in ``setup("fit")``, before profiling and the first step:

* a dataset with ``video_shapes`` (a list of :class:`VideoShape`, e.g.
  :class:`~lightning_dcp.diffusers.EncodedVideoDataset`'s, read from its index without opening a
  latent) is checked whole -- also through ``Subset`` and ``ConcatDataset``;
* any other dataset is checked on a first pass over its first ``max_samples`` samples
  (:func:`~lightning_dcp.diffusers.video_sample` dicts).

Every problem names the sample (its index in the dataset the DataLoader reads; and its clip when the
dataset has ``labels``, as :class:`~lightning_dcp.diffusers.EncodedVideoDataset` does) and the expected value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["ModelInputs", "VideoShape", "check_train_data", "check_video_shapes", "dataset_labels",
           "dataset_video_shapes", "sample_video_shape"]


@dataclass(frozen=True)
class VideoShape:
    """A sample's shapes: latent ``[C, F, H, W]``, text ``(tokens, dim)``, extra condition channels, image ``(tokens, dim)``."""

    latent: tuple[int, int, int, int]
    text: tuple[int, int] | None
    condition_channels: int = 0
    image: tuple[int, int] | None = None


@dataclass(frozen=True)
class ModelInputs:
    """What a video transformer takes: :meth:`of_model` for any supported family, :meth:`from_config` for a Wan config."""

    in_channels: int
    out_channels: int
    patch_size: tuple[int, int, int]
    text_dim: int
    rope_max_seq_len: int | None = None
    image_dim: int | None = None

    @classmethod
    def from_config(cls, config: Any) -> ModelInputs:
        get = (lambda k: config.get(k)) if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
        out = get("out_channels") or get("in_channels")
        rope = get("rope_max_seq_len")
        image = get("image_dim")
        return cls(int(get("in_channels")), int(out), tuple(int(v) for v in get("patch_size")), int(get("text_dim")),
                   None if rope is None else int(rope), None if image is None else int(image))

    @classmethod
    def of_model(cls, model: Any) -> ModelInputs:
        """The inputs of a model of any family in :data:`~lightning_dcp.diffusers.family.FAMILIES` (its patch size
        and text width as the family reads them from the config)."""
        from lightning_dcp.diffusers.family import family_of

        family, config = family_of(model), model.config
        out = getattr(config, "out_channels", None) or config.in_channels
        rope, image = getattr(config, "rope_max_seq_len", None), getattr(config, "image_dim", None)
        return cls(int(config.in_channels), int(out), tuple(family.patch_size(config)), int(family.text_dim(config)),
                   None if rope is None else int(rope), None if image is None else int(image))


def _problems(shape: VideoShape, model: ModelInputs, text_len: int | None) -> list[str]:
    c, f, h, w = shape.latent
    pt, ph, pw = model.patch_size
    out = []
    if c < 0:
        out.append(f"latent token width is not a multiple of the patch volume {pt * ph * pw}, expected "
                   f"{model.out_channels} channels x patch {model.patch_size} (build samples with video_sample for this "
                   "model's patch size)")
    elif c != model.out_channels:
        out.append(f"latent channels {c}, expected {model.out_channels} (the model's out_channels: the VAE's latent "
                   "channels; encode with this model's own VAE)")
    elif c + shape.condition_channels != model.in_channels:
        out.append(f"latent + condition channels {c} + {shape.condition_channels}, expected in_channels "
                   f"{model.in_channels} (an I2V model takes condition_latents of {model.in_channels - c} channels)")
    for name, n, p in (("frames", f, pt), ("height", h, ph), ("width", w, pw)):
        if n % p or n < p:
            out.append(f"latent {name} {n}, expected a positive multiple of the patch {name} {p} (crop the video: "
                       "lightning-dcp encode does)")
    if model.rope_max_seq_len is not None and min(pt, ph, pw) >= 1:
        grid = (f // pt, h // ph, w // pw)
        if max(grid) > model.rope_max_seq_len:
            out.append(f"patch grid {grid}, expected every side <= rope_max_seq_len {model.rope_max_seq_len}")
    if shape.text is None:
        out.append(f"no text embeddings, expected [tokens, {model.text_dim}] (an empty prompt's for unconditional samples)")
    else:
        tokens, dim = shape.text
        if dim != model.text_dim:
            out.append(f"text embedding width {dim}, expected the model's text_dim {model.text_dim} (encode the captions "
                       "with this model's own text encoder)")
        if text_len is not None and tokens > text_len:
            out.append(f"{tokens} text tokens, expected at most text_len {text_len}")
    if model.image_dim is not None and shape.image is not None and shape.image[1] != model.image_dim:
        out.append(f"image embedding width {shape.image[1]}, expected the model's image_dim {model.image_dim}")
    return out


def check_video_shapes(shapes: Iterable[tuple[int, VideoShape]], model: ModelInputs, *, text_len: int | None = None,
                       what: str = "the train dataset", labels: Sequence[str] | None = None) -> int:
    """Raise ``ValueError`` naming every bad sample (the first 5, and a count; with its ``labels[index]``, e.g. its
    clip's file) and the expected values; the samples checked."""
    bad, count = [], 0
    for index, shape in shapes:
        count += 1
        problems = _problems(shape, model, text_len)
        if problems:
            label = f"{labels[index]}: " if labels is not None else ""
            bad.append(f"sample {index} ({label}latent {tuple(shape.latent)}, text {shape.text}): "
                       f"{'; '.join(problems)}")
    if bad:
        more = f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(f"{what} does not fit the model ({len(bad)} bad of {count} samples checked):\n  "
                         + "\n  ".join(bad[:5]) + more)
    return count


def sample_video_shape(sample: Mapping[str, Any], patch_size: Sequence[int]) -> VideoShape:
    """The :class:`VideoShape` of a :func:`~lightning_dcp.diffusers.video_sample` dict (latent channels from the
    token width; a width that does not divide by the patch volume gives a fractional channel count, reported as
    ``-1``)."""
    from lightning_dcp.diffusers.samples import CONDITION, GRID, IMAGE, LATENTS, TEXT

    volume = math.prod(int(p) for p in patch_size)
    width = int(sample[LATENTS].shape[-1])
    c = width // volume if width % volume == 0 else -1
    grid = sample.get(GRID) or (0, 0, 0)
    latent = (c, *(int(g) * int(p) for g, p in zip(grid, patch_size)))

    def dims(value: Any) -> tuple[int, int] | None:
        if isinstance(value, (tuple, list)) and len(value) == 1:
            value = value[0]
        return None if value is None else (int(value.shape[-2]), int(value.shape[-1]))

    cond = sample.get(CONDITION)
    cond_c = 0 if cond is None else int(cond.shape[-1]) // volume
    return VideoShape(latent, dims(sample.get(TEXT)), cond_c, dims(sample.get(IMAGE)))


def dataset_video_shapes(dataset: Any, patch_size: Sequence[int], max_samples: int | None) -> tuple[list, str]:
    """``([(index, VideoShape)], how)``: from ``video_shapes`` (all samples) when the dataset (or every part of a
    ``Subset``/``ConcatDataset``) has it, else a first pass over ``max_samples`` samples (``None``: all)."""
    shapes = _indexed_shapes(dataset)
    if shapes is not None:
        return list(enumerate(shapes)), "index"
    from lightning_dcp.diffusers.samples import LATENTS

    n = len(dataset) if max_samples is None else min(len(dataset), max_samples)
    samples = ((i, dataset[i]) for i in range(n))  # samples that are not video_sample dicts are not checked
    return ([(i, sample_video_shape(s, patch_size)) for i, s in samples if isinstance(s, Mapping) and LATENTS in s],
            f"first {n} samples")


def _indexed_shapes(dataset: Any) -> list[VideoShape] | None:
    from torch.utils.data import ConcatDataset, Subset

    own = getattr(dataset, "video_shapes", None)
    if own is not None:
        return list(own)
    if isinstance(dataset, Subset):
        inner = _indexed_shapes(dataset.dataset)
        return None if inner is None else [inner[int(i)] for i in dataset.indices]
    if isinstance(dataset, ConcatDataset):
        parts = [_indexed_shapes(d) for d in dataset.datasets]
        return None if any(p is None for p in parts) else [s for p in parts for s in p]
    return None


def dataset_labels(dataset: Any) -> list[str] | None:
    """Each sample's ``labels`` entry (its clip), through ``Subset`` and ``ConcatDataset``; ``None`` when a part has none."""
    from torch.utils.data import ConcatDataset, Subset

    own = getattr(dataset, "labels", None)
    if own is not None:
        return list(own)
    if isinstance(dataset, Subset):
        inner = dataset_labels(dataset.dataset)
        return None if inner is None else [inner[int(i)] for i in dataset.indices]
    if isinstance(dataset, ConcatDataset):
        parts = [dataset_labels(d) for d in dataset.datasets]
        return None if any(p is None for p in parts) else [s for p in parts for s in p]
    return None


def _train_dataset(trainer: Any) -> Any | None:
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is None or not source.is_defined():
        return None
    loaders = source.dataloader()
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else (
        next(iter(loaders.values())) if isinstance(loaders, dict) else loaders)
    return getattr(loader, "dataset", None)


def check_train_data(trainer: Any, model: Any, max_samples: int | None) -> int:
    """Check the trainer's train dataset against ``model`` (a diffusers video transformer of a supported family; see
    the module docstring); the samples checked (0 when there is no map-style dataset to check)."""
    if max_samples == 0:
        return 0
    dataset = _train_dataset(trainer)
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return 0
    inputs = ModelInputs.of_model(model)
    shapes, how = dataset_video_shapes(dataset, inputs.patch_size, max_samples)
    text_len = getattr(dataset, "text_len", None)
    return check_video_shapes(shapes, inputs, text_len=text_len, labels=dataset_labels(dataset),
                              what=f"the train dataset {type(dataset).__name__} (checked at fit start: {how})")
