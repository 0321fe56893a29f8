"""sharp-serve against real servers on loopback ports with real gRPC clients, and the engine stepped by hand.

The served model is a small random SharpLM (exported once per session) whose weights are drawn wide so that
greedy tokens vary and top-2 logit gaps are wide: batched results can then be compared token for token with
`SharpLM.generate`, one sequence at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import json
import logging
import math
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2
from helpers import greedy_request, run_until_idle, sample_value, scrape, serving, start_sharp_serve
from prometheus_client.parser import text_string_to_metric_families

from sharp.models.tokenizer import BYTES
from sharp.serving import (
    BackgroundServer,
    Client,
    Engine,
    EngineConfig,
    RequestError,
    ServerConfig,
    ServingMetrics,
    load_backend,
)
from sharp.serving.backends.interface import BackendError, Chunk, _prefill_batches
from sharp.serving.engine.output import Delta, Finished
from sharp.serving.engine.text import StopText
from sharp.serving.kv.cache import BatchCache
from sharp.serving.status import Status
from sharp.v1 import generator_pb2 as pb

CONTEXT = 4096


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_generate_matches_the_model_and_streams_the_same_text(model_files, reference, backend):
    with serving(model_files, backend) as srv, Client(srv.target) as c:
        prompt = "def main():\n"
        r = c.generate(prompt, max_new_tokens=24, temperature=0, attention_stats=True)
        ids = c.tokenize(prompt, add_bos=True)
        assert f"attention: {c.info().attention}" == srv.server.engine.backend.attention  # the field says it once
        assert list(r.token_ids) == reference(ids, 24)
        assert len(set(r.token_ids)) > 3  # the check above is not about a constant sequence
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(r.token_ids)
        assert r.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
        stats = r.attention_stats
        assert stats.norm == "ssa" and len(stats.heads) == 4 and stats.positions == len(ids) + len(r.token_ids) - 1
        assert all(0 <= h.mean_normalized_entropy <= 1 and h.mean_entropy >= 0 for h in stats.heads)
        chunks = list(c.generate_stream(prompt, max_new_tokens=24, temperature=0))
        assert "".join(ch.text for ch in chunks) == r.text
        assert [t for ch in chunks for t in ch.token_ids] == list(r.token_ids)
        assert chunks[-1].finish_reason == r.finish_reason
        usage = chunks[-1].usage  # the same prompt again: all but its last token from the prefix cache
        assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)
        assert r.usage.cached_tokens == 0 and usage.cached_tokens == (len(ids) - 1 if backend != "torch" else 0)
        assert all(ch.finish_reason == pb.FINISH_REASON_UNSPECIFIED for ch in chunks[:-1])
        info = c.info()
        assert (info.norm, info.layers, info.heads, info.context_length) == ("ssa", 2, 2, CONTEXT)
        assert set(info.layer_info[0].parameters) == {"ssa_n", "ssa_b"}
        assert len(info.layer_info[0].parameters["ssa_n"].values) == 2


def test_32_concurrent_streams_complete_correctly_and_batch_together(model_files, reference):
    prompts = [f"item {i}: " + "x" * (i % 7) for i in range(32)]
    with serving(model_files, max_batch=32) as srv, Client(srv.target) as c:

        def run(p):
            chunks = list(c.generate_stream(p, max_new_tokens=16, temperature=0))
            return [t for ch in chunks for t in ch.token_ids], c.tokenize(p, add_bos=True)

        with cf.ThreadPoolExecutor(32) as ex:
            results = list(ex.map(run, prompts))
        for ids, prompt_ids in results:
            assert list(ids) == reference(prompt_ids, 16)
        m = scrape(srv)
        steps = sample_value(m, "sharp_batch_size", "sharp_batch_size_count")
        rows = sample_value(m, "sharp_batch_size", "sharp_batch_size_sum")
        assert rows / steps > 1, "decode steps should carry several sequences"
        assert sample_value(m, "sharp_batch_size", "sharp_batch_size_bucket", le="1.0") < steps
        assert sample_value(m, "sharp_requests", "sharp_requests_total", status="ok") == 32


def test_seeded_sampling_is_reproducible(model_files):
    with serving(model_files) as srv, Client(srv.target) as c:
        kw = dict(max_new_tokens=20, temperature=1.0, top_k=50, top_p=0.9)
        a, b = (c.generate("seed", seed=7, **kw).token_ids for _ in range(2))
        others = {tuple(c.generate("seed", seed=s, **kw).token_ids) for s in range(8, 12)}
        assert list(a) == list(b)
        assert len(others | {tuple(a)}) > 1


@pytest.mark.parametrize(
    ("kw", "code", "says"),
    [
        (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "empty prompt"),
        (dict(temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, ">= 0"),
        (dict(top_p=-0.1), grpc.StatusCode.INVALID_ARGUMENT, "[0, 1]"),
        (dict(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "[0, 1]"),
        (dict(top_k=-2), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        (dict(max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "[1, 1000]"),
        (dict(max_new_tokens=1001), grpc.StatusCode.INVALID_ARGUMENT, "[1, 1000]"),
        (dict(prompt=[300]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (dict(prompt="x" * 3500, max_new_tokens=1000), grpc.StatusCode.OUT_OF_RANGE, "context of 4096"),
    ],
)
def test_bad_requests_get_their_status_and_the_server_stays_healthy(model_files, kw, code, says):
    with serving(model_files, max_new_tokens_limit=1000) as srv, Client(srv.target) as c:
        kw = {"prompt": "ok", **kw}
        for call in (c.generate, lambda **k: list(c.generate_stream(**k))):
            with pytest.raises(grpc.RpcError) as err:
                call(**kw)
            assert err.value.code() == code
            assert says in err.value.details()
        assert c.generate("fine", max_new_tokens=3).usage.completion_tokens >= 1
        assert c.health() == "SERVING"
        status = code.name.lower()
        assert sample_value(scrape(srv), "sharp_requests", "sharp_requests_total", status=status) == 2


def test_queue_full_is_resource_exhausted_and_cancel_frees_the_slot(model_files):
    with serving(model_files, max_batch=1, max_queue=1) as srv, Client(srv.target) as c:
        long = c.generate_stream("long", max_new_tokens=3000, temperature=0)
        next(long), next(long)  # running
        queued = cf.ThreadPoolExecutor(1).submit(c.generate, "queued", max_new_tokens=5, temperature=0)
        deadline = time.time() + 10
        while sample_value(scrape(srv), "sharp_queue_size", "sharp_queue_size") < 1 and time.time() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            c.generate("one too many", max_new_tokens=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in err.value.details()
        assert not queued.done()
        long.cancel()
        assert queued.result(timeout=30).usage.completion_tokens >= 1  # started once the cancel freed the slot
        m = scrape(srv)
        assert sample_value(m, "sharp_requests", "sharp_requests_total", status="cancelled") == 1


def test_deadline_exceeded_frees_the_work(model_files):
    with serving(model_files) as srv, Client(srv.target, timeout=0.5) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate("slow", max_new_tokens=3000, temperature=0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.time() + 10
        while srv.server.engine.idle() is False and time.time() < deadline:
            time.sleep(0.01)
        assert srv.server.engine.idle()
        # counted when the step that dropped it publishes, a moment after the scheduler is idle
        while (
            cancelled := sample_value(scrape(srv), "sharp_requests", "sharp_requests_total", status="cancelled")
        ) < 1:
            assert time.time() < deadline
            time.sleep(0.01)
        assert cancelled == 1


def test_metrics_after_traffic(model_files):
    with serving(model_files) as srv, Client(srv.target) as c:
        for i in range(5):
            c.generate(f"metrics {i}", max_new_tokens=8)
        m = scrape(srv)
    assert sample_value(m, "sharp_time_to_first_token_seconds", "sharp_time_to_first_token_seconds_count") == 5
    assert sample_value(m, "sharp_request_duration_seconds", "sharp_request_duration_seconds_count") == 5
    generated = sample_value(m, "sharp_generation_tokens", "sharp_generation_tokens_total")
    assert (
        sample_value(m, "sharp_inter_token_latency_seconds", "sharp_inter_token_latency_seconds_count") == generated - 5
    )
    # each request's gaps add up to its first token → its last, inside its duration after its first token
    sums = {name: sample_value(m, name, f"{name}_sum") for name in ("sharp_inter_token_latency_seconds",
            "sharp_time_to_first_token_seconds", "sharp_request_duration_seconds")}  # fmt: skip
    assert (
        0
        < sums["sharp_inter_token_latency_seconds"]
        <= (sums["sharp_request_duration_seconds"] - sums["sharp_time_to_first_token_seconds"])
    )
    labels = {(s.labels["layer"], s.labels["head"]) for s in m["sharp_attention_entropy_nats"].samples}
    assert labels == {("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")}
    prompt_tokens = sample_value(m, "sharp_prompt_tokens", "sharp_prompt_tokens_total")
    cached = sample_value(m, "sharp_prefix_cache_hits", "sharp_prefix_cache_hits_total")
    assert cached == 4 * (1 + len("metrics "))  # BOS and "metrics " from the second request on
    assert sample_value(m, "sharp_prefix_cache_queries", "sharp_prefix_cache_queries_total") == prompt_tokens + cached
    # the last sampled token of each request is never fed back; cached positions are counted as if prefilled
    positions = prompt_tokens + cached + generated - 5
    for layer, head in labels:
        n = sample_value(
            m, "sharp_attention_entropy_nats", "sharp_attention_entropy_nats_count", layer=layer, head=head
        )
        assert n == positions
        # normalized entropy skips each request's first position (it sees one key: ln 1 = 0)
        n_norm = sample_value(
            m, "sharp_attention_normalized_entropy", "sharp_attention_normalized_entropy_count", layer=layer, head=head
        )
        assert n_norm == positions - 5
        inf = sample_value(
            m,
            "sharp_attention_normalized_entropy",
            "sharp_attention_normalized_entropy_bucket",
            layer=layer,
            head=head,
            le="+Inf",
        )
        le1 = sample_value(
            m,
            "sharp_attention_normalized_entropy",
            "sharp_attention_normalized_entropy_bucket",
            layer=layer,
            head=head,
            le="1.0",
        )
        assert inf == le1 == n_norm  # normalized entropy never exceeds 1
    assert sample_value(m, "sharp_kv_cache_usage_ratio", "sharp_kv_cache_usage_ratio") == 0
    steps = sample_value(m, "sharp_engine_steps", "sharp_engine_steps_total")
    busy = sample_value(m, "sharp_engine_busy_seconds", "sharp_engine_busy_seconds_total")
    forward = sample_value(m, "sharp_engine_forward_seconds", "sharp_engine_forward_seconds_total")
    decodes = sample_value(m, "sharp_batch_size", "sharp_batch_size_count")
    assert steps >= decodes >= generated - 5 and 0 < forward < busy  # the model's forwards are part of the steps


def test_attention_entropies_wait_for_a_scrape_but_never_pile_up(model_files):
    from sharp.serving.metrics import ATTENTION_BATCH

    metrics = ServingMetrics(load_backend(model_files["onnxruntime"]).spec, entropy="head")
    counted = lambda: metrics.attention[0].counts.sum() // 4  # observations per (layer, head)
    metrics.observe_attention(np.full((3, 2, 2), 0.5), np.array([1, 2, 3]))
    assert counted() == 0 and metrics._pending_positions == 3  # a step does not bin
    families = {f.name: f for f in metrics.registry.collect()}
    assert sample_value(families, "sharp_attention_entropy_nats", "sharp_attention_entropy_nats_count") == 3 * 4
    assert counted() == 3 and metrics._pending_positions == 0
    metrics.observe_attention(np.full((ATTENTION_BATCH - 1, 2, 2), 1.0), np.full(ATTENTION_BATCH - 1, 9))
    metrics.bin_due()
    assert counted() == 3 and metrics._pending_positions == ATTENTION_BATCH - 1  # not a batch yet: it waits
    metrics.observe_attention(np.full((1, 2, 2), 1.0), np.full(1, 9))
    assert counted() == 3  # observing never bins: the step's events go out first
    metrics.bin_due()
    assert counted() == 3 + ATTENTION_BATCH and metrics._pending_positions == 0  # a full batch bins at once


def test_a_reader_that_falls_behind_gets_the_pending_text_in_one_delta(model_files, reference):
    be = load_backend(model_files["onnxruntime"])
    eng = Engine(be, EngineConfig()).start()
    ids = [256, *b"slow reader"]

    async def read() -> list[Delta]:
        events = eng.stream(greedy_request(eng, ids, 12))
        await asyncio.sleep(1.0)  # the engine produces every token meanwhile
        return [ev async for ev in events]

    try:
        events = asyncio.run(read())
    finally:
        eng.stop()
    deltas = [ev for ev in events if isinstance(ev, Delta)]
    assert isinstance(events[-1], Finished) and len(deltas) < 12
    assert [t for d in deltas for t in d.token_ids] == reference(ids, 12)
    assert "".join(d.text for d in deltas) == BYTES.decode(reference(ids, 12))


@pytest.mark.parametrize(
    ("mode", "labels"), [("layer", {"model", "layer"}), ("off", None), ("auto", {"model", "layer", "head"})]
)
def test_entropy_metric_cardinality_setting(model_files, mode, labels):
    with serving(model_files, entropy=mode) as srv, Client(srv.target) as c:
        r = c.generate("x", max_new_tokens=4, attention_stats=True)
        m = scrape(srv)
    assert len(r.attention_stats.heads) == 4  # the request's own summary does not depend on the metric setting
    if labels is None:
        assert "sharp_attention_entropy_nats" not in m
    else:
        assert {k for s in m["sharp_attention_entropy_nats"].samples for k in s.labels} - {"le"} == labels


def test_entropy_buckets_reach_ln_context_and_auto_labels_large_models_by_layer():
    from sharp.serving.metrics import HEAD_LABEL_CAP, entropy_buckets, entropy_mode

    for n in (2, 4096, 22_000, 131_072, 1 << 20):
        bounds = entropy_buckets(n)
        assert bounds[-1] >= math.log(n) and list(bounds) == sorted(set(bounds))
        assert bounds[-1] - max(math.log(n), 6) <= 1  # no bucket far above what can happen
    assert entropy_mode("auto", 16, 16) == "head" and HEAD_LABEL_CAP >= 16 * 16
    assert entropy_mode("auto", 32, 32) == "layer" and entropy_mode("head", 32, 32) == "head"
    with pytest.raises(ValueError, match="auto, head, layer, off"):
        entropy_mode("all", 1, 1)


def test_model_name_and_capacity_gauges_reach_the_metrics(model_files):
    import dataclasses

    be = load_backend(model_files["onnxruntime"], "onnxruntime")
    be.spec = dataclasses.replace(be.spec, name="llama-sharp/v2")
    eng = Engine(be, EngineConfig(max_queue=7, max_batch=3), ServingMetrics(be.spec))
    with BackgroundServer(eng, ServerConfig(port=0, metrics_port=0)) as srv, Client(srv.target) as c:
        assert c.info().name == "llama-sharp/v2"
        m = scrape(srv)
    assert sample_value(m, "sharp_queue_capacity", "sharp_queue_capacity", model="llama-sharp/v2") == 7
    assert sample_value(m, "sharp_max_batch", "sharp_max_batch", model="llama-sharp/v2") == 3
    statuses = {
        (s.labels["api"], s.labels["status"]) for s in m["sharp_requests"].samples if s.name == "sharp_requests_total"
    }
    names = ("ok", "cancelled", "invalid_argument", "not_found", "out_of_range", "resource_exhausted", "unavailable")
    assert statuses == {(api, s) for api in ("grpc", "http") for s in (*names, "internal")}  # before any request
    top = max(
        float(s.labels["le"]) for s in m["sharp_attention_entropy_nats"].samples if s.labels.get("le", "+Inf") != "+Inf"
    )
    assert top >= math.log(CONTEXT)


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


def test_auth_token_and_tls(model_files, tmp_path):
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    server = dict(auth_token="s3cret", tls_cert=cert.cert_chain_pems[0].bytes(), tls_key=cert.private_key_pem.bytes())
    with serving(model_files, server=server) as srv:
        root = ca.cert_pem.bytes()
        with Client(srv.target, root_cert=root) as anonymous:
            assert anonymous.health() == "SERVING"  # health is exempt
            with pytest.raises(grpc.RpcError) as err:
                anonymous.generate("x", max_new_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(anonymous.generate_stream("x", max_new_tokens=2))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(srv.target, token="s3cret", root_cert=root) as c:
            assert c.generate("x", max_new_tokens=2).usage.completion_tokens >= 1
        with Client(srv.target, token="s3cret") as plaintext, pytest.raises(grpc.RpcError):
            plaintext.info()  # a plaintext client cannot talk to the TLS port


def test_plaintext_health_port_behind_tls_answers_health_only_and_follows_the_drain(model_files):
    """What a kubelet's gRPC probe needs when the service port speaks TLS: health in plaintext, nothing else."""
    import trustme

    cert = trustme.CA().issue_cert("127.0.0.1")
    tls = dict(tls_cert=cert.cert_chain_pems[0].bytes(), tls_key=cert.private_key_pem.bytes(), health_port=0)
    with serving(model_files, server=tls) as srv:
        port = srv.server.health_port
        assert port and port != srv.server.port
        with Client(f"127.0.0.1:{port}") as probe:
            assert probe.health() == "SERVING" and probe.health("sharp.v1.Generator") == "SERVING"
            with pytest.raises(grpc.RpcError) as err:
                probe.info()
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # the model is not reachable in plaintext
            srv.drain()
            with pytest.raises(grpc.RpcError):  # stopped with the server: the probe fails, as it must
                probe.health()


