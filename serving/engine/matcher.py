"""Structured outputs, the sampling stage's side: per sequence a matcher of its request's grammar (compiled at
validation, serving/grammar.py) that masks, each step, the tokens that would break it — in NumPy (llguidance's bitmask
path), so a graph server still never imports torch.

The tokenizer's vocabulary is compiled once per served model (`Grammars`), in a worker thread from the moment the
engine is built, so the first structured request neither waits for it nor stalls the event loop. A sequence's next
mask, when it is expensive, is computed in a worker thread as soon as its token is taken (llguidance releases the
GIL), so it is ready — computed while the next forward ran — when that step samples: off the step's critical path.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from sharp.models.sampling import SamplingParams
from sharp.serving.backends.sampler import Sampler
from sharp.serving.grammar import WORKERS as _MASKS
from sharp.serving.grammar import GrammarError, error_line

_DONE: Future = Future()  # a mask already computed
_DONE.set_result(None)
HANDOFF_SECONDS = 100e-6  # about what submitting a job to a worker thread and collecting it costs on a busy host
OPENING_TOKENS = 16  # a grammar's masks are kept for the states its outputs' first tokens reach ...
OPENINGS = 32  # ... at most this many states per grammar (64 grammars of a 152K vocabulary: at most 39 MB)


class Grammars:
    """A served model's vocabulary as llguidance reads it, and matchers of grammars over it. The vocabulary is
    compiled in a worker thread from construction on (tens of milliseconds for a byte vocabulary, more for 100K
    tokens): a server's first structured request would otherwise wait for it; a compile that fails raises when a
    matcher is first asked for."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiled = _MASKS.submit(self._compile)

    def _compile(self):
        from llguidance import LLTokenizer

        eos = sorted(self.tokenizer.eos_ids)
        return LLTokenizer(self.tokenizer.tokenizer_json(), n_vocab=self.vocab_size, eos_token=eos)

    def matcher(self, grammar: str, sampling: SamplingParams | None = None) -> Matcher:
        """A matcher at the start of `grammar`: a copy of one made once per grammar (making one parses the grammar,
        some hundred times what copying costs), sharing the grammar's opening masks (`Matcher`). Its row samples
        first and is masked only when the grammar refuses the token (`Matcher.checked`) unless `sampling`
        truncates the distribution (or is not given)."""
        fresh, openings = self._fresh(grammar)
        checked = sampling is not None and not sampling.truncates
        return Matcher(fresh.deep_copy(), self.vocab_size, openings=openings, checked=checked)

    def warm(self, grammar: str) -> None:
        """Make `grammar`'s first matcher now (parsing it takes up to seconds), so a later `matcher` only copies."""
        self._fresh(grammar)

    @lru_cache(maxsize=64)  # noqa: B019 - one Grammars per served model, alive as long as its engine
    def _fresh(self, grammar: str) -> tuple[Any, dict[tuple[int, ...], Opening]]:
        from llguidance import LLMatcher

        return LLMatcher(self._compiled.result(), grammar), {}


@dataclass(frozen=True)
class Opening:
    """A kept mask of a grammar's opening state, and its one allowed token if it allows only one."""

    bitmask: np.ndarray
    only: int | None


def only_token(words: np.ndarray) -> int | None:
    """The token of the single bit set in a bitmask's int32 words (lowest bit first), or None."""
    set_words = np.flatnonzero(words)
    if len(set_words) != 1:
        return None
    word = int(words[set_words[0]]) & 0xFFFFFFFF
    return int(set_words[0]) * 32 + word.bit_length() - 1 if word & (word - 1) == 0 else None


