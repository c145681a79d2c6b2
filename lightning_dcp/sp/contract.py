"""The model contract: everything the runtime and the profiler read off the user's module, read once.

:func:`read_model` looks at a module once (the strategy does it at setup) and returns a frozen
:class:`ModelContract`; every other component -- the ``fully_shard`` units, the recompute count and
the default cost model, the SP cap, the support level, the profiler's layer stack and its
``num_layers`` -- reads that contract and never the module's attributes again, so they all see the
same repeated layers.

**Repeated layers**, in this order:

1. ``layers_attr`` (``DCPStrategy(layers_attr=...)``, ``DCPProfiler(layers_attr=...)``) or, without
   it, the module's ``dcp_layers_attr`` attribute: a dotted attribute path from the module to a
   :class:`~lightning_dcp.sp.recompute.RecomputeLayers`, a ``ModuleList`` / ``Sequential`` of the
   layers, or a callable returning them (e.g. ``"model.dcp_repeated_layers"``);
2. else the module's one layer stack: a :class:`~lightning_dcp.sp.recompute.RecomputeLayers`
   anywhere in it, else the list a ``dcp_repeated_layers()`` method returns (on the module or any
   submodule; :func:`lightning_dcp.hf.adapt` and :func:`lightning_dcp.diffusers.adapt` add one).
   Candidates with the same layers are one stack, and so are stacks whose layers all sit inside one
   ``RecomputeLayers`` (e.g. a nested stack, or a ``dcp_repeated_layers()`` listing that
   ``RecomputeLayers``' own layers). Two or more different stacks are an :class:`AmbiguousLayersError`
   naming them and the fix.

**Support level** (``"safe"``, ``"packed"``, ``"sp"``; see :mod:`lightning_dcp.runtime.support`): the
requested one (``DCPStrategy(support=...)``), else the module's ``dcp_support``, else ``"sp"`` when
the module has a layer stack and ``"safe"`` when it has none.

**Attention heads** (SP sizes must divide them): ``dcp_num_heads`` on the module or a submodule
first, then ``num_heads`` on the module, its ``spec``, its ``model.spec`` or a submodule, then a
``config.num_attention_heads`` (Hugging Face); ``hidden_size`` likewise.

**Hooks** (bound callables or ``None``): ``dcp_prepare_batch(batch)``, ``dcp_shard_batch(batch,
sp_rank, sp_size)``, ``dcp_loss_units(batch)``, ``dcp_support_message(level)``.

**Ring attention** (SP sizes past the heads, :mod:`lightning_dcp.sp.ring`): a module at support ``"sp"``
whose batches the package shards (no ``dcp_shard_batch`` hook) can run it, since its attention goes
through :func:`~lightning_dcp.sp.ulysses.ulysses_attention`; the token layout of a ring item's shards is
the module's ``dcp_ring_layout`` (on the module or a submodule): ``"contiguous"`` (the default: the same
shards as Ulysses, which any forward that assumes contiguous shards keeps working with), ``"zigzag"``
(balanced causal work; the shipped causal language models set it) or ``None`` (no ring attention).

:func:`install_contract` is the other side: the one place a model adapter
(:func:`lightning_dcp.hf.adapt`, :func:`lightning_dcp.diffusers.adapt`) writes the ``dcp_*`` attributes
:func:`read_model` reads.

:func:`local_batch` is the one path from a packed micro-batch to what one SP rank trains on (the
module's prepare hook, token weights and loss units, the shard), used by the step executor and the
profiler alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from torch import nn

from lightning_dcp.sp.context import RING_LAYOUTS, SEGMENT_IDS
from lightning_dcp.sp.recompute import LayerRecompute, RecomputeLayers, RepeatedLayers
from lightning_dcp.sp.tokens import add_token_weights, local_loss_tokens, shard_batch

__all__ = ["LAYERS_ATTR", "REPEATED_LAYERS_METHOD", "RING_LAYOUT_ATTR", "SUPPORT_LEVELS", "AmbiguousLayersError",
           "LocalBatch", "ModelContract", "install_contract", "local_batch", "read_model", "ring_refusal"]

SUPPORT_LEVELS = ("safe", "packed", "sp")
"""What a module supports under DCP, each level a superset of the one before (:mod:`lightning_dcp.runtime.support`)."""

#: Name of the method a module may define to expose its repeated layers (in call order).
REPEATED_LAYERS_METHOD = "dcp_repeated_layers"

#: Name of the module attribute that names its repeated layers, like ``layers_attr``.
LAYERS_ATTR = "dcp_layers_attr"

#: Name of the module attribute that chooses the token layout of ring items (``None``: no ring attention).
RING_LAYOUT_ATTR = "dcp_ring_layout"


class AmbiguousLayersError(ValueError):
    """The module has two or more different layer stacks and nothing says which one is *the* repeated layers."""


@dataclass(frozen=True)
class _Stack:
    """One candidate layer stack: its layers, its attribute path (a valid ``layers_attr``), its switch."""

    layers: tuple[nn.Module, ...]
    path: str
    recompute: RecomputeLayers | LayerRecompute | None
    container: nn.Module | None = None  # the RecomputeLayers holding the layers, if any


@dataclass(frozen=True)
class ModelContract:
    """What the runtime and the profiler know about one module (built by :func:`read_model`).

    Attributes:
        name: the module's class name (for messages).
        support: ``"safe"``, ``"packed"`` or ``"sp"``.
        layers: the repeated layers in call order (empty when the module has none).
        layers_source: where they came from, for messages (``"TinyLM.model.layers (RecomputeLayers)"``).
        recompute: the switch that checkpoints the first ``n`` of them: the
            :class:`~lightning_dcp.sp.recompute.RecomputeLayers` holding them, or the
            :class:`~lightning_dcp.sp.recompute.LayerRecompute` an adapter installed
            (``dcp_recompute``); ``None`` when neither.
        num_heads: attention heads (SP sizes must divide them), ``None`` when nothing says.
        hidden_size: the model width, ``None`` when nothing says.
        per_sample_cost: a submodule does work per sample whatever its length (``dcp_cost_per_sample``).
        prepare_batch: the module's ``dcp_prepare_batch(batch)`` or ``None``.
        shard_batch: the module's ``dcp_shard_batch(batch, sp_rank, sp_size)`` or ``None``.
        loss_units: the module's ``dcp_loss_units(batch)`` (safe mode) or ``None``.
        support_message: the module's ``dcp_support_message(level)`` or ``None``.
        ring_layout: the token layout of a ring item's shards (``"contiguous"`` or ``"zigzag"``), ``None``
            when the module cannot run ring attention (see the module docstring).
    """

    name: str
    support: str
    layers: tuple[nn.Module, ...] = ()
    layers_source: str = ""
    recompute: RecomputeLayers | LayerRecompute | None = None
    num_heads: int | None = None
    hidden_size: int | None = None
    per_sample_cost: bool = False
    prepare_batch: Callable[[Any], Any] | None = None
    shard_batch: Callable[[Any, int, int], Any] | None = None
    loss_units: Callable[[Any], int] | None = None
    support_message: Callable[[str], str | None] | None = None
    ring_layout: str | None = None

    @property
    def num_layers(self) -> int:
        """How many repeated layers there are: the recompute ceiling and the cost model's ``num_layers``."""
        return len(self.layers)

    @property
    def recompute_layers(self) -> RecomputeLayers | None:
        """The :class:`~lightning_dcp.sp.recompute.RecomputeLayers` running the layers, if they sit in one."""
        return self.recompute if isinstance(self.recompute, RecomputeLayers) else None


