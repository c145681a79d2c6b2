"""LoRA under DCP (lightning_dcp.diffusers.lora, VideoDiffusionModule(lora=...)) for the four video families.

* peft's adapter on the diffusers transformer (``add_adapter``): only the adapter weights require
  gradients; the module's optimizer holds only them; a checkpoint holds only them and resumes exactly;
* ``save_lora`` writes the family pipeline's LoRA file: the pipeline's own ``lora_state_dict`` /
  ``load_lora_into_transformer`` (what ``load_lora_weights`` runs) reads it back into a fresh
  transformer, whose forward then equals the trained one's;
* DCPStrategy on 2 and 4 CPU processes, every sharding mode (none, zero1, zero2, fsdp, hsdp), plans mixing SP
  sizes and
  recompute == plain single-process peft training of the same adapter with diffusers' own forward,
  each sample alone: weights and their EMA within 1e-5, the frozen base bit-identical.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

import lightning.pytorch as pl  # noqa: E402
from _video_helpers import PlanRecorder, SGDVideo  # noqa: E402

from lightning_dcp import EMA  # noqa: E402
from lightning_dcp.diffusers import FlowMatching, VideoDiffusionModule, adapt, family_of  # noqa: E402
from lightning_dcp.diffusers.lora import LORA_WEIGHTS_FILE, add_lora, lora_config, lora_state_dict, save_lora  # noqa: E402
from lightning_dcp.diffusers.tiny import TINY_MODELS, tiny_transformer  # noqa: E402

try:
    from _dist import run_distributed
except ImportError:  # tests/ imported as a package
    from tests._dist import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("wan", "ltx", "cog", "hunyuan")
FLOW_SEED = 4
_LR, _STEPS = 0.5, 2


class _SGDLora(SGDVideo):
    """Plain SGD over the trainable parameters (the adapter), as the reference steps them."""

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def _lora(model, rank: int = 4, targets=None):
    """A rank-4 adapter with both factors random (peft's ``init_lora_weights=False``), so one step moves A and B;
    ``targets``: the modules it wraps (default the family's attention projections)."""
    return lora_config(model, rank=rank, alpha=8.0, init_lora_weights=False, target_modules=targets)


#: Each family's patch embedding (a Conv3d, Linear, Conv2d, Conv3d), which its packed forward runs on patch rows.
PATCH_EMBEDDING = {"wan": "patch_embedding", "ltx": "proj_in", "cog": "patch_embed.proj", "hunyuan": "x_embedder.proj"}


def _patch_targets(model, family):
    return [*family_of(model).lora_targets, PATCH_EMBEDDING[family]]


def _wrappable(model):
    """Every module of ``model`` peft's LoRA can wrap (its Linear, Conv and Embedding layers)."""
    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
    return [n for n, m in model.named_modules() if type(m) in kinds]


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


# ----------------------------------------------------------------------------- single process


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_adapter_trains_alone_and_round_trips_through_the_pipeline_loader(tmp_path, name):
    """Only the adapter requires gradients and sits in the optimizer; save_lora writes the pipeline's file, and the
    pipeline's loader puts the same weights into a fresh transformer, whose output then equals the trained one's."""
    model = tiny_transformer(name)
    torch.manual_seed(0)
    module = VideoDiffusionModule(model, lora=_lora(model))
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(_is_adapter(n) for n in trainable), trainable
    assert module.trains_adapter
    opt = module.configure_optimizers()
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in module.parameters() if p.requires_grad}
    with pytest.raises(ValueError, match="has a LoRA adapter already"):
        add_lora(module.model, 4)

    path = save_lora(module.model, tmp_path / "lora")
    assert path.name == LORA_WEIGHTS_FILE and path.is_file()
    pipeline = getattr(diffusers, family_of(model).pipeline)
    state, metadata = pipeline.lora_state_dict(str(tmp_path / "lora"), return_lora_metadata=True)
    assert all(k.startswith("transformer.") for k in state)
    fresh = adapt(tiny_transformer(name))  # the pretrained base again (same seed), adapted like the trained one
    pipeline.load_lora_into_transformer(state, transformer=fresh, metadata=metadata)
    (adapter_name,) = fresh.peft_config
    want = lora_state_dict(module.model)
    from peft.utils import get_peft_model_state_dict

    got = get_peft_model_state_dict(fresh, adapter_name=adapter_name)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert fresh.peft_config[adapter_name].lora_alpha == 8.0  # the metadata carried alpha (!= rank)
    _same_output(module.model, fresh)


def _same_output(a, b):
    """The two transformers' own diffusers forward agree on one random input (fp32, exactly)."""
    config = a.config
    g = torch.Generator().manual_seed(1)
    kind = type(a).__name__
    t = torch.tensor([500.0])
    if kind == "WanTransformer3DModel":
        args = (torch.randn(1, config.in_channels, 1, 4, 4, generator=g), t, torch.randn(1, 3, config.text_dim, generator=g))
    elif kind == "LTXVideoTransformer3DModel":
        args = (torch.randn(1, 4, config.in_channels, generator=g), torch.randn(1, 3, config.caption_channels, generator=g),
                t, torch.ones(1, 3))
        kw = dict(num_frames=1, height=2, width=2)
        with torch.no_grad():
            assert torch.equal(a(*args, **kw).sample, b(*args, **kw).sample)
        return
    elif kind == "CogVideoXTransformer3DModel":
        args = (torch.randn(1, 1, config.in_channels, 4, 4, generator=g),
                torch.randn(1, 3, config.text_embed_dim, generator=g), t)
    else:
        args = (torch.randn(1, config.in_channels, 1, 4, 4, generator=g), t,
                torch.randn(1, 3, config.text_embed_dim, generator=g), torch.ones(1, 3),
                torch.randn(1, config.pooled_projection_dim, generator=g), torch.tensor([6000.0]))
    with torch.no_grad():
        assert torch.equal(a(*args).sample, b(*args).sample)


def test_checkpoint_holds_only_the_adapter_and_resumes_exactly(tmp_path):
    """A LoRA run's checkpoint holds the adapter weights and their optimizer state only; resuming it on a module
    built from the same base continues exactly as the uninterrupted run."""
    from test_diffusers import _Videos, make_wan

    data = _Videos(n=6)  # resumed at an epoch's end: a plain DataLoader does not resume inside an epoch
    loader = torch.utils.data.DataLoader(data, batch_size=3, collate_fn=VideoDiffusionModule.collate)  # 2 steps an epoch

    def module():
        model = make_wan(seed=3)
        torch.manual_seed(7)
        return VideoDiffusionModule(model, lr=1e-2, seed=FLOW_SEED, lora=_lora(model))

    def trainer(steps):
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)

    full = module()
    trainer(3).fit(full, loader)
    first = module()
    t = trainer(2)
    t.fit(first, loader)
    t.save_checkpoint(tmp_path / "lora.ckpt")
    ckpt = torch.load(tmp_path / "lora.ckpt", weights_only=False)
    adapter = {n for n, p in first.named_parameters() if p.requires_grad}
    assert set(ckpt["state_dict"]) == adapter
    assert len(ckpt["optimizer_states"][0]["state"]) == len(adapter)
    resumed = module()
    trainer(3).fit(resumed, loader, ckpt_path=tmp_path / "lora.ckpt")
    want = full.state_dict()
    for n, w in resumed.state_dict().items():
        assert torch.equal(w, want[n]), n


