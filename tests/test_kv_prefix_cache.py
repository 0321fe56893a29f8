"""The prefix cache: a prompt that starts as an earlier one did is served from the earlier one's keys, values and
entropies, and answers exactly as it does cold — for every norm in the registry and every backend that runs here
(onnxruntime with the native op and with the fallback bodies, torch on CPU).

Engines are stepped by hand over real backends and compared with a cold engine (`--prefix-cache-mb 0`) on the same
model: greedy tokens, log-probabilities, the request's per-head entropy and what the metrics' histograms receive.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
import torch
from helpers import greedy_request, run_until_idle

from sharp.exporter.export import ExportSettings, export_model
from sharp.models import ModelConfig, SharpLM, save
from sharp.models.registry import NORMS
from sharp.serving import Engine, EngineConfig, ServingMetrics, load_backend
from sharp.serving.config import PAGE_SIZE
from sharp.serving.engine.output import Delta, Finished
from sharp.serving.kv import names as names_module
from sharp.serving.kv.names import PageNames
from sharp.serving.kv.pages import PageAllocator
from sharp.serving.kv.prefix import CANDIDATES, PrefixStore, common_prefix
from sharp.serving.requests import RequestError

BACKENDS = {  # name → how to load a model file for it
    "native": lambda files: load_backend(files["onnx"], "onnxruntime"),
    "fallback": lambda files: load_backend(files["onnx"], "onnxruntime", native=False),
    "torch": lambda files: load_backend(files["pt"], "torch"),
}


@pytest.fixture(scope="module")
def norm_models(tmp_path_factory) -> dict[str, dict]:
    """A tiny byte-level SharpLM per norm, as a checkpoint and as an ONNX export with a KV cache."""
    out = {}
    for norm in NORMS:
        torch.manual_seed(1)
        model = SharpLM(ModelConfig(vocab_size=258, dim=32, layers=2, heads=2, norm=norm, context_length=512))
        with torch.no_grad():  # wide weights: varied greedy text, sharp attention rows
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.2)
        d = tmp_path_factory.mktemp(norm)
        save(model, d / "m.pt")
        onnx.save(export_model(model, ExportSettings(norm=norm)), d / "m.onnx")
        out[norm] = {"pt": d / "m.pt", "onnx": d / "m.onnx"}
    return out


@dataclass
class Answer:
    tokens: list[int]
    logprobs: list[float]
    end: Finished
    entropy_sum: np.ndarray  # what the metrics received: Σ entropy per (layer, head) over the request's positions
    positions: int


def _engine(backend, **config) -> tuple[Engine, list]:
    published: list = []  # the steps' entropy records, as the metrics receive them
    holder: list[Engine] = []

    def publish(st, outbox):
        published.extend(st.entropy)
        holder[0]._publish_here(st, outbox)

    eng = Engine(backend, EngineConfig(**config), ServingMetrics(backend.spec, entropy="head"), publish=publish)
    holder.append(eng)
    return eng, published


def _ask(eng: Engine, published: list, ids, n: int = 8, **kw) -> Answer:
    tokens, logprobs, ends = [], [], []

    def sink(ev):
        if isinstance(ev, Delta):
            tokens.extend(ev.token_ids)
            logprobs.extend(lp.logprob for lp in ev.logprobs or [])
        else:
            ends.append(ev)

    published.clear()
    eng.submit(greedy_request(eng, ids, n, return_attention_stats=True, logprobs=3, **kw), sink)
    run_until_idle(eng)
    (end,) = ends
    assert isinstance(end, Finished), end
    sums = sum(e.astype(np.float64).sum(0) for e, _ in published)
    return Answer(tokens, logprobs, end, sums, sum(len(v) for _, v in published))


def _same(a: Answer, b: Answer) -> None:
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert a.end.prompt_tokens == b.end.prompt_tokens and a.end.positions == b.end.positions
    got = np.array([[h.mean_entropy, h.mean_normalized_entropy] for h in a.end.attention])
    want = np.array([[h.mean_entropy, h.mean_normalized_entropy] for h in b.end.attention])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert a.positions == b.positions
    np.testing.assert_allclose(a.entropy_sum, b.entropy_sum, rtol=1e-5)


def _prompt(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [256, *rng.integers(32, 127, n - 1).tolist()]


def _expected_hit(backend: str, common: int) -> int:
    """Graph backends reuse any common prefix; the paged cache whole pages."""
    return common if backend != "torch" else common // PAGE_SIZE * PAGE_SIZE


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("norm", NORMS)
def test_a_cached_prefix_answers_as_a_cold_prefill_does(norm_models, norm, backend):
    """A conversation's next turn: the earlier turn's prompt (37 tokens: the hit ends mid-page) is cached, the new
    prompt extends it; tokens, log-probabilities and entropies are the cold engine's, the cached tokens reported."""
    files = norm_models[norm]
    prompt = _prompt(0, 60)
    cold_eng, cold_pub = _engine(BACKENDS[backend](files), prefix_cache_mb=0, prefill_chunk=24)
    cold = _ask(cold_eng, cold_pub, prompt)
    assert cold.end.cached_tokens == 0
    warm_eng, warm_pub = _engine(BACKENDS[backend](files), prefill_chunk=24)
    first = _ask(warm_eng, warm_pub, prompt[:37], n=1)  # its cache: those 37 tokens
    assert first.end.cached_tokens == 0
    warm = _ask(warm_eng, warm_pub, prompt)
    assert warm.end.cached_tokens == _expected_hit(backend, 37) > 0
    _same(warm, cold)
    again = _ask(warm_eng, warm_pub, prompt)  # the same prompt again: all but its last token (a page less on torch)
    assert again.end.cached_tokens == (59 if backend != "torch" else 48)
    _same(again, cold)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_block_is_named_by_its_whole_prefix(norm_models, backend):
    """The same tokens after another prefix are not a hit: with A = X·Y and B = Z·W cached, C = Z·Y reuses Z only
    (a block hash without its parent would serve Y's keys computed after X)."""
    files = norm_models["softmax"]
    x, y, z, w, tail = (_prompt(s, 32)[1:] for s in range(1, 6))  # 31 tokens each: with BOS, X ends on a page
    a, b, c = [256, *x, *y[:32]], [256, *z, *w[:32]], [256, *z, *y[:32], *tail[:8]]
    cold_eng, cold_pub = _engine(BACKENDS[backend](files), prefix_cache_mb=0)
    cold = _ask(cold_eng, cold_pub, c)
    eng, pub = _engine(BACKENDS[backend](files))
    _ask(eng, pub, a, n=1)
    _ask(eng, pub, b, n=1)
    warm = _ask(eng, pub, c)
    assert warm.end.cached_tokens == 32
    _same(warm, cold)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_salted_prefix_is_found_only_with_its_salt(norm_models, backend):
    """vLLM's cache_salt: a prompt's pages are named from its salt, so its prefix is a hit for the same salt only —
    cached_tokens, exact, would otherwise tell one client what another's prompt begins with (an oracle that gave 4
    of 4 characters of a secret in 32-38 guesses). Unsalted and other-salted requests see nothing of it, and the
    salted hit answers as a cold prefill does."""
    files = norm_models["softmax"]
    prompt = _prompt(7, 60)
    cold_eng, cold_pub = _engine(BACKENDS[backend](files), prefix_cache_mb=0)
    cold = _ask(cold_eng, cold_pub, prompt)
    eng, pub = _engine(BACKENDS[backend](files))
    assert _ask(eng, pub, prompt, n=1, cache_salt="tenant-a").end.cached_tokens == 0
    assert _ask(eng, pub, prompt, cache_salt="tenant-b").end.cached_tokens == 0
    assert _ask(eng, pub, prompt).end.cached_tokens == 0
    assert _ask(eng, pub, prompt, n=1, cache_salt="tenant-c").end.cached_tokens == 0  # nor of the unsalted one
    hit = _ask(eng, pub, prompt, cache_salt="tenant-a")
    assert hit.end.cached_tokens == (59 if backend != "torch" else 48)
    _same(hit, cold)
    with pytest.raises(RequestError, match="cache_salt must be 1 to 1024 characters"):
        greedy_request(eng, prompt, 4, cache_salt="")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_eviction_under_a_tiny_budget_keeps_answers_right(norm_models, backend):
    files = norm_models["ssa"]
    probe = BACKENDS[backend](files)
    per_token = probe.kv_bytes_per_token
    budget_mb = 80 * per_token / 2**20  # room for one 64-token prompt's cache, not two
    eng, pub = _engine(BACKENDS[backend](files), prefix_cache_mb=budget_mb)
    cold_eng, cold_pub = _engine(BACKENDS[backend](files), prefix_cache_mb=0)
    p, q = _prompt(7, 64), _prompt(8, 64)
    full = _expected_hit(backend, 63)
    _ask(eng, pub, p, n=2)
    _ask(eng, pub, q, n=2)  # evicts p's (or, paged, p's tail pages first)
    again = _ask(eng, pub, p, n=4)
    assert again.end.cached_tokens < full
    _same(again, _ask(cold_eng, cold_pub, p, n=4))
    assert _ask(eng, pub, p, n=4).end.cached_tokens == full  # the most recent is kept
    if backend == "torch":
        assert eng.backend.cache.allocator.cached_pages <= 5
    else:
        assert eng.backend.prefixes.nbytes <= budget_mb * 2**20 and len(eng.backend.prefixes) == 1


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_requests_sharing_a_prefix_at_once_and_a_cancelled_one(norm_models, backend):
    """Three requests on one cached document run together and each gets its cold answer; a request cancelled
    mid-prefill leaves nothing held (the KV gauge back to 0) and what it computed serves the next one."""
    files = norm_models["adaptive"]
    doc = _prompt(11, 70)
    cold_eng, cold_pub = _engine(BACKENDS[backend](files), prefix_cache_mb=0)
    questions = [doc + _prompt(20 + i, 9)[1:] for i in range(3)]
    colds = [_ask(cold_eng, cold_pub, q) for q in questions]
    eng, pub = _engine(BACKENDS[backend](files), prefill_chunk=16)
    _ask(eng, pub, doc, n=1)
    tokens, ends = {i: [] for i in range(3)}, {}
    for i, q in enumerate(questions):
        eng.submit(
            greedy_request(eng, q, 8, return_attention_stats=True),
            lambda ev, i=i: tokens[i].extend(ev.token_ids) if isinstance(ev, Delta) else ends.__setitem__(i, ev),
        )
    run_until_idle(eng)
    for i in range(3):
        assert tokens[i] == colds[i].tokens
        assert ends[i].cached_tokens == _expected_hit(backend, 70)
    assert eng.backend.kv_usage() == 0
    # a cancelled request: prefilled 16 of its 100 new tokens, then cancelled
    long = _prompt(30, 100)
    seq = eng.submit(greedy_request(eng, long, 4), lambda ev: None)
    eng.step()
    assert 0 < seq.length < len(long)
    computed = seq.length
    eng.cancel(seq)
    eng.step()
    assert eng.idle() and eng.backend.kv_usage() == 0
    if backend == "torch":
        assert eng.backend.cache.allocator.cached_pages >= 1 and not eng.backend.cache.tables
    after = _ask(eng, pub, long)
    assert after.end.cached_tokens == _expected_hit(backend, computed) > 0
    _same(after, _ask(cold_eng, cold_pub, long))