def read_model(module: nn.Module, layers_attr: str | None = None, support: str | None = None) -> ModelContract:
    """Read ``module``'s contract once (see the module docstring for every rule).

    Args:
        module: the LightningModule (or any ``nn.Module``).
        layers_attr: dotted attribute path to the repeated layers; default the module's ``dcp_layers_attr``.
        support: the requested support level (``DCPStrategy(support=...)``); default the module's
            ``dcp_support``, else detected.

    Raises:
        AmbiguousLayersError: two or more different layer stacks and no ``layers_attr``.
        ValueError: an unknown support level, or a ``layers_attr`` that names nothing usable.
    """
    name = type(module).__name__
    candidates = _candidates(module)
    shard_hook = _hook(module, "dcp_shard_batch")
    attr, attr_origin = (layers_attr, "layers_attr") if layers_attr is not None else (
        getattr(module, LAYERS_ATTR, None), f"{name}.{LAYERS_ATTR}")
    if attr is not None:
        stack = _from_attr(module, attr, attr_origin, candidates)
        source = f"{name}.{attr} ({attr_origin}={attr!r})"
    else:
        stack = _single(name, candidates)
        source = _describe(name, stack) if stack is not None else (
            f"none (no RecomputeLayers or {REPEATED_LAYERS_METHOD}() in {name})")
    level = _resolve_support(module, support, has_stack=stack is not None)
    return ModelContract(
        name=name,
        support=level,
        layers=stack.layers if stack is not None else (),
        layers_source=source,
        recompute=stack.recompute if stack is not None else None,
        num_heads=_find_int(module, "dcp_num_heads", "num_heads", "num_attention_heads"),
        hidden_size=_find_int(module, None, "hidden_size", "hidden_size"),
        per_sample_cost=any(getattr(m, "dcp_cost_per_sample", False) is True for m in module.modules()),
        prepare_batch=_hook(module, "dcp_prepare_batch"),
        shard_batch=shard_hook,
        loss_units=_hook(module, "dcp_loss_units"),
        support_message=_hook(module, "dcp_support_message"),
        ring_layout=_ring_layout(module, level, shard_hook is not None),
    )


