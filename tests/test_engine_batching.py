"""The engine stepped by hand (serving/engine/) on the graph backends' batch cache (serving/kv/cache.py) and the torch
backend: stop strings, chunked prefill beside running decodes, in-place decode steps, prompts prefilled together,
sequences joining and leaving, the KV budget — each sequence's tokens equal the model's alone."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import greedy_request, run_until_idle, serving

from sharp.models.tokenizer import BYTES
from sharp.serving import (
    Client,
    Engine,
    EngineConfig,
    RequestError,
    load_backend,
)
from sharp.serving.backends.interface import Chunk, _prefill_batches
from sharp.serving.engine.output import Delta, Finished
from sharp.serving.engine.text import StopText
from sharp.serving.kv.cache import BatchCache
from sharp.serving.kv.names import PageNames
from sharp.serving.status import Status
from sharp.v1 import generator_pb2 as pb


def test_stop_strings_end_generation_without_leaking_text(model_files):
    with serving(model_files) as srv, Client(srv.target) as c:
        full = c.generate("stop test", max_new_tokens=40, temperature=0).text
        assert len(full) > 6
        stop = full[3:6]
        r = c.generate("stop test", max_new_tokens=40, temperature=0, stop=[stop, "never-seen"])
        assert r.finish_reason == pb.FINISH_REASON_STOP and r.text == full[: full.find(stop)]
        streamed = "".join(
            ch.text for ch in c.generate_stream("stop test", max_new_tokens=40, temperature=0, stop=[stop])
        )
        assert streamed == r.text


def test_stop_text_holds_back_a_possible_stop_string():
    s = StopText(("END",))
    out = [s.push(c) for c in "abEN"]
    assert "".join(out) == "ab"  # "EN" could start END
    assert s.push("X") == "ENX"
    assert s.push("E") + s.push("N") + s.push("D") == "" and s.stopped
    assert s.text == "abENX"
    u = StopText(("EN",))
    assert u.push("aE") == "a" and u.finish("") == "E"  # held back until the end, then sent
    stream = BYTES.stream()
    assert [stream.step(b) for b in "é".encode()] == ["", "é"]  # a split UTF-8 character is sent whole


def test_a_stop_string_ends_the_request_in_the_engine_too(model_files, reference):
    """The output processor finds the stop string; the scheduler must hear of it: the sequence leaves the batch in
    that step (its slot and cache freed) and nothing follows its Finished."""
    be = load_backend(model_files["onnxruntime"])
    eng = Engine(be, EngineConfig())  # stepped by hand
    prompt = [256, 5, 6, 7]
    text = eng.tokenizer.decode(reference(prompt, 12))
    events = []
    eng.submit(greedy_request(eng, prompt, 400, stop=[text[4:7]]), events.append)
    run_until_idle(eng, steps=20)  # far fewer than the 400 tokens it could have run
    assert isinstance(events[-1], Finished) and events[-1].reason == "stop"
    assert not any(isinstance(ev, Finished) for ev in events[:-1]) and events[-1].completion_tokens <= 12
    assert be.kv_usage() == 0


def test_chunked_prefill_interleaves_with_running_decodes(model_files, reference):
    be = load_backend(model_files["onnxruntime"])
    eng = Engine(be, EngineConfig(prefill_chunk=64))  # stepped by hand: no engine thread
    got: dict[str, list] = {"a": [], "b": []}
    a_prompt, b_prompt = [256, 1, 2, 3], [256, *range(40, 140), *range(40, 140), *range(40, 140)]  # 301 tokens
    eng.submit(greedy_request(eng, a_prompt, 40), lambda ev: isinstance(ev, Delta) and got["a"].extend(ev.token_ids))
    eng.step()
    assert len(got["a"]) == 2  # prefill's token, then one decode step
    eng.submit(greedy_request(eng, b_prompt, 5), lambda ev: isinstance(ev, Delta) and got["b"].extend(ev.token_ids))
    for i in range(5):  # 301 prompt tokens in chunks of 64: four steps prefill, the fifth finishes it
        eng.step()
        assert len(got["a"]) == 3 + i, "the running stream gets a token every step"
        assert (len(got["b"]) > 0) == (i == 4)
    while not eng.idle():
        eng.step()
    assert list(got["a"]) == reference(a_prompt, 40)
    assert list(got["b"]) == reference(b_prompt, 5)


def test_decode_steps_write_into_the_batch_buffers_and_match_the_model(model_files, reference):
    """A file in the op's cache form decodes in place: the batch's buffers stay the same arrays step after step
    (their column `width` written by the kernel, bound as each layer's present) until the room runs out and they
    move once into larger ones; two sequences of different lengths, joining at different steps, get the model's own
    greedy tokens."""
    be = load_backend(model_files["onnxruntime"])
    assert be.in_place
    eng = Engine(be, EngineConfig())  # stepped by hand
    got: dict[str, list] = {"a": [], "b": []}
    prompts = {"a": [256, *range(1, 30)], "b": [256, 5, 6]}
    eng.submit(
        greedy_request(eng, prompts["a"], 150), lambda ev: isinstance(ev, Delta) and got["a"].extend(ev.token_ids)
    )
    eng.step()
    eng.submit(
        greedy_request(eng, prompts["b"], 100), lambda ev: isinstance(ev, Delta) and got["b"].extend(ev.token_ids)
    )
    buffers, moves, widths = None, 0, []
    while not eng.idle():
        eng.step()
        cache = be._batch
        if cache.tensors is not None:
            assert cache.width <= cache.capacity  # the next step's `reserve` makes room when they are equal
            moves += buffers is not None and cache.tensors[0] is not buffers
            buffers = cache.tensors[0]
            widths.append(cache.width)
    assert got["a"] == reference(prompts["a"], 150) and got["b"] == reference(prompts["b"], 100)
    assert 1 <= moves <= 4 and widths == sorted(widths)  # a handful of moves for ~150 steps, not one per step


def test_an_in_place_step_hands_out_its_own_arrays_and_the_binding_leaves_with_the_batch(model_files):
    """The binding of the batch's buffers is kept from step to step and its output arrays are reused: a step's
    logits and entropies must be the caller's (untouched by the next step), and once the batch is gone the binding
    must not keep its buffers alive."""
    be = load_backend(model_files["onnxruntime"])
    be.allocate(2**26)
    assert be.reserve("a", 40)
    be.prefill("a", np.array([[256, 7, 8, 9]]), 0, entropy=True)
    be.join("a")
    first = be.decode(["a"], np.array([[5]]), entropy=True)
    kept = first.logits.copy(), first.entropy.copy()
    second = be.decode(["a"], np.array([[6]]), entropy=True)
    assert np.array_equal(first.logits, kept[0]) and np.array_equal(first.entropy, kept[1])
    assert not np.array_equal(second.logits, first.logits)
    assert be._binding is not None and be._binding.holds(be._batch.tensors)
    be.release("a")
    assert be._batch.tensors is None and be._binding is None


def test_a_prefill_in_place_writes_the_sequences_own_buffers_and_the_batch_takes_them(model_files):
    """In the op's cache form a prefill chunk writes its keys into the sequence's own buffers, as wide as its
    reservation: no chunk copies the keys before it, and the sequence, settling into an empty batch, brings those
    buffers along (no copy before its first decode step). Logits and entropies equal the copying path's (a present
    per chunk, then the batch's copy); the prefix store keeps a copy of its own, not a view of a buffer the batch
    goes on writing."""
    prompt = np.array([[256, *range(30, 130)]])  # 101 tokens, prefilled 40 at a time

    def run(in_place: bool):
        be = load_backend(model_files["onnxruntime"])
        be.in_place, be._batch = in_place, None
        be._batch = be._new_batch()
        be.allocate(2**26, prefix_bytes=2**22 if in_place else 0)
        assert be.reserve("a", 300)
        steps, bases = [], []
        for start in range(0, prompt.shape[1], 40):
            r = be.prefill("a", prompt[:, start : start + 40], start, entropy=True)
            steps.append((r.logits, r.entropy))
            bases.append(be._own["a"][0].base)
        own = be._own["a"]
        assert all(c.shape[2] == prompt.shape[1] for c in own)
        keep = SimpleNamespace(pages=PageNames(prompt[0]), entropy=None) if in_place else None
        be.join("a", keep)
        for token in (5, 6, 7):
            out = be.decode(["a"], np.array([[token]]), entropy=True)
            steps.append((out.logits, out.entropy))
        return be, steps, bases

    be, steps, bases = run(True)
    _, reference_steps, _ = run(False)
    for (logits, ent), (ref_logits, ref_ent) in zip(steps, reference_steps, strict=True):
        np.testing.assert_allclose(logits, ref_logits, atol=1e-6, rtol=0)
        np.testing.assert_allclose(ent, ref_ent, atol=1e-6, rtol=0)
    buffer = bases[0]
    assert buffer is not None and all(b is buffer for b in bases) and buffer.shape[2] == 300  # one buffer, no copy
    assert be._batch.tensors[0] is buffer and be._batch.width == prompt.shape[1] + 3  # the batch took it as it is
    (entry,) = be.prefixes._entries.values()
    assert not any(np.shares_memory(t, buffer) for t in entry.cache)


def test_a_prefill_computes_the_logits_of_its_last_position_only(model_files):
    """The file's `logits_to_keep` input (exporter/kept_logits.py): a prefill chunk and a decode step have
    onnxruntime compute the logits of their last position alone; prompt scores (every position) and a batched
    prefill (rows that end at different columns) all of them. The logits a caller reads are the same either way."""
    be = load_backend(model_files["onnxruntime"])
    assert "logits_to_keep" in be.input_names
    shapes = []
    run, run_bound = be.session.run, be.session.run_with_iobinding

    def spy(names, feed, *rest):
        out = run(names, feed, *rest)
        shapes.append(tuple(out[0].shape))
        return out

    def spy_bound(binding, *rest):
        run_bound(binding, *rest)
        shapes.append(tuple(binding.get_outputs()[0].shape()))

    be.session.run, be.session.run_with_iobinding = spy, spy_bound
    vocab = be.spec.vocab_size
    be.allocate(2**26)
    prompt = np.array([[256, *range(30, 69)]])  # 40 tokens
    for seq in "abcd":
        assert be.reserve(seq, 100)
    last = be.prefill("a", prompt, 0, entropy=True)
    assert shapes[-1] == (1, 1, vocab)
    scored = be.prefill("b", prompt, 0, entropy=True, scores=True)
    assert shapes[-1] == (1, 40, vocab) and scored.scores.shape == (40, vocab)
    np.testing.assert_allclose(last.logits, scored.logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(scored.logits[0], scored.scores[-1], atol=1e-5, rtol=0)
    be.join("a")
    be.decode(["a"], np.array([[7]]), entropy=True)
    assert shapes[-1] == (1, 1, vocab)
    both = be.prefill_many([Chunk("c", prompt[:, :30], 0), Chunk("d", prompt, 0)], entropy=True)
    assert shapes[-1] == (2, 40, vocab)  # one run of both rows, right-padded
    np.testing.assert_allclose(both[1].logits, last.logits, atol=1e-5, rtol=0)


def test_a_buffer_that_fills_beside_a_free_slot_moves_before_the_step_is_laid_out(model_files, reference, caplog):
    """A row left (a free slot, not yet dropped) when the in-place buffers run out of room: the move drops the free
    slot and renumbers the rows, so the step's tokens must be laid out after it — else the batched step fails on a
    shape mismatch and every row reruns alone (a warning, and a step's work twice)."""
    be = load_backend(model_files["onnxruntime"])
    eng = Engine(be, EngineConfig())  # stepped by hand
    prompts = {k: [256, 40 + i, 41 + i] for i, k in enumerate("abcd")}
    lengths = {"a": 4, "b": 90, "c": 90, "d": 90}  # a leaves early; the rest outgrow the first buffers (64 columns)
    got: dict[str, list] = {k: [] for k in prompts}
    for k, ids in prompts.items():
        eng.submit(
            greedy_request(eng, ids, lengths[k]), lambda ev, k=k: isinstance(ev, Delta) and got[k].extend(ev.token_ids)
        )
    moved_beside_a_free_slot = False
    with caplog.at_level(logging.WARNING, logger="sharp.serving"):
        while not eng.idle():
            cache = be._batch
            moved_beside_a_free_slot |= cache.tensors is not None and cache.free > 0 and cache.width == cache.capacity
            eng.step()
    assert moved_beside_a_free_slot  # the case this test is for happened
    assert not [r for r in caplog.records if "one by one" in r.getMessage()]
    assert all(got[k] == reference(prompts[k], lengths[k]) for k in prompts)


def _own_cache(length: int, fill: float, kind: str = "numpy") -> list:
    """One sequence's cache for BatchCache: 2 layers × keys/values of (1, kv_heads 2, length, head_dim 4), as
    NumPy arrays (onnxruntime) or torch tensors (the TensorRT backend's cache)."""
    if kind == "torch":
        return [torch.full((1, 2, length, 4), fill) for _ in range(4)]
    return [np.full((1, 2, length, 4), fill, np.float32) for _ in range(4)]


def _address(t) -> int:
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data


def _one_more_column(t, fill: float):
    """A decode step's present: the cache and one new column."""
    if isinstance(t, torch.Tensor):
        return torch.cat((t, torch.full((*t.shape[:2], 1, t.shape[3]), fill)), 2)
    return np.concatenate((t, np.full((*t.shape[:2], 1, t.shape[3]), fill, t.dtype)), 2)


def test_prompts_prefilled_together_get_what_each_gets_alone(model_files):
    """The graph backends prefill chunks that start together in one forward, right-padded to the longest: each
    sequence still gets its own last-token logits, entropies and a cache exactly its length wide — for first chunks
    of different lengths, and for second chunks over equally wide pasts (concatenated in the batch's order)."""
    be = load_backend(model_files["onnxruntime"])
    be.allocate(64 * 2**20)
    prompts = {"a": [256, 5, 6, 7, 8, 9, 10], "b": [256, 40], "c": [256, 70, 71, 72], "d": [256, 9, 9, 9, 9, 3]}
    firsts = {"x": ([256, 1, 2, 3], [4, 5, 6]), "y": ([256, 7, 8, 9], [10])}  # two chunks: 4 tokens, then 3 or 1
    alone = {}
    for key, ids in [*prompts.items(), *((k, a + b) for k, (a, b) in firsts.items())]:
        out = be.prefill(("alone", key), np.array([ids]), 0, True)
        alone[key] = (out, be._own.pop(("alone", key)))
    rows = []
    real_forward = be.forward
    be.forward = lambda ids, *a, **kw: rows.append(ids.shape[0]) or real_forward(ids, *a, **kw)
    together = be.prefill_many([Chunk(k, np.array([ids]), 0) for k, ids in prompts.items()], True)
    be.prefill_many([Chunk(k, np.array([a]), 0) for k, (a, _) in firsts.items()], True)
    seconds = be.prefill_many([Chunk(k, np.array([b]), 4) for k, (_, b) in firsts.items()], True)
    got = dict(zip([*prompts, *firsts], [*together, *seconds], strict=True))
    assert rows == [4, 2, 2]  # one forward per batch
    for key, out in got.items():
        ref, cache = alone[key]
        n = len(prompts[key]) if key in prompts else 4
        np.testing.assert_allclose(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(out.entropy, ref.entropy[..., -out.entropy.shape[-1] :], atol=1e-4, rtol=1e-4)
        assert out.entropy.shape[-1] == (n if key in prompts else len(firsts[key][1]))
        for mine, theirs in zip(be._own[key], cache, strict=True):
            assert mine.shape == theirs.shape and mine.flags.c_contiguous
            np.testing.assert_allclose(mine, theirs, atol=1e-4, rtol=1e-4)


def test_prefill_batches_share_a_start_and_stay_within_twice_their_tokens():
    lengths_starts = [(100, 0), (2, 0), (3, 5), (2, 0), (60, 0), (1, 5)]
    chunks = [Chunk(i, np.zeros((1, n), np.int64), start) for i, (n, start) in enumerate(lengths_starts)]
    batches = _prefill_batches(chunks)
    assert sorted(i for b in batches for i in b) == list(range(len(chunks)))
    for b in batches:
        assert len({chunks[i].start for i in b}) == 1
        n = [chunks[i].ids.shape[1] for i in b]
        assert n == sorted(n, reverse=True) and len(b) * n[0] <= 2 * sum(n)
    assert batches == [[0, 4, 1], [3], [2, 5]]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_batch_cache_reuses_a_freed_slot_without_moving_the_others(kind):
    cache = BatchCache()
    for key, length, fill in (("a", 3, 1.0), ("b", 5, 2.0), ("c", 2, 3.0)):
        cache.join(key, _own_cache(length, fill, kind), length)
    assert cache.tensors is None and cache.live == 3 and cache.slots() == 15  # new slots wait for settle
    cache.settle()
    assert (cache.owners, cache.lengths, cache.width) == (["a", "b", "c"], [3, 5, 2], 5)
    buffers = [_address(t) for t in cache.tensors]
    cache.leave("a")
    assert (cache.owners, cache.lengths, cache.free, cache.width) == ([None, "b", "c"], [0, 5, 2], 1, 5)
    for t in cache.tensors:
        t[0] = float("nan")  # what a row whose model output went non-finite can leave behind in its slot
    cache.join("d", _own_cache(4, 4.0, kind), 4)
    cache.settle()
    assert cache.owners == ["d", "b", "c"] and [_address(t) for t in cache.tensors] == buffers  # written in place
    for t in cache.tensors:
        assert (t[0, :, :1] == 0).all() and (t[0, :, 1:] == 4).all()  # the left-behind keys are gone
        assert (t[1] == 2).all() and (t[2, :, :3] == 0).all() and (t[2, :, 3:] == 3).all()
    assert cache.attention_mask().tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]]
    assert cache.positions().tolist() == [[4], [5], [2]] and cache.index(["c", "d"]) == [2, 0]
    cache.advance([_one_more_column(t, 9.0) for t in cache.tensors])
    assert cache.lengths == [5, 6, 3] and cache.width == 6
    cache.leave("b")  # the longest leaves: the column only it needed is trimmed; one free slot is kept
    assert (cache.owners, cache.lengths, cache.width, cache.slots()) == (["d", None, "c"], [5, 0, 3], 5, 15)
    cache.advance([_one_more_column(t, 8.0) for t in cache.tensors])
    assert (cache.lengths, cache.width) == ([6, 0, 4], 6)  # the free slot's output column is nobody's key
    cache.join("e", _own_cache(7, 5.0, kind), 7)  # wider than the batch: a new slot, in the copy dropping the free one
    cache.join("f", _own_cache(1, 6.0, kind), 1)
    assert cache.owners == ["d", "f", "c"] and cache.slots() == 4 * 7
    cache.settle()
    assert (cache.owners, cache.lengths, cache.free, cache.width) == (["d", "f", "c", "e"], [6, 1, 4, 7], 0, 7)
    assert [r[0][0, 0, :, 0].tolist() for r in map(cache.row, "dfce")] == [
        [4.0, 4.0, 4.0, 4.0, 9.0, 8.0],
        [6.0],
        [3.0, 3.0, 9.0, 8.0],
        [5.0] * 7,
    ]
    for key in "efc":
        cache.leave(key)
    assert cache.free == 3 and cache.live == 1
    cache.settle()  # three free slots, one live: they are dropped
    assert (cache.owners, cache.lengths, cache.free, cache.width) == (["d"], [6], 0, 6)
    assert cache.row("d")[0][0, 0, :, 0].tolist() == [4.0, 4.0, 4.0, 4.0, 9.0, 8.0]
    cache.join("g", _own_cache(2, 7.0, kind), 2)
    cache.leave("g")  # a pending sequence can leave too
    cache.leave("d")
    assert (cache.tensors, cache.owners, cache.live, cache.slots()) == (None, [], 0, 0)


def test_sequences_joining_and_leaving_at_different_steps_each_match_the_model(model_files, reference):
    be = load_backend(model_files["onnxruntime"])
    eng = Engine(be, EngineConfig(max_batch=4, prefill_chunk=512))  # stepped by hand: no engine thread
    jobs = [([256, *range(1, 1 + 3 * i)], 4 + 5 * (i % 3)) for i in range(10)]  # prompts of 1..28 tokens
    got: dict[int, list] = {}
    seen_free = seen_reuse = 0
    for i, (prompt, n) in enumerate(jobs):
        got[i] = []
        eng.submit(
            greedy_request(eng, prompt, n), lambda ev, i=i: isinstance(ev, Delta) and got[i].extend(ev.token_ids)
        )
        for _ in range(3):  # a new request every three steps: sequences come and go mid-batch
            slots = list(be._batch.owners)
            eng.step()
            seen_free += None in be._batch.owners
            seen_reuse += any(o is None and p is not None for o, p in zip(slots, be._batch.owners, strict=False))
    while not eng.idle():
        eng.step()
    assert seen_free and seen_reuse, "the schedule should free slots and refill them"
    for i, (prompt, n) in enumerate(jobs):
        assert got[i] == reference(prompt, n), f"request {i}"
    assert be._batch.owners == [] and be.kv_usage() == 0


def test_kv_budget_admits_only_what_fits(model_files):
    be = load_backend(model_files["onnxruntime"])
    per_seq = 200 * be.kv_bytes_per_token  # prompt 100 + 100 new tokens
    eng = Engine(be, EngineConfig(kv_cache_mb=2.5 * per_seq / 2**20))
    done = []
    for i in range(4):
        eng.submit(
            greedy_request(eng, [256, *range(1, 100)], 100, seed=i),
            lambda ev: isinstance(ev, Finished) and done.append(ev),
        )
    usage = []
    while not eng.idle():
        eng.step()
        assert len(eng.scheduler.prefilling) + len(eng.scheduler.running) <= 2
        usage.append(eng.metrics.kv_usage._value.get())
    assert len(done) == 4 and max(usage) <= 1.0 and max(usage) > 0.5
    with pytest.raises(RequestError) as err:
        greedy_request(eng, [256] * 10, 600)
    assert err.value.code is Status.RESOURCE_EXHAUSTED and "--kv-cache-mb" in err.value.message


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_the_default_kv_budget_holds_one_request_of_the_whole_context(model_files, backend):
    """Without --kv-cache-mb a prompt of the model's full context is admitted, whatever its KV bytes per token; a
    model whose context fits in 256 MiB keeps 256 MiB."""
    be = load_backend(model_files[backend], backend)
    context = be.spec.context_length
    assert EngineConfig().kv_cache_bytes(be.spec, be.kv_bytes_per_token) == 256 * 2**20
    wide = SimpleNamespace(context_length=1 << 20)  # a context whose cache needs more than 256 MiB
    assert EngineConfig().kv_cache_bytes(wide, be.kv_bytes_per_token) == (1 << 20) * be.kv_bytes_per_token
    assert EngineConfig(kv_cache_mb=1).kv_cache_bytes(wide, be.kv_bytes_per_token) == 2**20
    be.kv_bytes_per_token = 2 * 256 * 2**20 // context  # this model's whole context needs 512 MiB
    eng = Engine(be, EngineConfig())
    assert eng.limits.kv_budget_bytes >= context * be.kv_bytes_per_token
    greedy_request(eng, [256] * (context - 8), 8)  # admitted: no RequestError


@pytest.mark.parametrize("seed", range(170, 181))  # 170, 177, 180: a free slot would pass the budget
def test_random_arrivals_and_cancels_stay_within_the_kv_budget_and_match_the_model(model_files, reference, seed):
    """Free slots (left by finished or cancelled sequences) never take the batch cache past --kv-cache-mb; every
    request that was not cancelled gets the model's own tokens, wherever its slot was."""
    rng = random.Random(seed)
    be = load_backend(model_files["onnxruntime"])
    budget = rng.choice([40, 60, 100])
    eng = Engine(be, EngineConfig(kv_cache_mb=budget * be.kv_bytes_per_token / 2**20, prefill_chunk=512, max_batch=8))
    jobs, usage = [], []
    for step in range(80):
        if step < 60 and rng.random() < 0.4:
            prompt, n = [256, *range(1, rng.randint(1, 12))], rng.randint(1, 12)
            got: list[int] = []
            seq = eng.submit(
                greedy_request(eng, prompt, n), lambda ev, got=got: isinstance(ev, Delta) and got.extend(ev.token_ids)
            )
            jobs.append((seq, prompt, n, got))
        if jobs and rng.random() < 0.15:
            eng.cancel(rng.choice(jobs)[0])
        eng.step()
        usage.append(be.kv_usage())
    while not eng.idle():
        eng.step()
        usage.append(be.kv_usage())
    assert max(usage) <= 1.0
    finished = [(prompt, n, got) for seq, prompt, n, got in jobs if not seq.cancelled]
    assert len(finished) > len(jobs) // 2
    for prompt, n, got in finished:
        assert got == reference(prompt, n)


def test_torch_backend_on_cpu_streams_long_contexts_and_generates_the_same_tokens(model_files, reference, monkeypatch):
    """Past STREAMED_FROM_KEYS keys the CPU torch backend switches to the O(n)-memory streamed attention."""
    import sharp.models.attention as attention
    from sharp.serving.backends import torch_backend

    calls = []
    streamed = attention._streamed
    monkeypatch.setattr(attention, "_streamed", lambda *a: calls.append(1) or streamed(*a))
    monkeypatch.setattr(torch_backend, "STREAMED_FROM_KEYS", 40)
    prompt = "a prompt long enough to cross the threshold: " * 2
    with serving(model_files, "torch") as srv, Client(srv.target) as c:
        r = c.generate(prompt, max_new_tokens=12, temperature=0)
        ids = c.tokenize(prompt, add_bos=True)
    assert len(ids) >= 40 and calls  # the streamed path ran
    assert list(r.token_ids) == reference(ids, 12)
