"""What the APIs hold of an engine: one interface, two clients behind it.

The gRPC service, the HTTP API, the calls between them and the server's warm-up depend on `EngineClient` only. An
`Engine` (engine.py) runs the engine in the server's process; an `EngineProcess` (core.py) runs it in a child process
and speaks to it over a pipe. Which one serves is sharp-serve's `--engine-process` choice, invisible above this line.
Admission's refusals (draining, a full queue) and `stream` are written here, once.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from sharp.serving.engine.output import Delivery, Event
from sharp.serving.engine.warmup import WarmUp
from sharp.serving.requests import GenerationRequest, draining_error, queue_full_error
from sharp.serving.status import Status

if TYPE_CHECKING:
    from sharp.models.tokenizer import Tokenizer
    from sharp.serving.config import EngineConfig
    from sharp.serving.metrics import ServingMetrics
    from sharp.serving.requests import Limits
    from sharp.serving.spec import ModelSpec


class EngineClient(ABC):
    """An engine as the APIs see it. `submit` returns a handle that `cancel` takes; events reach the sink at the
    end of the engine step that made them. Set by the subclass: `spec`, `limits`, `tokenizer`, `metrics`,
    `config`, `attention` and `prefix_cache` (both in words, for the start-up line and GetModelInfo)."""

    spec: ModelSpec
    limits: Limits
    tokenizer: Tokenizer
    metrics: ServingMetrics
    config: EngineConfig
    attention: str
    prefix_cache: str
    delivery: Delivery
    draining: bool = False  # set by the server: every new request is refused, those admitted finish
    exit_code: int | None = None  # the engine's process, once it has ended (EngineProcess)
    _stopping: bool = False

    @abstractmethod
    def submit(self, req: GenerationRequest, sink: Callable[[Event], None], arrival: float | None = None) -> Any:
        """Queue a validated request that arrived at `arrival` (perf_counter); RequestError if refused."""

    @abstractmethod
    def prepare(self, req: GenerationRequest) -> None:
        """Do before `submit`, in a worker thread, what submitting would otherwise do where it blocks others (an
        in-process engine makes its first matcher of a new grammar); a core in its own process does it there."""

    @abstractmethod
    def cancel(self, handle: Any) -> None:
        """Free `handle`'s request at the next engine step (nothing if it has ended)."""

    @abstractmethod
    def end_all(self, code: Status, message: str) -> None:
        """End every unfinished request with `code` (a drain's deadline)."""

    @abstractmethod
    def idle(self) -> bool:
        """No request is queued or running."""

    @abstractmethod
    def warm_up(self) -> WarmUp:
        """Run the model's shapes once before `start`; raises WarmUpError."""

    @abstractmethod
    def start(self) -> EngineClient:
        """Start stepping."""

    @abstractmethod
    def stop(self) -> None:
        """Stop stepping and free the engine (waits for it)."""

    def on_exit(self, callback: Callable[[], None]) -> None:  # noqa: B027 (a default, not a stub)
        """Call `callback` when the engine ends without being told to stop; an engine in this process ends only
        with it, so the default never calls."""

    def stream(self, req: GenerationRequest) -> AsyncIterator[Event]:
        """Submit `req` (RequestError if refused); its events. Leaving early (cancel, deadline) frees its work."""
        events: asyncio.Queue[Event] = asyncio.Queue()
        return Delivery.follow(self.submit(req, self.delivery.sink_for(events)), events, self.cancel)

    def admission(self, waiting: int) -> None:
        """Refuse a new request while draining or stopping, or when `waiting` requests (submitted, not yet in the
        batch) fill the queue; the caller holds the lock that orders its submits."""
        if self.draining or self._stopping:
            raise draining_error()
        if waiting >= self.config.max_queue:
            raise queue_full_error(waiting)
