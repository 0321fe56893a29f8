"""The calls of every API (gRPC and HTTP) into the engine: one place that validates off the event loop when that
is slow (a large prompt to tokenize, a grammar to compile: `VALIDATORS`, a bounded queue), submits, counts what is
refused before it reaches the engine, and knows how many calls are in flight (what a drain waits for)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from sharp.serving.engine.engine_client import EngineClient
from sharp.serving.engine.output import Delivery, Event
from sharp.serving.requests import GenerationRequest, RequestError
from sharp.serving.stats import RequestOutcome
from sharp.serving.status import Status

LARGE_PROMPT = 1 << 16  # characters: validation of a longer prompt runs in a worker thread


def _yield_the_cpu() -> None:
    """A validator thread runs at a lower CPU priority (Linux: niceness is per thread): a client's compile of
    seconds then takes the cores the model's threads leave, not theirs (measured on 2 cores: a bystander's first
    token 2.65× its unloaded time beside a compile at equal priority)."""
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), VALIDATOR_NICENESS)


VALIDATOR_NICENESS = 10
# Validations that take long (a grammar's compile: llguidance releases the GIL, so the event loop keeps its pace) run
# here, two at a time, below the server's CPU priority; at most --max-queue wait, more are refused as a full queue is.
VALIDATORS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sharp-validate", initializer=_yield_the_cpu)


class Calls:
    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.inflight = 0
        self.validating = 0  # calls in VALIDATORS' queue or workers

    async def _validated(self, validate: Callable[[], GenerationRequest]) -> GenerationRequest:
        """`validate()` in a worker, then the engine's own preparation of the request (a new grammar's first
        matcher); a full queue of such work is refused as the engine's full queue is."""
        if self.validating >= (most := self.engine.config.max_queue):
            raise RequestError(Status.RESOURCE_EXHAUSTED, f"validation queue full: {self.validating} requests with a"
                               f" grammar or a large prompt are being checked (--max-queue {most})")  # fmt: skip

        def work() -> GenerationRequest:
            req = validate()
            self.engine.prepare(req)
            return req

        self.validating += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(VALIDATORS, work)
        finally:
            self.validating -= 1

    async def events(
        self, validate: Callable[[], GenerationRequest], api: str, prompt_chars: int = 0
    ) -> AsyncIterator[tuple[GenerationRequest, Event]]:
        """(request, event) pairs of one call, ending after its Finished or Failed event. A refusal raises
        RequestError, counted here; a call cancelled before it reached the engine is counted here too (after that
        the engine counts it)."""
        async with contextlib.aclosing(self.choices(validate, api, prompt_chars)) as events:
            async for req, _, ev in events:
                yield req, ev

    async def choices(
        self,
        validate: Callable[[], GenerationRequest],
        api: str,
        prompt_chars: int = 0,
        n: int = 1,
        constrained: bool = False,
    ) -> AsyncIterator[tuple[GenerationRequest, int, Event]]:
        """(request, choice, event) of a call for `n` choices of one prompt (`GenerationRequest.choices`), as they
        come, ending after every choice's Finished or Failed event; as `events` otherwise. A `constrained` call (a
        grammar to compile) or one with a large prompt is validated in a worker."""
        self.inflight += 1
        submitted = False
        try:
            if n > (most := self.engine.config.max_queue):  # it could never be queued: not a reason to retry
                raise RequestError(Status.INVALID_ARGUMENT, f"n: {n} choices can never wait together; the server"
                                   f" queues at most {most} requests (--max-queue)", field="n")  # fmt: skip
            if constrained or prompt_chars > LARGE_PROMPT:  # neither may stall the event loop
                req = await self._validated(validate)
            else:
                req = validate()
            if n == 1:
                events = self.engine.stream(req)
                submitted = True
                async for ev in events:  # the engine's stream ends after its Finished or Failed event
                    yield req, 0, ev
                return
            engine, handles = self.engine, []
            try:
                for r in req.choices(n):
                    queue: asyncio.Queue[Event] = asyncio.Queue()
                    handles.append((engine.submit(r, engine.delivery.sink_for(queue)), queue))
            except BaseException:  # a later choice refused (a full queue): the earlier ones leave too
                for h, _ in handles:
                    engine.cancel(h)
                raise
            submitted = True
            merged = _Merged([Delivery.follow(h, q, engine.cancel) for h, q in handles])
            try:
                while (item := await merged.next()) is not None:
                    yield req, *item
            finally:
                await merged.close()
        except RequestError as e:
            self.engine.metrics.log_outcome(RequestOutcome(e.code.value, api))
            raise
        except asyncio.CancelledError:
            if not submitted:
                self.engine.metrics.log_outcome(RequestOutcome("cancelled", api))
            raise
        finally:
            self.inflight -= 1


class _Merged:
    """The events of several streams as they come, each with its stream's index; from its start, each stream is
    read by a task of its own, and `close` leaves them all (their requests are cancelled)."""

    def __init__(self, streams: list[AsyncIterator[Event]]):
        self._queue: asyncio.Queue[tuple[int, Event | None, BaseException | None]] = asyncio.Queue()
        self._left = len(streams)
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream: AsyncIterator[Event]) -> None:
        try:
            async for ev in stream:
                self._queue.put_nowait((i, ev, None))
            self._queue.put_nowait((i, None, None))
        except Exception as e:  # handed to the reader
            self._queue.put_nowait((i, None, e))

    async def next(self) -> tuple[int, Event] | None:
        """The next (index, event); None once every stream has ended."""
        while self._left:
            i, ev, error = await self._queue.get()
            if error is not None:
                raise error
            if ev is not None:
                return i, ev
            self._left -= 1
        return None

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
