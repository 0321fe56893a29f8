"""The serving engine: the loop that ties the scheduler, the executor and the output processor together.

One engine thread runs steps. Each step drops cancelled sequences, admits queued requests whose KV cache fits the
budget (scheduler.py) — starting each on the longest prefix of its prompt the backend has cached —, prefills the
plan's prompt chunks (first tokens are sent at once), then runs one batched decode step over every running sequence
(executor.py). Each step's sampled tokens advance the scheduler's sequences (`Scheduler.update`: which requests
end) and become events in the output processor (output.py), which sees stop strings. The backend owns the KV cache:
the engine reserves each admitted sequence's room up front and releases it on every way out, handing over what its
cache holds for the prefix cache (nothing after a failure). `Engine` is also the in-process `EngineClient`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sharp.models.sampling import generator
from sharp.serving.backends.interface import Backend
from sharp.serving.config import EngineConfig
from sharp.serving.engine.engine_client import EngineClient
from sharp.serving.engine.executor import Executor
from sharp.serving.engine.matcher import Grammars
from sharp.serving.engine.output import Delivery, Event, HeadStats, Output, RequestState
from sharp.serving.engine.scheduler import Scheduler, Sequence
from sharp.serving.engine.text import StopText
from sharp.serving.engine.warmup import WarmUp, warm_up
from sharp.serving.metrics import ServingMetrics
from sharp.serving.requests import GenerationRequest
from sharp.serving.stats import StepStats
from sharp.serving.status import Status

log = logging.getLogger("sharp.serving")


class Engine(EngineClient):
    """Thread-safe front (`submit`, `cancel`, `stream`) over one engine thread. Each step's statistics and events
    go to `publish`: the metrics and the requests' sinks here, or the pipe of the engine's process (core.py)."""

    def __init__(self, backend: Backend, config: EngineConfig, metrics: ServingMetrics | None = None,
                 publish: Callable[[StepStats, list[tuple[RequestState, Event]]], None] | None = None):  # fmt: skip
        config.check()
        self.backend, self.config, self.spec = backend, config, backend.spec
        self.tokenizer = self.spec.tokenizer
        self.metrics = metrics or ServingMetrics(self.spec, entropy="off")
        kv_bytes = config.kv_cache_bytes(self.spec, backend.kv_bytes_per_token)
        self._prefix_bytes = config.prefix_cache_bytes(kv_bytes)
        budget = backend.allocate(kv_bytes, self._prefix_bytes)
        self.limits = config.limits(self.spec, backend.kv_bytes_per_token, budget, backend.block_tokens)
        self.metrics.configured(config.max_queue, config.max_batch, self.limits)
        self.attention = backend.attention  # what runs attention, in words (GetModelInfo, the start-up line)
        self.prefix_cache = backend.cache_info()  # its size, in words (the start-up line)
        self._cond = threading.Condition()
        self.scheduler = Scheduler(config.max_batch, config.prefill_chunk, self.tokenizer.eos_ids,
                                   aging=config.priority_aging)  # fmt: skip
        self.executor = Executor(backend, self.tokenizer.eos_ids)
        self.grammars = Grammars(self.tokenizer, self.spec.vocab_size)  # the vocabulary compiled on first use
        self.output = Output(self.metrics.entropy != "off")
        self.delivery = Delivery()
        self._publish = publish or self._publish_here
        self._end_seconds = 0.0  # the previous step's end, counted in the next step's busy time
        self._stopping = self.draining = False
        self._ending: tuple[Status, str] | None = None  # end_all's request to the engine thread
        self._thread = threading.Thread(target=self._loop, name="sharp-engine", daemon=True)

    # ---- front -----------------------------------------------------------------------------------------
    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():  # never started when the server stopped before serving (a failed warm-up)
            self._thread.join(timeout=30)

    def warm_up(self) -> WarmUp:
        """Run the model's shapes once before `start` (serving/engine/warmup.py); raises WarmUpError."""
        return warm_up(self.backend, self.config.prefill_chunk)

    def submit(self, req: GenerationRequest, sink: Callable[[Event], None], arrival: float | None = None) -> Sequence:
        """Queue a validated request that arrived at `arrival` (perf_counter); its events go to `sink`."""
        stats = HeadStats(self.spec.layers, self.spec.heads) if req.attention_stats else None
        arrival = time.perf_counter() if arrival is None else arrival
        text = StopText(req.stop, req.include_stop)
        state = RequestState(req, sink, arrival, text, self.tokenizer.stream(req.skip_special_tokens), stats)
        matcher = self.grammars.matcher(req.grammar, req.sampling) if req.grammar else None
        seq = Sequence(req, generator(req.seed), state, matcher=matcher)
        with self._cond:
            self.admission(len(self.scheduler.waiting))
            self.scheduler.add(seq)
            self._cond.notify_all()
        return seq

    def prepare(self, req: GenerationRequest) -> None:
        """A new grammar's first matcher, made here (a worker thread) so that `submit` only copies it."""
        if req.grammar:
            self.grammars.warm(req.grammar)

    def cancel(self, seq: Sequence) -> None:
        """Free the sequence at the start of the next engine step."""
        with self._cond:
            if not seq.done:
                seq.cancelled = True
                self._cond.notify_all()

    def end_all(self, code: Status, message: str) -> None:
        """End every unfinished request with `code` (a drain's deadline); the engine thread does it."""
        with self._cond:
            self._ending = (code, message)
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not self.scheduler.busy()

    # ---- engine thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self.scheduler.busy() or self._ending):
                    self._cond.wait()
                if self._stopping:
                    return
                ending, self._ending = self._ending, None
            if ending is not None:
                self._fail_all(ending[1], ending[0])
                continue
            try:
                self.step()
            except Exception as e:  # a backend failure ends the affected requests, never the server
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")

    def step(self) -> None:
        start = time.perf_counter()
        out = self.output
        with self._cond:
            gone = self.scheduler.drop_cancelled()
            admitted = self.scheduler.admit(self._reserve)
        for s in gone:
            self.backend.release(s, s.kept())
            out.cancelled(s.state)
        out.stats.queue_time += [(s.request.api, start - s.state.arrival) for s in admitted]
        if self._prefill():  # first tokens go out now, not after this step's decode (their time to first token)
            self._end_step()
        self._decode()
        end = time.perf_counter()
        out.stats.busy_seconds = end - start + self._end_seconds  # the step's record (its second, if it sent two)
        self._end_step()
        self._end_seconds = time.perf_counter() - end

    def _reserve(self, seq: Sequence) -> int | None:
        """Admission's question to the backend: room for `seq`, and how much of its prompt is cached already (a
        prompt whose log-probabilities are asked for is computed, not read from the cache)."""
        req, out = seq.request, self.output
        reuse = req.prompt_logprobs is None and self._prefix_bytes > 0
        hit = self.backend.admit(seq, seq.prompt_pages(), seq.reserved, reuse, out.want_entropy([seq.state]))
        if hit is not None and reuse:
            out.restored(seq.state, hit)
        return None if hit is None else hit.tokens

    def _end_step(self) -> None:
        """Log the step's statistics, then send its events: a client that sees its answer sees it counted."""
        st, outbox = self.output.take()
        st.queue_size = len(self.scheduler.waiting)
        st.running = len(self.scheduler.prefilling) + len(self.scheduler.running)
        st.kv_usage = self.backend.kv_usage()
        held = sum(s.length for s in self.scheduler.prefilling) + sum(s.cached for s in self.scheduler.running)
        st.kv_used = held * self.limits.kv_bytes_per_token / self.limits.kv_budget_bytes
        self._publish(st, outbox)

    def _publish_here(self, st: StepStats, outbox: list[tuple[RequestState, Event]]) -> None:
        self.metrics.log_step(st)
        self.delivery.send([(state.sink, ev) for state, ev in outbox])
        self.metrics.bin_due()

    def _prefill(self) -> bool:
        """Run the plan's prompt chunks; True when a sequence got its first token (or ended)."""
        plan, out = self.scheduler.plan(), self.output
        if not plan.prefill:
            return False
        want = out.want_entropy([c.seq.state for c in plan.prefill])
        results = self.executor.prefill(plan.prefill, want, out.stats)
        for chunk, res in zip(plan.prefill, results, strict=True):
            seq, n = chunk.seq, chunk.ids.shape[1]
            if res is None:  # the model failed on this prompt: it ends alone
                self._fail_forward(seq, f"prefill at prompt token {chunk.start}")
            else:
                out.prefilled(seq.state, chunk.start, n, res)
                if not self.scheduler.prompt_advanced(seq, n):
                    continue  # more of its prompt to come
                if seq.request.max_new_tokens == 0:  # scored, nothing to generate: its cache is freed now
                    self._end(seq)
                    out.scored(seq.state)
                else:
                    self._advance([seq], res.logits[0:1])
            self.scheduler.prefilled(seq)
            (self.backend.release if seq.done else self.backend.join)(seq, seq.kept())
        return bool(out.outbox)

    def _decode(self) -> None:
        seqs = self.scheduler.running
        if not seqs:
            return
        out = self.output
        res = self.executor.decode(seqs, out.want_entropy([s.state for s in seqs]), out.stats)
        for s in res.failed:
            self._fail_forward(s, f"decode at token {len(s.generated)}")
        failed = set(res.failed)
        kept = [s for s in seqs if s not in failed]
        out.record_entropy([s.state for s in kept], res.entropy, [s.cached for s in kept])
        self._advance(kept, res.logits)
        ended = [s for s in seqs if s.done]
        self.scheduler.leave(ended)
        for s in ended:
            self.backend.release(s, s.kept())

    def _advance(self, seqs: list[Sequence], logits) -> None:
        """Sample the rows' next tokens; the scheduler learns which requests they end, the output processor makes
        their events (and finds the stop strings, which end theirs too)."""
        tokens, logprobs = self.executor.sample(seqs, logits)
        with self._cond:  # `done` is read by the threads that cancel
            reasons = self.scheduler.update(seqs, tokens)
        out = self.output
        for seq, token, logprob, reason in zip(seqs, tokens, logprobs, reasons, strict=True):
            if token is None:
                out.unusable(seq.state, seq.matcher.error() if seq.matcher is not None else None)
            elif out.emit(seq.state, token, reason, logprob) == "stop":
                self._end(seq)

    def _end(self, seq: Sequence, failed: bool = False) -> None:
        with self._cond:
            self.scheduler.end(seq, failed)

    def _fail_forward(self, seq: Sequence, where: str) -> None:
        """The model failed on `seq`'s rows: it ends alone, its cache not kept."""
        self._end(seq, failed=True)
        self.output.fail_forward(seq.state, where)

    def _fail_all(self, message: str, code: Status = Status.INTERNAL) -> None:
        """End every unfinished sequence with `code`; those that finished this step keep their answer."""
        with self._cond:
            seqs = self.scheduler.clear()
            for s in seqs:
                self.scheduler.end(s)
        self.backend.clear()
        self.output.fail_all([s.state for s in seqs], code, message)
        self._end_step()