def _adapter_errors(case, module) -> tuple[float, float, dict[str, float]]:
    """(packed loss, diffusers' loss, relative gradient error of every trainable weight) on 4 videos: the module's
    packed forward against diffusers' own forward of a copy, each video alone."""
    ref = copy.deepcopy(module.model)
    want = case.loss(ref, module.flow, [case.item(i) for i in range(4)], "token")
    want.backward()
    loss = module.training_step(VideoDiffusionModule.collate([case.data[i] for i in range(4)]), 0)
    loss.backward()
    ref_params, errors = dict(ref.named_parameters()), {}
    for n, p in module.model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{case.family}: the trainable weight {n} got no gradient"
            r = ref_params[n].grad
            errors[n] = float((p.grad - r).abs().max() / r.abs().max().clamp_min(1e-12))
    return loss.item(), want.item(), errors


@pytest.mark.parametrize("family", FAMILIES)
def test_an_adapter_on_every_wrappable_module_trains_exactly(family):
    """LoRA on every module peft can wrap -- the patch embedding (a Conv3d / Conv2d the packed forward runs as a
    matrix product on patch rows), the timestep and text embedders, the blocks, the output projection -- gives the
    packed forward's loss and every adapter weight's gradient of diffusers' own forward, each video alone."""
    case = _Case(family)
    model = case.make()
    targets = _wrappable(model)
    torch.manual_seed(5)
    module = VideoDiffusionModule(model, seed=FLOW_SEED, lora=_lora(model, rank=2, targets=targets))
    assert {n.split(".lora_")[0] for n, p in module.model.named_parameters() if p.requires_grad} == set(targets)
    loss, want, errors = _adapter_errors(case, module)
    worst = max(errors, key=errors.get)
    patch = max(e for n, e in errors.items() if n.startswith(PATCH_EMBEDDING[family] + "."))
    print(f"{family}: LoRA on {len(targets)} modules; loss {loss:.6f} vs {want:.6f}; worst gradient {worst}: "
          f"{errors[worst]:.2e} relative; the patch embedding's {patch:.2e}")
    assert abs(loss - want) < 1e-5 * max(1.0, abs(want))
    assert errors[worst] < 1e-5, f"{family}: {worst}: relative gradient error {errors[worst]:.2e}"


