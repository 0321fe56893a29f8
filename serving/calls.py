"""The calls of every API (gRPC and HTTP) into the engine: one place that validates off the event loop when a
prompt is large, submits, counts what is refused before it reaches the engine, and knows how many calls are in
flight (what a drain waits for)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from sharp.serving.engine import Engine
from sharp.serving.output import Event
from sharp.serving.requests import GenerationRequest, RequestError
from sharp.serving.stats import RequestOutcome

LARGE_PROMPT = 1 << 16  # characters: validation of a longer prompt runs in a worker thread


class Calls:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.inflight = 0

    async def events(
        self, validate: Callable[[], GenerationRequest], api: str, prompt_chars: int = 0
    ) -> AsyncIterator[tuple[GenerationRequest, Event]]:
        """(request, event) pairs of one call, ending after its Finished or Failed event. A refusal raises
        RequestError, counted here; a call cancelled before it reached the engine is counted here too (after that
        the engine counts it)."""
        self.inflight += 1
        submitted = False
        try:
            if prompt_chars > LARGE_PROMPT:  # tokenizing a large prompt must not stall the event loop
                req = await asyncio.to_thread(validate)
            else:
                req = validate()
            events = self.engine.stream(req)
            submitted = True
            async for ev in events:  # the engine's stream ends after its Finished or Failed event
                yield req, ev
        except RequestError as e:
            self.engine.metrics.log_outcome(RequestOutcome(e.code.value, api))
            raise
        except asyncio.CancelledError:
            if not submitted:
                self.engine.metrics.log_outcome(RequestOutcome("cancelled", api))
            raise
        finally:
            self.inflight -= 1