class Matcher:
    """One sequence's place in its grammar: the mask of the tokens allowed next, and each sampled token taken.

    A step's next masks are computed as soon as its tokens are taken (`prefetch`): in a worker thread, while the
    next forward runs, when together they take longer than handing them over costs (`handoff` seconds); cheaper
    ones (a small vocabulary, a simple grammar, few rows) at once in the engine thread, where a thread's wake-up
    would cost more than it saves.

    A `checked` matcher's row — greedy, or sampled from its whole distribution (no top-k, top-p or min-p) — needs
    no mask at all while the grammar accepts the token it samples: the executor samples it unmasked, `accepts`
    checks the token (a lookup, where a mask tests every token of the vocabulary), and only a refused row is
    masked and sampled again. That is exact: the most likely allowed token is the most likely token when that one
    is allowed; and a draw from p, kept when allowed and otherwise drawn again from p restricted to the allowed set
    A, gives each x in A p(x) + (1 − p(A)) · p(x)/p(A) = p(x)/p(A), the masked distribution.

    A grammar's state is a function of the tokens taken, so the masks of its first states — where every output of a
    schema goes through the same `{"key":"` — are the same for every request that sends it: the matchers of one
    grammar share them (`openings`, keyed by the tokens taken, for the first OPENING_TOKENS tokens), and a later
    request finds them computed. Those masks are also the dearest: a fresh matcher's first ones took 10–20 µs on
    the zoo model's vocabulary, 3 µs inside a string. Where a kept state allows one token only, that token is
    known (`forced`): a checked row takes it without a mask or a second draw."""

    def __init__(self, matcher, vocab_size: int, handoff: float = HANDOFF_SECONDS,
                 openings: dict[tuple[int, ...], Opening] | None = None, checked: bool = False):  # fmt: skip
        self.matcher, self.vocab_size, self.handoff, self.checked = matcher, vocab_size, handoff, checked
        self.bitmask = np.full((1, (vocab_size + 31) // 32), -1, np.int32)  # llguidance's layout: a bit per token
        self._openings = {} if openings is None else openings
        self._taken: tuple[int, ...] | None = ()  # the tokens taken, while within the opening
        self.cost = 0.0 if () in self._openings else math.inf  # seconds its last mask took (inf: not known)
        self._next: Future | None = None
        if self.cost > handoff and not checked:
            self._prefetch()  # the grammar's first mask, while the prompt is prefilled

    def _fill(self) -> None:
        began = time.perf_counter()
        kept = self._kept()
        if kept is not None:
            self.bitmask = kept.bitmask
        else:
            self.bitmask = np.empty(self.bitmask.shape, np.int32)  # its own: a kept one is shared, never written
            self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)  # releases the GIL
            if self._taken is not None and len(self._openings) < OPENINGS:
                self._openings[self._taken] = Opening(self.bitmask, only_token(self.bitmask[0]))
        self.cost = time.perf_counter() - began

    def forced(self) -> int | None:
        """The one token the grammar allows next, where this state's mask is kept and allows no other."""
        kept = self._kept()
        return None if kept is None else kept.only

    def _kept(self) -> Opening | None:
        return None if self._taken is None else self._openings.get(self._taken)

    def _took(self, token: int) -> None:
        if self._taken is not None:
            self._taken = (*self._taken, token) if len(self._taken) < OPENING_TOKENS else None

    def _prefetch(self) -> None:
        self._next = _MASKS.submit(self._fill)

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits (V,) of every token the grammar does not allow next to −inf, in place."""
        mask_rows([self], logits[None])

    def error(self) -> str | None:
        """Why the grammar failed (llguidance's reason), or None while it has not."""
        return error_line(self.matcher.get_error()) if self.matcher.is_error() else None

    def accepts(self, token: int) -> bool:
        """Whether the grammar allows `token` next — taken if so; if not, the matcher is as it was."""
        if self.matcher.try_consume_tokens([token]) != 1:
            return False
        self._took(token)
        return True

    def take(self, token: int) -> None:
        """The token sampled (from masked logits: the grammar accepts it). `prefetch` then starts the next mask."""
        if self._next is not None:  # a mask still being computed reads the matcher: let it finish first
            self._next.result()
            self._next = None
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {error_line(self.matcher.get_error())}")
        self._took(token)


def allowed_bits(matchers: list[Matcher], vocab: int) -> np.ndarray:
    """Row i: the tokens matchers[i] allows next, one bit per token (lowest first) in (rows, ⌈vocab/32⌉) int32
    words — in one pass: the masks not computed ahead are computed in turn (the GIL released; llguidance's parallel
    fill wakes threads that compete with the model's on a small host)."""
    bits = np.empty((len(matchers), (vocab + 31) // 32), np.int32)
    for i, m in enumerate(matchers):
        pending, m._next = m._next, None
        if pending is None:
            m._fill()
        else:
            pending.result()
        bits[i] = m.bitmask[0]
    return bits


def mask_rows(matchers: list[Matcher], logits: np.ndarray) -> None:
    """Set row i of host `logits` (rows, V), in place, to −inf at every token matchers[i] does not allow next."""
    Sampler().mask(logits, list(range(len(matchers))), allowed_bits(matchers, logits.shape[1]))


def prefetch(matchers: list[Matcher]) -> None:
    """The next masks of a step's matchers, their tokens just taken: in one worker job, while the next forward runs,
    when together they cost more than the handoff; otherwise here and now — before the step's events go to the
    event loop, so computing them (which releases the GIL) never waits on the loop's thread to get it back."""
    live = [m for m in matchers if not m.matcher.is_stopped()]
    if not live:
        return
    if sum(m.cost for m in live) > live[0].handoff:
        job = _MASKS.submit(lambda: [m._fill() for m in live])
        for m in live:
            m._next = job
        return
    for m in live:
        m._fill()
        m._next = _DONE
