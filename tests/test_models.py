"""Reference models and synthetic data: packing, per-sample equivalence, recompute, SP equivalence, training."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_dcp.sp.context import (
    CU_SEQLENS, LOSS_MASK, MAX_SEQLEN, NUM_TOKENS, POSITION_IDS, SAMPLE_INDICES, SEGMENT_IDS, SPContext, sp_context,
)
from lightning_dcp.data import (
    SyntheticTokenDataset, SyntheticVideoDataset, pack_samples, plain_collate, tiny_lengths, tiny_video_shapes,
)
# Lightning (DCPTransformerModule) is imported inside the tests that need it: the spawned SP workers
# import this file, and skipping Lightning there saves seconds per process on shared cores.
from lightning_dcp.models import (
    FRAME_LAYOUT, Transformer1D, Transformer2D, build_model, frame_layout, shard_video_batch,
)
from lightning_dcp.models.transformer2d import partition_frames
from lightning_dcp.planning.models import get_model

try:
    from _dist import run_distributed
except ImportError:  # tests/ imported as a package
    from tests._dist import run_distributed



pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------ data

def test_tiny_lengths_deterministic_and_bounded():
    a = tiny_lengths(500, seed=3, min_len=8, max_len=512)
    assert a == tiny_lengths(500, seed=3, min_len=8, max_len=512) and a != tiny_lengths(500, seed=4)
    assert min(a) >= 8 and max(a) <= 512
    assert sorted(a)[250] < 100 < max(a)  # mostly short, long tail


def test_token_dataset():
    ds = SyntheticTokenDataset(num_samples=6, seed=1, vocab_size=64)
    assert ds.lengths == tiny_lengths(6, seed=1) and len(ds) == 6
    item = ds[2]
    assert item["input_ids"].shape == item["labels"].shape == (ds.lengths[2],)
    assert item["input_ids"].dtype == torch.int64 and int(item["labels"].max()) < 64
    torch.testing.assert_close(ds[2]["input_ids"], SyntheticTokenDataset(num_samples=6, seed=1, vocab_size=64)[2]["input_ids"])
    assert SyntheticTokenDataset([5, 7]).lengths == [5, 7]
    assert len(SyntheticTokenDataset(num_samples=4, distribution="short").lengths) == 4
    with pytest.raises(ValueError, match="distribution"):
        SyntheticTokenDataset(num_samples=4, distribution="nope")


def test_video_dataset():
    ds = SyntheticVideoDataset(num_samples=5, in_channels=8, seed=2, max_frames=6)
    assert ds.shapes == tiny_video_shapes(5, seed=2, max_frames=6)
    assert ds.lengths == [f * h * w for f, h, w in ds.shapes]
    item = ds[1]
    n = ds.lengths[1]
    assert item["latents"].shape == item["targets"].shape == (n, 8)
    assert item["shapes"] == ds.shapes[1] and 0.0 < item["timesteps"] < 1.0
    with pytest.raises(ValueError, match="frames, h, w"):
        SyntheticVideoDataset([(0, 2, 2)])


def test_pack_samples_padding_and_metadata():
    ds = SyntheticVideoDataset([(2, 2, 3), (1, 4, 4)], in_channels=4)
    b = pack_samples([ds[0], ds[1]], pad_to_multiple=8, sample_indices=[0, 1])
    assert b["latents"].shape == (32, 4) and b[NUM_TOKENS] == 28
    assert b[CU_SEQLENS].tolist() == [0, 12, 28, 32] and b[CU_SEQLENS].dtype == torch.int32 and b[MAX_SEQLEN] == 16
    assert b[SEGMENT_IDS].tolist() == [0] * 12 + [1] * 16 + [-1] * 4
    assert b[LOSS_MASK].sum() == 28 and b[POSITION_IDS][12:14].tolist() == [0, 1]
    assert b["shapes"] == [(2, 2, 3), (1, 4, 4)] and isinstance(b["timesteps"], list) and b[SAMPLE_INDICES] == [0, 1]
    t = pack_samples([{"input_ids": torch.ones(3, dtype=torch.long), "labels": torch.ones(3, dtype=torch.long)}], pad_to_multiple=4)
    assert t["labels"].tolist() == [1, 1, 1, -100] and t["input_ids"].tolist() == [1, 1, 1, 0]
    assert plain_collate([ds[0]])[CU_SEQLENS].tolist() == [0, 12]
    with pytest.raises(ValueError, match="same keys"):
        pack_samples([{"input_ids": torch.ones(2)}, {"latents": torch.ones(2)}])


# ------------------------------------------------------------------------------ frame layout

def test_partition_frames_minimises_largest_chunk():
    assert partition_frames([4, 4, 4, 4], 2) == ([0, 2, 4], 8)
    assert partition_frames([9, 1, 1, 1], 2) == ([0, 1, 4], 9)  # one frame bigger than total/sp
    assert partition_frames([5], 4) == ([0, 1, 1, 1, 1], 5)  # fewer frames than ranks
    bounds, largest = partition_frames([3, 7, 2, 2, 6, 1], 3)
    assert largest == 9 and len(bounds) == 4  # [3] [7, 2] [2, 6, 1]


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_shard_video_batch_round_trip(sp):
    """All ranks' shards together hold every real token once, whole frames, equal token counts, and
    the temporal permutation of the gathered layout visits the tokens of the SP=1 temporal order."""
    shapes = [(3, 2, 2), (1, 3, 3), (4, 1, 2)]
    ds = SyntheticVideoDataset(shapes, in_channels=2)
    full = pack_samples([ds[i] for i in range(3)], pad_to_multiple=sp)
    n = full[NUM_TOKENS]
    full["token_id"] = torch.arange(full["latents"].shape[0])
    shards = [shard_video_batch(full, r, sp) for r in range(sp)]
    P = shards[0]["latents"].shape[0]
    assert all(s["latents"].shape[0] == P and s[FRAME_LAYOUT] == (sp, P) for s in shards)
    gathered_ids = torch.cat([s["token_id"] for s in shards])
    gathered_mask = torch.cat([s[LOSS_MASK] for s in shards])
    assert sorted(gathered_ids[gathered_mask].tolist()) == list(range(n))
    assert int(gathered_mask.sum()) == n and torch.cat([s[SEGMENT_IDS] for s in shards])[~gathered_mask].eq(-1).all()
    ref = frame_layout(shapes, 1, 0)
    for r in range(sp):
        lay = frame_layout(shapes, sp, r)
        assert lay.tokens_per_rank == P
        torch.testing.assert_close(gathered_ids[lay.temporal_index], ref.temporal_index)
        torch.testing.assert_close(lay.segment_ids, shards[r][SEGMENT_IDS])
        assert lay.spatial_cu[-1] == P
    assert shards[0][CU_SEQLENS][-1] == sp * P


# ------------------------------------------------------------------------------ models

def _token_batch(lengths, pad_to_multiple=1, seed=0):
    ds = SyntheticTokenDataset(lengths, seed=seed, vocab_size=get_model("tiny-1d").vocab_size)
    return [ds[i] for i in range(len(lengths))], pack_samples([ds[i] for i in range(len(lengths))], pad_to_multiple)


def _video_batch(shapes, pad_to_multiple=1, seed=0):
    ds = SyntheticVideoDataset(shapes, seed=seed, in_channels=get_model("tiny-2d").in_channels)
    samples = [ds[i] for i in range(len(shapes))]
    return samples, pack_samples(samples, pad_to_multiple)


def test_shapes_and_build():
    _, b1 = _token_batch([7, 5])
    assert Transformer1D("tiny-1d")(b1).shape == (12, 256)
    _, b2 = _video_batch([(2, 2, 3), (1, 3, 3)])
    assert Transformer2D("tiny-2d")(b2).shape == (21, 16)
    assert isinstance(build_model("tiny-2d"), Transformer2D) and len(build_model("tiny-1d").layers) == 4
    with pytest.raises(ValueError, match="Transformer2D"):
        Transformer1D("tiny-2d")
    # a plain single sequence without packing keys works at SP size 1
    ids = torch.randint(256, (9,))
    torch.testing.assert_close(Transformer1D("tiny-1d")({"input_ids": ids}).shape, torch.Size([9, 256]))


def test_1d_packed_equals_each_sample_alone():
    torch.manual_seed(0)
    model = Transformer1D("tiny-1d").double().eval()
    samples, packed = _token_batch([11, 3, 17], pad_to_multiple=8)
    out = model(packed)
    cu = packed[CU_SEQLENS].tolist()
    for i, s in enumerate(samples):
        alone = model(pack_samples([s]))
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], alone, atol=1e-10, rtol=1e-10)


def test_2d_packed_equals_each_sample_alone():
    torch.manual_seed(0)
    model = Transformer2D("tiny-2d").double().eval()
    samples, packed = _video_batch([(3, 2, 2), (1, 3, 3), (4, 2, 3)], pad_to_multiple=16)
    packed["latents"] = packed["latents"].double()
    out = model(packed)
    cu = packed[CU_SEQLENS].tolist()
    for i, s in enumerate(samples):
        alone = pack_samples([s])
        alone["latents"] = alone["latents"].double()
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], model(alone), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", ["tiny-1d", "tiny-2d"])
def test_recompute_changes_nothing(name):
    from lightning_dcp.models.module import DCPTransformerModule

    torch.manual_seed(0)
    module = DCPTransformerModule(name).double()
    _, batch = _token_batch([9, 4]) if name == "tiny-1d" else _video_batch([(2, 2, 2), (3, 1, 2)])
    if name == "tiny-2d":
        batch["latents"], batch["targets"] = batch["latents"].double(), batch["targets"].double()
    results = []
    for recompute in (0, 2, 4):
        module.zero_grad()
        with sp_context(SPContext(recompute=recompute)):
            loss = module._mean_loss(batch)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in module.parameters()]))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-12, rtol=1e-12)
        for g, g0 in zip(grads, results[0][1]):
            torch.testing.assert_close(g, g0, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["tiny-1d", "tiny-2d"])
def test_loss_decreases(name):
    from lightning_dcp.models.module import DCPTransformerModule

    torch.manual_seed(0)
    module = DCPTransformerModule(name, lr=3e-3)
    _, batch = _token_batch([40, 24, 64]) if name == "tiny-1d" else _video_batch([(4, 4, 4), (2, 6, 6)])
    opt = module.configure_optimizers()
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = module._mean_loss(batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_plain_lightning_trainer_single_device(tmp_path):
    """No DCP strategy: an ordinary Trainer and DataLoader(collate_fn=plain_collate)."""
    import lightning.pytorch as pl

    from lightning_dcp.models.module import DCPTransformerModule

    for name, ds in (("tiny-1d", SyntheticTokenDataset(num_samples=8, seed=0)),
                     ("tiny-2d", SyntheticVideoDataset(num_samples=8, seed=0, max_frames=3))):
        module = DCPTransformerModule(name)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path)
        loader = DataLoader(ds, batch_size=4, collate_fn=plain_collate)
        trainer.fit(module, loader, loader)
        assert torch.isfinite(trainer.callback_metrics["train/loss"]) and "val_loss" in trainer.callback_metrics


def test_2d_rejects_unsharded_batch_under_sp():
    _, batch = _video_batch([(2, 2, 2)])
    with sp_context(SPContext(size=2, rank=0)):
        with pytest.raises(ValueError, match="dcp_shard_batch"):
            Transformer2D("tiny-2d")(batch)


# ------------------------------------------------------------------ SP across processes

def _chunk_tokens(batch, rank, sp):
    """The generic strategy sharding: every token tensor's contiguous 1/sp chunk."""
    total = batch[CU_SEQLENS][-1].item()
    local = total // sp
    return {k: (v[rank * local:(rank + 1) * local] if isinstance(v, torch.Tensor) and k != CU_SEQLENS
                and v.dim() >= 1 and v.shape[0] == total else v) for k, v in batch.items()}


