"""Engine statistics as plain records: the engine fills them, `ServingMetrics` turns them into Prometheus series
(the stats → loggers split of vLLM), so the engine's steps update no series themselves (it only sets the two
configuration gauges at start and reads which entropy statistics are wanted)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

APIS = ("grpc", "http")  # the doors a request comes in by: the `api` label of the per-request series


@dataclass
class RequestOutcome:
    """One request's final status (ok, cancelled, or a gRPC status name), its API and, when it ran, its duration,
    its id and its tokens (what the access log line says; never its text)."""

    status: str
    api: str
    duration: float | None = None
    request_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None  # arrival to its first token, when it had one

    def access_line(self) -> str:
        """One line per request, as vLLM and llama-server log them: id, API, status, tokens, times."""
        ms = lambda s: "-" if s is None else f"{s * 1000:.1f}ms"
        return (
            f"{_printable(self.request_id) or '-'} {self.api} {self.status} prompt_tokens={self.prompt_tokens}"
            f" completion_tokens={self.completion_tokens} cached_tokens={self.cached_tokens}"
            f" ttft={ms(self.ttft)} total={ms(self.duration)}"
        )


@dataclass
class StepStats:
    """What one engine step did."""

    queue_size: int = 0
    running: int = 0
    kv_usage: float = 0.0  # reserved
    kv_used: float = 0.0  # holding tokens
    prompt_tokens: Counter[str] = field(default_factory=Counter)  # by API
    prefix_queries: Counter[str] = field(default_factory=Counter)  # prompt tokens looked up in the prefix cache
    prefix_hits: Counter[str] = field(default_factory=Counter)  # of which found there
    generation_tokens: Counter[str] = field(default_factory=Counter)
    decode_batch: int | None = None  # rows of the batched decode step, when one ran
    busy_seconds: float = 0.0  # the step's wall time (its hand-over of events is counted in the next step's)
    forward_seconds: float = 0.0  # of which the model's forwards (prefill chunks and the decode step)
    ttft: list[tuple[str, float]] = field(default_factory=list)  # (API, seconds)
    inter_token: list[tuple[str, float]] = field(default_factory=list)
    queue_time: list[tuple[str, float]] = field(default_factory=list)
    outcomes: list[RequestOutcome] = field(default_factory=list)
    entropy: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (N, layers, heads) nats, (N,) keys
    pages_skipped: list[np.ndarray] = field(default_factory=list)  # (layers,) share of KV pages a decode step skipped


def _printable(text: str) -> str:
    """`text` with anything that is not printable escaped (\\n, \\x1b, …): a log line stays one line of its own."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
