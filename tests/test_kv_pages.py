"""The paged KV cache (serving/kv/pages.py, models/kvcache.py): allocator (budget, fragmentation, double free),
steps that write in chunks and only count once committed, cancellation, the paged kernel reading the cache's own
pools, and SharpLM on a paged cache generating exactly what it generates on its dense cache — every norm, the
reference path and the Triton kernels (paged decode and dense prefill chunks)."""

from __future__ import annotations

import pytest
import torch
from devices import ATOL, ATOL_LOOSE, DEVICE

from sharp.models import ModelConfig, SharpLM, kvcache
from sharp.models.kvcache import PAGED_KERNEL_ROWS
from sharp.models.registry import NORMS
from sharp.serving.kv.pages import OutOfPages, PageAllocator, PagedKVCache


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


def test_allocator_prefers_a_run_of_consecutive_pages():
    pool = PageAllocator(12)
    a, b, c = pool.allocate(3), pool.allocate(2), pool.allocate(3)
    assert (a, b, c) == ([0, 1, 2], [3, 4], [5, 6, 7])
    pool.release(a)
    pool.release(c)  # free runs: 0–2 and 5–11
    assert pool.allocate(4) == [5, 6, 7, 8]  # the lowest run long enough, not the lowest pages
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [9, 10, 11]
    assert pool.allocate(1) == [2] and pool.free_pages == 0 and pool.usage() == 1.0


def test_consecutive_pages_are_read_in_place_and_scattered_ones_gathered(monkeypatch):
    g = torch.Generator().manual_seed(3)
    cache = PagedKVCache(layers=1, kv_heads=2, head_dim=8, num_pages=16, page_size=16)
    cache.reserve("hole", 16)
    cache.reserve("run", 40)  # pages 1–3
    cache.free("hole")
    cache.reserve("filler", 16 * 8)  # pages 4–11
    cache.reserve("scattered", 70)  # 5 pages; free are 0 and 12–15: no run of 5, so the lowest free pages
    assert cache.tables["run"] == [1, 2, 3] and cache.tables["scattered"] == [0, 12, 13, 14, 15]
    written = {}
    for seq, n in (("run", 37), ("scattered", 66)):
        k, v = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
        written[seq] = k
        _append(cache, [seq], k, v)
        step = cache.step([seq], 0)
        dk, dv, _ = step.layer(0).dense()
        torch.testing.assert_close(dk, k, rtol=0, atol=0)
        torch.testing.assert_close(dv, v, rtol=0, atol=0)
        in_place = dk.untyped_storage().data_ptr() == cache.keys[0].untyped_storage().data_ptr()
        assert in_place == (seq == "run") and (step.run_start is not None) == (seq == "run")
    monkeypatch.setattr(kvcache, "VIEW_MAX_ELEMENTS", cache.keys[0].numel())  # a pool too large for int32 offsets
    dk, _, _ = cache.step(["run"], 0).layer(0).dense()
    assert dk.untyped_storage().data_ptr() != cache.keys[0].untyped_storage().data_ptr()  # gathered instead
    torch.testing.assert_close(dk, written["run"], rtol=0, atol=0)


def _append(cache: PagedKVCache, seqs: list[str], k: torch.Tensor, v: torch.Tensor) -> None:
    """One step appending k, v (B, kv_heads, new, D) to `seqs` at every layer (layer l writes (l + 1)·k)."""
    step = cache.step(seqs, k.shape[2])
    for layer in range(len(cache.keys)):
        step.layer(layer).write(k * (layer + 1), v)
    step.commit()


def test_cache_round_trip_in_chunks_and_cancellation_frees_pages():
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(layers=2, kv_heads=2, head_dim=8, num_pages=12, page_size=16)
    want = {s: [torch.randn(1, 2, n, 8, generator=g) for n in chunks] for s, chunks in
            {"a": [20, 1, 1], "b": [5], "c": [16, 17]}.items()}  # fmt: skip
    # interleaved chunked prefill / decode: each sequence appends its chunks, others in between
    for step in range(3):
        for seq, chunks in want.items():
            if step < len(chunks):
                cache.reserve(seq, cache.lengths.get(seq, 0) + chunks[step].shape[2])
                _append(cache, [seq], chunks[step], -chunks[step])
    for seq, chunks in want.items():
        k, v = cache.gather(seq, 1)
        expected = torch.cat(chunks, dim=2)
        torch.testing.assert_close(k, 2 * expected, rtol=0, atol=0)
        torch.testing.assert_close(v, -expected, rtol=0, atol=0)
    assert cache.allocator.free_pages == 12 - (2 + 1 + 3)
    # a batched step over sequences of different lengths writes each row at its own position
    cache.reserve("a", 23)
    cache.reserve("c", 34)
    new = torch.randn(2, 2, 1, 8, generator=g)
    _append(cache, ["c", "a"], new, new)
    k_a, _ = cache.gather("a", 0)
    torch.testing.assert_close(k_a, torch.cat([*want["a"], new[1:]], dim=2), rtol=0, atol=0)
    cache.free("a")  # cancelled: its pages return, the others are untouched
    assert cache.allocator.free_pages == 12 - 4 and "a" not in cache.lengths
    cache.free("a")  # every way out may free; a second time is a no-op
    cache.reserve("d", 40)  # reuses a's pages
    k_c, _ = cache.gather("c", 1)
    torch.testing.assert_close(k_c, 2 * torch.cat([*want["c"], new[:1]], dim=2), rtol=0, atol=0)
    with pytest.raises(OutOfPages):
        cache.reserve("e", 16 * 6)
    assert "e" not in cache.tables and cache.allocator.free_pages == 12 - 7
    with pytest.raises(ValueError, match="reserve first"):
        cache.step(["b"], 12)
    uncommitted = cache.step(["b"], 1)
    uncommitted.layer(0).write(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))
    assert cache.lengths["b"] == 5  # a step that did not finish leaves the length: it can be run again
    cache.clear()
    assert cache.allocator.free_pages == 12 and not cache.tables


