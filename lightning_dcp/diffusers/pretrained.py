"""A diffusers video transformer by name, for the command line: :func:`load_transformer`, :func:`hub_problem`.

A name is a tiny offline model (``tiny-wan``, ...; :mod:`lightning_dcp.diffusers.tiny`), a local
folder (a pipeline folder with ``transformer/``, or the transformer's own folder), or a Hugging Face
Hub id. A name that cannot be read is one :class:`PretrainedError` naming it and the cause --
unreachable Hub, unknown or gated repository, not an id -- found with one quick request instead of
``from_pretrained``'s retries and traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["PretrainedError", "hub_problem", "load_transformer"]


class PretrainedError(ValueError):
    """A model name that cannot be loaded: what, from where, why and what to do."""


def hub_problem(repo: str, subfolder: str | None = None) -> str | None:
    """Why ``repo`` (not a local folder, not in the local cache) cannot be read from the Hugging Face Hub, in one
    quick request; ``None`` when it can, or when the cache or offline mode (``HF_HUB_OFFLINE=1``) decide."""
    if Path(repo).exists():
        return None
    import huggingface_hub as hub
    from huggingface_hub import constants, errors

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        if hub.try_to_load_from_cache(repo, f"{subfolder}/config.json" if subfolder else "config.json") is not None:
            return None
        hub.HfApi().model_info(repo, timeout=10)
    except errors.HFValidationError:
        return f"{repo!r} is neither a local folder nor a Hugging Face Hub id (owner/name)"
    except errors.RepositoryNotFoundError:
        return (f"the Hugging Face Hub has no model {repo!r} (or it is private or gated: `huggingface-cli login`); "
                "check the id, or pass a local folder")
    except Exception as err:  # noqa: BLE001 - httpx / requests / OS network errors
        return (f"{repo!r} is not a local folder, and the Hugging Face Hub cannot be reached ({type(err).__name__}: "
                f"{err}); check the network or pass a local pipeline folder")
    return None


def _subfolder(path: str) -> str | None:
    """``"transformer"`` for a pipeline (folder or Hub id with ``model_index.json``), ``None`` for a model folder."""
    local = Path(path)
    if local.is_dir():
        return "transformer" if (local / "transformer").is_dir() else None
    return "transformer"


def load_transformer(name: str, *, torch_dtype: Any = None, tiny_seed: int = 0) -> Any:
    """The diffusers transformer ``name`` names: a tiny model's (random weights), or ``from_pretrained`` of a folder
    or Hub id (its ``transformer/`` subfolder when it is a pipeline), in ``torch_dtype`` (default float32).

    Raises:
        PretrainedError: the name cannot be loaded, saying why and what to try.
    """
    import torch

    from lightning_dcp.diffusers.tiny import TINY_MODELS, is_tiny, tiny_transformer

    if is_tiny(name):
        return tiny_transformer(name, seed=tiny_seed)
    sub = _subfolder(name)
    problem = hub_problem(name, sub)
    offline = f"to try it offline use a tiny model: {', '.join(TINY_MODELS)}"
    if problem:
        raise PretrainedError(f"cannot load the transformer: {problem}; {offline}")
    import diffusers

    kw = {"subfolder": sub} if sub else {}
    try:
        config = diffusers.ModelMixin.load_config(name, **kw)
        cls = getattr(diffusers, str(config.get("_class_name")), None)
        if cls is None:
            raise ValueError(f"its config names class {config.get('_class_name')!r}, not a diffusers model")
        return cls.from_pretrained(name, torch_dtype=torch_dtype or torch.float32, **kw)
    except Exception as err:  # noqa: BLE001 - diffusers / huggingface_hub raise many types
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        where = f"{name!r}" + (f" (subfolder {sub}/)" if sub else "")
        raise PretrainedError(f"cannot load the transformer from {where}: {type(err).__name__}: {first}; {offline}") \
            from None
