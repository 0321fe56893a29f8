"""The Prometheus metrics (serving/metrics.py) after real traffic: request counters, latencies, the per-head attention
entropy histograms and their cardinality settings, the model's name and capacity gauges."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from helpers import sample_value, scrape, serving

from sharp.serving import (
    BackgroundServer,
    Client,
    Engine,
    EngineConfig,
    ServerConfig,
    ServingMetrics,
    load_backend,
)

CONTEXT = 4096


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