def test_paged_decode_reads_the_cache_pools():
    pytest.importorskip("triton")
    from sharp.models import attend
    from sharp.plugins.triton.paged import paged_decode

    g = torch.Generator().manual_seed(1)
    cache = PagedKVCache(layers=1, kv_heads=2, head_dim=16, num_pages=20, page_size=16, device=DEVICE)
    for seq, n in (("x", 50), ("y", 3), ("z", 33)):
        cache.reserve(seq, n)
        k, v = torch.randn(2, 1, 2, n, 16, generator=g).to(DEVICE).unbind(0)
        _append(cache, [seq], k, v)
    cache.free("y")  # a hole in the pool between the others
    seqs = ["z", "x"]
    step = cache.step(seqs, 0)
    q = torch.randn(2, 4, 1, 16, generator=g).to(DEVICE)
    n, b = torch.full((4,), 1.5, device=DEVICE), torch.full((4,), 1.0, device=DEVICE)
    out, ent = paged_decode(q, *cache.pages(0), step.block_table, step.seq_lens, norm="ssa", ssa_n=n, ssa_b=b)
    for i, seq in enumerate(seqs):
        k, v = cache.gather(seq, 0)
        o_ref, h_ref = attend(q[i : i + 1], k, v, norm="ssa", causal=True, return_entropy=True)
        torch.testing.assert_close(out[i : i + 1], o_ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(ent[i : i + 1], h_ref, atol=ATOL, rtol=0)


def _paged_generation(
    model: SharpLM, prompts: dict[str, torch.Tensor], chunk: int, impl: str, decode: int, scattered: bool
):
    """Chunked prefill of each prompt, then `decode` batched greedy steps over all of them, on a paged cache:
    (logits, entropy) per sequence and step. `scattered`: the pool is fragmented first (every other page held), so
    no sequence gets two consecutive pages and prefill gathers its keys instead of viewing them in place."""
    dev = next(model.parameters()).device
    cfg = model.cfg
    cache = PagedKVCache(cfg.layers, cfg.kv_heads, cfg.head_dim, num_pages=64, page_size=16, device=dev)
    if scattered:
        for page in range(64):
            cache.reserve(("filler", page), 1)
        for page in range(0, 64, 2):
            cache.free(("filler", page))
    seen = {s: [] for s in prompts}
    last = {}
    for s, p in prompts.items():
        cache.reserve(s, p.shape[1] + decode)
        for start in range(0, p.shape[1], chunk):
            ids = p[:, start : start + chunk]
            step = cache.step([s], ids.shape[1])
            assert (step.run_start is None) == (scattered and len(cache.tables[s]) > 1)
            pos = torch.arange(start, start + ids.shape[1], device=dev)[None]
            out = model.step(ids, cache=step, positions=pos, return_entropy=True, impl=impl)
            step.commit()
            seen[s].append((out.logits[0, -1], out.entropy[0, ..., -1]))
        last[s] = int(out.logits[0, -1].argmax())
    seqs = list(prompts)
    for _ in range(decode):
        step = cache.step(seqs, 1)
        pos = torch.tensor([[cache.lengths[s]] for s in seqs], device=dev)
        ids = torch.tensor([[last[s]] for s in seqs], device=dev)
        out = model.step(ids, cache=step, positions=pos, return_entropy=True, impl=impl)
        step.commit()
        for i, s in enumerate(seqs):
            seen[s].append((out.logits[i, -1], out.entropy[i, ..., -1]))
            last[s] = int(out.logits[i, -1].argmax())
    return seen


def _dense_generation(model: SharpLM, prompts: dict[str, torch.Tensor], chunk: int, decode: int):
    seen = {}
    for s, p in prompts.items():
        seen[s], cache = [], None
        for start in range(0, p.shape[1], chunk):
            out = model.step(p[:, start : start + chunk], cache=cache, return_entropy=True)
            cache = out.cache
            seen[s].append((out.logits[0, -1], out.entropy[0, ..., -1]))
        for _ in range(decode):
            out = model.step(out.logits[:, -1:].argmax(-1), cache=cache, return_entropy=True)
            cache = out.cache
            seen[s].append((out.logits[0, -1], out.entropy[0, ..., -1]))
    return seen


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=pytest.mark.kernels)])
@pytest.mark.parametrize("norm", NORMS)
def test_sharp_lm_on_a_paged_cache_matches_its_dense_cache(norm, impl, monkeypatch):
    """Sequences of different lengths (one page, several, partly filled) prefill in chunks and decode together;
    GQA 4:2 with RoPE. With impl='triton' the chunks of ≤ PAGED_KERNEL_ROWS query rows and the decode steps run the
    paged kernel, the 40-token chunk (80 rows) the dense prefill kernel over the sequence's keys — viewed in place
    (consecutive pages) for half the norms, gathered from a fragmented pool for the other half."""
    scattered = norm in NORMS[::2]
    if impl == "triton":
        pytest.importorskip("triton")
    paged_rows = []
    load = kvcache._paged_impl

    def counting(name):
        kernel = load(name)
        return lambda q, *a, **kw: paged_rows.append(q.shape[2]) or kernel(q, *a, **kw)

    monkeypatch.setattr(kvcache, "_paged_impl", counting)
    torch.manual_seed(0)
    layers = 1 if impl == "triton" else 2  # the interpreter's kernels are slow; layers stack as on the reference
    cfg = ModelConfig(vocab_size=64, dim=32, layers=layers, heads=4, kv_heads=2, context_length=256, norm=norm)
    model = SharpLM(cfg).eval().to(DEVICE)
    g = torch.Generator().manual_seed(2)
    prompts = {"long": torch.randint(0, 64, (1, 70), generator=g), "short": torch.randint(0, 64, (1, 5), generator=g)}
    prompts = {s: p.to(DEVICE) for s, p in prompts.items()}
    assert 40 * 2 > PAGED_KERNEL_ROWS >= 30 * 2
    with torch.inference_mode():
        want = _dense_generation(model, prompts, 40, decode=3)
        got = _paged_generation(model, prompts, 40, impl, decode=3, scattered=scattered)
        if impl == "triton":  # the 70-token prompt again in chunks that all fit the paged kernel
            want_small = _dense_generation(model, {"long": prompts["long"]}, 30, decode=1)
            got_small = _paged_generation(model, {"long": prompts["long"]}, 30, impl, decode=1, scattered=scattered)
            want, got = {**want, "small": want_small["long"]}, {**got, "small": got_small["long"]}
    # the paged kernel ran for every layer of the 30-token chunks, the 5-token prompt and each decode step
    assert sorted(set(paged_rows)) == ([] if impl == "reference" else [1, 5, 10, 30])
    for s in want:
        for (lw, hw), (lg, hg) in zip(want[s], got[s], strict=True):
            torch.testing.assert_close(lg, lw, atol=ATOL_LOOSE, rtol=0)
            torch.testing.assert_close(hg, hw.to(hg.dtype), atol=ATOL_LOOSE, rtol=0)


