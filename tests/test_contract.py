"""The model contract (:mod:`lightning_dcp.sp.contract`): one reading of the user's module that the
FSDP units, the recompute count, the profiler's layer stack and the cost model's ``num_layers`` share.

Each kind of model -- the package's own transformers, a Hugging Face causal LM through
``lightning_dcp.hf``, a diffusers Wan transformer through ``lightning_dcp.diffusers`` and a module with
two stacks chosen by ``layers_attr`` -- is read once, and every reader must see the same layers.
"""

from __future__ import annotations

import types

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_dcp import DCPStrategy, RecomputeLayers
from lightning_dcp.data import SyntheticTokenDataset
from lightning_dcp.models.module import DCPTransformerModule
from lightning_dcp.models.transformer2d import FRAME_LAYOUT
from lightning_dcp.planning.default_cost import DefaultCostModel
from lightning_dcp.planning.profiled import ProfiledCostModel
from lightning_dcp.profiling import DCPProfiler, find_layer_stack, layer_stack, profile_module
from lightning_dcp.runtime.sharding.units import shard_units
from lightning_dcp.sp.context import TOKEN_WEIGHT
from lightning_dcp.sp.contract import AmbiguousLayersError, ModelContract, local_batch, read_model
from lightning_dcp.sp.packing import pack_samples
from lightning_dcp.sp.recompute import LayerRecompute


pytestmark = pytest.mark.usefixtures("one_thread")


def check_readers_agree(module: nn.Module, contract: ModelContract, want: list[nn.Module]) -> None:
    """FSDP units, the recompute count and the profiler's stack are all ``want``, in call order."""
    assert list(contract.layers) == want and contract.num_layers == len(want) > 0
    units = shard_units(module, contract.layers)
    assert {id(u) for u in units} == {id(m) for m in want if any(True for _ in m.parameters())}
    stack = layer_stack(contract)
    assert stack.layers == want and stack.name == contract.layers_source
    assert DefaultCostModel(contract.num_layers).num_layers == len(want)  # what the strategy builds without a profile


# ----------------------------------------------------------------------------- the package's own models

@pytest.mark.parametrize("name", ["tiny-1d", "tiny-2d"])
def test_own_model(name):
    module = DCPTransformerModule(name)
    contract = read_model(module)
    check_readers_agree(module, contract, list(module.model.layers))
    assert contract.recompute is module.model.layers and contract.recompute_layers is module.model.layers
    assert layer_stack(contract).hook_target is module.model.layers  # the RecomputeLayers is hooked and bypassed
    assert contract.support == "sp" and contract.name == "DCPTransformerModule"
    assert contract.num_heads == module.spec.num_heads and contract.hidden_size == module.spec.hidden_size
    assert "model.layers" in contract.layers_source and "RecomputeLayers" in contract.layers_source
    assert contract.prepare_batch is None and contract.loss_units is None
    assert (contract.shard_batch is not None) == (name == "tiny-2d")  # 1-d modules have no hook (AttributeError)


# ----------------------------------------------------------------------------- Hugging Face

def _tiny_causal_lm(layers: int = 3):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_hugging_face_causal_lm():
    from lightning_dcp.hf import CausalLMModule

    module = CausalLMModule(_tiny_causal_lm(layers=3))
    contract = read_model(module)
    decoder_layers = list(module.model.model.layers)
    check_readers_agree(module, contract, decoder_layers)
    assert isinstance(contract.recompute, LayerRecompute) and contract.recompute is module.model.dcp_recompute
    assert contract.recompute_layers is None and layer_stack(contract).hook_target is decoder_layers[0]
    assert contract.layers_source == "CausalLMModule.model.dcp_repeated_layers()"
    assert contract.num_heads == 4 and contract.hidden_size == 32 and contract.support == "sp"
    assert contract.prepare_batch == module.dcp_prepare_batch and contract.shard_batch is None
    assert contract.support_message == module.dcp_support_message


def test_local_batch_prepares_weights_then_shards():
    """One path for the executor and the profiler: the module's prepare hook on the whole item, token
    weights and loss units, then the shard; the divisor counts the item once, on its first SP rank."""
    from lightning_dcp.hf import CausalLMModule
    from lightning_dcp.hf.module import SHIFT_LABELS

    contract = read_model(CausalLMModule(_tiny_causal_lm(layers=1)))
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 61, (n,), generator=g) for n in (5, 9)]
    parts = [local_batch(contract, pack_samples([{"input_ids": i} for i in ids], pad_to_multiple=2), r, 2, "token")
             for r in range(2)]
    assert all(SHIFT_LABELS in p.data and TOKEN_WEIGHT in p.data for p in parts)  # prepared before weights
    assert [p.data["input_ids"].numel() for p in parts] == [7, 7]
    item = parts[0].item_loss_tokens
    assert item == (5 - 1) + (9 - 1)  # next-token targets within each sample
    assert [p.loss_units for p in parts] == [item, 0]
    assert sum(p.local_loss_tokens for p in parts) == item and sum(p.real_tokens for p in parts) == 14
    with pytest.raises(ValueError, match="safe mode"):
        local_batch(read_model(nn.Linear(2, 2)), torch.zeros(2, 2), 0, 1, "token")


