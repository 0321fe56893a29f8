"""Prometheus metrics (docs/serving.md): vLLM-style serving metrics with a `sharp_` prefix and a `model` label, plus
per-layer/per-head attention entropy histograms fed by the attention's own entropy output.

The attention histograms are updated once per engine step with NumPy bucket counts for every (position,
layer, head) of the step, instead of one Python `observe` per value, and exposed through a custom collector;
`entropy="layer"` aggregates the heads of a layer to bound the cardinality, `"off"` disables them, and `"auto"`
(the default) is per head up to HEAD_LABEL_CAP (layer, head) pairs and per layer above. The entropy buckets reach
ln(context length) of the served model, the entropy of a fully dispersed head at full context.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from sharp.serving.requests import Limits
from sharp.serving.spec import ModelSpec
from sharp.serving.stats import APIS, RequestOutcome, StepStats

access = logging.getLogger("sharp.access")
ENTROPY_MODES = ("auto", "head", "layer", "off")
METRIC_NAMES = ("sharp", "vllm")  # sharp_ series only, or also the vllm: series routers and gateways read
# Above this many (layer, head) pairs "auto" labels the entropy histograms by layer only: each pair costs 35-40
# series (two histograms' buckets, +Inf, _sum and _count), so the cap bounds them near 10K per replica, where a
# 32-layer × 32-head model labelled by head would make ~38K.
HEAD_LABEL_CAP = 256
# Final statuses of a request: ok, cancelled (client cancel, disconnect or deadline), or the gRPC status it got.
STATUSES = (
    "ok",
    "cancelled",
    "invalid_argument",
    "not_found",  # the HTTP API: a model name that is not the served one
    "out_of_range",
    "resource_exhausted",
    "unavailable",
    "internal",
)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOW_ENTROPY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0)
NORMALIZED_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SKIPPED_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 1.0)
ATTENTION_BATCH = 4096  # query positions of entropy that wait for a scrape at most (bounds their memory)


def entropy_buckets(context_length: int) -> tuple[float, ...]:
    """Fine buckets near 0 (sharp heads), then one per nat up to the first integer >= ln(context_length), so a
    dispersed head at full context still lands in a finite bucket."""
    top = max(math.ceil(math.log(max(context_length, 2))), 7)
    return LOW_ENTROPY_BUCKETS + tuple(float(b) for b in range(7, top + 1))


def entropy_mode(requested: str, layers: int, heads: int) -> str:
    """The label granularity `requested` resolves to for a model of this shape."""
    if requested not in ENTROPY_MODES:
        raise ValueError(f"entropy metrics must be one of {', '.join(ENTROPY_MODES)}, got {requested!r}")
    if requested == "auto":
        return "head" if layers * heads <= HEAD_LABEL_CAP else "layer"
    return requested


class AttentionHistogram:
    """One histogram per layer (and head) whose observations arrive as arrays."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...], model: str, layers: int, heads: int, mode: str):
        self.name, self.doc, self.model, self.mode = name, doc, model, mode
        self.bounds = np.asarray(bounds)
        groups = (layers, heads) if mode == "head" else (layers, 1)
        self.counts = np.zeros((*groups, len(bounds) + 1), dtype=np.int64)  # last bucket: above every bound
        self.sums = np.zeros(groups)
        self.lock = threading.Lock()

    def observe(self, values: np.ndarray) -> None:
        """values (N, layers, heads); NaN (undefined) entries are skipped."""
        if self.mode == "layer":
            values = values.transpose(0, 2, 1).reshape(-1, values.shape[1], 1)  # every head is an observation
        n_buckets = len(self.bounds) + 1
        bucket = np.searchsorted(self.bounds, values, side="left")  # Prometheus buckets are `le`
        valid = ~np.isnan(values)
        group = np.arange(values.shape[1] * values.shape[2]).reshape(1, values.shape[1], values.shape[2])
        flat = (np.broadcast_to(group, values.shape) * n_buckets + bucket)[valid]
        counts = np.bincount(flat, minlength=self.counts.size).reshape(self.counts.shape)
        sums = np.where(valid, values, 0.0).sum(0)
        with self.lock:
            self.counts += counts
            self.sums += sums

    def collect(self) -> HistogramMetricFamily:
        labels = ["model", "layer", "head"] if self.mode == "head" else ["model", "layer"]
        family = HistogramMetricFamily(self.name, self.doc, labels=labels)
        with self.lock:
            counts, sums = self.counts.copy(), self.sums.copy()
        edges = [*(floatToGoString(b) for b in self.bounds), "+Inf"]  # "1.0", as prometheus-client writes it
        for layer in range(counts.shape[0]):
            for head in range(counts.shape[1]):
                cumulative = np.cumsum(counts[layer, head])
                values = [self.model, str(layer)] + ([str(head)] if self.mode == "head" else [])
                family.add_metric(values, list(zip(edges, cumulative.tolist(), strict=True)), float(sums[layer, head]))
        return family