def test_prompt_logprobs_are_computed_not_read_and_the_counters_move(norm_models):
    files = norm_models["ssmax"]
    eng, pub = _engine(BACKENDS["native"](files))
    prompt = _prompt(3, 40)
    _ask(eng, pub, prompt, n=2)
    scored = _ask(eng, pub, prompt, n=2, prompt_logprobs=1)
    assert scored.end.cached_tokens == 0
    hit = _ask(eng, pub, prompt, n=2)
    assert hit.end.cached_tokens == 39
    queries = eng.metrics.prefix_queries["grpc"]._value.get()
    hits = eng.metrics.prefix_hits["grpc"]._value.get()
    assert (queries, hits) == (80, 39)  # the scoring request was not looked up
    assert "prefix cache 256 MiB" in eng.prefix_cache


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_what_a_failed_request_offered_is_withdrawn(norm_models, backend):
    """A running request's prompt is offered from its join; if it then fails (its cache may be what failed), the
    offer is withdrawn: the same prompt afterwards is prefilled cold. One that ends well keeps it."""
    files = norm_models["softmax"]
    eng, pub = _engine(BACKENDS[backend](files))
    prompt = _prompt(4, 40)
    seq = eng.submit(greedy_request(eng, prompt, 5), lambda ev: None)
    eng.step()  # prefilled and joined: its prompt is offered now
    # what a second request would find, asked of the running engine's backend
    assert eng.backend.admit("probe", PageNames(prompt), 48, True, False).tokens == _expected_hit(backend, 39)
    eng.backend.release("probe", None)
    eng._fail_forward(seq, "a test")  # what a forward failure does to it
    run_until_idle(eng)
    assert seq.kept() is None
    assert _ask(eng, pub, prompt, n=2).end.cached_tokens == 0
    assert _ask(eng, pub, prompt, n=2).end.cached_tokens == _expected_hit(backend, 39)  # kept: it ended well


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_a_requests_pages_are_named_once(norm_models, backend, monkeypatch):
    """A request's page names are computed once — not again each step it waits to be admitted, nor when it joins
    the batch and when it leaves: each full page of its prompt and fed-back tokens is hashed once."""
    hashed = []
    real = names_module._name
    monkeypatch.setattr(names_module, "_name", lambda *a: hashed.append(1) or real(*a))
    eng, _ = _engine(BACKENDS[backend](norm_models["softmax"]), kv_cache_mb=0.05)  # room for one of them at a time
    for seed in (1, 2):
        eng.submit(greedy_request(eng, _prompt(seed, 40), 20), lambda ev: None)
    waited = 0
    for _ in range(500):
        if eng.idle():
            break
        waited += len(eng.scheduler.waiting)
        eng.step()
    assert eng.idle() and waited >= 10  # the second asked to be admitted step after step
    assert len(hashed) == 2 * ((40 + 19) // PAGE_SIZE)  # per request: its prompt and 19 tokens fed back, 3 pages


# ---- the pieces alone --------------------------------------------------------------------------------------------
def test_page_names_chain_the_parent_and_are_computed_once(monkeypatch):
    a = PageNames(range(48), 16).names()
    b = PageNames([99, *range(1, 48)], 16).names()
    assert len(a) == 3 and len(PageNames(range(47), 16).names()) == 2
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]  # every later page differs with the first
    assert PageNames(range(48), 16).names() == a
    hashed = []
    real = names_module._name
    monkeypatch.setattr(names_module, "_name", lambda *x: hashed.append(1) or real(*x))
    prompt = PageNames(range(40), 16)
    for _ in range(5):  # admission asks every step while a request waits
        assert prompt.names(39) == a[:2]
    kept = prompt.extended([*range(48), 7])  # its prompt and the tokens generated since
    assert kept.names() == a and len(hashed) == 3  # each page once: the third when it filled
    assert prompt.extended(range(20)).names() == a[:1] and len(hashed) == 3


