"""The serving engine: continuous batching, chunked prefill, a KV-cache budget, sampling and stop strings.

One engine thread runs steps. Each step drops cancelled sequences, admits queued requests whose KV cache fits
the budget, prefills at most `prefill_chunk` prompt tokens (so a long prompt never stalls running streams for
more than one chunk), then runs one batched decode step over every running sequence. The backend owns the KV
cache (serving/backends.py): the engine reserves each admitted sequence's room up front (prompt + max_new_tokens)
and releases it on every way out. What a step did is recorded in a `StepStats` and handed to the metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields

import numpy as np

from sharp.models.sampling import generator, sample_rows, token_logprobs
from sharp.models.tokenizer import TextStream
from sharp.serving.backends import PAGE_SIZE, Backend, Chunk
from sharp.serving.metrics import ServingMetrics
from sharp.serving.requests import GenerationRequest, Limits, RequestError
from sharp.serving.stats import RequestOutcome, StepStats
from sharp.serving.status import Status
from sharp.serving.text import StopText

log = logging.getLogger("sharp.serving")
PROMPT_BYTES_PER_TOKEN = 16  # the default prompt limit: more bytes than this per context token is never a prompt


def option(default, help: str):
    """A config field that is also a sharp-serve flag: `--name-with-dashes`, this default, this help."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; each is a sharp-serve flag of the same name (serving/cli.py builds them from here)."""

    max_batch: int = option(32, "sequences decoded together")
    max_queue: int = option(256, "waiting requests; more get RESOURCE_EXHAUSTED (HTTP 429)")
    kv_cache_mb: float = option(
        256.0,
        f"KV-cache budget (torch: a pool of {PAGE_SIZE}-token pages allocated at start; onnxruntime/tensorrt:"
        " padding included)",
    )
    prefill_chunk: int = option(256, "prompt tokens per engine step")
    max_new_tokens_limit: int = option(4096, "per request")
    default_max_new_tokens: int = option(64, "when a request does not say")
    max_prompt_bytes: int | None = option(None, "UTF-8 bytes of a text prompt (default: 16 × the model's context)")
    max_stop_strings: int = option(16, "stop strings per request")
    max_stop_length: int = option(256, "characters of one stop string")

    def check(self) -> None:
        """Raise ValueError naming the first setting out of range (in backquotes: the CLI names its flag)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type.startswith("int") and value is None and f.type.endswith("None"):
                continue
            if f.type.startswith("int") and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"`{f.name}` must be an integer >= 1, got {value!r}")
        if not (isinstance(self.kv_cache_mb, int | float) and math.isfinite(self.kv_cache_mb) and self.kv_cache_mb > 0):
            raise ValueError(f"`kv_cache_mb` must be a finite number > 0, got {self.kv_cache_mb!r}")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(
                f"`default_max_new_tokens` ({self.default_max_new_tokens}) must be <= `max_new_tokens_limit`"
                f" ({self.max_new_tokens_limit})"
            )


@dataclass
class TokenLogprob:
    """A token's log-probability under the model and the most likely tokens at its position (id, log-probability),
    most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """New tokens and their text; `logprobs`: one per token, when the request asked; `prompt_logprobs`: the
    prompt's tokens after the first, on a request's first Delta, when it asked."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    def __add__(self, later: Delta) -> Delta:
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        return Delta(self.token_ids + later.token_ids, self.text + later.text, logprobs, self.prompt_logprobs)


@dataclass
class HeadSummary:
    layer: int
    head: int
    mean_entropy: float
    mean_normalized_entropy: float


@dataclass
class Finished:
    reason: str  # length | stop | eos
    prompt_tokens: int
    completion_tokens: int
    attention: list[HeadSummary] | None = None
    positions: int = 0


@dataclass
class Failed:
    code: Status
    message: str


Event = Delta | Finished | Failed


class HeadStats:
    """Running sums of one request's per-head entropies (for return_attention_stats)."""

    def __init__(self, layers: int, heads: int):
        self.entropy = np.zeros((layers, heads))
        self.normalized = np.zeros((layers, heads))
        self.positions = self.normalized_positions = 0

    def add(self, entropy: np.ndarray, visible: np.ndarray) -> None:
        """entropy (layers, heads, L) for positions that see `visible` (L,) keys."""
        self.entropy += entropy.sum(-1)
        self.positions += entropy.shape[-1]
        more = visible > 1
        self.normalized += (entropy[..., more] / np.log(visible[more])).sum(-1)
        self.normalized_positions += int(more.sum())

    def summary(self) -> list[HeadSummary]:
        mean = self.entropy / max(self.positions, 1)
        norm = self.normalized / max(self.normalized_positions, 1)
        return [
            HeadSummary(layer, head, float(mean[layer, head]), float(norm[layer, head]))
            for layer, head in itertools.product(range(mean.shape[0]), range(mean.shape[1]))
        ]


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    sink: Callable[[Event], None]
    arrival: float
    generator: np.random.Generator
    text: StopText
    stats: HeadStats | None
    detokenizer: TextStream
    length: int = 0  # prompt tokens prefilled so far
    generated: list[int] = field(default_factory=list)
    prompt_scores: list[TokenLogprob] = field(default_factory=list)  # with prompt_logprobs: tokens 2 … length
    cancelled: bool = False
    done: bool = False
    last_token_time: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def cached(self) -> int:
        """Tokens in the cache once prefilled: the prompt and every generated token but the newest."""
        return self.prompt_len + len(self.generated) - 1

    @property
    def reserved(self) -> int:
        """Tokens of cache this sequence may need."""
        return self.prompt_len + self.request.max_new_tokens