def test_other_peft_wrappers_of_the_patch_embedding_train_and_target_parameters_are_refused():
    """DoRA and ``modules_to_save`` on Wan's patch embedding train as under diffusers' forward; peft's
    ``target_parameters`` (applied only inside the owning module's own forward) is refused, naming the parameter,
    whether passed to the module or added with ``model.add_adapter`` before."""
    import peft

    case = _Case("wan")
    for extra in (dict(use_dora=True, target_modules=["patch_embedding", "to_q"]),
                  dict(target_modules=["to_q"], modules_to_save=["patch_embedding"])):
        torch.manual_seed(5)
        module = VideoDiffusionModule(case.make(), seed=FLOW_SEED,
                                      lora=peft.LoraConfig(r=2, lora_alpha=4.0, init_lora_weights=False, **extra))
        loss, want, errors = _adapter_errors(case, module)
        assert any(n.startswith("patch_embedding.") for n in errors), sorted(errors)
        assert abs(loss - want) < 1e-5 * max(1.0, abs(want)) and max(errors.values()) < 1e-5, (extra, errors)
    config = dict(r=2, target_modules=["to_q"], target_parameters=["blocks.0.scale_shift_table"])
    with pytest.raises(ValueError, match=r"target_parameters \['blocks.0.scale_shift_table'\] cannot train.*"
                                         r"Target modules instead"):
        VideoDiffusionModule(case.make(), lora=peft.LoraConfig(**config))
    model = case.make()
    model.add_adapter(peft.LoraConfig(**config))
    with pytest.raises(ValueError, match=r"target_parameters \['blocks.0.scale_shift_table'\] cannot train"):
        VideoDiffusionModule(model)


# ----------------------------------------------------------------------------- DCPStrategy vs plain peft


class _Case:
    """One family's dataset, tiny model and single-process diffusers reference (from its own test module)."""

    def __init__(self, family: str):
        self.family = family
        if family == "wan":
            import test_diffusers as m

            self.data, self.make = m._Videos(n=16), lambda: m.make_wan(seed=3)
            self.item = lambda i: (i, self.data[i])
            self.loss = m.reference_loss
        elif family == "ltx":
            import test_diffusers_ltx as m

            self.data, self.make = m._Videos(n=16), lambda: m.make_ltx(seed=3)
            self.item = lambda i: (i, self.data.raw[i], self.data.grids[i])
            self.loss = m.reference_loss
        else:
            import test_diffusers_joint as m

            self.data, self.make = m._Videos(family, n=16), lambda: m.make(family, seed=3)
            self.item = lambda i: (i, self.data[i], self.data.raws[i])
            self.loss = m.reference_loss
        self.max_tokens = 6 if family in ("cog", "hunyuan") else 8


