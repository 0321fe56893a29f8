"""Structured outputs, the request's side: a JSON schema (or "any JSON object"), regular expression, choice of
strings or Lark grammar compiled by llguidance into a grammar when the request is validated — a schema llguidance
cannot compile is refused with its reason. JSON is emitted compact (no free whitespace), so a small schema's output
is bounded. The sampling stage's side, the matchers that mask each step, is serving/engine/matcher.py.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from importlib import import_module
from typing import Any

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # response_format json_object
WORKERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sharp-grammar")  # imports, vocabularies, next masks


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
        if isinstance(schema := _json(spec), dict) and "x-guidance" in schema:  # it would override the options below
            raise GrammarError("x-guidance is not accepted: sharp writes compact JSON that the schema validates, and a"
                               " schema may not change how (separators, whitespace, lenient keywords)")  # fmt: skip
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
        raise GrammarError(explained(" ".join(problem.split())[:300]))
    if kind == "json_schema" and (problem := dead_start(grammar)):  # a client's schema; sharp's own tool grammars
        raise GrammarError(problem)  # name the served vocabulary's tokens, which a byte vocabulary lacks
    return grammar


# What to use instead of a JSON Schema keyword no grammar can enforce while the text is written (llguidance refuses
# them as "Unimplemented keys"), so the refusal names the keyword and a way out, not only the library's words.
INSTEAD = {
    "uniqueItems": "items cannot be kept distinct token by token: send an array without it (pydantic: list[...] for"
    " set[...]) and deduplicate what you parse",
    "contains": "send the item's schema as `items`, or check the item after parsing",
    "not": "state what is allowed (enum, const, pattern) rather than what is not",
    "if": "use anyOf of the cases, each with its own required properties",
    "then": "use anyOf of the cases, each with its own required properties",
    "else": "use anyOf of the cases, each with its own required properties",
    "dependentRequired": "use anyOf of the shapes the object may take",
    "dependentSchemas": "use anyOf of the shapes the object may take",
}
ONE_OF = (
    "oneOf: its branches could both match one value, and exactly-one cannot be enforced while the text is written"
    " (sharp does not weaken it to anyOf: the reply must validate): use anyOf, or make the branches exclusive — a"
    " required property with a different const in each (pydantic: a discriminated union), or different types"
)


def explained(problem: str) -> str:
    """llguidance's refusal of a schema, with the keyword it could not enforce named and what to use instead."""
    if "oneOf constraints are not supported" in problem:
        return ONE_OF
    if m := re.fullmatch(r"Unimplemented keys: \[(.*)\]", problem):
        keys = [k.strip().strip('"') for k in m[1].split(",")]
        advice: dict[str, list[str]] = {}
        for k in keys:
            if k in INSTEAD:
                advice.setdefault(INSTEAD[k], []).append(k)
        ways = "; ".join(f"{'/'.join(named)}: {way}" for way, named in advice.items())
        said = ", ".join(keys)
        return f"the schema uses {said}, which cannot be enforced while decoding" + (f" ({ways})" if ways else "")
    return problem


PROBE_STEPS = 64  # bytes a new grammar is walked on the byte vocabulary before it is admitted (best effort: the
# walk takes the lowest byte allowed, so it opens declared objects of a strict schema but not every branch)


def dead_start(grammar: str) -> str | None:
    """Why a grammar that compiles cannot be used, or None: one that admits no output that can begin (a `$ref` loop,
    a schema whose every instance is infinite — llguidance reports such a grammar only when a matcher computes its
    first mask, and then allows nothing but end-of-sequence: an empty reply that would pass for a finished one), or
    one beyond llguidance's parser limits as soon as its text opens (an object of ~500 optional properties: a row of
    over 2,000 Earley items at its first byte — that was a failure on the first token, after admission). Walked for
    PROBE_STEPS bytes on a byte vocabulary, taking the lowest byte allowed each time (the grammar's structure, not the
    served model's tokens, decides)."""
    import numpy as np
    from llguidance import LLMatcher

    vocab = _probe_tokenizer().vocab_size
    probe = LLMatcher(_probe_tokenizer(), grammar, log_level=0)  # its reason is said to the client, not on stderr
    mask = np.zeros((1, (vocab + 31) // 32), np.int32)
    for step in range(PROBE_STEPS):  # noqa: B007 - `step` says where it failed
        probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if probe.is_error():
            break
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])
        if probe.is_stopped() or allowed.size == 0:
            return None
        if not probe.consume_token(int(allowed[0])):
            break
    else:
        return None
    reason = error_line(probe.get_error())
    if m := re.search(r"Current row has (\d+) items; max is (\d+)", reason):
        return (
            f"the schema is beyond the grammar library's limit of {m[2]} parser items in a row (it needs {m[1]} as"
            " its text opens; llguidance's max_items_in_row): an object of about 500 or more optional properties"
            " does this — split it into nested objects, or make properties required"
        )
    if step == 0:
        return f"the schema admits no output that can begin (llguidance: {reason})"
    return f"the schema fails after its first {step} bytes (llguidance: {reason})"


def error_line(error: str) -> str:
    """llguidance's error text without the parser state it appends."""
    return " ".join(error.split("<state>")[0].split())[:300] or "no reason given"


@lru_cache(maxsize=1)
def _probe_tokenizer():
    from llguidance import LLTokenizer

    from sharp.models.tokenizer import BYTES

    return LLTokenizer(BYTES.tokenizer_json(), n_vocab=BYTES.vocab_size, eos_token=sorted(BYTES.eos_ids))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None  # llguidance says why


def preload() -> Future:
    """Import llguidance in a worker thread: the first structured request's `validate` (in the event loop) then
    finds it imported — the import alone takes tens of milliseconds, all of which would hold up every stream."""
    return WORKERS.submit(import_module, "llguidance")


def schema_text(schema: dict[str, Any] | None) -> str:
    return json.dumps(ANY_OBJECT if schema is None else schema)