def _token_logprobs(lp, tokens: list[int], top: list[int]) -> list[TokenLogprob]:
    """Rows of `token_logprobs` as TokenLogprob objects, row i with its top[i] alternatives."""
    ids, vals = lp.top_ids.tolist(), lp.top.tolist()
    return [
        TokenLogprob(t, c, list(zip(i[:k], v[:k], strict=True)))
        for t, c, i, v, k in zip(tokens, lp.chosen.tolist(), ids, vals, top, strict=True)
    ]


class _Courier:
    """Events bound for one event loop's stream() callers, handed over once per engine step: one wake-up of that
    loop per step, not one per event."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: list[tuple[asyncio.Queue, Event]] = []  # touched by the engine thread only

    def post(self, queue: asyncio.Queue, ev: Event) -> None:
        self.pending.append((queue, ev))

    def flush(self) -> bool:
        """Hand the pending events over; False when the loop is gone (the courier can be dropped)."""
        if not self.pending:
            return not self.loop.is_closed()
        batch, self.pending = self.pending, []
        try:
            self.loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the caller's loop is closed
            return False
        return True


def _deliver(batch: list[tuple[asyncio.Queue, Event]]) -> None:
    for queue, ev in batch:
        queue.put_nowait(ev)


class Engine:
    """Thread-safe front (`submit`, `cancel`, `stream`) over one engine thread."""

    def __init__(self, backend: Backend, config: EngineConfig, metrics: ServingMetrics | None = None):
        config.check()
        self.backend, self.config, self.spec = backend, config, backend.spec
        self.tokenizer = self.spec.tokenizer
        self.metrics = metrics or ServingMetrics(self.spec, entropy="off")
        self.metrics.queue_capacity.set(config.max_queue)
        self.metrics.max_batch.set(config.max_batch)
        self.budget_bytes = backend.allocate(int(config.kv_cache_mb * 2**20))
        self.limits = Limits(
            vocab_size=self.spec.vocab_size,
            context_length=self.spec.context_length,
            kv_bytes_per_token=backend.kv_bytes_per_token,
            kv_budget_bytes=self.budget_bytes,
            max_new_tokens_limit=config.max_new_tokens_limit,
            default_max_new_tokens=config.default_max_new_tokens,
            max_prompt_bytes=config.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * self.spec.context_length,
            max_stop_strings=config.max_stop_strings,
            max_stop_length=config.max_stop_length,
        )
        self._waiting: deque[Sequence] = deque()
        self._prefilling: list[Sequence] = []
        self._running: list[Sequence] = []  # the decode batch, in order
        self._stats = StepStats()
        self._outbox: list[tuple[Sequence, Event]] = []  # events of this step, sent at its end
        self._couriers: dict[asyncio.AbstractEventLoop, _Courier] = {}  # stream()'s callers, by event loop
        self._end_seconds = 0.0  # the previous step's _end_step, counted in the next step's busy time
        self._cond = threading.Condition()
        self._stopping = False
        self._ending: tuple[Status, str] | None = None  # end_all's request to the engine thread
        self.draining = False
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

    def submit(self, req: GenerationRequest, sink: Callable[[Event], None]) -> Sequence:
        """Queue a validated request (serving.requests.validate); events go to `sink` from the engine thread."""
        seq = Sequence(
            req,
            sink,
            time.perf_counter(),
            generator(req.seed),
            StopText(req.stop),
            HeadStats(self.spec.layers, self.spec.heads) if req.attention_stats else None,
            self.tokenizer.stream(),
        )
        with self._cond:
            if self.draining or self._stopping:
                raise RequestError(
                    Status.UNAVAILABLE,
                    "the server is draining and accepts no new requests; retry elsewhere",
                    transient=True,
                )
            if len(self._waiting) >= self.config.max_queue:
                raise RequestError(
                    Status.RESOURCE_EXHAUSTED,
                    f"queue full: {len(self._waiting)} requests waiting (--max-queue)",
                    transient=True,
                )
            self._waiting.append(seq)
            self._cond.notify_all()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Free the sequence at the start of the next engine step."""
        with self._cond:
            if not seq.done:
                seq.cancelled = True
                self._cond.notify_all()

    def stream(self, req: GenerationRequest) -> AsyncIterator[Event]:
        """Submit `req` now (RequestError if refused) and return its events; leaving the iterator early (cancel,
        deadline, disconnect) frees its work."""
        loop = asyncio.get_running_loop()
        with self._cond:
            courier = self._couriers.get(loop)
            if courier is None:
                courier = self._couriers[loop] = _Courier(loop)
        events: asyncio.Queue[Event] = asyncio.Queue()
        return self._follow(self.submit(req, lambda ev: courier.post(events, ev)), events)

    async def _follow(self, seq: Sequence, events: asyncio.Queue[Event]) -> AsyncIterator[Event]:
        """The events of `seq`; the text of steps a slow reader has not taken yet comes as one Delta (a client
        that falls behind gets fewer, larger messages instead of a growing backlog of one-token ones)."""
        try:
            ev = await events.get()
            while True:
                nxt = None
                while isinstance(ev, Delta) and not events.empty():
                    nxt = events.get_nowait()
                    if not isinstance(nxt, Delta):
                        break
                    ev, nxt = ev + nxt, None
                yield ev
                if not isinstance(ev, Delta):
                    return
                ev = nxt if nxt is not None else await events.get()
        finally:
            self.cancel(seq)

    def request_bytes(self) -> int:
        """The largest GenerateRequest message the limits allow (the server's receive limit)."""
        lim = self.limits
        return (
            lim.max_prompt_bytes
            + 4 * lim.context_length
            + lim.max_stop_strings * (4 * lim.max_stop_length + 8)
            + (1 << 16)
        )

    def end_all(self, code: Status, message: str) -> None:
        """End every unfinished request with `code` (from any thread; the engine thread does it): a drain's
        deadline."""
        with self._cond:
            self._ending = (code, message)
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not (self._waiting or self._prefilling or self._running)

    # ---- engine thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._prefilling or self._running or self._ending):
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
        self._reap_cancelled()
        self._admit()
        self._prefill()
        self._decode()
        end = time.perf_counter()
        self._stats.busy_seconds = end - start + self._end_seconds
        self._end_step()
        self._end_seconds = time.perf_counter() - end

    def _end_step(self) -> None:
        """Log the step's statistics, then send its events: a client that sees its answer sees it counted. Events
        for stream() callers leave in one hand-over per event loop."""
        st, self._stats = self._stats, StepStats()
        st.queue_size = len(self._waiting)
        st.running = len(self._prefilling) + len(self._running)
        st.kv_usage = self.backend.kv_usage()
        self.metrics.log_step(st)
        outbox, self._outbox = self._outbox, []
        for seq, event in outbox:
            seq.sink(event)
        with self._cond:
            couriers = list(self._couriers.items())
        for loop, courier in couriers:
            if not courier.flush():
                with self._cond:
                    self._couriers.pop(loop, None)

    def _reap_cancelled(self) -> None:
        with self._cond:
            gone = [s for s in (*self._waiting, *self._prefilling, *self._running) if s.cancelled and not s.done]
            if not gone:
                return
            self._waiting = deque(s for s in self._waiting if not s.cancelled)
        self._prefilling = [s for s in self._prefilling if not s.cancelled]
        self._running = [s for s in self._running if not s.cancelled]
        for s in gone:
            s.done = True
            self.backend.release(s)
            self._stats.outcomes.append(RequestOutcome("cancelled", s.request.api, time.perf_counter() - s.arrival))

    def _admit(self) -> None:
        with self._cond:
            while self._waiting and len(self._prefilling) + len(self._running) < self.config.max_batch:
                if not self.backend.reserve(self._waiting[0], self._waiting[0].reserved):
                    break  # it waits until running sequences leave
                seq = self._waiting.popleft()
                self._stats.queue_time.append((seq.request.api, time.perf_counter() - seq.arrival))
                self._prefilling.append(seq)

    def _want_entropy(self, seqs: list[Sequence]) -> bool:
        return self.metrics.entropy != "off" or any(s.stats is not None for s in seqs)

    def _record_entropy(self, seqs: list[Sequence], entropy: np.ndarray | None, first_pos: list[int]) -> None:
        """entropy (B, layers, heads, L) of rows `seqs` whose first query sits at position first_pos[i]."""
        if entropy is None:
            return
        ent = entropy.astype(np.float64)
        visible = np.asarray(first_pos)[:, None] + np.arange(ent.shape[-1])[None] + 1  # (B, L)
        for i, s in enumerate(seqs):
            if s.stats is not None:
                s.stats.add(ent[i], visible[i])
        if self.metrics.entropy != "off":
            self._stats.entropy.append((ent.transpose(0, 3, 1, 2).reshape(-1, *ent.shape[1:3]), visible.reshape(-1)))

    def _prefill(self) -> None:
        """The next chunk of each prefilling sequence, oldest first, up to `prefill_chunk` prompt tokens in all, in
        one call: the backend batches what it can."""
        budget, chunks = self.config.prefill_chunk, []
        for seq in self._prefilling:
            if budget <= 0:
                break
            n = min(budget, seq.prompt_len - seq.length)
            ids = np.array([seq.request.prompt_ids[seq.length : seq.length + n]], np.int64)
            chunks.append(Chunk(seq, ids, seq.length, seq.request.prompt_logprobs is not None))
            budget -= n
        if not chunks:
            return
        began = time.perf_counter()
        results = self.backend.prefill_many(chunks, self._want_entropy([c.seq for c in chunks]))
        self._stats.forward_seconds += time.perf_counter() - began
        for chunk, out in zip(chunks, results, strict=True):
            seq, n = chunk.seq, chunk.ids.shape[1]
            if out is None:  # the model failed on this prompt: it ends alone
                self._prefilling.remove(seq)
                self.backend.release(seq)
                self._fail_forward(seq, f"prefill at prompt token {chunk.start}")
                continue
            seq.length = chunk.start + n
            self._stats.prompt_tokens[seq.request.api] += n
            self._record_entropy([seq], out.entropy, [chunk.start])
            if out.scores is not None:
                self._score_prompt(seq, out.scores, chunk.start)
            if seq.length == seq.prompt_len:
                self._prefilling.remove(seq)
                if seq.request.max_new_tokens == 0:  # scored, nothing to generate: its cache is freed now
                    self._outbox.append((seq, Delta([], "", None, seq.prompt_scores)))
                    self._finish(seq, "length")
                else:
                    token = sample_rows(out.logits[0:1], [seq.request.sampling], [seq.generator])[0]
                    self._emit(seq, token, *self._logprobs([seq], out.logits[0:1], [token]))
                if seq.done:
                    self.backend.release(seq)
                else:
                    self.backend.join(seq)
                    self._running.append(seq)

    def _leave(self, seqs: list[Sequence]) -> None:
        gone = set(seqs)
        self._running = [s for s in self._running if s not in gone]
        for s in seqs:
            self.backend.release(s)

    def _decode(self) -> None:
        if not self._running:
            return
        seqs = self._running
        tokens = np.array([[s.generated[-1]] for s in seqs], np.int64)
        began = time.perf_counter()
        out = self.backend.decode(seqs, tokens, self._want_entropy(seqs))
        self._stats.forward_seconds += time.perf_counter() - began
        for s in out.failed:
            self._fail_forward(s, f"decode at token {len(s.generated)}")
        failed = set(out.failed)
        kept = [s for s in seqs if s not in failed]
        self._stats.decode_batch = len(seqs)
        self._record_entropy(kept, out.entropy, [s.cached for s in kept])
        chosen = sample_rows(out.logits, [s.request.sampling for s in kept], [s.generator for s in kept])
        for s, token, logprob in zip(kept, chosen, self._logprobs(kept, out.logits, chosen), strict=True):
            self._emit(s, token, logprob)
        self._leave([s for s in seqs if s.done])

    @staticmethod
    def _logprobs(seqs: list[Sequence], logits: np.ndarray, chosen: list[int | None]) -> list[TokenLogprob | None]:
        """The chosen tokens' log-probabilities for the rows whose request asked (None for the others), in one
        batched pass over those rows only."""
        out: list[TokenLogprob | None] = [None] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if s.request.logprobs is not None and chosen[i] is not None]
        if not rows:
            return out
        top = [seqs[i].request.logprobs for i in rows]
        lp = token_logprobs(logits[rows], np.array([chosen[i] for i in rows]), max(top))
        for i, made in zip(rows, _token_logprobs(lp, [chosen[i] for i in rows], top), strict=True):
            out[i] = made
        return out

    def _score_prompt(self, seq: Sequence, scores: np.ndarray, start: int) -> None:
        """Log-probabilities of the prompt tokens that the chunk's positions predict (scores (n, V) from `start`)."""
        ids = seq.request.prompt_ids
        n = min(len(scores), len(ids) - 1 - start)  # the prompt's last position predicts the first new token
        if n <= 0:
            return
        targets = list(ids[start + 1 : start + 1 + n])
        k = seq.request.prompt_logprobs
        lp = token_logprobs(scores[:n], np.array(targets), k)
        seq.prompt_scores += _token_logprobs(lp, targets, [k] * n)

    def _fail_forward(self, seq: Sequence, where: str) -> None:
        log.error("model forward failed for request %r (%s)", seq.request.request_id, where)
        self._fail(seq, Status.INTERNAL, f"the model failed on this request ({where}); see the server log")

    def _emit(self, seq: Sequence, token: int | None, logprob: TokenLogprob | None = None) -> None:
        """Send the sampled token of `seq` (and its log-probability, when asked) and finish the sequence when a stop
        condition holds; None: its logits were unusable (it ends alone, the batch goes on). A first token carries
        the prompt's log-probabilities, when asked."""
        if token is None:
            self._fail(
                seq,
                Status.INTERNAL,
                f"the model produced non-finite logits for this request after {len(seq.generated)} tokens",
            )
            return
        now = time.perf_counter()
        api = seq.request.api
        if seq.generated:
            self._stats.inter_token.append((api, now - seq.last_token_time))
        else:
            self._stats.ttft.append((api, now - seq.arrival))
        seq.last_token_time = now
        seq.generated.append(token)
        self._stats.generation_tokens[api] += 1
        text = seq.text.push(seq.detokenizer.step(token))
        reason = None
        if token in self.tokenizer.eos_ids:
            reason = "eos"
        elif seq.text.stopped:
            reason = "stop"
        elif len(seq.generated) >= seq.request.max_new_tokens:
            reason = "length"
        if reason is not None:
            text += seq.text.finish(seq.detokenizer.finish())
        prompt = seq.prompt_scores if len(seq.generated) == 1 and seq.request.prompt_logprobs is not None else None
        self._outbox.append((seq, Delta([token], text, None if logprob is None else [logprob], prompt)))
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        with self._cond:
            seq.done = True
        stats = seq.stats
        summary = Finished(
            reason,
            seq.prompt_len,
            len(seq.generated),
            stats.summary() if stats else None,
            stats.positions if stats else 0,
        )
        self._outbox.append((seq, summary))
        self._stats.outcomes.append(RequestOutcome("ok", seq.request.api, time.perf_counter() - seq.arrival))

    def _fail(self, seq: Sequence, code: Status, message: str) -> None:
        """End one sequence with `code`; the caller drops it from the batch (it is marked done)."""
        with self._cond:
            seq.done = True
        self._outbox.append((seq, Failed(code, message)))
        self._stats.outcomes.append(RequestOutcome(code.value, seq.request.api, time.perf_counter() - seq.arrival))

    def _fail_all(self, message: str, code: Status = Status.INTERNAL) -> None:
        """End every unfinished sequence with `code`; those that finished this step keep their answer."""
        with self._cond:
            seqs = [s for s in (*self._waiting, *self._prefilling, *self._running) if not s.done]
            self._waiting.clear()
            for s in seqs:
                s.done = True
        self._prefilling, self._running = [], []
        self.backend.clear()
        failing = set(seqs)
        self._outbox = [(q, ev) for q, ev in self._outbox if q not in failing]
        for s in seqs:
            self._outbox.append((s, Failed(code, message)))
            self._stats.outcomes.append(RequestOutcome(code.value, s.request.api, time.perf_counter() - s.arrival))
        self._end_step()
