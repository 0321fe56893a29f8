"""The serving engine: continuous batching, chunked prefill, a KV-cache budget, sampling and stop strings.

One engine thread runs steps. Each step drops cancelled sequences, admits queued requests whose KV cache fits
the budget, prefills at most `prefill_chunk` prompt tokens (so a long prompt never stalls running streams for
more than one chunk), then runs one batched decode step over every running sequence. Running sequences share
one left-padded cache (B, kv_heads, T, head_dim): sequences of different lengths are right-aligned and the
attention mask hides the padding, so a decode step is one forward whatever the lengths; joining pads, leaving
trims the columns nobody needs.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from sharp.models.sampling import SamplingParams, sample
from sharp.serving.backends import Backend
from sharp.serving.metrics import ServingMetrics

log = logging.getLogger("sharp.serving")


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32  # sequences decoded together
    max_queue: int = 256  # requests waiting for admission; more are refused
    kv_cache_mb: float = 256.0  # budget for every sequence's keys and values, padding included
    prefill_chunk: int = 256  # prompt tokens processed per engine step
    max_new_tokens_limit: int = 4096
    default_max_new_tokens: int = 64

    def check(self) -> None:
        for name in ("max_batch", "max_queue", "prefill_chunk", "max_new_tokens_limit", "default_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.kv_cache_mb > 0:
            raise ValueError(f"kv_cache_mb must be > 0, got {self.kv_cache_mb}")


class RequestError(Exception):
    """A request the engine refuses; `code` names the gRPC status the server answers with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    seed: int | None = None
    stop: tuple[str, ...] = ()
    attention_stats: bool = False
    request_id: str = ""


@dataclass
class Delta:
    token_ids: list[int]
    text: str


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
    code: str
    message: str


Event = Delta | Finished | Failed


