"""The output processor: what the model's sampled tokens become for clients — detokenized text with stop strings
held back, finish reasons, log-probabilities, per-head attention statistics — as events (`Delta`, `Finished`,
`Failed`), collected during an engine step (`Output`) from each request's `RequestState`; and their delivery at
the step's end to the requests' sinks and asyncio callers, one hand-over per event loop per step (`Delivery`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from sharp.models.sampling import Logprobs, token_logprobs
from sharp.models.tokenizer import TextStream
from sharp.serving.engine.text import StopText
from sharp.serving.requests import GenerationRequest
from sharp.serving.stats import RequestOutcome, StepStats
from sharp.serving.status import Status

log = logging.getLogger("sharp.serving")

if TYPE_CHECKING:
    from sharp.serving.backends.interface import Hit, StepResult

S = TypeVar("S")  # what a stream's caller holds of its request: a Sequence in process, a handle across the pipe


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
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not prefilled)


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


@dataclass(eq=False)
class RequestState:
    """One request as the output processor keeps it: where its events go, its text so far (stop strings held
    back), its statistics, and the per-position entropies kept with its cache for the prefix cache."""

    request: GenerationRequest
    sink: Callable[[Event], None]
    arrival: float  # perf_counter
    text: StopText
    detokenizer: TextStream
    stats: HeadStats | None = None  # with attention_stats
    tokens: int = 0  # generated so far
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    prompt_scores: list[TokenLogprob] = field(default_factory=list)  # with prompt_logprobs: tokens 2 … length
    last_token_time: float = 0.0
    ttft: float | None = None  # arrival to its first token
    entropies: list[np.ndarray] = field(default_factory=list)  # (layers, heads, L) of positions 0, 1, … in order
    entropy_positions: int = 0  # positions the list covers

    def kept_entropy(self) -> np.ndarray | None:
        """(layers, heads, positions) of what the prefix cache keeps of its positions; None when not recorded."""
        return np.concatenate(self.entropies, -1) if self.entropies else None


def _outcome(st: RequestState, status: str) -> RequestOutcome:
    req = st.request
    return RequestOutcome(status, req.api, time.perf_counter() - st.arrival, req.request_id, len(req.prompt_ids),
                          st.tokens, st.cached_tokens, st.ttft)  # fmt: skip


def as_token_logprobs(lp: Logprobs, tokens: list[int], top: list[int]) -> list[TokenLogprob]:
    """Rows of `token_logprobs` as TokenLogprob objects, row i with its top[i] alternatives."""
    ids, vals = lp.top_ids.tolist(), lp.top.tolist()
    return [
        TokenLogprob(t, c, list(zip(i[:k], v[:k], strict=True)))
        for t, c, i, v, k in zip(tokens, lp.chosen.tolist(), ids, vals, top, strict=True)
    ]


class Output:
    """Turns a step's tokens into events and records what they mean for the metrics (`stats`). Events wait in
    `outbox` until the step ends: a client that sees its answer sees it counted. It reads requests' states only;
    whether a request goes on is the scheduler's (a stop string is the one ending found here: `emit` says so)."""

    def __init__(self, entropy_metrics: bool):
        self.entropy_metrics = entropy_metrics
        self.stats = StepStats()
        self.outbox: list[tuple[RequestState, Event]] = []

    # ---- the step's events ---------------------------------------------------------------------------------
    def emit(self, st: RequestState, token: int, reason: str | None, logprob: TokenLogprob | None = None) -> str | None:
        """Send a sampled token (and its log-probability, when asked); `reason`: why the scheduler ends the request
        with it (eos, stop for a stop token, length), None if it goes on. Returns the reason it ended for, "stop"
        when the token completed a stop string. A first token carries the prompt's log-probabilities, when asked."""
        now = time.perf_counter()
        api = st.request.api
        if st.tokens:
            self.stats.inter_token.append((api, now - st.last_token_time))
        else:
            st.ttft = now - st.arrival
            self.stats.ttft.append((api, st.ttft))
        st.last_token_time = now
        st.tokens += 1
        self.stats.generation_tokens[api] += 1
        req = st.request
        ended_by_token = reason in ("eos", "stop")  # its text is left out unless the request keeps what stopped it
        piece = "" if ended_by_token and not req.include_stop else st.detokenizer.step(token)
        text = st.text.push(piece, armed=st.tokens >= req.min_tokens)
        if reason is None and st.text.stopped:
            reason = "stop"
        if reason is not None:
            text += st.text.finish(st.detokenizer.finish())
        prompt = st.prompt_scores if st.tokens == 1 and st.request.prompt_logprobs is not None else None
        self.outbox.append((st, Delta([token], text, None if logprob is None else [logprob], prompt)))
        if reason is not None:
            self.finish(st, reason)
        return reason

    def unusable(self, st: RequestState, grammar_error: str | None = None) -> None:
        """No token could be taken — its logits were not finite, or its grammar failed (`grammar_error`, the
        request's own fault, said as llguidance says it): it ends alone, the batch goes on."""
        if grammar_error is not None:
            message = f"the request's grammar failed after {st.tokens} tokens: {grammar_error}"
            self.fail(st, Status.INVALID_ARGUMENT, message)
            return
        message = f"the model produced non-finite logits for this request after {st.tokens} tokens"
        self.fail(st, Status.INTERNAL, message)

    def prefilled(self, st: RequestState, start: int, n: int, res: StepResult) -> None:
        """Record a prefilled prompt chunk of `n` tokens from `start`: tokens, entropy, prompt log-probabilities."""
        self.stats.prompt_tokens[st.request.api] += n
        self.record_entropy([st], res.entropy, [start])
        if res.scores is not None:
            self.score_prompt(st, res.scores, start)

    def restored(self, st: RequestState, hit: Hit) -> None:
        """An admitted prompt looked up in the prefix cache: count the query and the hit, and record the cached
        positions' entropies as their prefill would have (the request's statistics and the metrics' histograms)."""
        api = st.request.api
        st.cached_tokens = hit.tokens
        self.stats.prefix_queries[api] += len(st.request.prompt_ids)
        self.stats.prefix_hits[api] += hit.tokens
        if hit.tokens and hit.entropy is not None:
            self.record_entropy([st], hit.entropy[None], [0])

    def scored(self, st: RequestState) -> None:
        """A prompt-scoring request (max_new_tokens 0): its prompt's log-probabilities, and the end."""
        self.outbox.append((st, Delta([], "", None, st.prompt_scores)))
        self.finish(st, "length")

    def finish(self, st: RequestState, reason: str) -> None:
        stats = st.stats
        summary = Finished(
            reason,
            len(st.request.prompt_ids),
            st.tokens,
            stats.summary() if stats else None,
            stats.positions if stats else 0,
            st.cached_tokens,
        )
        self.outbox.append((st, summary))
        self.stats.outcomes.append(_outcome(st, "ok"))

    def fail(self, st: RequestState, code: Status, message: str) -> None:
        """End one request with `code` (the scheduler has ended it)."""
        self.outbox.append((st, Failed(code, message)))
        self.stats.outcomes.append(_outcome(st, code.value))

    def fail_forward(self, st: RequestState, where: str) -> None:
        log.error("model forward failed for request %r (%s)", st.request.request_id, where)
        self.fail(st, Status.INTERNAL, f"the model failed on this request ({where}); see the server log")

    def cancelled(self, st: RequestState) -> None:
        self.stats.outcomes.append(_outcome(st, "cancelled"))

    def fail_all(self, states: list[RequestState], code: Status, message: str) -> None:
        """End `states` with `code`, dropping what this step had for them; those that finished keep their answer."""
        failing = set(states)
        self.outbox = [(q, ev) for q, ev in self.outbox if q not in failing]
        for st in states:
            self.fail(st, code, message)

    @staticmethod
    def score_prompt(st: RequestState, scores: np.ndarray, start: int) -> None:
        """Log-probabilities of the prompt tokens that the chunk's positions predict (scores (n, V) from `start`)."""
        ids = st.request.prompt_ids
        n = min(len(scores), len(ids) - 1 - start)  # the prompt's last position predicts the first new token
        if n <= 0:
            return
        targets = list(ids[start + 1 : start + 1 + n])
        k = st.request.prompt_logprobs
        lp = token_logprobs(scores[:n], np.array(targets), k)
        st.prompt_scores += as_token_logprobs(lp, targets, [k] * n)

    def want_entropy(self, states: list[RequestState]) -> bool:
        return self.entropy_metrics or any(st.stats is not None for st in states)

    def record_entropy(self, states: list[RequestState], entropy: np.ndarray | None, first_pos: list[int]) -> None:
        """entropy (B, layers, heads, L) of rows `states` whose first query sits at position first_pos[i]."""
        if entropy is None:
            return
        ent = entropy.astype(np.float64)
        visible = np.asarray(first_pos)[:, None] + np.arange(ent.shape[-1])[None] + 1  # (B, L)
        for i, st in enumerate(states):
            if st.stats is not None:
                st.stats.add(ent[i], visible[i])
            if first_pos[i] == st.entropy_positions:  # kept with its cache for the prefix cache, in order
                st.entropies.append(entropy[i])
                st.entropy_positions += entropy.shape[-1]
        if self.entropy_metrics:
            self.stats.entropy.append((ent.transpose(0, 3, 1, 2).reshape(-1, *ent.shape[1:3]), visible.reshape(-1)))

    # ---- the step's end --------------------------------------------------------------------------------------
    def take(self) -> tuple[StepStats, list[tuple[RequestState, Event]]]:
        """The step's statistics and events; the next step starts empty."""
        st, self.stats = self.stats, StepStats()
        out, self.outbox = self.outbox, []
        return st, out


