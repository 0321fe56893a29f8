"""The output processor: what the model's sampled tokens become for clients — detokenized text with stop strings
held back, finish reasons, log-probabilities, per-head attention statistics — as events (`Delta`, `Finished`,
`Failed`), collected during an engine step (`Output`); and their delivery at the step's end to the requests' sinks
and asyncio callers, one hand-over per event loop per step (`Delivery`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from sharp.models.sampling import sample_rows, token_logprobs
from sharp.models.tokenizer import Tokenizer
from sharp.serving.stats import RequestOutcome, StepStats
from sharp.serving.status import Status

log = logging.getLogger("sharp.serving")

if TYPE_CHECKING:
    from sharp.serving.backends import Chunk, Hit, StepResult
    from sharp.serving.scheduler import Sequence

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


class Output:
    """Turns a step's sampled tokens into events and records what they mean for the metrics (`stats`). Events wait
    in `outbox` until the step ends: a client that sees its answer sees it counted. `lock` is the engine's: it
    guards a sequence's `done` against the threads that submit and cancel."""

    def __init__(self, tokenizer: Tokenizer, entropy_metrics: bool, lock: threading.Condition):
        self.tokenizer, self.entropy_metrics, self._lock = tokenizer, entropy_metrics, lock
        self.stats = StepStats()
        self.outbox: list[tuple[Sequence, Event]] = []

    # ---- the step's events ---------------------------------------------------------------------------------
    def emit(self, seq: Sequence, token: int | None, logprob: TokenLogprob | None = None) -> None:
        """Send the sampled token of `seq` (and its log-probability, when asked) and finish the sequence when a stop
        condition holds; None: its logits were unusable (it ends alone, the batch goes on). A first token carries
        the prompt's log-probabilities, when asked."""
        if token is None:
            self.fail(
                seq,
                Status.INTERNAL,
                f"the model produced non-finite logits for this request after {len(seq.generated)} tokens",
            )
            return
        now = time.perf_counter()
        api = seq.request.api
        if seq.generated:
            self.stats.inter_token.append((api, now - seq.last_token_time))
        else:
            self.stats.ttft.append((api, now - seq.arrival))
        seq.last_token_time = now
        seq.generated.append(token)
        self.stats.generation_tokens[api] += 1
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
        self.outbox.append((seq, Delta([token], text, None if logprob is None else [logprob], prompt)))
        if reason is not None:
            self.finish(seq, reason)

    def prefilled(self, chunk: Chunk, res: StepResult) -> bool:
        """Record a prefilled prompt chunk (tokens, entropy, prompt log-probabilities); True when it was the last."""
        seq, n = chunk.seq, chunk.ids.shape[1]
        seq.length = chunk.start + n
        self.stats.prompt_tokens[seq.request.api] += n
        self.record_entropy([seq], res.entropy, [chunk.start])
        if res.scores is not None:
            self.score_prompt(seq, res.scores, chunk.start)
        return seq.length == seq.prompt_len

    def restored(self, seq: Sequence, hit: Hit) -> None:
        """An admitted prompt looked up in the prefix cache: count the query and the hit, and record the cached
        positions' entropies as their prefill would have (the request's statistics and the metrics' histograms)."""
        api = seq.request.api
        self.stats.prefix_queries[api] += seq.prompt_len
        self.stats.prefix_hits[api] += hit.tokens
        if hit.tokens and hit.entropy is not None:
            self.record_entropy([seq], hit.entropy[None], [0])

    def scored(self, seq: Sequence) -> None:
        """A prompt-scoring request (max_new_tokens 0): its prompt's log-probabilities, and the end."""
        self.outbox.append((seq, Delta([], "", None, seq.prompt_scores)))
        self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str) -> None:
        with self._lock:
            seq.done = True
        stats = seq.stats
        summary = Finished(
            reason,
            seq.prompt_len,
            len(seq.generated),
            stats.summary() if stats else None,
            stats.positions if stats else 0,
            seq.cached_tokens,
        )
        self.outbox.append((seq, summary))
        self.stats.outcomes.append(RequestOutcome("ok", seq.request.api, time.perf_counter() - seq.arrival))

    def fail(self, seq: Sequence, code: Status, message: str) -> None:
        """End one sequence with `code`; the caller drops it from the batch (it is marked done)."""
        with self._lock:
            seq.done = seq.failed = True
        self.outbox.append((seq, Failed(code, message)))
        self.stats.outcomes.append(RequestOutcome(code.value, seq.request.api, time.perf_counter() - seq.arrival))

    def fail_forward(self, seq: Sequence, where: str) -> None:
        log.error("model forward failed for request %r (%s)", seq.request.request_id, where)
        self.fail(seq, Status.INTERNAL, f"the model failed on this request ({where}); see the server log")

    def cancelled(self, seq: Sequence) -> None:
        self.stats.outcomes.append(RequestOutcome("cancelled", seq.request.api, time.perf_counter() - seq.arrival))

    def fail_all(self, seqs: list[Sequence], code: Status, message: str) -> None:
        """End `seqs` with `code`, dropping what this step had for them; those that finished keep their answer."""
        failing = set(seqs)
        self.outbox = [(q, ev) for q, ev in self.outbox if q not in failing]
        for s in seqs:
            self.outbox.append((s, Failed(code, message)))
            self.stats.outcomes.append(RequestOutcome(code.value, s.request.api, time.perf_counter() - s.arrival))

    def sample(self, seqs: list[Sequence], logits: np.ndarray) -> None:
        """Sample each row's next token from `logits` (rows of `seqs`) and emit it, with its log-probability when
        the request asked."""
        chosen = sample_rows(logits, [s.request.sampling for s in seqs], [s.generator for s in seqs])
        for s, token, logprob in zip(seqs, chosen, self.logprobs(seqs, logits, chosen), strict=True):
            self.emit(s, token, logprob)

    @staticmethod
    def logprobs(seqs: list[Sequence], logits: np.ndarray, chosen: list[int | None]) -> list[TokenLogprob | None]:
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

    @staticmethod
    def score_prompt(seq: Sequence, scores: np.ndarray, start: int) -> None:
        """Log-probabilities of the prompt tokens that the chunk's positions predict (scores (n, V) from `start`)."""
        ids = seq.request.prompt_ids
        n = min(len(scores), len(ids) - 1 - start)  # the prompt's last position predicts the first new token
        if n <= 0:
            return
        targets = list(ids[start + 1 : start + 1 + n])
        k = seq.request.prompt_logprobs
        lp = token_logprobs(scores[:n], np.array(targets), k)
        seq.prompt_scores += _token_logprobs(lp, targets, [k] * n)

    def want_entropy(self, seqs: list[Sequence]) -> bool:
        return self.entropy_metrics or any(s.stats is not None for s in seqs)

    def record_entropy(self, seqs: list[Sequence], entropy: np.ndarray | None, first_pos: list[int]) -> None:
        """entropy (B, layers, heads, L) of rows `seqs` whose first query sits at position first_pos[i]."""
        if entropy is None:
            return
        ent = entropy.astype(np.float64)
        visible = np.asarray(first_pos)[:, None] + np.arange(ent.shape[-1])[None] + 1  # (B, L)
        for i, s in enumerate(seqs):
            if s.stats is not None:
                s.stats.add(ent[i], visible[i])
            if first_pos[i] == s.entropy_positions:  # kept with its cache for the prefix cache, in order
                s.entropies.append(entropy[i])
                s.entropy_positions += entropy.shape[-1]
        if self.entropy_metrics:
            self.stats.entropy.append((ent.transpose(0, 3, 1, 2).reshape(-1, *ent.shape[1:3]), visible.reshape(-1)))

    # ---- the step's end --------------------------------------------------------------------------------------
    def take(self) -> tuple[StepStats, list[tuple[Sequence, Event]]]:
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
