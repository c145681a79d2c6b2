

@pytest.mark.parametrize("sp", [3, 5, 6, 7])
def test_any_sp_size_pads_to_its_multiple_and_shards_every_token_once(sp):
    """The padding rule at SP sizes that are not powers of two: the packed tokens pad to a multiple of the SP size
    (a padding segment of its own), and the contiguous shards are equal and cover them in order."""
    from lightning_dcp.sp.packing import pack_samples
    from lightning_dcp.sp.tokens import shard_batch

    b = pack_samples([{"input_ids": torch.arange(n)} for n in (4, 11, 1)], pad_to_multiple=pad_multiple(sp))
    total = -(-16 // sp) * sp
    assert b["input_ids"].shape[0] == total and b[CU_SEQLENS].tolist()[-1] == total
    assert b[CU_SEQLENS].tolist()[:4] == [0, 4, 15, 16] and (total == 16 or len(b[CU_SEQLENS]) == 5)
    shards = [shard_batch(b, r, sp)["input_ids"] for r in range(sp)]
    assert {s.shape[0] for s in shards} == {total // sp} and torch.equal(torch.cat(shards), b["input_ids"])