def test_implementations_are_resolved_once_per_process(monkeypatch):
    """Scanning the installed packages' entry points costs milliseconds — more than a GPU decode step — so attend's
    and the paged cache's implementations are looked up once per process and group, not per call."""
    pytest.importorskip("triton")
    from sharp.models import attention

    scans = []
    real = attention.entry_points
    monkeypatch.setattr(attention, "entry_points", lambda **kw: scans.append(kw["group"]) or real(**kw))
    attention.registered_impl.cache_clear()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, context_length=256, norm="ssa")
    model = SharpLM(cfg).eval().to(DEVICE)
    prompts = {"a": torch.randint(0, 64, (1, 70), device=DEVICE), "b": torch.randint(0, 64, (1, 5), device=DEVICE)}
    with torch.inference_mode():  # 40-token chunks run attend(impl="triton"), shorter ones and decode the pages
        _paged_generation(model, prompts, 40, "triton", decode=3, scattered=False)
        for _ in range(3):
            attention.attend(*torch.randn(3, 1, 2, 8, 16, device=DEVICE).unbind(0), impl="triton", norm="entmax")
    assert sorted(scans) == [attention.IMPL_GROUP, attention.PAGED_IMPL_GROUP]
    with pytest.raises(ValueError, match=r"'cuda-x' is not installed here for sharp\.attention_impls"):
        attention.registered_impl(attention.IMPL_GROUP, "cuda-x")
    attention.registered_impl.cache_clear()