# ----------------------------------------------------------------------------- diffusers

def test_diffusers_wan():
    diffusers = pytest.importorskip("diffusers")
    from lightning_dcp.diffusers import VideoDiffusionModule

    torch.manual_seed(0)
    wan = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12,
                                          in_channels=4, out_channels=4, text_dim=8, freq_dim=16, ffn_dim=32,
                                          num_layers=2, cross_attn_norm=True, rope_max_seq_len=32)
    module = VideoDiffusionModule(wan)
    contract = read_model(module)
    check_readers_agree(module, contract, list(module.model.blocks))
    assert contract.recompute is module.model.dcp_recompute and contract.per_sample_cost
    assert contract.num_heads == 4 and contract.prepare_batch == module.dcp_prepare_batch


# ----------------------------------------------------------------------------- two stacks, layers_attr

class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Decoder(nn.Module):
    """Loops over its own blocks and lists them with ``dcp_repeated_layers()``."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))

    def dcp_repeated_layers(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class TwoStackLM(pl.LightningModule):
    """An encoder in a RecomputeLayers (2 blocks) and a decoder listed by dcp_repeated_layers() (3 blocks)."""

    def __init__(self, hidden: int = 16, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder = RecomputeLayers(nn.ModuleList(Block(hidden) for _ in range(2)))
        self.decoder = Decoder(hidden, 3)
        self.head = nn.Linear(hidden, vocab)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = self.decoder(self.encoder(self.embed(batch["input_ids"])))
        return F.cross_entropy(self.head(x), batch["labels"], ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_two_stacks_are_ambiguous_until_one_is_named():
    module = TwoStackLM()
    with pytest.raises(AmbiguousLayersError) as err:
        read_model(module)
    message = str(err.value)
    for part in ("TwoStackLM has 2 different stacks", "'encoder' (2 layers, RecomputeLayers)",
                 "'decoder.dcp_repeated_layers' (3 layers, dcp_repeated_layers())", "DCPStrategy(layers_attr=",
                 "TwoStackLM.dcp_layers_attr = "):
        assert part in message, message
    with pytest.raises(AmbiguousLayersError):
        find_layer_stack(module)  # the profiler reads the same contract

    decoder = list(module.decoder.blocks)
    for attr in ("decoder.blocks", "decoder.dcp_repeated_layers"):
        contract = read_model(module, layers_attr=attr)
        check_readers_agree(module, contract, decoder)
        assert contract.recompute is None and f"layers_attr={attr!r}" in contract.layers_source
    contract = read_model(module, layers_attr="encoder")
    check_readers_agree(module, contract, list(module.encoder))
    assert contract.recompute is module.encoder
    assert read_model(module, layers_attr="encoder.layers").recompute is module.encoder  # the list inside it

    module.dcp_layers_attr = "decoder.blocks"  # the module names its layers itself
    assert list(read_model(module).layers) == decoder and "TwoStackLM.dcp_layers_attr" in read_model(module).layers_source
    assert list(read_model(module, layers_attr="encoder").layers) == list(module.encoder)  # the argument wins


def test_layers_attr_errors_name_the_path_and_the_fix():
    module = TwoStackLM()
    with pytest.raises(ValueError, match=r"layers_attr='decoder.layers': decoder \(Decoder\) has no attribute 'layers'; "
                                         r"layer stacks in TwoStackLM: 'encoder', 'decoder.dcp_repeated_layers'"):
        read_model(module, layers_attr="decoder.layers")
    with pytest.raises(TypeError, match="layers_attr='head' is a Linear; it must name the repeated layers"):
        read_model(module, layers_attr="head")
    with pytest.raises(ValueError, match="layers_attr must be a dotted attribute path"):
        DCPStrategy(layers_attr="decoder..blocks")


def test_one_stack_seen_twice_is_one_stack():
    """Stacks with the same layers, or all inside one RecomputeLayers, are one stack (no ambiguity)."""

    class Listed(nn.Module):  # a RecomputeLayers and a dcp_repeated_layers() listing its layers
        def __init__(self) -> None:
            super().__init__()
            self.layers = RecomputeLayers(nn.ModuleList(Block(4) for _ in range(3)))

        def dcp_repeated_layers(self) -> list[nn.Module]:
            return list(self.layers)

    listed = Listed()
    contract = read_model(listed)
    assert list(contract.layers) == list(listed.layers) and contract.recompute is listed.layers

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sub = RecomputeLayers(nn.ModuleList(Block(4) for _ in range(2)))

    class Nested(nn.Module):  # every outer layer holds a RecomputeLayers of its own
        def __init__(self) -> None:
            super().__init__()
            self.outer = RecomputeLayers(nn.ModuleList(Inner() for _ in range(4)))

    nested = Nested()
    contract = read_model(nested)
    assert list(contract.layers) == list(nested.outer) and contract.recompute is nested.outer
    assert read_model(nn.Linear(2, 2)).layers == () and read_model(nn.Linear(2, 2)).support == "safe"


def test_heads_come_from_dcp_num_heads_first():
    class Attn(nn.Module):
        num_heads = 4

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attn()

    model = Model()
    assert read_model(model).num_heads == 4
    model.dcp_num_heads = 6
    assert read_model(model).num_heads == 6
    model.attn.dcp_num_heads = 2  # the module's own comes before a submodule's
    assert read_model(model).num_heads == 6
    del model.dcp_num_heads
    assert read_model(model).num_heads == 2  # a submodule's dcp_num_heads beats any num_heads
    holder = nn.Linear(2, 2)
    holder.config = types.SimpleNamespace(num_attention_heads=12, hidden_size=96)  # an unadapted HF model
    assert read_model(holder).num_heads == 12 and read_model(holder).hidden_size == 96
    assert read_model(nn.Linear(2, 2)).num_heads is None


# ----------------------------------------------------------------------------- the strategy and the profiler

def test_profiler_layers_attr_must_name_the_strategy_layers():
    module = TwoStackLM()
    strategy = types.SimpleNamespace(model_contract=read_model(module, "decoder.blocks"),
                                     settings=types.SimpleNamespace(layers_attr="decoder.blocks"))
    with pytest.raises(ValueError, match=r"DCPProfiler\(layers_attr='encoder'\) names TwoStackLM.encoder .*2 layers, but "
                                         r"SimpleNamespace\(layers_attr='decoder.blocks'\) recomputes and shards"):
        DCPProfiler(layers_attr="encoder")._contract(strategy, module)
    same = DCPProfiler(layers_attr="decoder.dcp_repeated_layers")._contract(strategy, module)  # other path, same layers
    assert same is strategy.model_contract and DCPProfiler()._contract(strategy, module) is strategy.model_contract


def _fit(strategy: DCPStrategy, module: pl.LightningModule, callbacks=()) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks))
    try:
        trainer.fit(module, DataLoader(SyntheticTokenDataset(num_samples=16), batch_size=2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return trainer


def test_strategy_reads_the_module_once_and_everyone_uses_it(tmp_path, monkeypatch):
    """Under a fit: DCPStrategy(layers_attr=...) picks the stack; its model_contract, the profile's
    num_layers and the measured cost model agree; without a profile the default cost model does; an
    ambiguous module stops the fit at setup with the error naming the stacks."""
    from _dist import find_free_port

    # one in-process rank: its process group must not leave MASTER_PORT taken for later spawned tests
    for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    torch.manual_seed(0)

    module = TwoStackLM()
    strategy = DCPStrategy(global_batch_size=4, log_metrics=False, layers_attr="decoder.blocks")
    assert strategy.model_contract is None
    profiler = DCPProfiler(cache_dir=str(tmp_path), lengths=[16, 48], micro_batch_sizes=[1], time_budget_s=None)
    _fit(strategy, module, [profiler])
    contract = strategy.model_contract
    assert list(contract.layers) == list(module.decoder.blocks) and strategy.num_heads is None
    assert isinstance(strategy.cost_model, ProfiledCostModel) and strategy.cost_model.num_layers == 3
    assert profiler.profile["model"]["num_layers"] == 3 and profiler.profile["meta"]["profiled_layers"] == 3

    strategy = DCPStrategy(global_batch_size=4, log_metrics=False, layers_attr="encoder", profile=False)
    with pytest.warns(UserWarning, match="no cost model"):
        _fit(strategy, module)
    assert isinstance(strategy.cost_model, DefaultCostModel) and strategy.cost_model.num_layers == 2
    assert strategy.model_contract.recompute is module.encoder

    with pytest.raises(AmbiguousLayersError, match="TwoStackLM has 2 different stacks"):
        _fit(DCPStrategy(global_batch_size=4, log_metrics=False, profile=False), TwoStackLM())


def test_profile_module_reads_layers_attr_and_refuses_safe_mode():
    module = TwoStackLM()
    data = SyntheticTokenDataset(lengths=[8, 24, 40])
    profile = profile_module(module, data, layers_attr="encoder", micro_batch_sizes=[1], lengths=[8, 40],
                             time_budget_s=None)
    assert profile["model"]["num_layers"] == 2 and all(p.grad is None for p in module.parameters())
    module.dcp_support = "safe"
    with pytest.raises(ValueError, match="TwoStackLM runs in safe mode"):
        profile_module(module, data, layers_attr="encoder", micro_batch_sizes=[1], lengths=[8])


def test_2d_shard_hook_runs_through_local_batch():
    from lightning_dcp.data import SyntheticVideoDataset

    module = DCPTransformerModule("tiny-2d")
    data = SyntheticVideoDataset(num_samples=4)
    batch = pack_samples([data[i] for i in range(2)], pad_to_multiple=2)
    contract = read_model(module)
    parts = [local_batch(contract, dict(batch), r, 2, "token") for r in range(2)]
    assert all(FRAME_LAYOUT in p.data for p in parts)  # the module's dcp_shard_batch, not the token chunking