def install_contract(model: nn.Module, *stacks: nn.ModuleList, num_heads: int, per_sample_cost: bool | None = None,
                     recompute_override: int | None = None,
                     make_switch: Callable[[int | None], LayerRecompute] | None = None) -> LayerRecompute:
    """Write on ``model`` (in place) the attributes :func:`read_model` reads, for a model whose own forward loops
    over ``stacks`` (one or more ``ModuleList`` s of its repeated layers, in call order):

    * ``dcp_recompute``: the :class:`~lightning_dcp.sp.recompute.LayerRecompute` switch of those layers, made by
      ``make_switch(recompute_override)`` (default a plain ``LayerRecompute``). One already there for as many
      layers is kept and only its ``recompute_override`` updated, so adapting twice is a no-op;
    * ``dcp_num_heads`` (SP sizes must divide it);
    * ``dcp_repeated_layers``: a :class:`~lightning_dcp.sp.recompute.RepeatedLayers` over ``stacks``;
    * ``dcp_cost_per_sample`` when given (every sample costs a term whatever its length, e.g. its text's
      cross-attention projections).

    Returns:
        The switch now on the model.
    """
    count = sum(len(stack) for stack in stacks)
    switch = getattr(model, "dcp_recompute", None)
    if isinstance(switch, LayerRecompute) and len(switch) == count:
        switch.recompute_override = recompute_override
    elif make_switch is not None:
        switch = make_switch(recompute_override)
    else:
        switch = LayerRecompute(count, recompute_override=recompute_override)
    model.dcp_recompute = switch
    model.dcp_num_heads = int(num_heads)
    model.dcp_repeated_layers = RepeatedLayers(*stacks)
    if per_sample_cost is not None:
        model.dcp_cost_per_sample = bool(per_sample_cost)
    return switch


def _ring_layout(module: nn.Module, level: str, own_sharding: bool) -> str | None:
    """The module's ring token layout (see the module docstring): its ``dcp_ring_layout`` on the module or a
    submodule, else ``"contiguous"``; ``None`` below support ``"sp"`` or with its own ``dcp_shard_batch``."""
    if level != "sp" or own_sharding:
        return None
    for m in module.modules():
        if hasattr(m, RING_LAYOUT_ATTR):
            value = getattr(m, RING_LAYOUT_ATTR)
            if value is not None and value not in RING_LAYOUTS:
                raise ValueError(f"{type(m).__name__}.{RING_LAYOUT_ATTR} is {value!r}; use one of {RING_LAYOUTS} or None "
                                 "(no ring attention)")
            return value
    return "contiguous"


# ---------------------------------------------------------------------------------------------- layers

def _as_layers(value: Any, where: str) -> tuple[nn.Module, ...]:
    layers = tuple(value)
    bad = sorted({type(m).__name__ for m in layers if not isinstance(m, nn.Module)})
    if bad:
        raise TypeError(f"{where} gave non-modules {bad}; it must give the repeated layers (nn.Module) in call order")
    return layers


def _candidates(module: nn.Module) -> list[_Stack]:
    """Every RecomputeLayers, then every ``dcp_repeated_layers()`` list, in ``named_modules()`` order."""
    found = [_Stack(tuple(m), name, m, container=m) for name, m in module.named_modules() if isinstance(m, RecomputeLayers)]
    for name, holder in module.named_modules():
        method = getattr(holder, REPEATED_LAYERS_METHOD, None)
        if callable(method):
            path = f"{name}.{REPEATED_LAYERS_METHOD}" if name else REPEATED_LAYERS_METHOD
            switch = getattr(holder, "dcp_recompute", None)
            found.append(_Stack(_as_layers(method(), f"{type(module).__name__}.{path}()"), path,
                                switch if isinstance(switch, LayerRecompute) else None))
    return found