def _sp_matches_sp1(name, full, shard, rank, sp, group):
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_model(name), num_layers=2)).double()
    out_key = "input_ids" if name == "tiny-1d" else "latents"
    g = torch.Generator().manual_seed(1)
    total = full[out_key].shape[0]
    dims = model.spec.vocab_size if name == "tiny-1d" else model.spec.in_channels
    full["w"] = torch.randn(total, dims, generator=g, dtype=torch.float64)
    if name == "tiny-2d":
        full["latents"] = full["latents"].double()
    # reference: SP size 1, whole batch, in this process
    ref_out = model(full)
    ref_loss = (ref_out * full["w"] * full[LOSS_MASK][:, None]).sum()
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
    # SP: this rank's shard; the first layer recomputed (its backward re-runs the all-to-alls)
    local = shard(full, rank, sp)
    with sp_context(SPContext(group=group, size=sp, rank=rank, recompute=1)):
        out = model(local)
        loss = (out * local["w"] * local[LOSS_MASK][:, None]).sum()
    grads = torch.autograd.grad(loss, list(model.parameters()))  # backward after leaving the context
    expect = shard({**full, out_key: ref_out}, rank, sp)[out_key]
    m = local[LOSS_MASK]
    torch.testing.assert_close(out[m], expect[m], atol=1e-9, rtol=1e-9, msg=lambda s: f"{name} rank {rank} out: {s}")
    for (pname, _), got, want in zip(model.named_parameters(), grads, ref_grads):
        got = got.clone()
        dist.all_reduce(got, group=group)
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-7, msg=lambda s: f"{name} rank {rank} grad {pname}: {s}")