class StopText:
    """Incremental UTF-8 text with stop strings: text that could still become a stop string is held back."""

    def __init__(self, stops: tuple[str, ...]):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text, self.emitted, self.searched, self.stopped = "", 0, 0, False

    def push(self, byte: int | None) -> str:
        """Add one token's byte (None for a non-byte token); returns the text that is now safe to send."""
        if byte is not None:
            self.text += self.decoder.decode(bytes([byte]))
        if not self.stops:
            return self._release(len(self.text))
        start = max(0, self.searched - self.longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
            return self._release(len(self.text))
        self.searched = len(self.text)
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._release(len(self.text) - hold)

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.decoder.decode(b"", final=True)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out


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
    generator: torch.Generator
    text: StopText
    stats: HeadStats | None
    cache: list[torch.Tensor] | None = None  # own cache while prefilling
    length: int = 0  # tokens in the cache (while prefilling: the prompt tokens done)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    last_token_time: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def reserved(self) -> int:
        """Tokens of cache this sequence may need."""
        return self.prompt_len + self.request.max_new_tokens


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, T, D) → (B, H, width, D) with zero keys on the left (masked out by the attention mask)."""
    return F.pad(t, (0, 0, width - t.shape[2], 0))


class Engine:
    """Thread-safe front (`submit`, `cancel`, `stream`, `generate`) over one engine thread."""

    def __init__(self, backend: Backend, config: EngineConfig, metrics: ServingMetrics | None = None):
        config.check()
        self.backend, self.config, self.spec = backend, config, backend.spec
        self.metrics = metrics or ServingMetrics(self.spec, entropy="off")
        self.budget_bytes = int(config.kv_cache_mb * 2**20)
        self._waiting: deque[Sequence] = deque()
        self._prefilling: list[Sequence] = []
        self._running: list[Sequence] = []  # rows of the batch cache, in order
        self._batch: list[torch.Tensor] | None = None  # 2 × layers of (B, kv_heads, T, head_dim)
        self._cond = threading.Condition()
        self._stopping = False
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
        self._thread.join(timeout=30)

    def validate(self, req: GenerationRequest) -> None:
        """Raise RequestError for what can never run, with the allowed range."""
        limit, ctx = self.config.max_new_tokens_limit, self.spec.context_length
        if not req.prompt_ids:
            raise RequestError("invalid_argument", "empty prompt: give a non-empty prompt or input_ids")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestError(
                "invalid_argument", f"input_ids {bad[:3]} outside the vocabulary [0, {self.spec.vocab_size})"
            )
        if not 1 <= req.max_new_tokens <= limit:
            raise RequestError("invalid_argument", f"max_new_tokens must be in [1, {limit}], got {req.max_new_tokens}")
        try:
            req.sampling.check()
        except ValueError as e:
            raise RequestError("invalid_argument", str(e)) from None
        if len(req.prompt_ids) + req.max_new_tokens > ctx:
            raise RequestError(
                "out_of_range",
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds the"
                f" model's context of {ctx} tokens",
            )
        need = (len(req.prompt_ids) + req.max_new_tokens) * self.spec.kv_bytes_per_token
        if need > self.budget_bytes:
            raise RequestError(
                "resource_exhausted",
                f"this request needs {need / 2**20:.1f} MiB of KV cache; the server's budget is"
                f" {self.config.kv_cache_mb:g} MiB (--kv-cache-mb)",
            )

    def submit(self, req: GenerationRequest, sink: Callable[[Event], None]) -> Sequence:
        """Queue a validated request; events go to `sink` from the engine thread."""
        self.validate(req)
        seed = req.seed if req.seed is not None else int(torch.randint(0, 2**63 - 1, ()).item())
        seq = Sequence(
            req,
            sink,
            time.perf_counter(),
            torch.Generator().manual_seed(seed),
            StopText(req.stop),
            HeadStats(self.spec.layers, self.spec.heads) if req.attention_stats else None,
        )
        with self._cond:
            if self.draining or self._stopping:
                raise RequestError("unavailable", "the server is draining and accepts no new requests; retry elsewhere")
            if len(self._waiting) >= self.config.max_queue:
                raise RequestError(
                    "resource_exhausted", f"queue full: {len(self._waiting)} requests waiting (--max-queue)"
                )
            self._waiting.append(seq)
            self.metrics.queue_size.set(len(self._waiting))
            self._cond.notify_all()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Free the sequence at the start of the next engine step."""
        with self._cond:
            if not seq.done:
                seq.cancelled = True
                self._cond.notify_all()

    async def stream(self, req: GenerationRequest) -> AsyncIterator[Event]:
        """Events of one request; leaving the iterator early (cancel, deadline, disconnect) frees its work."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop is gone
                loop.call_soon_threadsafe(events.put_nowait, ev)

        seq = self.submit(req, sink)
        try:
            while True:
                ev = await events.get()
                yield ev
                if not isinstance(ev, Delta):
                    return
        finally:
            self.cancel(seq)

    def generate(self, req: GenerationRequest) -> Iterator[Event]:
        """Blocking variant of `stream` for in-process callers."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        seq = self.submit(req, events.put)
        try:
            while True:
                ev = events.get()
                yield ev
                if not isinstance(ev, Delta):
                    return
        finally:
            self.cancel(seq)

    def idle(self) -> bool:
        with self._cond:
            return not (self._waiting or self._prefilling or self._running)

    def kv_usage_bytes(self) -> int:
        batch = self._batch
        used = batch[0].shape[0] * batch[0].shape[2] if batch is not None else 0
        used += sum(s.length for s in self._prefilling)
        return used * self.spec.kv_bytes_per_token

    # ---- engine thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not (self._waiting or self._prefilling or self._running):
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # a backend failure ends the affected requests, never the server
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")

    def step(self) -> None:
        self._reap_cancelled()
        self._admit()
        self._prefill()
        self._decode()
        m = self.metrics
        m.queue_size.set(len(self._waiting))
        m.running.set(len(self._prefilling) + len(self._running))
        m.kv_usage.set(self.kv_usage_bytes() / self.budget_bytes)

    def _reap_cancelled(self) -> None:
        with self._cond:
            gone = [s for s in (*self._waiting, *self._prefilling, *self._running) if s.cancelled and not s.done]
            if not gone:
                return
            self._waiting = deque(s for s in self._waiting if not s.cancelled)
        self._prefilling = [s for s in self._prefilling if not s.cancelled]
        self._leave([i for i, s in enumerate(self._running) if s.cancelled])
        for s in gone:
            s.done, s.cache = True, None
            self.metrics.finished("cancelled", time.perf_counter() - s.arrival)

    def _fits(self, seq: Sequence) -> bool:
        active = [*self._prefilling, *self._running, seq]
        longest = max(s.reserved for s in active)  # the batch cache pads every row to the longest one
        return len(active) * longest * self.spec.kv_bytes_per_token <= self.budget_bytes

    def _admit(self) -> None:
        with self._cond:
            while self._waiting and len(self._prefilling) + len(self._running) < self.config.max_batch:
                if not self._fits(self._waiting[0]):
                    break
                seq = self._waiting.popleft()
                self.metrics.queue_time.observe(time.perf_counter() - seq.arrival)
                self._prefilling.append(seq)

    def _want_entropy(self, seqs: list[Sequence]) -> bool:
        return self.metrics.entropy != "off" or any(s.stats is not None for s in seqs)

    def _record_entropy(self, seqs: list[Sequence], entropy: torch.Tensor | None, first_pos: list[int]) -> None:
        """entropy (B, layers, heads, L) of rows `seqs` whose first query sits at position first_pos[i]."""
        if entropy is None:
            return
        ent = entropy.numpy().astype(np.float64)
        visible = np.asarray(first_pos)[:, None] + np.arange(ent.shape[-1])[None] + 1  # (B, L)
        for i, s in enumerate(seqs):
            if s.stats is not None:
                s.stats.add(ent[i], visible[i])
        if self.metrics.entropy != "off":
            self.metrics.observe_attention(ent.transpose(0, 3, 1, 2).reshape(-1, *ent.shape[1:3]), visible.reshape(-1))

    def _prefill(self) -> None:
        budget = self.config.prefill_chunk
        for seq in list(self._prefilling):
            if budget <= 0:
                break
            start = seq.length
            n = min(budget, seq.prompt_len - start)
            ids = torch.tensor([seq.request.prompt_ids[start : start + n]], dtype=torch.int64)
            past = seq.cache if seq.cache is not None else self.backend.empty_past(1)
            want = self._want_entropy([seq])
            out = self.backend.forward(
                ids,
                torch.ones(1, start + n, dtype=torch.int64),
                torch.arange(start, start + n, dtype=torch.int64)[None],
                past,
                want,
            )
            seq.cache, seq.length = out.presents, start + n
            budget -= n
            self.metrics.prompt_tokens.inc(n)
            self._record_entropy([seq], out.entropy, [start])
            if seq.length == seq.prompt_len:
                self._prefilling.remove(seq)
                self._emit(seq, out.logits[0:1])
                if not seq.done:
                    self._join(seq)

    def _join(self, seq: Sequence) -> None:
        cache, seq.cache = seq.cache, None
        if self._batch is None:
            self._batch, self._running = cache, [seq]
            return
        width = max(self._batch[0].shape[2], cache[0].shape[2])
        self._batch = [
            torch.cat((_left_pad(b, width), _left_pad(c, width)), dim=0)
            for b, c in zip(self._batch, cache, strict=True)
        ]
        self._running.append(seq)

    def _leave(self, rows: list[int]) -> None:
        if not rows:
            return
        keep = [i for i in range(len(self._running)) if i not in set(rows)]
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._batch = None
            return
        width = max(s.length for s in self._running)
        index = torch.tensor(keep, device=self._batch[0].device)
        self._batch = [t.index_select(0, index)[:, :, t.shape[2] - width :] for t in self._batch]

    def _decode(self) -> None:
        if not self._running:
            return
        seqs, width = self._running, self._batch[0].shape[2]
        lengths = torch.tensor([s.length for s in seqs], dtype=torch.int64)
        columns = torch.arange(width + 1)[None]
        mask = (columns >= (width - lengths)[:, None]).to(torch.int64)
        ids = torch.tensor([[s.generated[-1]] for s in seqs], dtype=torch.int64)
        out = self.backend.forward(ids, mask, lengths[:, None], self._batch, self._want_entropy(seqs))
        self._batch = out.presents
        self.metrics.batch_size.observe(len(seqs))
        self._record_entropy(seqs, out.entropy, lengths.tolist())
        finished = []
        for i, s in enumerate(seqs):
            s.length += 1
            self._emit(s, out.logits[i : i + 1])
            if s.done:
                finished.append(i)
        self._leave(finished)

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample the next token of `seq`, send it and finish the sequence when a stop condition holds."""
        token = int(sample(logits, seq.request.sampling, seq.generator))
        now = time.perf_counter()
        if seq.generated:
            self.metrics.inter_token.observe(now - seq.last_token_time)
        else:
            self.metrics.ttft.observe(now - seq.arrival)
        seq.last_token_time = now
        seq.generated.append(token)
        self.metrics.generation_tokens.inc()
        text = seq.text.push(token if token < 256 else None)
        reason = None
        if token == self.spec.eos:
            reason = "eos"
        elif seq.text.stopped:
            reason = "stop"
        elif len(seq.generated) >= seq.request.max_new_tokens:
            reason = "length"
        if reason is not None:
            text += seq.text.finish()
        seq.sink(Delta([token], text))
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        with self._cond:
            seq.done = True
        stats = seq.stats
        seq.sink(
            Finished(
                reason,
                seq.prompt_len,
                len(seq.generated),
                stats.summary() if stats else None,
                stats.positions if stats else 0,
            )
        )
        self.metrics.finished("ok", time.perf_counter() - seq.arrival)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            seqs = [*self._waiting, *self._prefilling, *self._running]
            self._waiting.clear()
            for s in seqs:
                s.done = True
        self._prefilling, self._running, self._batch = [], [], None
        for s in seqs:
            s.sink(Failed("internal", message))
            self.metrics.finished("internal", time.perf_counter() - s.arrival)