def _distinct(candidates: list[_Stack]) -> list[_Stack]:
    """The candidates that are different stacks: the first of those with the same layers, none whose
    layers all sit inside another candidate's RecomputeLayers."""
    unique: list[_Stack] = []
    seen: set[frozenset[int]] = set()
    for stack in candidates:
        key = frozenset(id(m) for m in stack.layers)
        if key not in seen:
            seen.add(key)
            unique.append(stack)
    inside = {id(s.container): {id(m) for m in s.container.modules() if m is not s.container}
              for s in unique if s.container is not None}

    def subsumed(stack: _Stack) -> bool:
        return any(other is not stack and other.container is not None and stack.layers
                   and all(id(m) in inside[id(other.container)] for m in stack.layers) for other in unique)

    return [s for s in unique if not subsumed(s)]


def _single(name: str, candidates: list[_Stack]) -> _Stack | None:
    distinct = _distinct(candidates)
    if len(distinct) <= 1:
        return distinct[0] if distinct else None
    listed = "; ".join(f"{s.path!r} ({len(s.layers)} layers, {_kind(s)})" for s in distinct)
    raise AmbiguousLayersError(
        f"{name} has {len(distinct)} different stacks of repeated layers: {listed}. DCP recomputes, shards and "
        f"profiles one stack; name it with DCPStrategy(layers_attr={distinct[0].path!r}) (and the same "
        f"DCPProfiler(layers_attr=...) if you add one), or set {name}.{LAYERS_ATTR} = {distinct[0].path!r}")


def _kind(stack: _Stack) -> str:
    return "RecomputeLayers" if stack.container is not None else f"{REPEATED_LAYERS_METHOD}()"


def _describe(name: str, stack: _Stack) -> str:
    return f"{name}.{stack.path}" + (" (RecomputeLayers)" if stack.container is not None else "()")


def _from_attr(module: nn.Module, attr: Any, origin: str, candidates: list[_Stack]) -> _Stack:
    """The stack ``attr`` (a dotted attribute path from ``module``) names."""
    name = type(module).__name__
    if not isinstance(attr, str) or not attr or any(not part for part in attr.split(".")):
        raise ValueError(f"{origin}={attr!r} must be a dotted attribute path from {name} to its repeated layers, "
                         "e.g. 'model.layers'")
    target: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(target, part):
            where = ".".join(attr.split(".")[:i]) or name
            known = ", ".join(repr(s.path) for s in _distinct(candidates)) or "none found"
            raise ValueError(f"{origin}={attr!r}: {where} ({type(target).__name__}) has no attribute {part!r}; layer "
                             f"stacks in {name}: {known}")
        target = getattr(target, part)
    if isinstance(target, RecomputeLayers):
        return _Stack(tuple(target), attr, target, container=target)
    if isinstance(target, (nn.ModuleList, nn.Sequential)):
        layers = _as_layers(target, f"{origin}={attr!r}")
    elif callable(target) and not isinstance(target, nn.Module):
        layers = _as_layers(target(), f"{origin}={attr!r} (called)")
    else:
        raise TypeError(f"{origin}={attr!r} is a {type(target).__name__}; it must name the repeated layers: a "
                        "RecomputeLayers, a ModuleList or Sequential of the layers, or a callable returning them")
    same = [s for s in candidates if s.layers == layers]
    return _Stack(layers, attr, same[0].recompute if same else None, container=same[0].container if same else None)


# ---------------------------------------------------------------------------------------------- the rest

def _resolve_support(module: nn.Module, requested: str | None, has_stack: bool) -> str:
    level = requested if requested is not None else getattr(module, "dcp_support", None)
    if level is None:
        level = "sp" if has_stack else "safe"
    if level not in SUPPORT_LEVELS:
        source = "DCPStrategy(support=...)" if requested is not None else f"{type(module).__name__}.dcp_support"
        raise ValueError(f"{source} is {level!r}; use one of {SUPPORT_LEVELS}")
    return level


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _find_int(module: nn.Module, preferred: str | None, name: str, config_name: str) -> int | None:
    """The first positive int: ``preferred`` on the module or any submodule, then ``name`` on the module,
    its ``spec``, its ``model.spec`` or any submodule, then ``config.<config_name>`` on any of them."""
    subs = [m for m in module.modules() if m is not module]
    spec = getattr(module, "spec", None)
    model_spec = getattr(getattr(module, "model", None), "spec", None)
    searches: list[tuple[str, Iterable[Any]]] = [(preferred, [module, *subs])] if preferred else []
    searches.append((name, [module, spec, model_spec, *subs]))
    searches.append((config_name, [getattr(m, "config", None) for m in (module, *subs)]))
    for attr, holders in searches:
        for holder in holders:
            value = _positive_int(getattr(holder, attr, None)) if holder is not None else None
            if value is not None:
                return value
    return None