def _fit(world, out_dir, family, sharding, targets=None):
    """One LoRA fit under DCPStrategy; rank 0 replays its plans with plain peft training and compares.
    ``targets="patch"``: the family's attention projections and its patch embedding."""
    from lightning_dcp import DCPStrategy, DefaultCostModel

    case = _Case(family)
    model = case.make()
    torch.manual_seed(5)
    module = _SGDLora(model, lr=_LR, seed=FLOW_SEED,
                      lora=_lora(model, targets=_patch_targets(model, family) if targets == "patch" else None))
    start = copy.deepcopy(module.model)  # the reference starts from the same base and adapter
    if sharding == "hsdp":  # lockstep rounds: SP 2 items (a one-token one: a shard of only padding), uneven counts
        from _dcp_helpers import RandomPlanner

        plan = dict(planner=RandomPlanner(world, seed=2, max_sp=2, force_mix=True), shard_group_size=world)
    else:
        plan = dict(cost_model=DefaultCostModel(num_layers=len(model.dcp_repeated_layers()), num_heads=4,
                                                max_tokens=case.max_tokens))
    strategy = DCPStrategy(global_batch_size=6, seed=1, log_metrics=False, profile=False, sharding=sharding, **plan)
    plans, ema = PlanRecorder(), EMA(decay=0.5)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=_STEPS, callbacks=[plans, ema],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(case.data, batch_size=3, collate_fn=VideoDiffusionModule.collate))
    optimized = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
    names = {id(p): n for n, p in module.named_parameters()}
    assert optimized and all(_is_adapter(names[i]) for i in optimized), "the optimizer holds more than the adapter"
    if sharding in ("none", "zero1"):
        weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    else:  # the weights gathered from every rank's shards (rank 0 holds them)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        weights = {k.removeprefix("model."): v for k, v in full.items()}
    averages = {k.removeprefix("model."): v.clone() for k, v in ema.full_weights().items()}
    assert set(averages) == {n for n, p in module.model.named_parameters() if p.requires_grad}
    gathered, gathered_ema = [None] * world, [None] * world
    dist.all_gather_object(gathered, weights)
    dist.all_gather_object(gathered_ema, averages)
    if dist.get_rank() != 0:
        return
    sizes = sorted({len(it["ranks"]) for p in plans.plans for it in p["items"]})
    assert len(plans.plans) == _STEPS and max(sizes) > 1, f"{family}: the plans never used SP > 1: {plans.plans}"
    if sharding == "hsdp":  # some rank ran a dummy round
        counts = [[sum(r in it["ranks"] for it in p["items"]) for r in range(world)] for p in plans.plans]
        assert any(len(set(c)) > 1 for c in counts), counts
    ref, initial = start, {n: v.clone() for n, v in start.state_dict().items() if _is_adapter(n)}
    flow = FlowMatching(family_of(ref).patch_size(ref.config), seed=FLOW_SEED,
                        target_layout=family_of(ref).output_layout)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=_LR)
    ref_ema = {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    for plan in plans.plans:
        items = [case.item(i) for it in plan["items"] for i in it["samples"]]
        opt.zero_grad(set_to_none=True)
        case.loss(ref, flow, items, "token").backward()
        opt.step()
        for n, p in ref.named_parameters():
            if p.requires_grad:
                ref_ema[n] = 0.5 * ref_ema[n] + 0.5 * p.detach()
    want, base = ref.state_dict(), case.make().state_dict()
    worst = 0.0
    for r, got in enumerate(gathered):
        for n, w in got.items():
            if _is_adapter(n):
                rel = float((w - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12))
                worst = max(worst, rel)
                assert rel < 1e-5, f"{family}: rank {r} adapter weight {n}: relative error {rel:.2e}"
            else:  # the frozen base: untouched, bit for bit
                key = n.replace(".base_layer", "")
                assert torch.equal(w, base[key]), f"{family}: rank {r} frozen weight {n} changed"
    for r, got in enumerate(gathered_ema):  # the EMA of the adapter, on every rank
        for n, w in got.items():
            rel = float((w - ref_ema[n]).abs().max() / ref_ema[n].abs().max().clamp_min(1e-12))
            assert rel < 1e-5, f"{family}: rank {r} EMA of {n}: relative error {rel:.2e}"
    moved = max(float((want[n] - w).abs().max()) for n, w in initial.items())
    assert moved > 1e-3  # training moved the adapter
    if targets == "patch":  # ... the patch embedding's too (its adapter checked against the reference above)
        patch = [n for n in initial if n.startswith(PATCH_EMBEDDING[family] + ".lora_")]
        assert len(patch) == 2 and all(float((want[n] - initial[n]).abs().max()) > 1e-4 for n in patch), patch
    print(f"world {world} {family} LoRA ({sharding}{', patch embedding' if targets else ''}; SP sizes {sizes}): max rel "
          f"adapter err {worst:.2e}", flush=True)
    with open(os.path.join(out_dir, f"{family}-{sharding}.done"), "w") as f:
        f.write(f"{sizes} {worst}")


def _world_worker(rank, world, out_dir, cases):
    for family, sharding, *targets in cases:
        _fit(world, out_dir, family, sharding, *targets)


#: (processes, [(family, sharding[, targets])]) of each variant; "2-more" and "4-all" are slow (tests/conftest.py).
#: On 2 processes every family's adapter also wraps its patch embedding ("patch").
_CASES = {
    "2-replicated-and-hsdp": (2, [("wan", "none", "patch"), ("hunyuan", "zero1", "patch"), ("wan", "hsdp")]),
    "2-more": (2, [("ltx", "zero1", "patch"), ("cog", "none", "patch"), ("cog", "zero2"), ("hunyuan", "fsdp"),
                   ("ltx", "hsdp")]),
    "4-all": (4, [("wan", "fsdp"), ("ltx", "none"), ("cog", "hsdp"), ("hunyuan", "zero2")]),
}


@pytest.mark.parametrize("variant", list(_CASES))
def test_lora_under_dcp_equals_plain_peft_training(tmp_path, variant):
    """Each family's adapter trained by DCPStrategy on 2 or 4 CPU processes, under every sharding mode (the frozen base
    sharded where the mode shards it; dcp plans with SP > 1 and recompute; under hsdp random plans with SP 2 items and
    uneven micro-batch counts) == plain
    single-process peft training with the family's own diffusers forward: adapter weights and their EMA within 1e-5,
    the frozen base unchanged. On 2 processes each family's adapter wraps its patch embedding too."""
    world, cases = _CASES[variant]
    run_distributed(_world_worker, world, str(tmp_path), cases, timeout=900)
    done = sorted(p for p in os.listdir(tmp_path) if p.endswith(".done"))
    assert done == sorted({f"{c[0]}-{c[1]}.done" for c in cases}), done
