"""The scheduler: the request queues and the decisions of a step, with no model calls (tested with plans alone).

A `Sequence` is one request's scheduling state: how much of its prompt is in the cache, the tokens it generated,
whether it has ended. What those tokens mean to its client (text, stop strings, log-probabilities, statistics) is
the output processor's `RequestState` (output.py), which it carries but never reads. The scheduler holds sequences
in three places — waiting (by priority, then arrival), prefilling and running (the decode batch, in order) — admits
waiting ones while the batch has room and the backend can reserve their KV cache (prompt + max_new_tokens, up
front; one that does not fit yet is passed a bounded number of times), and returns
each step's `StepPlan`: the next prompt chunk of each prefilling sequence, oldest first, up to `prefill_chunk`
tokens in all (a long prompt never stalls running streams for more than one chunk), and the running sequences to
decode. After a step it advances each sequence from what the step produced (`prompt_advanced`, `update`): the
tokens sampled, and which requests they end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sharp.serving.backends.interface import Chunk, Prefix
from sharp.serving.engine.matcher import Matcher
from sharp.serving.engine.output import RequestState
from sharp.serving.kv.names import PageNames, root
from sharp.serving.requests import GenerationRequest

MAX_OVERTAKES = 16  # admissions that may pass a waiting request that does not fit, before it blocks the queue
LOOKAHEAD = 8  # waiting requests tried behind ones that do not fit, per step


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    generator: np.random.Generator  # its sampler's, seeded by the request
    state: RequestState | None = None  # the output processor's (None where no output is made: the scheduler's tests)
    length: int = 0  # prompt tokens in its cache so far (prefilled, or found in the prefix cache)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    failed: bool = False  # ended by a failure: its cache is not kept
    overtaken: int = 0  # requests admitted past it while it did not fit
    matcher: Matcher | None = None  # structured outputs: its place in its grammar (the executor masks by it)
    queued: float = 0.0  # when it joined the waiting queue (the scheduler's clock)
    _prompt: PageNames | None = None

    def prompt_pages(self) -> PageNames:
        """The prompt's ids (int64) and page names, made once: admission may ask every step while the request
        waits, and joining and leaving name its pages again."""
        if self._prompt is None:
            self._prompt = PageNames(self.request.prompt_ids, root=root(self.request.cache_salt))
        return self._prompt

    def prompt_array(self) -> np.ndarray:
        return self.prompt_pages().ids

    def kept(self) -> Prefix | None:
        """What its cache holds as it leaves, for the prefix cache: the prompt tokens in it and, once the prompt is
        in, every generated token but the newest (never fed); None after a failure."""
        if self.failed:
            return None
        ids = list(self.request.prompt_ids[: self.length])
        if self.length == self.prompt_len:
            ids += self.generated[:-1]
        entropy = self.state.kept_entropy() if self.state is not None else None
        return Prefix(self.prompt_pages().extended(ids), entropy)

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


@dataclass
class StepPlan:
    """The prefill of one engine step: the next prompt chunk of each prefilling sequence, oldest first, within the
    step's token budget, run in one batched call. The step then decodes `Scheduler.running` — which includes the
    sequences whose prompt this prefill completed (their second token comes in the same step)."""

    prefill: list[Chunk] = field(default_factory=list)


class Scheduler:
    """Queues and admission; the engine calls it under its lock where other threads touch the same state (the
    waiting queue, a sequence's `cancelled` and `done`)."""

    def __init__(
        self,
        max_batch: int,
        prefill_chunk: int,
        eos_ids: frozenset[int] | set[int] = frozenset(),
        max_overtakes: int = MAX_OVERTAKES,
        lookahead: int = LOOKAHEAD,
        aging: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_batch, self.prefill_chunk, self.eos_ids = max_batch, prefill_chunk, eos_ids
        self.max_overtakes, self.lookahead = max_overtakes, lookahead
        self.aging, self.clock = aging, clock
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []  # the decode batch, in order

    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def unfinished(self) -> list[Sequence]:
        return [s for s in (*self.waiting, *self.prefilling, *self.running) if not s.done]

    def drop_cancelled(self) -> list[Sequence]:
        """Take the cancelled sequences that have not ended out of every queue, marked done; returns them."""
        gone = [s for s in (*self.waiting, *self.prefilling, *self.running) if s.cancelled and not s.done]
        for s in gone:
            s.done = True
        if gone:
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
            self.prefilling = [s for s in self.prefilling if not s.cancelled]
            self.running = [s for s in self.running if not s.cancelled]
        return gone

    def add(self, seq: Sequence) -> None:
        """Queue `seq` behind every waiting sequence of its priority or a lower value (arrival order within one)."""
        seq.queued = self.clock()
        at = len(self.waiting)
        while at and self.waiting[at - 1].request.priority > seq.request.priority:
            at -= 1
        self.waiting.insert(at, seq)

    def _age(self) -> None:
        """With aging, order the queue by priority less one for every `aging` seconds waited (then arrival): a
        request waits at most about its priority's gap to the best one times `aging`, however many better-priority
        requests keep arriving."""
        if self.aging > 0 and len(self.waiting) > 1:
            now = self.clock()
            key = lambda s: (s.request.priority - (now - s.queued) / self.aging, s.queued)
            self.waiting = deque(sorted(self.waiting, key=key))

    def admit(self, reserve: Callable[[Sequence], int | None]) -> list[Sequence]:
        """Move waiting sequences, in queue order, to prefilling while the batch has room and `reserve(seq)` finds
        their KV cache — it answers how many of the prompt's tokens are cached already (their prefill is skipped),
        or None when it does not fit. One that does not fit lets the next `lookahead` behind it try (smaller
        requests are not stuck behind a large one), but only `max_overtakes` times: then it blocks the queue until
        running sequences leave and it fits (a large request is never starved)."""
        self._age()
        admitted: list[Sequence] = []
        passed: list[Sequence] = []  # those that did not fit this step, in order
        for seq in list(self.waiting):
            if len(self.prefilling) + len(self.running) >= self.max_batch or len(passed) > self.lookahead:
                break
            cached = None if self._waits_for_its_first_choice(seq) else reserve(seq)
            if cached is None:
                if seq.overtaken >= self.max_overtakes:
                    break
                passed.append(seq)
                continue
            for p in passed:
                p.overtaken += 1
            seq.length = cached
            self.waiting.remove(seq)
            self.prefilling.append(seq)
            admitted.append(seq)
        return admitted

    def _waits_for_its_first_choice(self, seq: Sequence) -> bool:
        """A later choice of a request with n > 1 is admitted once choice 0 has prefilled the prompt, so that it
        starts from that prompt's cache (one prefill for all choices) — or once choice 0 has ended."""
        req = seq.request
        return bool(req.choice and req.group) and any(
            s.request.group == req.group and s.request.choice == 0 for s in (*self.prefilling, *self.waiting)
        )

    def plan(self) -> StepPlan:
        budget, chunks = self.prefill_chunk, []
        for seq in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, seq.prompt_len - seq.length)
            ids = np.array([seq.request.prompt_ids[seq.length : seq.length + n]], np.int64)
            chunks.append(Chunk(seq, ids, seq.length, seq.request.prompt_logprobs is not None))
            budget -= n
        return StepPlan(chunks)

    @staticmethod
    def prompt_advanced(seq: Sequence, tokens: int) -> bool:
        """`tokens` more of the prompt of `seq` are in its cache; True when the whole prompt is."""
        seq.length += tokens
        return seq.length == seq.prompt_len

    def update(self, seqs: list[Sequence], tokens: list[int | None]) -> list[str | None]:
        """Append each row's sampled token; the reason each ends for — eos, stop (one of its stop_token_ids),
        length, or error (None: its logits were unusable) — or None where it goes on. An ended sequence is marked
        done; `leave` takes it out."""
        reasons: list[str | None] = []
        for seq, token in zip(seqs, tokens, strict=True):
            reason = None
            if token is None:
                reason = "error"
                seq.failed = True
            else:
                seq.generated.append(token)
                req = seq.request
                may_stop = len(seq.generated) > req.min_tokens  # min_tokens' sampling mask keeps these out before
                if token in self.eos_ids and may_stop and not req.ignore_eos:
                    reason = "eos"
                elif token in req.stop_token_ids and may_stop:
                    reason = "stop"
                elif len(seq.generated) >= req.max_new_tokens:
                    reason = "length"
            seq.done = seq.done or reason is not None
            reasons.append(reason)
        return reasons

    @staticmethod
    def end(seq: Sequence, failed: bool = False) -> None:
        """`seq` ends this step for a reason the scheduler does not see (a stop string, a scored prompt, a failed
        forward); a failed one's cache is not kept."""
        seq.done = True
        seq.failed = seq.failed or failed

    def prefilled(self, seq: Sequence) -> None:
        """`seq` leaves prefilling: its prompt is in (it decodes next unless it ended) or its prefill failed."""
        self.prefilling.remove(seq)
        if not seq.done:
            self.running.append(seq)

    def leave(self, seqs: list[Sequence]) -> None:
        gone = set(seqs)
        self.running = [s for s in self.running if s not in gone]

    def clear(self) -> list[Sequence]:
        """Empty every queue; returns the sequences that had not ended."""
        out = self.unfinished()
        self.waiting.clear()
        self.prefilling, self.running = [], []
        return out