def test_the_allocator_keeps_released_named_pages_as_free_and_evicts_the_oldest_tail_first():
    pool = PageAllocator(6, keep=4)
    a = pool.allocate(3)
    for page, digest in zip(a, (b"x", b"y", b"z"), strict=True):
        assert pool.register(page, digest)
    assert not pool.register(a[0], b"w")  # named already
    pool.release(a)
    assert pool.free_pages == 6 and pool.cached_pages == 3 and pool.usage() == 0
    got = pool.lookup([b"x", b"y", b"q", b"z"])  # stops at the first miss
    assert got == a[:2] and pool.cached_pages == 1 and pool.usage() == pytest.approx(2 / 6)
    other = pool.allocate(4)  # 3 truly free + the kept z (the tail) evicted
    assert a[2] in other and pool.cached_pages == 0 and pool.lookup([b"x", b"y", b"z"]) == a[:2]
    with pytest.raises(ValueError, match="double free"):
        pool.release(other + other[:1])
    pool.release(a[:2])
    pool.release(a[:2])  # held twice (two lookups): now kept
    with pytest.raises(ValueError, match="double free"):
        pool.release(a[:1])
    assert pool.cached_pages == 2
    off = PageAllocator(2)  # keep=0: nothing is named, released pages are free
    p = off.allocate(1)
    assert not off.register(p[0], b"x")
    off.release(p)
    assert off.lookup([b"x"]) == [] and off.free_pages == 2


