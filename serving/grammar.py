"""Structured outputs: a request's JSON schema (or "any JSON object"), regular expression, choice of strings or Lark
grammar compiled by llguidance into a grammar, and
per sequence a matcher that masks, each step, the tokens that would break it — in NumPy (llguidance's bitmask
path), so a graph server still never imports torch. JSON is emitted compact (no free whitespace), so a small
schema's output is bounded.

The tokenizer's vocabulary is compiled once per served model (`Grammars`, lazily); a schema is checked when a
request is validated, and a schema llguidance cannot compile is refused with its reason. A sequence's next mask is
computed in a worker thread as soon as its token is taken (llguidance releases the GIL), so it is ready — computed
while the next forward ran — when that step samples: off the step's critical path.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # response_format json_object
_MASKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sharp-grammar")  # next masks, beside the forwards


class GrammarError(ValueError):
    """A schema that cannot constrain decoding, with llguidance's reason."""


KINDS = ("json_schema", "regex", "choice", "grammar")  # what a request may constrain its output to


@lru_cache(maxsize=256)
def compile_grammar(kind: str, spec: str) -> str:
    """The llguidance grammar of `spec`: a JSON schema's text, a regular expression, the JSON text of a list of
    strings to choose from, or a Lark grammar, by `kind` (KINDS); GrammarError saying why it cannot be one. The last
    grammars are kept: an agent sends the same schema with every request."""
    from llguidance import LLMatcher

    if kind == "json_schema":
        try:
            grammar = LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        except ValueError as e:  # not a JSON object
            raise GrammarError(f"not a JSON schema: {e}") from None
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":
        choices = json.loads(spec)
        if not choices:
            raise GrammarError("no choices")
        grammar = LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in choices))
    else:
        grammar = LLMatcher.grammar_from_lark(spec)
    if problem := LLMatcher.validate_grammar(grammar):
        raise GrammarError(" ".join(problem.split())[:300])
    return grammar


class Grammars:
    """A served model's vocabulary as llguidance reads it, and matchers of grammars over it."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    @cached_property
    def _vocabulary(self):
        from llguidance import LLTokenizer

        eos = sorted(self.tokenizer.eos_ids)
        return LLTokenizer(self.tokenizer.tokenizer_json(), n_vocab=self.vocab_size, eos_token=eos)

    def matcher(self, grammar: str) -> Matcher:
        from llguidance import LLMatcher

        return Matcher(LLMatcher(self._vocabulary, grammar), self.vocab_size)


class Matcher:
    """One sequence's place in its grammar: the mask of the tokens allowed next, and each sampled token taken."""

    def __init__(self, matcher, vocab_size: int):
        import llguidance.numpy as llnp

        self.matcher, self._np = matcher, llnp
        self.bitmask = llnp.allocate_token_bitmask(1, vocab_size)
        self._next: Future | None = None
        self._prefetch()  # the first mask, while the prompt is prefilled

    def _fill(self) -> None:
        self._np.fill_next_token_bitmask(self.matcher, self.bitmask, 0)

    def _prefetch(self) -> None:
        if not self.matcher.is_stopped():
            self._next = _MASKS.submit(self._fill)

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits (V,) of every token the grammar does not allow next to −inf, in place (with the mask
        computed since the last token was taken, or now)."""
        pending, self._next = self._next, None
        if pending is None:
            self._fill()
        else:
            pending.result()
        row = logits[None] if logits.flags.c_contiguous else np.ascontiguousarray(logits[None])
        self._np.apply_token_bitmask_inplace(row, self.bitmask)
        logits[:] = row[0]

    def take(self, token: int) -> None:
        """The token sampled (from masked logits: the grammar accepts it)."""
        if self._next is not None:  # a mask still being computed reads the matcher: let it finish first
            self._next.result()
            self._next = None
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self._prefetch()  # the next mask, computed while the next forward runs


def schema_text(schema: dict[str, Any] | None) -> str:
    return json.dumps(ANY_OBJECT if schema is None else schema)