def test_drain_in_process_health_and_unavailable(model_files):
    with serving(model_files, server=dict(drain_timeout=30)) as srv, Client(srv.target) as c:
        assert c.health() == "SERVING" and c.health("sharp.v1.Generator") == "SERVING"
        stream = c.generate_stream("draining", max_new_tokens=3000, temperature=0)
        next(stream)
        drainer = threading.Thread(target=srv.drain)
        drainer.start()
        deadline = time.time() + 10
        while c.health() == "SERVING" and time.time() < deadline:
            time.sleep(0.01)
        assert c.health("sharp.v1.Generator") == "NOT_SERVING"
        listed = c.health_stub.List(health_pb2.HealthListRequest(), timeout=10).statuses
        assert {v.status for v in listed.values()} == {health_pb2.HealthCheckResponse.NOT_SERVING} and len(listed) == 2
        with pytest.raises(grpc.RpcError) as err:
            c.generate("new", max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)
        assert rest[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED  # the in-flight call finished normally
        drainer.join(timeout=30)


def test_a_drain_deadline_ends_calls_with_a_status_that_says_so(model_files):
    """In-flight calls that outlive --drain-timeout end UNAVAILABLE with the reason (not gRPC's generic
    cancellation), counted once, and the engine is left empty."""
    with serving(model_files, server=dict(drain_timeout=0.3)) as srv, Client(srv.target) as c:
        stream = c.generate_stream("deadline", max_new_tokens=4000, temperature=0, stop=["never"])
        next(stream)
        srv.drain()
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "the server is draining: drain deadline reached before this request finished"
        assert srv.server.engine.idle() and srv.server.calls.inflight == 0
        from prometheus_client import generate_latest

        text = generate_latest(srv.server.engine.metrics.registry).decode()  # the endpoint stopped with the server
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert sample_value(families, "sharp_requests", "sharp_requests_total", status="unavailable") == 1


def test_sharp_serve_sigterm_drains_and_exits_0(model_files):
    proc, line = start_sharp_serve(model_files["onnxruntime"])
    try:
        port = re.search(r" on 127\.0\.0\.1:(\d+)", line).group(1)
        with Client(f"127.0.0.1:{port}") as c:
            stream = c.generate_stream("sigterm", max_new_tokens=600, temperature=0)
            next(stream)
            proc.send_signal(signal.SIGTERM)
            rest = list(stream)
            assert rest[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read()
        assert "draining" in out and "stopped" in out
    finally:
        proc.kill()


def test_an_onnx_server_never_imports_torch(model_files, tmp_path):
    """`sharp-serve MODEL.onnx` serves gRPC (with per-head stats), the OpenAI API and metrics without torch nor any
    torch-backed module of sharp: the interpreter's own import log (`-X importtime`, every module the process ever
    imports) is read after a drain."""
    log = tmp_path / "imports.txt"
    cmd = [sys.executable, "-X", "importtime", "-m", "sharp.serving.cli", str(model_files["onnxruntime"]),
           "--port", "0", "--metrics-port", "0", "--http-port", "0"]  # fmt: skip
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        port = re.search(r" on 127\.0\.0\.1:(\d+)", line).group(1)
        with Client(f"127.0.0.1:{port}") as c:
            reply = c.generate("lean", max_new_tokens=4, temperature=0.8, seed=1, attention_stats=True)
            assert len(reply.token_ids) == 4 and len(reply.attention_stats.heads) > 0
        api = re.search(r"OpenAI API (http://[\d.:]+/v1)", line).group(1)
        body = json.dumps({"model": "tiny", "prompt": "lean", "max_tokens": 3, "temperature": 0}).encode()
        request = urllib.request.Request(f"{api}/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            assert json.load(r)["usage"]["completion_tokens"] == 3
        metrics = re.search(r"metrics (http://\S+/metrics)", line).group(1)
        with urllib.request.urlopen(metrics, timeout=10) as r:
            assert b"sharp_attention_entropy" in r.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    imported = {m.group(1).strip() for m in re.finditer(r"^import time:.*\|\s*(\S+)\s*$", log.read_text(), re.M)}
    assert {"onnxruntime", "sharp.serving.engine.engine", "sharp.models.sampling"} <= imported  # the log is read right
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "triton", "transformers"))
    torch_backed = sorted(imported & {"sharp.models.lm", "sharp.models.normalizers", "sharp.models.attention"})
    assert heavy == [] and torch_backed == [], (heavy[:5], torch_backed)


def test_sharp_serve_logs_one_json_object_per_event_and_reports_its_attention(model_files):
    """`--log-format json`: every stderr line is one JSON object (a cluster's log collector needs no parser), the
    first says what runs the attention, and GetModelInfo reports the same."""
    cmd = [sys.executable, "-m", "sharp.serving.cli", str(model_files["onnxruntime"]), "--port", "0",
           "--metrics-port", "-1", "--log-format", "json"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = re.search(r" on 127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1)
        with Client(f"127.0.0.1:{port}") as c:
            attention = c.info().attention
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        lines = [json.loads(line) for line in proc.stderr.read().splitlines()]
    finally:
        proc.kill()
    assert re.fullmatch(r"the native sharp::SharpAttention kernel \(x86-64-v[234]\)", attention), attention
    first = lines[0]
    assert first["level"] == "info" and first["logger"] == "sharp.serving"
    assert first["message"] == f"tiny: fp32 weights, fp32 KV cache, prefix cache 256 MiB; attention: {attention}"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])


def test_a_second_signal_stops_the_drain(model_files):
    """SIGTERM starts a drain that would wait for a long stream; a second SIGTERM exits at once (status 1)."""
    cmd = [sys.executable, "-m", "sharp.serving.cli", str(model_files["onnxruntime"]), "--port", "0"]
    proc = subprocess.Popen([*cmd, "--metrics-port", "-1", "--drain-timeout", "600"], stdout=subprocess.PIPE, text=True)
    try:
        port = re.search(r" on 127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1)
        with Client(f"127.0.0.1:{port}") as c:
            stream = c.generate_stream("second signal", max_new_tokens=4000, temperature=0, stop=["never"])
            next(stream)
            proc.send_signal(signal.SIGTERM)
            assert proc.stdout.readline().strip() == "sharp-serve: draining"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["/nonexistent.onnx"], "no such file"),
        (["MODEL", "--tls-cert", "x.pem"], "--tls-cert and --tls-key go together"),
        (["MODEL", "--max-batch", "0"], "max-batch must be an integer >= 1"),
        (["MODEL.pt"], "export it with sharp-export"),
        (["MODEL", "--entropy-metrics", "all"], "invalid choice"),
        (["MODEL", "--model-name", "has space"], "--model-name 'has space': 1-128 characters"),
        (["MODEL", "--health-port", "70000"], "--health-port must be in [0, 65535]"),
        (["MODEL", "--port", "5000", "--health-port", "5000"], "--health-port 5000 is taken"),
        (["MODEL", "--http-port", "70000"], "--http-port must be in [0, 65535]"),
        (["MODEL", "--port", "5000", "--http-port", "5000"], "--http-port 5000 is taken"),
        (["MODEL", "--http-host", "0.0.0.0"], "--http-host needs --http-port"),
        (["MODEL", "--dtype", "bf16"], "--dtype applies to --backend torch"),
        (["MODEL.pt", "--backend", "torch", "--dtype", "fp8"], "invalid choice"),
        (["MODEL.pt", "--backend", "torch", "--kv-cache-mb", "0.0001"], "holds no page of 16 tokens"),
        (["MODEL", "--backend", "torch"], "an ONNX file; --backend torch serves a model.pt checkpoint"),
    ],
)
def test_sharp_serve_usage_errors_exit_2_with_one_line(model_files, args, says):
    args = [
        a.replace("MODEL.pt", str(model_files["torch"])).replace("MODEL", str(model_files["onnxruntime"])) for a in args
    ]
    r = subprocess.run([sys.executable, "-m", "sharp.serving.cli", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_sharp_client_commands(model_files, capsys):
    from sharp.serving.cli import client_main

    with serving(model_files) as srv:
        run = lambda *a: subprocess.run(
            [
                sys.executable,
                "-c",
                "import atexit, sys; atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr));"
                "from sharp.serving.cli import client_main; raise SystemExit(client_main())",
                "--target",
                srv.target,
                *a,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        health = run("health")
        assert health.stdout.strip() == "SERVING" and health.returncode == 0
        assert health.stderr.strip() == "False"  # the client never loads torch (it starts in a fraction of a second)
        srv._call(srv.server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
        health = run("health")  # a script or probe relies on the status, as with grpc_health_probe
        assert health.stdout.strip() == "NOT_SERVING" and health.returncode == 1
        srv._call(srv.server.health.set("", health_pb2.HealthCheckResponse.SERVING))
        info = run("info").stdout
        assert '"norm": "ssa"' in info and '"attention": "the native sharp::SharpAttention kernel' in info
        # the connection's flags also after the command, where users put them
        assert client_main(["health", "--target", srv.target, "--timeout", "30"]) == 0
        assert capsys.readouterr().out.strip() == "SERVING"
        r = run("generate", "hello", "--stream", "--max-new-tokens", "5", "--stats")
        assert r.returncode == 0 and "attention (ssa)" in r.stdout and "[finish: " in r.stderr
        bad = run("generate", "hello", "--top-p", "2")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr


def test_async_client(model_files):
    import asyncio

    from sharp.serving import AsyncClient

    async def go(target):
        async with AsyncClient(target) as c:
            unary = await c.generate("async", max_new_tokens=6, temperature=0)
            chunks = [ch async for ch in c.generate_stream("async", max_new_tokens=6, temperature=0)]
            return unary, chunks, await c.info(), await c.health(), await c.tokenize("ab")

    with serving(model_files) as srv:
        unary, chunks, info, health, ids = asyncio.run(go(srv.target))
    assert "".join(ch.text for ch in chunks) == unary.text
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens == 6
    assert (unary.usage.cached_tokens, chunks[-1].usage.cached_tokens) == (0, unary.usage.prompt_tokens - 1)
    assert info.norm == "ssa" and health == "SERVING" and ids == [97, 98]


def test_sharp_serve_model_name_and_health_port_options_reach_the_server(model_files):
    from sharp.serving.cli import build_server, serve_parser

    args = serve_parser().parse_args(
        [str(model_files["onnxruntime"]), "--model-name", "prod-model", "--health-port", "0", "--port", "0"]
    )
    engine, config = build_server(args)
    assert engine.spec.name == "prod-model" and config.health_port == 0
    assert engine.metrics.registry.get_sample_value("sharp_queue_capacity", {"model": "prod-model"}) == 256


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


def test_sharp_serve_help_shows_the_defaults_the_engine_and_server_use(capsys):
    """One source per setting: every sharp-serve option that is an EngineConfig or ServerConfig field defaults to
    that field's default, and --help prints it."""
    from sharp.serving.api.server import ServerConfig
    from sharp.serving.cli import serve_parser
    from sharp.serving.config import EngineConfig

    ap = serve_parser()
    options = {a.dest for a in ap._actions} - {"warm_up"}  # auto|on|off, resolved into the field per --device
    shared = 0
    for config in (EngineConfig(), ServerConfig()):
        for f in dataclasses.fields(config):
            if f.name in options:
                assert ap.get_default(f.name) == getattr(config, f.name), f.name
                shared += 1
    assert shared >= 14
    with pytest.raises(SystemExit):
        ap.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"sequences decoded together (default: {EngineConfig.max_batch})" in text
    assert f"after SIGTERM (default: {ServerConfig.drain_timeout})" in text


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (dict(port=70000), "`port` must be in [0, 65535]"),
        (dict(health_port=-1), "`health_port` must be in [0, 65535]"),
        (dict(drain_timeout=math.inf), "`drain_timeout` must be a finite number"),
        (dict(port=5000, http_port=5000), "`http_port` 5000 is taken by `port`"),
        (dict(port=5000, metrics_port=5000, metrics_host="127.0.0.2"), None),  # another address: no clash
        (dict(http_host="0.0.0.0"), "`http_host` needs `http_port`"),
        (dict(tls_cert=b"pem"), "`tls_cert` and `tls_key` go together"),
    ],
)
def test_server_config_checks_itself_as_the_engine_config_does(model_files, config, says):
    """One check() per config: the CLI's refusals come from it (test above), and so do the API's."""
    from sharp.serving import SharpServer

    if says is None:
        ServerConfig(**config).check()
        return
    with pytest.raises(ValueError) as err:
        ServerConfig(**config).check()
    assert says in str(err.value)
    engine = Engine(load_backend(model_files["onnxruntime"]), EngineConfig())
    with pytest.raises(ValueError, match=re.escape(says)):
        SharpServer(engine, ServerConfig(**config))


def test_grpc_stays_at_the_grpc_edge():
    """The engine, request validation, the backends and the HTTP API speak `Status` and `RequestParams`, not gRPC:
    only the gRPC edge imports grpc or the proto's messages."""
    import ast

    edge = {"server.py", "client.py", "calls.py", "auth.py", "cli.py", "__init__.py"}
    root = Path(__file__).resolve().parents[1] / "serving"
    for path in sorted(root.glob("*.py")):
        if path.name in edge:
            continue
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m.split(".")[0] == "grpc" or m.startswith("sharp.v1") for m in imported), path.name


def test_every_public_name_of_sharp_serving_resolves():
    """The lazy map of sharp.serving (names imported on first use) points each name at the module that has it."""
    import sharp.serving

    for name in sharp.serving.__all__:
        getattr(sharp.serving, name)  # AttributeError when its home module lacks it


def test_the_onnx_server_never_parses_the_graph_itself(model_files, tmp_path, monkeypatch):
    """sharp-serve reads a file's metadata by scanning its top-level fields; onnxruntime alone loads the graph and
    its weights (onnx.load would hold a second copy of every weight at start-up: +400 MiB of peak memory for a
    SmolLM2-sized model). The scan agrees with onnx.load, and refuses what is not an ONNX file."""
    import onnx

    from sharp.exporter import metadata

    path = model_files["onnxruntime"]
    full = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert metadata.file_properties(path) == full and metadata.KEY in full

    def no_load(*a, **kw):
        raise AssertionError("onnx.load called while loading a backend")

    monkeypatch.setattr(onnx, "load", no_load)
    monkeypatch.setattr(onnx, "load_model", no_load)
    be = load_backend(path)
    assert be.spec.metadata == metadata.parse(full[metadata.KEY], full.get(metadata.TOKENIZER_KEY))
    for name, data in (("empty.onnx", b""), ("junk.onnx", b"\xff" * 64), ("text.onnx", b"not a model at all\n")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(BackendError) as err:
            load_backend(tmp_path / name)
        assert str(tmp_path / name) in str(err.value)