def test_the_graph_store_matches_the_longest_prefix_within_its_budget():
    def cache(n):
        return [np.full((1, 1, n, 2), float(n), np.float32)]  # 8 bytes a token

    store = PrefixStore(8 * 100)
    store.put(PageNames(np.arange(50)), cache(50), None)
    store.put(PageNames(np.arange(60)), cache(60), np.zeros((1, 1, 60), np.float32))  # extends the first: replaces it
    assert len(store) == 1 and store.nbytes == 480
    entry, n = store.match(PageNames(np.arange(80)), entropy=True)
    assert n == 60 and entry.cache[0][0, 0, 0, 0] == 60
    assert store.match(PageNames(np.arange(60)), entropy=False)[1] == 59  # capped at all but the last token
    store.put(PageNames(np.arange(100, 150)), cache(50), None)  # 400 more bytes: the first goes
    assert len(store) == 1 and store.match(PageNames(np.arange(80)), entropy=False) == (None, 0)
    assert store.match(PageNames(np.arange(100, 130)), entropy=True) == (None, 0)  # no entropies kept for it
    assert common_prefix(np.arange(5), np.array([0, 1, 7]), None) == 2
    store.put(PageNames(np.arange(500)), cache(500), None)  # larger than the budget: its first 100 tokens are kept
    assert store.match(PageNames(np.arange(200)), entropy=False)[1] == 100
    few = PrefixStore(10**6, max_entries=2)  # a flood of short prompts: the entries stay few, the oldest go
    for start in (0, 1000, 2000):
        few.put(PageNames(np.arange(start, start + 3)), cache(3), None)
    assert len(few) == 2 and few.match(PageNames(np.arange(0, 3)), entropy=False) == (None, 0)
    assert few.match(PageNames(np.arange(2000, 2003)), entropy=False)[1] == 2


