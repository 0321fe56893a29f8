"""Engine statistics as plain records: the engine fills them, `ServingMetrics` turns them into Prometheus series
(the stats → loggers split of vLLM), so the engine's steps update no series themselves (it only sets the two
configuration gauges at start and reads which entropy statistics are wanted)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestOutcome:
    """One request's final status (ok, cancelled, or a gRPC status name) and, when it ran, its duration."""

    status: str
    duration: float | None = None


@dataclass
class StepStats:
    """What one engine step did."""

    queue_size: int = 0
    running: int = 0
    kv_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    decode_batch: int | None = None  # rows of the batched decode step, when one ran
    ttft: list[float] = field(default_factory=list)
    inter_token: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    outcomes: list[RequestOutcome] = field(default_factory=list)
    entropy: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (N, layers, heads) nats, (N,) keys