class _AttentionCollector:
    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics

    def collect(self):
        self.metrics.flush_attention()
        for h in self.metrics.attention:
            yield h.collect()


@dataclass
class Load:
    """A replica's load as of the engine's last step: what routers and the inference gateway's endpoint picker
    balance by (GET /get_load, the load gauges)."""

    waiting: int = 0
    running: int = 0
    kv_used: float = 0.0  # tokens held in the KV cache / its capacity (reservations not counted)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache so far, every API
    prefix_hits: int = 0  # of which found


class _VLLMCollector:
    """The load series under vLLM's names (`vllm:`, label `model_name`), for the routers and endpoint pickers
    configured for vLLM: the same values as sharp's own series, read at scrape time."""

    def __init__(self, metrics: ServingMetrics, model: str):
        self.metrics, self.model = metrics, model

    def collect(self):
        m, label = self.metrics, ["model_name"]
        load = m.load
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests prefilling or decoding.", load.running),
            ("vllm:num_requests_waiting", "Requests waiting for admission.", load.waiting),
            ("vllm:kv_cache_usage_perc", "KV cache in use, 0-1 (tokens held / capacity).", load.kv_used),
            ("vllm:gpu_cache_usage_perc", "The same, under vLLM's older name.", load.kv_used),
        ):
            family = GaugeMetricFamily(name, doc, labels=label)
            family.add_metric([self.model], value)
            yield family
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's shape.",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])  # fmt: skip
        info.add_metric([self.model, str(m.block_size), str(m.blocks)], 1.0)
        yield info
        for name, doc, total in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", load.prefix_queries),
            ("vllm:prefix_cache_hits", "Of them, those found.", load.prefix_hits),
        ):
            family = CounterMetricFamily(name, doc, labels=label)
            family.add_metric([self.model], total)
            yield family