def test_a_graph_lookup_walks_the_prompts_pages_not_the_entries():
    """512 kept caches (the most a store keeps) that share their first page: a lookup compares at most CANDIDATES of
    them token by token, whatever their number, and finds the longest — whole pages by name, then token by token."""
    store = PrefixStore(10**9)
    base = np.arange(16)
    for i in range(511):  # each: the shared page, then a page of its own
        store.put(PageNames(np.concatenate([base, np.full(20, 1000 + i)])), [np.zeros((1, 1, 36, 2), np.float32)], None)
    store.put(PageNames(np.arange(100)), [np.zeros((1, 1, 100, 2), np.float32)], None)
    assert len(store) == 512
    store.comparisons = 0
    entry, n = store.match(PageNames(np.concatenate([np.arange(70), [5, 5]])), entropy=False)
    assert n == 70 and len(entry.tokens) == 100 and store.comparisons == 1  # the one entry on the prompt's 4 pages
    store.comparisons = 0
    entry, n = store.match(PageNames(np.concatenate([base, np.full(10, 1000 + 510), [1]])), entropy=False)
    assert n == 26 and entry.tokens[-1] == 1510 and store.comparisons <= CANDIDATES  # past the shared page
    store.comparisons = 0
    assert store.match(PageNames(np.arange(500, 600)), entropy=False) == (None, 0) and store.comparisons <= CANDIDATES
    # a lookup that needs entropies walks the pages they cover: a longer entry kept without them hides nothing
    both = PrefixStore(10**9)
    both.put(PageNames(np.arange(64)), [np.zeros((1, 1, 64, 2), np.float32)], np.zeros((1, 1, 64), np.float32))
    both.put(PageNames(np.arange(128)), [np.zeros((1, 1, 128, 2), np.float32)], None)
    assert len(both) == 2 and both.match(PageNames(np.arange(100)), entropy=False)[1] == 99
    entry, n = both.match(PageNames(np.arange(100)), entropy=True)
    assert n == 64 and len(entry.tokens) == 64


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_n_choices_share_one_prefill(norm_models, backend):
    """n = 3 choices of one prompt: choice 0 prefills it, the others wait for that and start from its cache; each
    samples as a request alone with its seed (seed + i) does on a cold engine."""
    files = norm_models["entmax"]
    prompt = _prompt(40, 53)
    eng, _ = _engine(BACKENDS[backend](files), prefill_chunk=16)
    req = greedy_request(eng, prompt, 6, return_attention_stats=True)
    req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, temperature=1.0), seed=7)
    tokens, ends = {i: [] for i in range(3)}, {}
    choices = req.choices(3)
    assert len({r.group for r in choices}) == 1 and choices[0].group and [r.seed for r in choices] == [7, 8, 9]
    for r in choices:
        eng.submit(r, lambda ev, i=r.choice: tokens[i].extend(ev.token_ids) if isinstance(ev, Delta)
                   else ends.__setitem__(i, ev))  # fmt: skip
    run_until_idle(eng)
    hit = _expected_hit(backend, 52)
    assert [ends[i].cached_tokens for i in range(3)] == [0, hit, hit]
    prefilled = eng.metrics.prompt_tokens["grpc"]._value.get()
    assert prefilled == 53 + 2 * (53 - hit)  # the prompt once, then each later choice's uncached tail
    cold, _ = _engine(BACKENDS[backend](files), prefix_cache_mb=0)
    for i in range(3):
        alone = []
        cold.submit(
            dataclasses.replace(req, seed=7 + i), lambda ev, a=alone: isinstance(ev, Delta) and a.extend(ev.token_ids)
        )
        run_until_idle(cold)
        assert tokens[i] == alone
    assert len({tuple(t) for t in tokens.values()}) > 1  # the seeds differ: so do the choices


def test_paged_cached_pages_are_evicted_before_a_request_is_refused(norm_models):
    """A pool of 8 pages, all of them kept after a first request: the gauge reads 0, and a request that needs 7
    pages is admitted (the kept pages evicted, the tail first) instead of waiting for ever."""
    files = norm_models["softmax"]
    probe = BACKENDS["torch"](files)
    mb = 8 * PAGE_SIZE * probe.kv_bytes_per_token / 2**20
    eng, pub = _engine(BACKENDS["torch"](files), kv_cache_mb=mb)
    allocator = eng.backend.cache.allocator
    first = _prompt(50, 100)
    _ask(eng, pub, first, n=4)  # 103 tokens cached: 6 full pages kept
    assert allocator.cached_pages == 6 and eng.backend.kv_usage() == 0 and allocator.free_pages == 8
    other = _prompt(51, 100)
    got = _ask(eng, pub, other, n=10)  # 110 tokens: 7 pages, 2 of them only by evicting kept ones
    assert got.end.cached_tokens == 0 and len(got.tokens) == 10
    assert allocator.cached_pages == 1 + 6  # the first's head page survived (tails go first), beside the new 6
    assert _ask(eng, pub, first[:40], n=1).end.cached_tokens == 16
