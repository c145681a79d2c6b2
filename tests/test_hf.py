"""Hugging Face path: lightning_dcp.hf.adapt and CausalLMModule against plain transformers.

* packed micro-batches through an adapted model equal each sample alone through the unadapted
  one, for every tested family (Llama with GQA, Qwen2 with MQA, Qwen3, Mistral, Gemma, Gemma 2
  with attention and final logit soft-capping, Phi-3's fused qkv, GPT-NeoX's partial rotary,
  OLMo, OLMo 2): no cross-sample attention, positions restart;
* the per-layer recompute switch checkpoints exactly the first ``k`` decoder layers, same grads;
* SP 2 and SP 4 (spawned gloo processes) equal the single-process forward and backward,
  GQA/MQA with fewer key/value heads than SP ranks included, every family at SP 2;
* CausalLMModule under DCPStrategy (2 and 4 CPU processes, SP > 1, recompute) ends with the weights
  of plain single-process transformers training, every family in one 2-process run; its logged
  ``train/loss`` is each step's global-batch loss;
* label shifting inside samples, the plain-Trainer path, the support-level line, and the errors
  for unsupported models and misnamed sample keys.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from lightning_dcp.sp.context import CU_SEQLENS, LOSS_MASK, MAX_SEQLEN, POSITION_IDS, SPContext, sp_context  # noqa: E402
from lightning_dcp.hf import (  # noqa: E402
    SHIFT_LABELS,
    TESTED_MODEL_TYPES,
    CausalLMModule,
    adapt,
    causal_lm_logits,
    prepare_causal_lm_batch,
)
from lightning_dcp.hf.attention import kv_repeat_before_all_to_all  # noqa: E402
from lightning_dcp.sp.packing import pack_samples  # noqa: E402
from lightning_dcp.sp.tokens import shard_batch  # noqa: E402

try:
    from _dist import run_distributed
except ImportError:  # tests/ imported as a package
    from tests._dist import run_distributed

VOCAB = 61
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "gpt_neox", "olmo", "olmo2"]
#: key/value heads per family for 4 query heads: GQA, MQA (1 < SP 2), and MHA where the family has no GQA
KV_HEADS = {"llama": 2, "qwen2": 1, "qwen3": 2, "mistral": 2, "gemma": 1, "gemma2": 2, "phi3": 2, "gpt_neox": 4,
            "olmo": 4, "olmo2": 2}
#: what makes a family differ from Llama, set so that it matters in these tiny models
_FAMILY_CONFIG = {
    # soft-capping that bites: scores of the 0.3-initialised weights reach several times the caps
    "gemma2": dict(attn_logit_softcapping=1.0, final_logit_softcapping=3.0, query_pre_attn_scalar=16,
                   sliding_window=64, initializer_range=0.3),
    "gemma": dict(tie_word_embeddings=True),
    "phi3": dict(pad_token_id=0),  # its default pad id 32000 is outside the tiny vocabulary
    "gpt_neox": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "olmo": dict(clip_qkv=0.5),
}


def make_model(family: str = "llama", heads: int = 4, kv_heads: int | None = None, layers: int = 3, seed: int = 0):
    """A tiny random-config causal LM of ``family`` (a ``config.model_type``; fp32, no download)."""
    kv_heads = KV_HEADS[family] if kv_heads is None else kv_heads
    kw = dict(vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=40, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=256,
              tie_word_embeddings=False)
    kw.update(_FAMILY_CONFIG.get(family, {}))
    try:
        config = transformers.AutoConfig.for_model(family, **kw)
    except ValueError:
        pytest.skip(f"transformers {transformers.__version__} has no {family!r} model type")
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def make_samples(lengths, seed: int = 1, labels: bool = False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        s = {"input_ids": torch.randint(0, VOCAB, (n,), generator=g)}
        if labels:
            lab = s["input_ids"].clone()
            lab[: n // 3] = -100  # a masked "prompt"
            s["labels"] = lab
        out.append(s)
    return out


def packed_logits(model, batch, with_boundaries: bool = True):
    """Logits [tokens, vocab] of the adapted ``model`` on a packed (possibly sharded) batch."""
    kw = {}
    if with_boundaries:
        kw = dict(cu_seq_lens_q=batch[CU_SEQLENS], max_length_q=int(batch[MAX_SEQLEN]))
    return model(input_ids=batch["input_ids"][None], position_ids=batch[POSITION_IDS][None], use_cache=False,
                 **kw).logits[0]


# ----------------------------------------------------------------------------- single process

def test_every_tested_family_is_tested_here():
    assert sorted(FAMILIES) == sorted(TESTED_MODEL_TYPES)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_per_sample(family):
    """Several samples packed (plus padding) through the adapted model == each alone through plain transformers."""
    heads = 4
    ref = make_model(family, heads).eval()
    model = adapt(copy.deepcopy(ref)).eval()
    assert model.config._attn_implementation == "lightning_dcp" and ref.config._attn_implementation != "lightning_dcp"
    assert model.dcp_num_heads == heads and len(model.dcp_repeated_layers()) == 3
    assert model.state_dict().keys() == ref.state_dict().keys()
    lengths = [7, 1, 12, 4, 9]
    samples = make_samples(lengths)
    batch = pack_samples(samples, pad_to_multiple=8)  # 33 -> 40: a padding segment too
    with torch.no_grad():
        want = torch.cat([ref(input_ids=s["input_ids"][None]).logits[0] for s in samples])
        for with_boundaries in (True, False):
            got = packed_logits(model, batch, with_boundaries)[: sum(lengths)]
            err = (got - want).abs().max().item()
            print(f"{family} packed vs per-sample (boundaries={with_boundaries}): max abs err {err:.2e}")
            assert err < 1e-5, err
        # the boundaries really reach the attention function: one segment over everything differs
        whole = dict(batch, **{CU_SEQLENS: torch.tensor([0, 40], dtype=torch.int32), MAX_SEQLEN: 40})
        assert (packed_logits(model, whole)[: sum(lengths)] - want).abs().max() > 1e-3
        # CausalLMModule's own logits (fp32 head, final soft-capping) are the model's
        got = causal_lm_logits(model, prepare_causal_lm_batch(batch))[: sum(lengths)]
        assert (got - want).abs().max() < 1e-5
        if family == "gemma2":  # the soft-capping is applied, not skipped: without it the logits differ
            for layer in model.dcp_repeated_layers():
                layer.self_attn.attn_logit_softcapping = None
            assert (packed_logits(model, batch)[: sum(lengths)] - want).abs().max() > 1e-2


def test_repeated_layers_in_call_order_and_pickle():
    """dcp_repeated_layers() lists the decoder layers in call order; the adapted model pickles and deep-copies
    with its recompute switch shared by all layers (spawned processes receive it pickled)."""
    import pickle

    model = adapt(make_model("llama", 4, 2, layers=4)).train()
    order = []
    layers = model.dcp_repeated_layers()
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: order.append(i)) for i, layer in enumerate(layers)]
    batch = pack_samples(make_samples([4, 6]))
    want = packed_logits(model, batch).detach()
    assert order == [0, 1, 2, 3]
    for h in handles:
        h.remove()
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert all(layer._gradient_checkpointing_func.switch is clone.dcp_recompute for layer in clone.dcp_repeated_layers())
        assert clone.dcp_repeated_layers()[0] is clone.model.layers[0]
        clone.dcp_recompute.recompute_override = 2
        torch.testing.assert_close(packed_logits(clone, batch), want, atol=0, rtol=0)
    assert model.dcp_recompute.recompute_override is None


def test_kv_repeat_factor():
    assert kv_repeat_before_all_to_all(8, 8, 4) == 1
    assert kv_repeat_before_all_to_all(8, 2, 4) == 2
    assert kv_repeat_before_all_to_all(8, 1, 4) == 4
    assert kv_repeat_before_all_to_all(16, 4, 8) == 2  # 4 kv heads x 2 = 8
    assert kv_repeat_before_all_to_all(24, 6, 4) == 2  # 6 x 2 = 12
    assert kv_repeat_before_all_to_all(8, 4, 2) == 1
    with pytest.raises(ValueError, match="not divisible by the SP size 4"):
        kv_repeat_before_all_to_all(6, 2, 4)


def _attn_call_counts(model):
    counts = [0] * len(model.dcp_repeated_layers())
    for i, layer in enumerate(model.dcp_repeated_layers()):
        layer.self_attn.register_forward_hook(lambda *a, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


@pytest.mark.parametrize("source", ["context", "override"])
def test_recompute_switch_first_k_layers(source):
    """recompute = k: exactly layers 0..k-1 run their attention twice (forward + recompute); same grads."""
    model = adapt(make_model("llama", 4, 2, layers=4)).train()
    batch = pack_samples(make_samples([6, 9, 3]))
    gout = torch.randn(batch[POSITION_IDS].shape[0], VOCAB, generator=torch.Generator().manual_seed(5))
    results = {}
    for k in (0, 1, 3, 4, 9):
        counts = _attn_call_counts(model)
        model.zero_grad(set_to_none=True)
        ctx = SPContext(recompute=k if source == "context" else 0)
        model.dcp_recompute.recompute_override = k if source == "override" else None
        with sp_context(ctx):
            logits = packed_logits(model, batch)
        (logits * gout).sum().backward()  # outside the context, as the strategy's backward may be
        expected = [2 if i < k else 1 for i in range(4)]
        assert counts == expected, (k, counts)
        results[k] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        for layer in model.dcp_repeated_layers():
            layer.self_attn._forward_hooks.clear()
    model.dcp_recompute.recompute_override = None
    base_logits, base_grads = results[0]
    for k, (logits, grads) in results.items():
        assert torch.equal(logits, base_logits)
        for n, g in grads.items():
            torch.testing.assert_close(g, base_grads[n], atol=1e-6, rtol=1e-5, msg=lambda m: f"k={k} {n}: {m}")
    with torch.no_grad(), sp_context(SPContext(recompute=4)):  # no grad: nothing is checkpointed
        counts = _attn_call_counts(model)
        packed_logits(model, batch)
        assert counts == [1, 1, 1, 1]


class _NoInterfaceLlama(transformers.LlamaForCausalLM):
    _supports_attention_backend = False


def test_unsupported_models_raise():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="no decoder layer list found in GPT2LMHeadModel"):
        adapt(gpt2)
    with pytest.raises(ValueError, match="no decoder layer list found"):
        adapt(torch.nn.Linear(2, 2))
    model = _NoInterfaceLlama(make_model("llama").config)
    with pytest.raises(ValueError, match="attention interface"):
        adapt(model)
    dropout = make_model("llama")
    dropout.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        adapt(dropout)


def test_support_line_says_what_runs():
    """The line DCPStrategy prints at fit start for CausalLMModule (strategy: module.dcp_support_message(level))."""
    sp = CausalLMModule(make_model("qwen2")).dcp_support_message("sp")
    assert sp.startswith("DCPStrategy: CausalLMModule trains Qwen2ForCausalLM (model_type 'qwen2', a tested family) "
                         "at support level 'sp': packed micro-batches") and "\n" not in sp
    assert "dividing its 4 attention heads (1 key/value heads)" in sp and "recompute of its 3 decoder layers" in sp
    packed = CausalLMModule(make_model("gemma2")).dcp_support_message("packed")
    assert "SP size 1 (support='packed')" in packed and "Ulysses" not in packed
    assert "attention logit soft-capping 1.0, final logit soft-capping 3.0" in packed
    assert "sliding window (64 tokens) are refused" in packed
    assert CausalLMModule(make_model("llama")).dcp_support_message("safe") is None  # the strategy's own line

    class _Untested(transformers.LlamaForCausalLM):
        pass

    model = _Untested(make_model("llama").config)
    model.config.model_type = "my-llama"
    assert "NOT among the tested families" in CausalLMModule(model).dcp_support_message("sp")


@pytest.mark.parametrize("where", ["collate", "dcp", "padded"])
def test_misnamed_token_key_names_the_rename(where):
    """Samples with 'tokens' instead of 'input_ids': the error names the key and the rename, wherever it shows."""
    samples = [{"tokens": s["input_ids"]} for s in make_samples([5, 3])]
    module = CausalLMModule(make_model("llama"))
    with pytest.raises(KeyError, match=r"samples have the keys \['tokens'\].*return \{'input_ids': sample\['tokens'\]\}"
                                       r".*rename_column\('tokens', 'input_ids'\)"):
        if where == "collate":
            CausalLMModule.collate(samples)
        elif where == "dcp":  # DCPStrategy packs (adding its own keys), then calls dcp_prepare_batch
            module.dcp_prepare_batch(pack_samples(samples, sample_indices=[0, 1]))
        else:
            module.training_step({"tokens": torch.zeros(2, 4, dtype=torch.long)}, 0)
    with pytest.raises(KeyError, match="pack the samples first"):
        prepare_causal_lm_batch({"input_ids": torch.zeros(4, dtype=torch.long)})


def test_unsupported_head_is_refused_at_once():
    model = make_model("llama")
    model.config.logit_scale = 0.5
    with pytest.raises(ValueError, match=r"config.logit_scale=0.5.*override forward"):
        CausalLMModule(model)


def test_sliding_window_longer_than_window_raises():
    model = make_model("mistral")
    model.config.sliding_window = 8
    adapt(model)
    with pytest.raises(ValueError, match="sliding_window=8"):
        packed_logits(model, pack_samples(make_samples([12, 3])))
    packed_logits(model, pack_samples(make_samples([8, 3])))  # within the window: fine


def test_prepare_shifts_inside_samples():
    samples = make_samples([5, 1, 4], labels=True)  # prompt masks: 1, 0, 1 tokens
    batch = prepare_causal_lm_batch(pack_samples(samples, pad_to_multiple=4))  # 10 -> 12
    want = []
    for s in samples:
        want += s["labels"][1:].tolist() + [-100]
    want += [-100, -100]
    assert batch[SHIFT_LABELS].tolist() == want and "labels" not in batch
    assert batch[LOSS_MASK].tolist() == [w != -100 for w in want]
    # the token before the first answer token predicts it: masked prompt of sample 0 is position 0 only
    assert batch[LOSS_MASK][0].item() is True
    assert prepare_causal_lm_batch(batch)[SHIFT_LABELS].tolist() == want  # idempotent
    nolabels = prepare_causal_lm_batch(pack_samples(make_samples([3, 2])))
    ids = nolabels["input_ids"].tolist()
    assert nolabels[SHIFT_LABELS].tolist() == [ids[1], ids[2], -100, ids[4], -100]


def test_untested_family_whose_head_transforms_logits_is_refused_at_once():
    """Granite scales its logits (config.logits_scaling): a family outside the tested list is checked at
    construction -- a packed batch must give each sample's own logits -- never trained 8x off."""
    import transformers

    def granite(scaling: float):
        torch.manual_seed(0)
        cfg = transformers.GraniteConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         logits_scaling=scaling)
        return transformers.GraniteForCausalLM(cfg)

    with pytest.raises(ValueError, match=r"not among the tested families.*relative error .*logits_scaling"):
        CausalLMModule(granite(8.0))
    CausalLMModule(granite(1.0))  # the same family without the transform passes the check


