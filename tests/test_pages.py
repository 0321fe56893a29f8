"""The paged KV cache: allocator (budget, fragmentation, double free), writes in chunks, cancellation, and the
paged decode kernel reading the cache's own pools and block tables."""

from __future__ import annotations

import pytest
import torch

from sharp.serving.pages import OutOfPages, PageAllocator, PagedKVCache


def test_allocator_budget_fragmentation_and_double_free():
    pool = PageAllocator(10)
    a, b, c = pool.allocate(3), pool.allocate(4), pool.allocate(2)
    assert sorted(a + b + c) == list(range(9)) and pool.free_pages == 1 and pool.usage() == 0.9
    with pytest.raises(OutOfPages, match="2 pages requested, 1 of 10 free"):
        pool.allocate(2)
    assert pool.free_pages == 1  # a refused request allocates nothing
    pool.release(b)  # a hole in the middle
    d = pool.allocate(5)  # served from the hole and the tail: no fragment is unusable
    assert set(d) == set(b) | {9}
    with pytest.raises(ValueError, match="not allocated"):
        pool.release(b[:1] + b[:1])
    pool.release(a)
    with pytest.raises(ValueError, match="double free"):
        pool.release(a)


def test_cache_round_trip_in_chunks_and_cancellation_frees_pages():
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(layers=2, kv_heads=2, head_dim=8, num_pages=12, page_size=16)
    want = {s: [torch.randn(2, n, 8, generator=g) for n in chunks] for s, chunks in
            {"a": [20, 1, 1], "b": [5], "c": [16, 17]}.items()}  # fmt: skip
    # interleaved chunked prefill / decode: each sequence appends its chunks, others in between
    for step in range(3):
        for seq, chunks in want.items():
            if step < len(chunks):
                n = chunks[step].shape[1]
                cache.reserve(seq, cache.lengths.get(seq, 0) + n)
                for layer in range(2):
                    cache.write(seq, layer, chunks[step] * (layer + 1), -chunks[step])
                cache.advance(seq, n)
    for seq, chunks in want.items():
        k, v = cache.gather(seq, 1)
        expected = torch.cat(chunks, dim=1)
        torch.testing.assert_close(k[0], 2 * expected, rtol=0, atol=0)
        torch.testing.assert_close(v[0], -expected, rtol=0, atol=0)
    assert cache.allocator.free_pages == 12 - (2 + 1 + 3)
    cache.free("a")  # cancelled: its pages return, the others are untouched
    assert cache.allocator.free_pages == 12 - 4
    cache.reserve("d", 40)  # reuses a's pages
    k_c, _ = cache.gather("c", 1)
    torch.testing.assert_close(k_c[0], 2 * torch.cat(want["c"], dim=1), rtol=0, atol=0)
    with pytest.raises(OutOfPages):
        cache.reserve("e", 16 * 6)
    assert "e" not in cache.tables and cache.allocator.free_pages == 12 - 7
    with pytest.raises(ValueError, match="reserve first"):
        cache.write("b", 0, torch.zeros(2, 12, 8), torch.zeros(2, 12, 8))


def test_paged_decode_reads_the_cache_pools():
    pytest.importorskip("triton")
    from sharp.models import attend
    from sharp.plugins.triton.paged import paged_decode

    g = torch.Generator().manual_seed(1)
    cache = PagedKVCache(layers=1, kv_heads=2, head_dim=16, num_pages=20, page_size=16)
    for seq, n in (("x", 50), ("y", 3), ("z", 33)):
        cache.reserve(seq, n)
        cache.write(seq, 0, torch.randn(2, n, 16, generator=g), torch.randn(2, n, 16, generator=g))
        cache.advance(seq, n)
    cache.free("y")  # a hole in the pool between the others
    seqs = ["z", "x"]
    table, lengths = cache.block_table(seqs)
    q = torch.randn(2, 4, 1, 16, generator=g)
    out, ent = paged_decode(q, cache.keys[0], cache.values[0], table, lengths, norm="ssa",
                            ssa_n=torch.full((4,), 1.5), ssa_b=torch.full((4,), 1.0))  # fmt: skip
    for i, seq in enumerate(seqs):
        k, v = cache.gather(seq, 0)
        o_ref, h_ref = attend(q[i : i + 1], k, v, norm="ssa", causal=True, return_entropy=True)
        torch.testing.assert_close(out[i : i + 1], o_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[i : i + 1], h_ref, atol=1e-5, rtol=0)