class Delivery:
    """Hands events to their requests' sinks at the end of a step; asyncio callers (`sink_for`) get theirs in one
    hand-over per event loop per step. The engine thread (or, with the engine core in its own process, the thread
    that reads its pipe) is the only one that calls `send`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._couriers: dict[asyncio.AbstractEventLoop, _Courier] = {}  # stream callers, by event loop

    def send(self, events: list[tuple[Callable[[Event], None], Event]]) -> None:
        for sink, event in events:
            sink(event)
        with self._lock:
            couriers = list(self._couriers.items())
        for loop, courier in couriers:
            if not courier.flush():
                with self._lock:
                    self._couriers.pop(loop, None)

    def sink_for(self, events: asyncio.Queue) -> Callable[[Event], None]:
        """A sink that posts to `events`, a queue of the running event loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            courier = self._couriers.get(loop)
            if courier is None:
                courier = self._couriers[loop] = _Courier(loop)
        return lambda ev: courier.post(events, ev)

    @staticmethod
    async def follow(seq: S, events: asyncio.Queue[Event], cancel: Callable[[S], None]) -> AsyncIterator[Event]:
        """The events of `seq`; the text of steps a slow reader has not taken yet comes as one Delta (a client
        that falls behind gets fewer, larger messages instead of a growing backlog of one-token ones). Leaving
        early (cancel, deadline, disconnect) cancels `seq`."""
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
            cancel(seq)