def test_module_refuses_unprepared_dcp_batches():
    """A DCP micro-batch the strategy did not pass through dcp_prepare_batch is refused, not silently mis-shifted."""
    from lightning_dcp.sp.context import TOKEN_WEIGHT

    module = CausalLMModule(make_model("llama"))
    batch = pack_samples(make_samples([5, 3]), pad_to_multiple=2)
    with pytest.raises(RuntimeError, match="dcp_prepare_batch"):
        module.training_step(shard_batch(batch, 0, 2), 0)
    with pytest.raises(RuntimeError, match="dcp_prepare_batch"):
        module.training_step(dict(batch, **{TOKEN_WEIGHT: batch[LOSS_MASK].float()}), 0)


def test_missing_transformers_names_the_extra(monkeypatch):
    import sys

    for name in [m for m in sys.modules if m == "lightning_dcp.hf" or m.startswith("lightning_dcp.hf.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install lightning-dcp\[hf\]"):
        import lightning_dcp.hf  # noqa: F401


def _reference_loss(model, samples):
    """Plain transformers: per-sample shifted CE summed over valid targets / valid targets of the batch."""
    total, count = 0.0, 0
    for s in samples:
        labels = s.get("labels", s["input_ids"])
        logits = model(input_ids=s["input_ids"][None]).logits[0].float()
        tl = F.cross_entropy(logits[:-1], labels[1:], reduction="sum", ignore_index=-100)
        total, count = total + tl, count + int((labels[1:] != -100).sum())
    return total / count


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_module_loss_and_grads_match_reference(family):
    """CausalLMModule's loss and grads == plain transformers' (Gemma 2: both soft-cappings)."""
    ref = make_model(family)
    module = CausalLMModule(copy.deepcopy(ref))
    module.train()
    samples = make_samples([6, 11, 2, 8], labels=True)
    want = _reference_loss(ref, samples)
    want.backward()
    for name, batch in [("collate", CausalLMModule.collate(samples)), ("raw packed", pack_samples(samples))]:
        module.zero_grad(set_to_none=True)
        loss = module.training_step(batch, 0)
        loss.backward()
        assert abs(loss.item() - want.item()) < 1e-5, (name, loss.item(), want.item())
        ref_grads = dict(ref.named_parameters())
        for n, p in module.model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n].grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name} {n}: {m}")
    # Hugging Face-style right-padded [B, T] batch
    T = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), T, dtype=torch.long)
    labels = torch.full((len(samples), T), -100)
    mask = torch.zeros(len(samples), T, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = s["input_ids"], s["labels"], 1
    loss = module.training_step({"input_ids": ids, "labels": labels, "attention_mask": mask}, 0)
    assert abs(loss.item() - want.item()) < 1e-5


# ----------------------------------------------------------------------------- SP (spawned gloo)

# (family, heads, kv heads, recompute, pass cu_seqlens) -- kv heads < SP size in several
_SP_CASES = [("llama", 4, 2, 0, True), ("llama", 8, 2, 2, True), ("qwen2", 4, 1, 1, False), ("qwen3", 8, 4, 3, True)]
# every other family, at SP 2 only (two groups side by side)
_SP2_CASES = [(f, 4, None, 1 + i % 3, True) for i, f in enumerate(FAMILIES) if f not in ("llama", "qwen2", "qwen3")]
_SP_LENGTHS = [7, 3, 10, 1, 5]  # 26 tokens: padded to 28 (SP 2, 4)


def _sp_case(rank, layout, groups, case):
    family, heads, kv, recompute, with_cu = case
    (gi,) = [i for i, ranks in enumerate(layout) if rank in ranks]
    ranks, group = layout[gi], groups[gi]
    sp, sp_rank = len(ranks), layout[gi].index(rank)
    model = adapt(make_model(family, heads, kv, seed=gi)).train()
    batch = pack_samples(make_samples(_SP_LENGTHS, seed=gi), pad_to_multiple=4)
    T = batch[POSITION_IDS].shape[0]
    gout = torch.randn(T, VOCAB, generator=torch.Generator().manual_seed(7 + gi))
    ref_logits = packed_logits(model, batch, with_cu)  # SP 1, same process
    (ref_logits * gout).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    local = shard_batch(batch, sp_rank, sp)
    with sp_context(SPContext(group=group, size=sp, rank=sp_rank, recompute=recompute)):
        logits = packed_logits(model, local, with_cu)
    lo = sp_rank * (T // sp)
    (logits * gout[lo: lo + T // sp]).sum().backward()  # outside the context: recompute must re-enter it
    parts = [torch.empty_like(logits) for _ in range(sp)]
    dist.all_gather(parts, logits.detach().contiguous(), group=group)
    full = torch.cat(parts)
    errs = {"logits": ((full - ref_logits).abs().max().item(), ref_logits.abs().max().item())}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        errs[n] = ((g - ref_grads[n]).abs().max().item(), ref_grads[n].abs().max().item())
    worst_abs = max(e for e, _ in errs.values())
    worst_rel = max(e / max(m, 1e-12) for e, m in errs.values())
    if sp_rank == 0:
        print(f"SP {sp} {case}: max abs err {worst_abs:.2e}, max rel err {worst_rel:.2e}", flush=True)
    bad = {n: e for n, (e, m) in errs.items() if e > 1e-5 * max(1.0, m)}
    assert not bad, f"rank {rank} SP {sp} {case}: errors {bad}"


def _sp_world4_worker(rank, world_size):
    for layout in ([[0, 1, 2, 3]], [[0, 1], [2, 3]]):
        groups = [dist.new_group(r) for r in layout]
        for case in _SP_CASES + (_SP2_CASES if len(layout) == 2 else []):
            _sp_case(rank, layout, groups, case)


def test_sp2_sp4_equal_single_process():
    """SP 4, then two SP 2 groups side by side: gathered logits and summed grads == the SP-1 result
    (every family at SP 2)."""
    run_distributed(_sp_world4_worker, 4, timeout=600)


# ----------------------------------------------------------------------------- plain Trainer

class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, samples):
        self.samples = samples
        self.lengths = [len(s["input_ids"]) for s in samples]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def _sgd_module(model, lr):
    class _SGD(CausalLMModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)
    return _SGD(model)


def test_plain_trainer_matches_reference():
    """CausalLMModule under an ordinary single-device Trainer == plain transformers + torch.optim;
    train/loss is logged once per step: the batch's loss."""
    import lightning.pytorch as pl

    samples = make_samples([5, 9, 3, 12, 7, 4], labels=True)
    ref = make_model("llama", 4, 2, layers=2)
    module = _sgd_module(copy.deepcopy(ref), lr=0.1)
    loader = torch.utils.data.DataLoader(_ListDataset(samples), batch_size=3, collate_fn=CausalLMModule.collate)
    recorder = _LossRecorder()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=recorder, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        opt.zero_grad()
        loss = _reference_loss(ref, samples[3 * step: 3 * step + 3])
        loss.backward()
        losses.append(loss.item())
        opt.step()
    logged = [(step, m["train/loss"]) for step, m in recorder.rows if "train/loss" in m]
    assert [step for step, _ in logged] == [0, 1], logged
    assert max(abs(got - want) for (_, got), want in zip(logged, losses)) < 1e-5, (logged, losses)
    want = ref.state_dict()
    for n, w in module.model.state_dict().items():
        torch.testing.assert_close(w, want[n], atol=1e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")


def test_bf16_mixed_trains_fp32_weights():
    """The README's recipe: fp32 weights under precision="bf16-mixed". The packed forward runs under bf16
    autocast (a projection's output is bf16), the weights stay fp32, and AdamW at lr 1e-5 moves them
    (bf16 weights would lose most such updates to rounding)."""
    import lightning.pytorch as pl

    module = CausalLMModule(make_model("llama", 4, 2, layers=2), lr=1e-5)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    seen = []
    module.model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    samples = make_samples([5, 9, 3, 12], labels=True)
    loader = torch.utils.data.DataLoader(_ListDataset(samples), batch_size=4, collate_fn=CausalLMModule.collate)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, precision="bf16-mixed", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    assert seen == [torch.bfloat16]
    for n, p in module.model.named_parameters():
        assert p.dtype == torch.float32 and torch.isfinite(p).all(), n
        if "embed_tokens" not in n:  # only the batch's tokens' rows get a gradient
            assert (p != before[n]).float().mean() > 0.5, f"{n}: most weights did not move"


# ----------------------------------------------------------------------------- DCPStrategy end to end

_E2E_STEPS = 3
_E2E_LR = 0.2


def _e2e_dataset(n: int = 32, seed: int = 11) -> _ListDataset:
    import random

    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(2, 12), rng.randint(20, 48)]) for _ in range(n)]
    return _ListDataset(make_samples(lengths, seed=seed, labels=True))


class _LossRecorder(__import__("lightning.pytorch", fromlist=["loggers"]).loggers.Logger):
    """A Lightning logger that keeps what it is given: ``rows`` of ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list = []

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))


class _E2EDump(__import__("lightning.pytorch", fromlist=["Callback"]).Callback):
    """Records each step's plan and, at the end, this rank's weights (per family) and what its
    logger was given, to ``out_dir``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.plans = out_dir, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.plans.append(batch.step.plan.to_dict())

    def on_train_end(self, trainer, pl_module):
        import os

        state = {f: {k: v.detach().clone() for k, v in m.state_dict().items()} for f, m in pl_module.family_models()}
        logged = getattr(trainer.logger, "rows", None)
        torch.save({"plans": self.plans, "weights": state, "logged": logged},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


class _SGDCausalLM(CausalLMModule):
    """CausalLMModule with SGD, training one model per family side by side on the same batches (the
    loss is the sum of theirs, so each model's gradient is its own): one process launch covers them all.
    Each model has its own stack of layers; the first one's is the stack DCP plans recompute for (every
    adapted model reads the step's recompute count from the SP context)."""

    dcp_layers_attr = "model.dcp_repeated_layers"

    def __init__(self, families, lr, heads: int = 4):
        super().__init__(make_model(families[0], heads=heads, layers=3, seed=3), lr=lr)
        self.families = list(families)
        self.others = torch.nn.ModuleList(adapt(make_model(f, heads=heads, layers=3, seed=3)) for f in families[1:])

    def family_models(self):
        return zip(self.families, [self.model, *self.others])

    def training_step(self, batch, batch_idx):
        if not len(self.others):
            return super().training_step(batch, batch_idx)
        from lightning_dcp.sp.tokens import weighted_loss

        batch = self._as_prepared(batch)
        token_loss = sum(F.cross_entropy(causal_lm_logits(model, batch), batch[SHIFT_LABELS], reduction="none",
                                         ignore_index=-100) for _, model in self.family_models())
        return weighted_loss(token_loss, batch)  # one weighted sum: the strategy takes it as is

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def setup(self, stage):
        torch.set_num_threads(1)


def _e2e_reference(plans, dataset, family: str, heads: int = 4):
    """Plain transformers, no lightning_dcp math: per sample, shifted CE summed over valid targets,
    divided by the valid targets of the step's global batch; torch.optim.SGD. Returns the final
    state dict and each step's loss."""
    model = make_model(family, heads=heads, layers=3, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=_E2E_LR)
    losses = []
    for plan in plans:
        samples = [dataset[s] for it in plan["items"] for s in it["samples"]]
        valid = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for s in samples:
            logits = model(input_ids=s["input_ids"][None]).logits[0].float()
            loss = F.cross_entropy(logits[:-1], s["labels"][1:], reduction="sum", ignore_index=-100) / valid
            loss.backward()
            step_loss += loss.item()
        losses.append(step_loss)
        opt.step()
    return model.state_dict(), losses


class _SupportLines(__import__("logging").Handler):
    """Counts this process's log records that hold ``line`` (DCPStrategy prints the support line with
    ``rank_zero_info``, a record of the ``lightning.pytorch`` logger, whose handler writes it out)."""

    def __init__(self, line: str) -> None:
        super().__init__()
        self.line, self.count = line, 0

    def emit(self, record) -> None:
        self.count += record.getMessage().count(self.line)


def _e2e_fit(world, out_dir, families, policy):
    """One fit of _SGDCausalLM under DCPStrategy on this spawn's ``world`` processes; each rank writes its plans,
    weights and logged metrics (rank{r}.pt, _E2EDump) and how many support lines it printed (rank{r}.lines) to
    ``out_dir``."""
    import logging
    import os

    import lightning.pytorch as pl

    from lightning_dcp import DCPStrategy, DefaultCostModel

    try:
        from _dcp_helpers import RandomPlanner
    except ImportError:
        from tests._dcp_helpers import RandomPlanner

    os.makedirs(out_dir, exist_ok=True)
    dataset = _e2e_dataset()
    if policy == "random":  # mixes SP 1/2/4, packing, uneven accumulation and recompute 0-3 in each step
        kw = dict(planner=RandomPlanner(world, seed=2, force_mix=True))
    else:  # a cost model under which the long samples need SP > 1 (and recompute for dcp-intra)
        kw = dict(policy=policy, cost_model=DefaultCostModel(num_layers=3, num_heads=4, max_tokens=8))
    strategy = DCPStrategy(global_batch_size=8, loss_reduction="token", seed=1, log_metrics=False, profile=False, **kw)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=_E2E_STEPS,
                         callbacks=[_E2EDump(out_dir)], logger=_LossRecorder(), log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    module = _SGDCausalLM(families, lr=_E2E_LR)
    line = (f"DCPStrategy: _SGDCausalLM trains {type(module.model).__name__} (model_type {families[0]!r}, a tested "
            "family) at support level 'sp'")
    # Lightning's handler of the "lightning.pytorch" logger (propagate=False) writes rank_zero_info's records out;
    # this one, beside it for this fit only, counts the support line among them.
    counter, logger = _SupportLines(line), logging.getLogger("lightning.pytorch")
    logger.addHandler(counter)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(dataset, batch_size=4, collate_fn=CausalLMModule.collate))
    finally:
        logger.removeHandler(counter)
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.lines"), "w") as f:
        f.write(str(counter.count))


def _e2e_world_worker(rank, world, out_dir, cases):
    import os

    for i, (families, policy) in enumerate(cases):
        _e2e_fit(world, os.path.join(out_dir, str(i)), families, policy)


#: (processes, [(families, policy)]) of each variant, its fits one after the other on one spawn; "4-dcp-and-random"
#: is slow (tests/conftest.py).
_E2E_CASES = {
    "2-dcp-dcp-intra-and-bucket": (2, [(("llama",), "dcp"), (("qwen2",), "dcp-intra"), (tuple(FAMILIES), "bucket")]),
    "4-dcp-and-random": (4, [(("qwen2",), "dcp"), (("llama",), "random")]),
}


@pytest.mark.parametrize("variant", list(_E2E_CASES))
def test_dcp_trainer_equals_plain_training(tmp_path, variant):
    """CausalLMModule under DCPStrategy (2/4 CPU processes) == plain single-process transformers training,
    with prompt-masked labels, SP > 1 and recompute > 0 (every family in the bucket run); the logged
    train/loss of every step == the reference's loss of the step's global batch; the support line is printed,
    once per fit, by rank 0. A variant's fits share one spawn of its processes."""
    import os

    world, cases = _E2E_CASES[variant]
    run_distributed(_e2e_world_worker, world, str(tmp_path), cases, timeout=900)
    dataset = _e2e_dataset()
    for i, (families, policy) in enumerate(cases):
        out_dir = os.path.join(tmp_path, str(i))
        lines = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.lines")) as f:
                lines.append(int(f.read()))
        assert lines == [1] + [0] * (world - 1), f"{policy}: the support line is printed once, by rank 0: {lines}"
        logs = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
        plans = logs[0]["plans"]
        assert len(plans) == _E2E_STEPS
        sizes = sorted({len(it["ranks"]) for p in plans for it in p["items"]})
        recompute = sorted({it["recompute"] for p in plans for it in p["items"]})
        assert max(sizes) > 1, f"{policy}: the plans never used SP > 1 ({plans}); the test data must force it"
        assert max(recompute) > 0, f"{policy}: the plans never recomputed ({plans})"
        want_losses = [0.0] * _E2E_STEPS
        for family in families:
            want, losses = _e2e_reference(plans, dataset, family)
            want_losses = [a + b for a, b in zip(want_losses, losses)]
            worst = 0.0
            for r, log in enumerate(logs):
                for n, w in log["weights"][family].items():
                    rel = float((w - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12))
                    worst = max(worst, rel)
                    assert rel < 1e-5, f"{family} {policy}: rank {r} weight {n} after {_E2E_STEPS} steps: relative error {rel:.2e}"
            print(f"{family} {policy} world {world} (SP sizes {sizes}, recompute {recompute}): max rel weight err {worst:.2e}",
                  flush=True)
        for r, log in enumerate(logs):  # train/loss: once per step, the global batch's loss on every rank
            logged = [(step, m["train/loss"]) for step, m in log["logged"] if "train/loss" in m]
            assert [step for step, _ in logged] == list(range(_E2E_STEPS)), logged
            worst = max(abs(got - want) for (_, got), want in zip(logged, want_losses))
            print(f"{'+'.join(families)} {policy} world {world} rank {r}: logged train/loss {[round(v, 6) for _, v in logged]}, "
                  f"max abs err vs plain training {worst:.2e}", flush=True)
            assert worst < 1e-5, (r, logged, want_losses)


def test_profiler_measures_an_adapted_model():
    """The dual-layer profiler drives CausalLMModule as the strategy does (dcp_prepare_batch, then
    the decoder layers from dcp_repeated_layers()) and yields a usable cost model."""
    from lightning_dcp.planning.profiled import ProfiledCostModel
    from lightning_dcp.profiling import profile_module

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            self.samples = make_samples([8, 16, 32, 64, 64, 32], labels=True)
            self.lengths = [len(s["input_ids"]) for s in self.samples]

        def __len__(self):
            return len(self.samples)

        def __getitem__(self, i):
            return self.samples[i]

    module = CausalLMModule(make_model("qwen2", 4, 1, layers=3))
    module.train()
    profile = profile_module(module, Data(), time_budget_s=10, micro_batch_sizes=[1, 2])
    assert profile["entries"] and all(e["forward_s"] > 0 and e["activation_bytes"] > 0 for e in profile["entries"])
    cm = ProfiledCostModel(profile)
    assert cm.num_layers == 3
    assert cm.item_time([64], 1, 3) > cm.item_time([64], 1, 0) > cm.item_time([8], 1, 0)