def _hook(module: nn.Module, name: str) -> Callable[..., Any] | None:
    value = getattr(module, name, None)  # a property raising AttributeError reads as absent
    return value if callable(value) else None


# ---------------------------------------------------------------------------------------------- local batch

@dataclass(frozen=True)
class LocalBatch:
    """One SP rank's part of one work item, with the counts the step needs (counted on the host).

    Attributes:
        data: what ``training_step`` gets on this rank.
        loss_units: this rank's share of the step's loss divisor: the item's loss units on its first
            SP rank, 0 on the others (so each item counts once, whatever its SP size).
        item_loss_tokens: loss tokens of the whole item (re-weights a plain mean in sample mode).
        local_loss_tokens: loss tokens in ``data`` (a plain mean is multiplied by it).
        real_tokens: tokens of ``data`` that are not padding.
    """

    data: Any
    loss_units: int
    item_loss_tokens: int
    local_loss_tokens: int
    real_tokens: int


def local_batch(contract: ModelContract, batch: Any, sp_rank: int, sp: int, reduction: str,
                lengths: Sequence[int] | None = None, ring: int = 1) -> LocalBatch:
    """This SP rank's part of the micro-batch ``batch`` and its counts (see :class:`LocalBatch`).

    A packed batch (support ``"packed"`` / ``"sp"``): the module's ``dcp_prepare_batch`` first (e.g.
    the per-sample label shift), then the token weights and loss units
    (:func:`~lightning_dcp.sp.tokens.add_token_weights`), then this rank's shard (the module's
    ``dcp_shard_batch``, else :func:`~lightning_dcp.sp.tokens.shard_batch`). Safe mode: the batch as
    the user's ``collate_fn`` built it; its loss units are ``dcp_loss_units(batch)``, else in token mode
    the ``labels`` entries other than -100 of a mapping with integer ``labels``, else its samples.

    Args:
        lengths: the item's sample lengths (needed in safe mode: its samples and real tokens).
        ring: the item's ring degree: ``> 1`` shards by the module's :attr:`ModelContract.ring_layout`.

    Raises:
        ValueError: safe mode without ``lengths`` or with an SP size above 1; a ring item for a module
            without ring attention.
    """
    if contract.support == "safe":
        if lengths is None or sp != 1:
            raise ValueError(f"{contract.name} runs in safe mode: a micro-batch needs its sample lengths and SP size 1 "
                             f"(got lengths={lengths!r}, sp={sp})")
        units = _safe_loss_units(contract, batch, len(lengths), reduction)
        return LocalBatch(batch, units, units, units, int(sum(lengths)))
    if contract.prepare_batch is not None:
        batch = contract.prepare_batch(batch)
    units = add_token_weights(batch, reduction)
    item_tokens = units if reduction == "token" else local_loss_tokens(batch)  # token mode: the same count
    if ring > 1:
        if contract.ring_layout is None:
            raise ValueError(ring_refusal(contract, sp, ring))
        local = shard_batch(batch, sp_rank, sp, ring, contract.ring_layout)
    elif contract.shard_batch is not None:
        local = contract.shard_batch(batch, sp_rank, sp)
    else:
        local = shard_batch(batch, sp_rank, sp)
    real = int((local[SEGMENT_IDS] >= 0).sum()) if SEGMENT_IDS in local else local_loss_tokens(local)
    return LocalBatch(local, units if sp_rank == 0 else 0, item_tokens, local_loss_tokens(local), real)


def ring_refusal(contract: ModelContract, sp: int, ring: int) -> str:
    """Why ``contract``'s module cannot run an item of ``sp`` ranks as ring ``ring`` (for errors), and the fix."""
    why = (f"it runs at support level {contract.support!r}" if contract.support != "sp" else
           "it shards its own batches (dcp_shard_batch)" if contract.shard_batch is not None else
           f"it sets {RING_LAYOUT_ATTR} = None")
    heads = f" dividing its {contract.num_heads} attention heads" if contract.num_heads else ""
    return (f"an item of SP {sp} with ring degree {ring} needs ring attention, which {contract.name} cannot run: {why}. "
            f"Plan SP sizes{heads} only (DCPStrategy(max_sp_size=...), a planner without ring items)")


def _safe_loss_units(contract: ModelContract, batch: Any, num_samples: int, reduction: str) -> int:
    if contract.loss_units is not None:
        return int(contract.loss_units(batch))
    if reduction == "token" and isinstance(batch, Mapping):
        labels = batch.get("labels")
        if labels is not None and hasattr(labels, "is_floating_point") and not labels.is_floating_point():
            return int((labels != -100).sum())
    return int(num_samples)
