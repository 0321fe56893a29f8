"""Exact sparse entmax decode (models/sparse_decode.py): on a paged cache whose pages are scattered, reused and
written by prefill chunks and by single decode tokens, the decode that skips pages by their key summaries equals
dense entmax (`attend`, reference) within 1e-6 in outputs and entropies — on the cases a bound can get wrong: a
dominant key against negative query components, a dominant key written by a decode step, ties exactly at τ, all
scores equal (nothing skippable), pages straddling τ, GQA, per-head α, ASEntmax's λ of either sign, ALiBi — and
reads few pages where few carry weight, and the values of few keys where few can."""

from __future__ import annotations

import re

import pytest
import torch
from devices import ATOL

from sharp.models import attend
from sharp.models.sparse_decode import FIRST_PAGES, sparse_entmax_decode
from sharp.serving.kv.pages import PagedKVCache

PAGE = 16
TOL = 1e-6


def _fill(hkv: int, d: int, keys: list[torch.Tensor], decode_tokens: int, seed: int) -> tuple[PagedKVCache, list]:
    """A cache holding each sequence's keys (and random values): pages handed out interleaved with a sequence that
    is then freed (its pages, holding large stale keys, reused from their first slot); each sequence's keys
    written by a prefill chunk, then its last `decode_tokens` one token per step."""
    g = torch.Generator().manual_seed(seed)
    longest = max(k.shape[1] for k in keys)
    pages = max(sum(-(-k.shape[1] // PAGE) for k in keys) + 1, 3 + 2 * len(keys))  # the freed pages must be used
    cache = PagedKVCache(1, hkv, d, pages, PAGE, bounds=True)
    cache.reserve("stale", 3 * PAGE)
    step = cache.step(["stale"], 3 * PAGE)
    stale = torch.randn(2, 1, hkv, 3 * PAGE, d, generator=g)
    step.layer(0).write(stale[0] * 50, stale[1])
    step.commit()
    seqs = list(range(len(keys)))
    for t in range(0, longest, PAGE):  # one page at a time for each sequence in turn: no sequence's pages are a run
        for s, k in zip(seqs, keys, strict=True):
            if t < k.shape[1]:
                cache.reserve(s, min(t + PAGE, k.shape[1]))
        if t == PAGE:
            cache.free("stale")  # its pages come back with their keys in them
    values = [torch.randn(1, hkv, k.shape[1], d, generator=g) for k in keys]
    for s, k, v in zip(seqs, keys, values, strict=True):
        n = k.shape[1] - decode_tokens
        step = cache.step([s], n)
        step.layer(0).write(k[None, :, :n], v[:, :, :n])
        step.commit()
        for i in range(n, k.shape[1]):
            step = cache.step([s], 1)
            step.layer(0).write(k[None, :, i : i + 1], v[:, :, i : i + 1])
            step.commit()
    return cache, seqs


IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.kernels)]


def _compare(q, keys, alpha, *, impl="torch", decode_tokens=3, query_scale=None, alibi=None, seed=0):
    """Sparse decode of q (B, Hq, D) against dense entmax of each sequence: the torch path's (returns its stats) or
    the Triton paged kernel's with the page summaries (Triton's interpreter; returns the pages each sequence's KV
    head read, (B, Hkv), the pages read for τ_S apart)."""
    hkv, d = keys[0].shape[0], keys[0].shape[2]
    cache, seqs = _fill(hkv, d, keys, decode_tokens, seed)
    step = cache.step(seqs, 0)
    kp, vp = step.layer(0).pools
    if impl == "torch":
        out, ent, stats = sparse_entmax_decode(
            q, kp, vp, cache.bounds[0], step.block_table, step.seq_lens, alpha, query_scale=query_scale,
            alibi_slopes=alibi,
        )  # fmt: skip
    else:
        from sharp.plugins.triton.paged import paged_decode

        stats = torch.full((len(seqs), hkv), -1, dtype=torch.int32)
        lam = None if query_scale is None else query_scale[:, :, None]
        norm = "entmax" if lam is None else "asentmax"
        args = (q[:, :, None], kp.transpose(0, 1), vp.transpose(0, 1), step.block_table, step.seq_lens)
        kw = dict(norm=norm, alpha=alpha, alibi_slopes=alibi, query_scale=lam)
        out, ent = paged_decode(*args, **kw, page_bounds=cache.bounds[0], pages_read=stats)
        dense, dense_ent = paged_decode(*args, **kw)  # the same kernels reading every page: equal within 1e-6
        torch.testing.assert_close(out, dense, atol=TOL, rtol=0)
        torch.testing.assert_close(ent, dense_ent, atol=TOL, rtol=0)
        out, ent = out[:, :, 0], ent[:, :, 0]
    tol = TOL if impl == "torch" else ATOL  # the kernels' own rounding against the reference: the suite's bound
    held_by = []
    for b, s in enumerate(seqs):
        k, v = cache.gather(s, 0)
        lam = None if query_scale is None else query_scale[b : b + 1, :, None]
        want, want_ent = attend(
            q[b : b + 1, :, None], k, v, norm="asentmax" if lam is not None else "entmax", alpha=alpha,
            query_scale=lam, alibi_slopes=alibi, return_entropy=True,
        )  # fmt: skip
        torch.testing.assert_close(out[b], want[0, :, 0], atol=tol, rtol=0)
        torch.testing.assert_close(ent[b], want_ent[0, :, 0], atol=tol, rtol=0)
        if impl == "torch":  # the pages holding weight: dense's weights, read out through one-hot values
            n = k.shape[2]
            eye = torch.eye(n).expand(1, hkv, n, n)
            w = attend(
                q[b : b + 1, :, None], k, eye, norm="asentmax" if lam is not None else "entmax", alpha=alpha,
                query_scale=lam, alibi_slopes=alibi,
            )[0, :, 0]  # fmt: skip
            paged = torch.nn.functional.pad(w, (0, -n % PAGE)).view(w.shape[0], -1, PAGE)
            clear, held = (paged > 1e-6).any(-1).sum(-1), (paged > 0).any(-1).sum(-1)  # per query head
            weighted = [h[2] for h in stats.by_head]
            held_by.append((clear, held))
    if impl == "torch":  # every page with clear weight counted, none beyond those with any; kept ⊇ weighted
        clear, held = (sum(x) for x in zip(*held_by, strict=True))
        assert all(int(c) <= h_ <= int(a) for c, h_, a in zip(clear, weighted, held, strict=True)), (weighted, held)
        assert all(pages >= kept >= w for pages, kept, w in stats.by_head) and stats.weighted == sum(weighted)
    return stats


def _dominant(hkv: int, d: int, lengths: list[int], q: torch.Tensor, where: list[int], g) -> list[torch.Tensor]:
    """Random keys with, for each query head, one key along the negative part of its query at where[b] − its index
    in the group: the components where a bound from the keys' maxima alone falls short."""
    keys = []
    group = q.shape[1] // hkv
    for b, n in enumerate(lengths):
        k = torch.randn(hkv, n, d, generator=g)
        for h in range(q.shape[1]):
            neg = q[b, h].clamp(max=0)
            k[h // group, where[b] - h % group] = neg / neg.norm() * 8 * d**0.5
        keys.append(k)
    return keys


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("decode_written", [False, True], ids=["prefill-written", "decode-written"])
def test_a_dominant_key_is_found_and_the_rest_skipped(decode_written, impl):
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, lengths = 4, 2, 32, [700, 1000]
    q = torch.randn(2, hq, d, generator=g)
    where = [n - 2 if decode_written else 300 for n in lengths]  # the last 3 keys are written by decode steps
    keys = _dominant(hkv, d, lengths, q, where, g)
    stats = _compare(q, keys, torch.full((hq,), 1.5), impl=impl)
    if impl == "triton":  # each KV head's two query heads weigh keys on one page (where, where − 1): read alone
        assert stats.tolist() == [[1, 1], [1, 1]], stats
        return
    assert stats.pages == hq * sum(-(-n // PAGE) for n in lengths)
    assert stats.kept == 2 * hq and stats.reads == FIRST_PAGES * 2 * hq, stats  # each row reads the pages for
    # τ_S and keeps the dominant key's alone: its u is far above every other page's bound (a reused page's summary,
    # restarted, is tight too)
    assert stats.values == 2 * hq, stats  # and of its page's 16 keys weighs the dominant one alone
    assert stats.weighted == 2 * hq and [h[1:] for h in stats.by_head] == [(2, 2)] * hq, stats  # per head: 2 rows


@pytest.mark.parametrize("impl", IMPLS)
def test_all_equal_scores_skip_nothing_and_stay_exact(impl):
    hq, hkv, d, lengths = 2, 2, 16, [100, 37]
    keys = [torch.randn(hkv, n, d, generator=torch.Generator().manual_seed(n)) for n in lengths]
    stats = _compare(torch.zeros(2, hq, d), keys, torch.full((hq,), 1.5), impl=impl)  # q = 0: uniform weights
    if impl == "triton":
        assert stats.tolist() == [[7, 7], [3, 3]], stats  # every page of both sequences
        return
    assert stats.kept == stats.pages and stats.values == hq * sum(lengths)  # every key holds weight: all weighed
    assert stats.weighted == stats.pages and [h[2] for h in stats.by_head] == [10, 10]  # 7 + 3 pages a head


@pytest.mark.parametrize("impl", IMPLS)
def test_ties_exactly_at_tau_and_pages_straddling_it(impl):
    """Sparsemax (α = 2), q = 4·e₀ and scale 1/4: z = k₀ exactly. One key at z = 1 and the rest below 0 but for
    two pages of keys at exactly 0 = τ (weight zero, kept: a page is skipped only strictly below τ_S's margin);
    then keys at 0.5 on pages that also hold lower keys — τ lies between, the pages straddle it."""
    hq, hkv, d, n = 2, 1, 16, 400
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(hkv, n, d, generator=g)
    keys[..., 0] = -0.25
    keys[0, 5, 0] = 1.0
    keys[0, 64:96, 0] = 0.0  # two whole pages at τ
    q = torch.zeros(1, hq, d)
    q[..., 0] = 4.0
    stats = _compare(q, [keys.clone()], torch.full((hq,), 2.0), impl=impl)  # τ = 0
    if impl == "triton":
        assert 3 <= int(stats) < 25 / 2, stats  # the key's page and the two at τ, of 25
    else:
        assert stats.kept < stats.pages / 2, stats
    keys[0, [40, 41, 200, 333], 0] = 0.5
    _compare(q, [keys], torch.full((hq,), 2.0), impl=impl)
    keys[0, :, 0] = -0.25
    keys[0, [16 * i + 3 for i in range(FIRST_PAGES)], 0] = 1.0  # the support of the pages read first: τ_S = 7/8
    keys[0, 300, 0] = 0.8755  # just above τ_S on a page not read first: weight 4.4e-4 (τ* = 0.87506)
    stats = _compare(q, [keys], torch.full((hq,), 2.0), impl=impl)
    assert (int(stats) if impl == "triton" else stats.kept / hq) == FIRST_PAGES + 1, stats
    keys[0, [40, 41, 200, 333], 0] = 0.5  # pages holding 0.5 and 0 straddle τ
    _compare(q[:1], [keys], torch.full((hq,), 2.0), impl=impl)
    keys[0, :, 0] = -0.25
    keys[0, 5, 0], keys[0, 250, 0] = 1.0, 2e-3  # τ* = 1e-3: the second key, just above max(u) − 1 = 0, weighs 1e-3
    stats = _compare(q, [keys], torch.full((hq,), 2.0), impl=impl)
    assert (int(stats) == 2) if impl == "triton" else (stats.values == 2 * hq), stats  # both keys weighed, nothing else


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("alpha", [2.0, 3.0, 4.0])
def test_a_support_wider_than_the_first_pages_is_found_by_the_newton_floor(alpha, impl):
    """The largest keys spread one a page over more pages than τ_S reads, with keys just below τ* between: the
    floor that τ_S and max(u) − 1 give admits those, the Newton steps shut them out — and at α > 2, where a step
    can land past τ*, the steps kept are only those still at or below it."""
    hq, hkv, d, n = 2, 1, 16, 1200
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(hkv, n, d, generator=g)
    keys[..., 0] = -1.0
    top = [16 * i + 7 for i in range(5 * FIRST_PAGES)]  # one key a page on 40 pages
    keys[0, top, 0] = 1.0 + torch.rand(len(top), generator=g) * 1e-2
    keys[0, [16 * i + 9 for i in range(45, 70)], 0] = 0.9  # below τ* (0.975 at α = 2), above τ_S (about 7/8)
    q = torch.zeros(1, hq, d)
    q[..., 0] = 4.0
    stats = _compare(q, [keys], torch.full((hq,), alpha), impl=impl)
    if impl == "torch" and alpha == 2.0:
        assert stats.values == hq * len(top), stats


@pytest.mark.parametrize(("alphas", "searched"), [([1.25, 1.5, 2.0, 1.75], False), ([1.5, 1.5, 3.0, 1.5], True)])
def test_newton_finds_tau_where_alpha_is_at_most_2_and_the_search_runs_past_it(alphas, searched, monkeypatch):
    """The final weights come from τ* by Newton's method for α ≤ 2, with no search; one head with α > 2 sends its
    rows to entmax's own search (and the result is exact either way)."""
    from sharp.models import sparse_decode

    calls = []
    search = sparse_decode.entmax
    monkeypatch.setattr(sparse_decode, "entmax", lambda *a, **k: calls.append(1) or search(*a, **k))
    monkeypatch.setattr(sparse_decode, "SOLVE", 8)  # quadratic from the Newton floor: a handful of steps settle it
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 32, generator=g)
    keys = [torch.randn(2, n, 32, generator=g) * 2 for n in (300, 517)]
    _compare(q, keys, torch.tensor(alphas))
    assert bool(calls) == searched, calls


@pytest.mark.parametrize("impl", IMPLS)
def test_gqa_with_per_head_alpha_asentmax_of_either_sign_and_alibi(impl):
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, lengths = 4, 2, 32, [513, 64, 250]
    q = torch.randn(3, hq, d, generator=g)
    keys = _dominant(hkv, d, lengths, q, [17, 60, 249], g)
    alpha = torch.tensor([1.25, 1.5, 2.0, 3.0])
    _compare(q, keys, alpha, impl=impl)
    lam = torch.rand(3, hq, generator=g) * 2.5 + 0.5
    lam[0, 2] = -1.3  # a negative scale flips the order of the logits: the lower bound is the one that counts
    _compare(q, keys, alpha, query_scale=lam, impl=impl)
    _compare(q, keys, alpha, alibi=torch.tensor([0.05, -0.02, 0.3, 0.0]), impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_alibi_alone_puts_the_support_at_the_far_end_of_a_page(impl):
    """q = 0: the logits are ALiBi's term alone, slope·(j − i). A positive slope puts the support on the newest keys
    — the last page's last ones, 4 positions after its first — a negative one on the oldest, at the first page's
    start: a bound that took the term at one end of every page would skip the page that holds the weight."""
    hq, hkv, d, n = 2, 1, 16, 213  # the last page holds positions 208..212
    keys = [torch.randn(hkv, n, d, generator=torch.Generator().manual_seed(9))]
    stats = _compare(torch.zeros(1, hq, d), keys, torch.full((hq,), 2.0), alibi=torch.tensor([0.3, -0.3]), impl=impl)
    pages = -(-n // PAGE)
    assert (int(stats) if impl == "triton" else stats.kept) < pages, stats


@pytest.mark.kernels
def test_the_triton_kernel_never_loads_a_skipped_page():
    """The pages the Triton decode may skip hold keys that would outweigh every other and NaN values (their
    summaries as written before): the output is what it was — a skipped page's keys are never loaded, not loaded
    and then ignored. Kept clean: each row's FIRST_PAGES pages with the highest bounds (read for τ_S) and the
    dominant keys' page."""
    from sharp.models.sparse_decode import page_bounds
    from sharp.plugins.triton.paged import paged_decode

    g = torch.Generator().manual_seed(4)
    hq, hkv, d, lengths = 4, 2, 32, [900, 450]
    q = torch.randn(2, hq, d, generator=g)
    where = [500, 200]
    keys = _dominant(hkv, d, lengths, q, where, g)
    cache, seqs = _fill(hkv, d, keys, 3, 0)
    step = cache.step(seqs, 0)
    kp, vp = step.layer(0).pools
    args = (q[:, :, None], kp.transpose(0, 1), vp.transpose(0, 1), step.block_table, step.seq_lens)
    # one split: a program walks all of its sequence's pages, 4 a turn, and skips pages inside a turn it reads
    kw = dict(norm="entmax", alpha=torch.full((hq,), 1.5), page_bounds=cache.bounds[0], splits=1)
    clean, clean_ent = paged_decode(*args, **kw)
    bound = page_bounds(q, cache.bounds[0], step.block_table, step.seq_lens, PAGE, d**-0.5, torch.ones(2, hq), None)
    first = bound.topk(FIRST_PAGES, dim=-1).indices  # (B, Hq, FIRST_PAGES) pages of the sequence
    poisoned = 0
    for b, n in enumerate(lengths):
        for h in range(hkv):
            keep = set(first[b, 2 * h : 2 * h + 2].flatten().tolist()) | {where[b] // PAGE}
            for page in set(range(-(-n // PAGE))) - keep:
                slot = int(step.block_table[b, page])
                kp[h, slot] = 1e3 * q[b, 2 * h : 2 * h + 2].sum(0)  # loaded, it would outweigh every key
                vp[h, slot] = float("nan")
                poisoned += 1
    assert poisoned > 70
    read = torch.zeros(2, hkv, dtype=torch.int32)
    out, ent = paged_decode(*args, **kw, pages_read=read)
    assert read.tolist() == [[1, 1], [1, 1]], read
    torch.testing.assert_close(out, clean, atol=0, rtol=0)
    torch.testing.assert_close(ent, clean_ent, atol=0, rtol=0)


@pytest.mark.kernels
def test_the_triton_kernel_refuses_bounds_it_cannot_use():
    """Summaries of another shape, and summaries for a norm whose weights are never exactly zero: one line each."""
    from sharp.plugins.triton.paged import paged_decode

    hkv, d = 1, 16
    cache, seqs = _fill(hkv, d, [torch.randn(hkv, 40, d)], 1, 0)
    step = cache.step(seqs, 0)
    kp, vp = (pool.transpose(0, 1) for pool in step.layer(0).pools)
    args = (torch.randn(1, 2, 1, d), kp, vp, step.block_table, step.seq_lens)
    with pytest.raises(ValueError, match=r"page bounds must be \(2, 1, "):
        paged_decode(*args, norm="entmax", page_bounds=cache.bounds[0][:, :, :-1])
    with pytest.raises(ValueError, match="entmax family only, not softmax"):
        paged_decode(*args, norm="softmax", page_bounds=cache.bounds[0])


def test_alpha_one_is_refused():
    hkv, d = 1, 8
    cache, seqs = _fill(hkv, d, [torch.randn(hkv, 20, d)], 1, 0)
    step = cache.step(seqs, 0)
    with pytest.raises(ValueError, match="alpha > 1"):
        sparse_entmax_decode(
            torch.randn(1, 1, d), *step.layer(0).pools, cache.bounds[0], step.block_table, step.seq_lens,
            torch.ones(1),
        )  # fmt: skip


@pytest.mark.parametrize("norm", ["entmax", "asentmax"])
def test_the_torch_backend_decodes_sparsely_with_the_models_own_tokens_and_reports_the_skipped_share(norm, tmp_path):
    """An entmax-family SharpLM on the torch backend: the engine's greedy tokens after a 700-token prompt are the
    model's own (dense cache), with and without skipping pages; the share skipped reaches Prometheus per layer."""
    from helpers import greedy_request, run_until_idle

    from sharp.models import ModelConfig, SharpLM, save
    from sharp.models.sampling import GREEDY
    from sharp.serving import Engine, EngineConfig
    from sharp.serving.backends.torch_backend import TorchBackend
    from sharp.serving.engine.output import Delta
    from sharp.serving.metrics import ServingMetrics

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=258, dim=64, layers=2, heads=4, kv_heads=2, norm=norm, context_length=2048)
    model = SharpLM(cfg)
    with torch.no_grad():  # wide weights: peaked attention and varied greedy text
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    save(model, tmp_path / "m.pt")
    prompt = [256, *torch.randint(0, 256, (700,), generator=torch.Generator().manual_seed(1)).tolist()]
    want = model.eval().generate(prompt, 12, GREEDY)
    for sparse in (True, False):
        be = TorchBackend(tmp_path / "m.pt", sparse=sparse)
        assert be.sparse == sparse and ("skips the pages" in be.attention) == sparse
        metrics = ServingMetrics(be.spec, entropy="off")
        eng = Engine(be, EngineConfig(), metrics)
        got: list[int] = []
        eng.submit(
            greedy_request(eng, prompt, 12), lambda ev, got=got: isinstance(ev, Delta) and got.extend(ev.token_ids)
        )
        run_until_idle(eng)
        assert got == want, sparse
        steps = metrics.registry.get_sample_value(
            "sharp_attention_pages_skipped_ratio_count", {"model": be.spec.name, "layer": "1"}
        )
        assert steps == (11 if sparse else None)  # every decode step after the prompt's (which is a prefill)
        if sparse:
            share = metrics.registry.get_sample_value(
                "sharp_attention_pages_skipped_ratio_sum", {"model": be.spec.name, "layer": "1"}
            )
            assert 0 < share / steps < 1


@pytest.mark.kernels
@pytest.mark.parametrize("norm", ["entmax", "asentmax"])
def test_the_triton_kernels_serve_the_zoo_models_sparsely_with_their_own_tokens(norm):
    """The zoo's trained entmax and ASEntmax models on the torch backend through the Triton kernels (the GPU's
    path; here the interpreter): after a 200-byte prompt of their held-out text the engine's greedy tokens are the
    model's own (dense cache), and most KV pages go unread — their trained heads put their weight on a few keys."""
    from helpers import greedy_request, run_until_idle

    from sharp.models.checkpoint import load, zoo_dir
    from sharp.models.corpus import validation_text
    from sharp.models.sampling import GREEDY
    from sharp.serving import Engine, EngineConfig
    from sharp.serving.backends.torch_backend import TorchBackend
    from sharp.serving.engine.output import Delta
    from sharp.serving.metrics import ServingMetrics

    path = zoo_dir() / f"{norm}.pt"
    prompt = [256, *validation_text().encode()[:200]]
    want = load(path).eval().generate(prompt, 4, GREEDY)
    be = TorchBackend(path, impl="triton", sparse=True)
    metrics = ServingMetrics(be.spec, entropy="off")
    eng = Engine(be, EngineConfig(), metrics)
    got: list[int] = []
    eng.submit(greedy_request(eng, prompt, 4), lambda ev: isinstance(ev, Delta) and got.extend(ev.token_ids))
    run_until_idle(eng)
    assert got == want
    shares = []
    for layer in range(be.spec.layers):
        labels = {"model": be.spec.name, "layer": str(layer)}
        steps = metrics.registry.get_sample_value("sharp_attention_pages_skipped_ratio_count", labels)
        assert steps == 3  # the decode steps after the prompt's prefill
        shares.append(metrics.registry.get_sample_value("sharp_attention_pages_skipped_ratio_sum", labels) / steps)
    assert all(0 <= x < 1 for x in shares) and sum(shares) / len(shares) > 0.3, shares


@pytest.mark.parametrize("seed", range(4))
def test_page_bounds_hold_every_key_of_the_page(seed):
    """The bound of each page is ≥ the exact logit of every key on it — q of both signs, λ of both signs, ALiBi
    slopes of both signs — and it is the page's largest logit where it can be: q along one axis with λ = 1, or
    q = 0 with ALiBi (on the full pages: the last one's bound reaches its unwritten slots)."""
    from sharp.models.sparse_decode import page_bounds

    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, lengths = 4, 2, 16, [200, 77]
    keys = [torch.randn(hkv, n, d, generator=g) * 3 for n in lengths]
    cache, seqs = _fill(hkv, d, keys, 5, seed)
    step = cache.step(seqs, 0)
    q = torch.randn(2, hq, d, generator=g)
    lam = torch.randn(2, hq, generator=g) * 2
    slopes = torch.tensor([0.5, -0.25, 1.0, 0.0])
    one, axis = torch.ones(2, hq), q * (torch.arange(d) == 0)
    for qq, ll, alibi in ((q, lam, slopes), (q, one, None), (axis, one, None), (q * 0, one, slopes)):
        bound = page_bounds(qq, cache.bounds[0], step.block_table, step.seq_lens, PAGE, d**-0.5, ll, alibi)
        for b, s in enumerate(seqs):
            k, _ = cache.gather(s, 0)
            n = k.shape[2]
            heads = torch.arange(hq) // (hq // hkv)
            z = torch.einsum("hd,hnd->hn", qq[b], k[0, heads]) * d**-0.5
            if alibi is not None:
                z = z + alibi[:, None] * (torch.arange(n) - (n - 1))
            z = z * ll[b][:, None]
            pages = -(-n // PAGE)
            zmax = torch.nn.functional.pad(z, (0, pages * PAGE - n), value=float("-inf")).view(hq, pages, PAGE).amax(-1)
            assert bool((bound[b, :, :pages] >= zmax - 1e-4).all())
            assert bool((bound[b, :, pages:] == float("-inf")).all())
            if bool((ll == 1).all()) and bool((qq[:, :, 1:] == 0).all()):
                full = pages if alibi is None else n // PAGE
                torch.testing.assert_close(bound[b, :, :full], zmax[:, :full], atol=1e-5, rtol=0)


@pytest.mark.bench
def test_the_benchmark_times_the_three_sides_and_reports_the_skipped_share(tmp_path, capsys):
    """`sharp-bench sparse-decode` end to end on two tiny models, with the native op's table (`--native`: its sparse
    and dense outputs equal); a wrong argument is one line and exit 2."""
    from sharp.benchmarks import sparse as bench
    from sharp.models import ModelConfig, SharpLM, save

    for norm, pos, context in (("entmax", "nape", 1024), ("softmax", "rope", 128)):  # the zoo's differ so too
        torch.manual_seed(0)
        save(
            SharpLM(ModelConfig(vocab_size=258, dim=32, layers=2, heads=2, norm=norm, pos=pos, context_length=context)),
            tmp_path / f"{norm}.pt",
        )
    models = ["--entmax", str(tmp_path / "entmax.pt"), "--softmax", str(tmp_path / "softmax.pt")]
    page = tmp_path / "bench.md"
    args = ["--lengths", "200", "--rounds", "2", "--steps", "1", "--native", "--write", str(page)]
    assert bench.run([*models, *args]) == 0
    text = page.read_text()
    native = text[text.index("on the native onnxruntime op") :].splitlines()
    cells = next(line for line in native if line.startswith("| 200 |")).split("|")[2:-1]
    assert len(cells) == 7 and all("×" in c for c in cells[3:6])  # three sides, three ratios, max |Δ|
    assert float(cells[6]) <= 1e-6  # the native op's sparse decode equals its dense decode
    assert "The softmax model decodes past its recorded context of 128 at 200 keys" in text
    assert "The entmax model decodes past" not in text
    row = next(line for line in text.splitlines() if line.startswith("| 200 |") and "×" in line and "±" in line)
    assert len(row.split("|")) == 9  # context, three sides, three ratios
    share = next(line for line in text.splitlines() if line.startswith("| 200 |") and "%" in line)
    assert all(0 <= float(c.strip(" %")) <= 100 for c in share.split("|")[2:-1])
    heads = [line.split("|")[3:-1] for line in text.splitlines() if line.startswith("| 200 | ") and "(" in line]
    assert len(heads) == 2 and all(len(h) == 2 for h in heads), heads  # a row per layer, a cell per head
    for cell in (c for h in heads for c in h):  # read ≥ holding weight > 0: every head weighs its own page at least
        read, held = (float(x) for x in re.fullmatch(r" ([\d.]+)% \(([\d.]+)%\) ", cell).groups())
        assert 100 >= read >= held > 0, cell
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        bench.run([*models[:2], "--softmax", str(tmp_path / "nope.pt")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "nope.pt is not a file" in err and len(err.splitlines()) == 1