class ServingMetrics:
    """Every metric of one served model, in its own registry (several servers can share a process). The load
    gauges are in a second, small registry too (`load_registry`: GET /metrics/load), for a picker that scrapes
    every few tens of milliseconds and should not be sent the entropy histograms each time."""

    def __init__(
        self,
        spec: ModelSpec,
        entropy: str = "auto",
        registry: CollectorRegistry | None = None,
        names: str = "sharp",
    ):
        if names not in METRIC_NAMES:
            raise ValueError(f"metric names must be one of {', '.join(METRIC_NAMES)}, got {names!r}")
        self.registry = registry or CollectorRegistry()
        self.load_registry = CollectorRegistry()
        self.load = Load()
        self.block_size = self.blocks = 0
        self.entropy = entropy = entropy_mode(entropy, spec.layers, spec.heads)
        model, r = spec.name, self.registry

        def load_gauge(name, doc, labels=("model",)):  # in both registries
            gauge = Gauge(name, doc, list(labels), registry=None)
            r.register(gauge)
            self.load_registry.register(gauge)
            return gauge

        def per_api(kind, name, doc, **kw):  # the series of each API (requests' own measures), created up front
            family = kind(name, doc, ["model", "api"], registry=r, **kw)
            return {api: family.labels(model, api) for api in APIS}

        def per_model(kind, name, doc):  # a Counter or Gauge of this model's one series
            return kind(name, doc, ["model"], registry=r).labels(model)

        latency = {"buckets": LATENCY_BUCKETS}
        self.ttft = per_api(
            Histogram, "sharp_time_to_first_token_seconds", "Arrival to the first generated token.", **latency
        )
        self.inter_token = per_api(
            Histogram, "sharp_inter_token_latency_seconds", "Time between consecutive generated tokens.", **latency
        )
        self.duration = per_api(
            Histogram, "sharp_request_duration_seconds", "Arrival to the end of the request.", **latency
        )
        self.queue_time = per_api(
            Histogram, "sharp_request_queue_seconds", "Arrival to admission into the running batch.", **latency
        )
        self.batch_size = Histogram(
            "sharp_batch_size", "Sequences in each batched decode step.", ["model"], registry=r, buckets=BATCH_BUCKETS
        ).labels(model)
        requests = Counter(
            "sharp_requests", "Requests by API and final status.", ["model", "api", "status"], registry=r
        )
        # every series exists from the start, so the first error shows in rate()
        self._requests = {(api, s): requests.labels(model, api, s) for api in APIS for s in STATUSES}
        self.prompt_tokens = per_api(Counter, "sharp_prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = per_api(Counter, "sharp_generation_tokens", "Tokens generated.")
        self.prefix_queries = per_api(
            Counter, "sharp_prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission."
        )
        self.prefix_hits = per_api(
            Counter, "sharp_prefix_cache_hits", "Of the prompt tokens looked up, those found (not prefilled)."
        )
        self.queue_size = load_gauge("sharp_queue_size", "Requests waiting for admission.").labels(model)
        self.queue_capacity = per_model(
            Gauge, "sharp_queue_capacity", "Requests that may wait (--max-queue); more are refused."
        )
        self.max_batch = per_model(Gauge, "sharp_max_batch", "Sequences decoded together at most (--max-batch).")
        self.running = load_gauge("sharp_running_requests", "Requests prefilling or decoding.").labels(model)
        self.kv_usage = per_model(
            Gauge,
            "sharp_kv_cache_usage_ratio",
            "KV cache reserved (pages, or padded rows) / --kv-cache-mb; cached prefixes nobody holds count as free.",
        )
        self.kv_used = load_gauge(
            "sharp_kv_cache_used_ratio",
            "KV cache holding tokens of running requests / --kv-cache-mb (what is used, not what is reserved).",
        ).labels(model)
        self._block_size = load_gauge("sharp_kv_cache_block_size", "Tokens per KV cache block.").labels(model)
        self._blocks = load_gauge("sharp_kv_cache_blocks", "KV cache blocks in --kv-cache-mb.").labels(model)
        self.steps = per_model(Counter, "sharp_engine_steps", "Engine steps run.")
        self.busy = per_model(Counter, "sharp_engine_busy_seconds", "Wall time of engine steps.")
        self.forward = per_model(
            Counter,
            "sharp_engine_forward_seconds",
            "Of the engine steps' time, the model's forwards (the rest is host overhead).",
        )
        self.attention: list[AttentionHistogram] = []
        self._model = model
        self._skipped: list | None = None  # per layer, once a decode step skipped pages (`observe_skipped`)
        # entropies wait here until a scrape (or ATTENTION_BATCH positions) bins them: one NumPy pass over many
        # steps instead of a dozen small calls per step, which cost an engine step more than its rows' sampling
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_positions = 0
        self._pending_lock = threading.Lock()
        if entropy != "off":
            shape = (model, spec.layers, spec.heads, entropy)
            self.attention = [
                AttentionHistogram(
                    "sharp_attention_entropy_nats",
                    "Entropy of each query's attention distribution (nats), per layer and head.",
                    entropy_buckets(spec.context_length),
                    *shape,
                ),
                AttentionHistogram(
                    "sharp_attention_normalized_entropy",
                    "Attention entropy / ln(visible keys): 1 is uniform (fully dispersed), 0 is one key.",
                    NORMALIZED_BUCKETS,
                    *shape,
                ),
            ]
            self.registry.register(_AttentionCollector(self))
        if names == "vllm":
            vllm = _VLLMCollector(self, model)
            self.registry.register(vllm)
            self.load_registry.register(vllm)

    def configured(self, max_queue: int, max_batch: int, limits: Limits) -> None:
        """The engine's configuration gauges, set once at start."""
        self.queue_capacity.set(max_queue)
        self.max_batch.set(max_batch)
        self.block_size = limits.kv_block_tokens
        self.blocks = limits.kv_budget_bytes // (limits.kv_block_tokens * limits.kv_bytes_per_token)
        self._block_size.set(self.block_size)
        self._blocks.set(self.blocks)

    def log_outcome(self, outcome: RequestOutcome) -> None:
        """Count a request's end, and write its access log line (INFO, logger sharp.access)."""
        access.info("%s", outcome.access_line())
        self._requests[outcome.api, outcome.status].inc()
        if outcome.duration is not None and outcome.status == "ok":
            self.duration[outcome.api].observe(outcome.duration)

    def log_step(self, stats: StepStats) -> None:
        """Turn one engine step's record into series."""
        self.load = Load(stats.queue_size, stats.running, stats.kv_used,
                         self.load.prefix_queries + sum(stats.prefix_queries.values()),
                         self.load.prefix_hits + sum(stats.prefix_hits.values()))  # fmt: skip
        self.queue_size.set(stats.queue_size)
        self.running.set(stats.running)
        self.kv_usage.set(stats.kv_usage)
        self.kv_used.set(stats.kv_used)
        for api, n in stats.prompt_tokens.items():
            self.prompt_tokens[api].inc(n)
        for api, n in stats.generation_tokens.items():
            self.generation_tokens[api].inc(n)
        for api, n in stats.prefix_queries.items():
            self.prefix_queries[api].inc(n)
        for api, n in stats.prefix_hits.items():
            self.prefix_hits[api].inc(n)
        if stats.decode_batch is not None:
            self.batch_size.observe(stats.decode_batch)
        if stats.busy_seconds > 0:
            self.steps.inc()
            self.busy.inc(stats.busy_seconds)
            self.forward.inc(stats.forward_seconds)
        for hist, values in (
            (self.ttft, stats.ttft),
            (self.inter_token, stats.inter_token),
            (self.queue_time, stats.queue_time),
        ):
            for api, v in values:
                hist[api].observe(v)
        for outcome in stats.outcomes:
            self.log_outcome(outcome)
        for entropy, visible in stats.entropy:
            self.observe_attention(entropy, visible)
        for skipped in stats.pages_skipped:
            self.observe_skipped(skipped)

    def observe_skipped(self, skipped: np.ndarray) -> None:
        """skipped (layers,): the share of the KV pages one decode step did not read in each layer (entmax's exact
        sparse decode; NaN where a layer read them all). The histogram appears with the first such step: only a
        model and backend that skip pages have it."""
        if self._skipped is None:
            family = Histogram(
                "sharp_attention_pages_skipped_ratio",
                "Share of the KV cache pages a decode step did not read (they get exactly zero attention weight), "
                "per layer: the sequences' (query head, page) pairs skipped over all of them.",
                ["model", "layer"], registry=self.registry, buckets=SKIPPED_BUCKETS,
            )  # fmt: skip
            self._skipped = [family.labels(self._model, str(i)) for i in range(len(skipped))]
        for hist, value in zip(self._skipped, skipped.tolist(), strict=True):
            if not math.isnan(value):
                hist.observe(value)

    def observe_attention(self, entropy: np.ndarray, visible: np.ndarray) -> None:
        """entropy (N, layers, heads) nats of N query positions that see `visible` (N,) keys each; binned at the
        next scrape, or by `bin_due` once ATTENTION_BATCH positions wait."""
        if not self.attention:
            return
        with self._pending_lock:
            self._pending.append((entropy, visible))
            self._pending_positions += len(visible)

    def bin_due(self) -> None:
        """Bin the waiting entropies once ATTENTION_BATCH positions wait (bounds their memory). Called after a
        step's events are sent: binning a prefix hit's thousands of positions must not delay its first token."""
        with self._pending_lock:
            full = self._pending_positions >= ATTENTION_BATCH
        if full:
            self.flush_attention()

    def flush_attention(self) -> None:
        """Bin every waiting entropy into the histograms."""
        with self._pending_lock:
            pending, self._pending, self._pending_positions = self._pending, [], 0
        if not pending:
            return
        entropy = np.concatenate([e for e, _ in pending])
        visible = np.concatenate([v for _, v in pending])
        with np.errstate(divide="ignore", invalid="ignore"):
            log_n = np.log(visible.astype(np.float64))[:, None, None]
            normalized = np.where(log_n > 0, entropy / log_n, np.nan)
        self.attention[0].observe(entropy)
        self.attention[1].observe(normalized)