def _sp_worker(rank, world_size):
    """Two concurrent SP=2 groups ([0, 1], [2, 3]) with different data, then one SP=4 group."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    everyone = dist.new_group([0, 1, 2, 3])
    pair, sp_rank = pairs[rank // 2], rank % 2
    seed = rank // 2
    _, tokens = _token_batch([13, 2, 6] if seed == 0 else [5, 9], pad_to_multiple=2, seed=seed)
    _sp_matches_sp1("tiny-1d", tokens, _chunk_tokens, sp_rank, 2, pair)
    # unequal frame sizes across samples; a frame bigger than total/sp; trailing collate padding
    _, video = _video_batch([(3, 2, 2), (1, 4, 5), (5, 1, 2)] if seed == 0 else [(2, 3, 3), (3, 2, 1)], pad_to_multiple=2, seed=seed)
    _sp_matches_sp1("tiny-2d", video, shard_video_batch, sp_rank, 2, pair)
    # SP=4: the 9 frames split [4, 4, 4] [20] [2, 2, 2, 2, 2] [] -- rank 3 holds only padding
    _, video = _video_batch([(3, 2, 2), (1, 4, 5), (5, 1, 2)], pad_to_multiple=4)
    _sp_matches_sp1("tiny-2d", video, shard_video_batch, rank, 4, everyone)


def test_sp_matches_sp1_forward_and_gradients():
    """Module-level SP equivalence on 4 gloo processes (generic chunking for 1d, frame sharding for 2d)."""
    run_distributed(_sp_worker, 4, timeout=240)
