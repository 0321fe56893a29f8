"""Structured outputs: `response_format` json_schema and json_object (and gRPC's json_schema), decoding
constrained by llguidance — every output validates against its schema at temperature 1 over many seeds, streamed
or not; a schema llguidance cannot compile is a 400 with its reason."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import jsonschema
import pytest
from helpers import HTTP, api, server, serving

from sharp.serving import Client

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def srv(chat_files):
    with serving(chat_files, server=HTTP) as s:
        yield s


def test_every_output_follows_the_schema_at_temperature_one(srv):
    oa = api(srv)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    for seed in range(12):
        r = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a thing"}],
                                       response_format=fmt, temperature=1.0, seed=seed, max_tokens=60)  # fmt: skip
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    ask = {"model": "tiny", "response_format": fmt, "temperature": 1.0, "max_tokens": 60}
    chunks = oa.chat.completions.create(messages=[{"role": "user", "content": "streamed"}], seed=99, stream=True, **ask)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), SCHEMA)


def test_json_object_is_an_object_and_a_short_budget_says_length(srv):
    oa = api(srv)
    for seed in range(6):
        r = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json"}], seed=seed,
                                       response_format={"type": "json_object"}, max_tokens=200)  # fmt: skip
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # an object the model kept open: cut by the budget, and said so
            assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    short = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       response_format=fmt)  # fmt: skip
    assert short.choices[0].finish_reason == "length" and short.choices[0].message.content.startswith("{")


def test_grpc_takes_the_same_schema(srv):
    with Client(srv.target) as c:
        for seed in range(4):
            r = c.generate("grpc", max_new_tokens=60, temperature=1.0, seed=seed, json_schema=json.dumps(SCHEMA))
            jsonschema.validate(json.loads(r.text), SCHEMA)


def test_a_schema_that_cannot_be_compiled_is_a_400_with_the_reason(srv):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nonsense"}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/chat/completions", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "response_format" and "nonsense" in error["message"], error


LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # no finite instance


@pytest.mark.parametrize("schema", [{"$ref": "#"}, LOOP, RECURSIVE], ids=["self", "a-b-a", "required-recursive"])
def test_a_schema_no_output_can_begin_is_a_400_not_an_empty_success(srv, schema):
    """A `$ref` loop compiles, but llguidance's matcher is in error from its first mask and allows only the end:
    served, that was HTTP 200, finish_reason "stop", content "". Refused at validation, on both APIs."""
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/chat/completions", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "response_format", error
    assert "admits no output that can begin" in error["message"], error
    with Client(srv.target) as c, pytest.raises(grpc.RpcError) as err:
        c.generate("x", max_new_tokens=4, json_schema=json.dumps(schema))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "admits no output" in err.value.details()


def _optional(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


NESTED = {"type": "object", "properties": {"a": _optional(600)}, "additionalProperties": False}  # strict mode's shape


@pytest.mark.parametrize("schema", [_optional(500), NESTED], ids=["500-optional", "nested-600"])
def test_a_schema_beyond_the_parsers_limits_is_refused_at_admission_naming_the_limit(srv, schema):
    """~500 optional properties compile, then llguidance's parser exceeds its 2,000 items in a row at the first
    byte: that was a 500 "non-finite logits" on the first token, counted `internal`. Refused at validation with the
    limit named, on both APIs; 400 properties are served."""
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": fmt, "max_tokens": 4}
    r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/chat/completions", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "response_format", error
    assert "limit of 2000 parser items in a row" in error["message"] and "max_items_in_row" in error["message"], error
    with Client(srv.target) as c, pytest.raises(grpc.RpcError) as err:
        c.generate("x", max_new_tokens=4, json_schema=json.dumps(schema))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parser items in a row" in err.value.details()
    fmt["json_schema"]["schema"] = _optional(400)
    r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("placement", ["in-process", "engine-process"])
def test_a_schema_being_compiled_stalls_neither_health_nor_a_bystanders_stream(srv, chat_files, placement):
    """A large schema's compile (and the matcher of a new grammar) runs in a worker, not on the event loop: while a
    4,000-property schema is compiled (seconds; then refused, past the parser's limits), /health and a plain
    streamed request's first token keep their unloaded pace (generous bounds: 2x + 0.25 s; on the loop they waited
    for the whole compile) — with the engine in the server's process and in its own."""
    if placement == "in-process":
        _pace_while_compiling(srv)
    else:
        with server(chat_files, http_port=0) as own:
            _pace_while_compiling(own)


def _pace_while_compiling(srv) -> None:
    import statistics
    import time
    from concurrent.futures import ThreadPoolExecutor

    base = f"http://127.0.0.1:{srv.server.http_port}"
    plain = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}

    def health() -> float:
        began = time.perf_counter()
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        return time.perf_counter() - began

    def first_token() -> float:
        began = time.perf_counter()
        took = None
        with httpx.stream("POST", f"{base}/v1/completions", json=plain, timeout=30) as r:
            for line in r.iter_lines():
                if took is None and line.startswith("data: {"):
                    took = time.perf_counter() - began
        assert took is not None
        return took

    unloaded = statistics.median(health() for _ in range(5)), statistics.median(first_token() for _ in range(3))
    schema = _optional(4000)
    hostile = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
               "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(httpx.post, f"{base}/v1/chat/completions", json=hostile, timeout=120)
        time.sleep(0.3)  # its compile under way
        during = max(health() for _ in range(5)), max(first_token() for _ in range(3))
        measured_while_compiling = not refused.done()
        answer = refused.result()
        assert answer.status_code == 400 and "parser items in a row" in answer.text, answer.text
    assert measured_while_compiling, (during, unloaded)
    for n in (9000, 13000):  # 260 KB, 380 KB: past the budget, never compiled
        hostile["response_format"]["json_schema"]["schema"] = _optional(n)
        began = time.perf_counter()
        answer = httpx.post(f"{base}/v1/chat/completions", json=hostile, timeout=120)
        assert answer.status_code == 400 and "(--max-grammar-bytes)" in answer.text and time.perf_counter() - began < 2
    assert during[0] <= 2 * unloaded[0] + 0.25 and during[1] <= 2 * unloaded[1] + 0.25, (during, unloaded)


def test_a_grammar_that_fails_while_decoding_says_why_in_one_line():
    """A token the grammar refuses leaves its matcher in error: the engine ends that request with the grammar's
    reason (serving/engine/output.py `unusable`: INVALID_ARGUMENT, the request's own fault), not as the model's
    "non-finite logits"; the reason is llguidance's first line, without the parser state it appends."""
    from sharp.models.tokenizer import BYTES
    from sharp.serving.engine.matcher import Grammars
    from sharp.serving.grammar import GrammarError, compile_grammar

    m = Grammars(BYTES, BYTES.vocab_size).matcher(compile_grammar("regex", "ab"))
    assert m.error() is None
    with pytest.raises(GrammarError) as err:
        m.take(ord("z"))
    assert "\n" not in str(err.value) and "<state>" not in str(err.value)
    assert m.error() == """Parser Error: token "z" doesn't satisfy the grammar; forced bytes: got 'a'; applying 'z'"""


@pytest.mark.parametrize("option", [{"key_separator": " = "}, {"whitespace_flexible": True}, {"lenient": True}])
def test_a_schema_may_not_change_how_its_json_is_written(srv, option):
    """llguidance reads a schema's x-guidance as compile options: " = " between keys is not JSON, free whitespace
    undoes the compact output, lenient ignores keywords it cannot enforce. Refused, naming it, on both APIs."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "x-guidance": option}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/chat/completions", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "response_format" and "x-guidance" in error["message"], error
    with Client(srv.target) as c, pytest.raises(grpc.RpcError) as err:
        c.generate("x", max_new_tokens=4, json_schema=json.dumps(schema))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-guidance" in err.value.details()


def test_the_openai_sdks_parse_returns_the_pydantic_model(srv):
    """What `client.chat.completions.parse(response_format=Model)` sends (a strict json_schema of the model) and
    reads back: the reply parses into the model."""
    from typing import Literal

    from pydantic import BaseModel

    class Thing(BaseModel):
        ok: bool
        color: Literal["red", "green", "blue"]

    for seed in range(4):
        messages = [{"role": "user", "content": "a thing"}]
        r = api(srv).chat.completions.parse(model="tiny", messages=messages, response_format=Thing, temperature=1.0,
                                            seed=seed, max_tokens=60)  # fmt: skip
        assert isinstance(r.choices[0].message.parsed, Thing)


def test_pydantic_unions_work_and_what_cannot_be_enforced_is_named_with_a_way_out(srv):
    """A discriminated union (oneOf with a const per branch) is served and parses; a set[...] (uniqueItems) and a
    oneOf whose branches overlap are refused naming the keyword and what to use — never llguidance's
    "Enable 'coerce_one_of' option", which no client can reach (and which would let a reply break the schema)."""
    from typing import Annotated, Literal

    import openai
    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(BaseModel):
        pet: Annotated[Cat | Dog, Field(discriminator="kind")]

    assert "oneOf" in json.dumps(Pet.model_json_schema())
    for seed in range(3):
        r = api(srv).chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "a pet"}],
                                            response_format=Pet, temperature=1.0, seed=seed, max_tokens=60)  # fmt: skip
        assert isinstance(r.choices[0].message.parsed, Pet)  # (parse raises on a reply cut by max_tokens)

    class Tagged(BaseModel):
        tags: set[str]

    overlapping = {"type": "object", "properties": {"n": {"oneOf": [{"type": "number"}, {"type": "integer"}]}}}
    for schema, says in ((Tagged.model_json_schema(), "uniqueItems"), (overlapping, "oneOf")):
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
        with pytest.raises(openai.BadRequestError) as err:
            api(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                             response_format=fmt, max_tokens=4)  # fmt: skip
        error = err.value.body
        assert error["param"] == "response_format" and says in error["message"], error
        assert "coerce_one_of" not in error["message"]
    assert "list[...]" in str(grammar_refusal(Tagged.model_json_schema()))
    assert "use anyOf, or make the branches exclusive" in str(grammar_refusal(overlapping))


def grammar_refusal(schema: dict) -> Exception:
    from sharp.serving.grammar import GrammarError, compile_grammar

    with pytest.raises(GrammarError) as err:
        compile_grammar("json_schema", json.dumps(schema))
    return err.value


def test_vllms_structured_outputs_regex_choice_and_grammar_on_both_apis(srv):
    """vLLM's `structured_outputs` extension (completions and chat) and gRPC's fields: a regular expression, a
    choice of strings, a Lark grammar; two at once, or one that cannot compile, is refused naming it."""
    oa = api(srv)
    cases = [
        ({"regex": r"[a-c]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
        ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"grammar": 'start: "<" NAME ">"\nNAME: /[xyz]{2,4}/'}, lambda t: re.fullmatch(r"<[xyz]{2,4}>", t)),
    ]
    for extra, ok in cases:
        for seed in range(3):
            body = {"extra_body": {"structured_outputs": extra}, "temperature": 1.0, "seed": seed, "max_tokens": 20}
            text = oa.completions.create(model="tiny", prompt="pick", **body).choices[0].text
            assert ok(text), (extra, text)
            chat = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "pick"}], **body)
            assert ok(chat.choices[0].message.content), (extra, chat)
    with Client(srv.target) as c:
        r = c.generate("pick", max_new_tokens=20, temperature=1.0, seed=1, choice=["red", "blue"])
        assert r.text in ("red", "blue")
    url = f"http://127.0.0.1:{srv.server.http_port}/v1/completions"
    for bad, field in (({"regex": "(unclosed"}, "structured_outputs.regex"),
                       ({"regex": "a", "choice": ["b"]}, "structured_outputs.choice")):  # fmt: skip
        r = httpx.post(url, json={"model": "tiny", "prompt": "x", "structured_outputs": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_constrained_request_found_in_the_prefix_cache_gives_the_same_tokens(srv):
    """The same seeded constrained request twice: the second finds its prompt in the prefix cache and still
    samples the same tokens under the grammar."""
    with Client(srv.target) as c:
        ask = {"max_new_tokens": 60, "temperature": 1.0, "seed": 5, "json_schema": json.dumps(SCHEMA)}
        prompt = "a cached prompt long enough to be kept " * 4
        first, second = c.generate(prompt, **ask), c.generate(prompt, **ask)
        assert second.usage.cached_tokens > 0 and list(second.token_ids) == list(first.token_ids)
        jsonschema.validate(json.loads(second.text), SCHEMA)


def test_an_expensive_next_mask_is_computed_as_soon_as_a_token_is_taken():
    """Matchers whose masks cost more than a thread handoff start their next masks in a worker once the step's
    tokens are taken (and the first when made), so the next step's forward runs while they are computed; cheap
    ones compute them at once. Either way the mask used is the new state's."""
    import numpy as np

    from sharp.models.tokenizer import BYTES
    from sharp.serving.engine.matcher import Grammars, prefetch
    from sharp.serving.grammar import compile_grammar

    grammars = Grammars(BYTES, BYTES.vocab_size)
    for handoff, ahead, regex in ((0.0, True, "ab"), (1.0, False, "ac")):  # every mask dearer than a handoff; none
        m = grammars.matcher(compile_grammar("regex", regex))
        m.handoff = handoff
        allowed = lambda m=m: set(np.flatnonzero(np.isfinite(_masked(m, BYTES.vocab_size))).tolist())
        assert m._next is not None  # the first mask, while the prompt is prefilled (its cost is not known yet)
        assert allowed() == {ord("a")}
        m.take(ord("a"))
        prefetch([m])  # as the executor does once a step's tokens are taken
        assert m._next is not None and (ahead or m._next.done())  # in the worker when dear, else computed at once
        assert allowed() == {ord(regex[1])}
        m.take(ord(regex[1]))
        prefetch([m])
        assert m._next is None  # nothing after the grammar's end
    # a later request's matcher finds the grammar's first mask kept (computed by the matcher above): nothing to
    # start in a worker, and nothing computed when asked
    later = grammars.matcher(compile_grammar("regex", "ac"))
    assert later.cost == 0.0 and later._next is None
    assert set(np.flatnonzero(np.isfinite(_masked(later, BYTES.vocab_size))).tolist()) == {ord("a")}
    assert later.bitmask is grammars._fresh(compile_grammar("regex", "ac"))[1][()].bitmask


def test_a_grammars_opening_masks_are_computed_once_for_all_its_requests(monkeypatch):
    """The masks of a grammar's first states are kept, keyed by the tokens taken: a later request along the same
    opening computes none of them, one that parts from it computes its own from there, and every mask is the one
    llguidance computes for that state. Past OPENING_TOKENS tokens, or OPENINGS states, nothing more is kept."""
    import numpy as np

    from sharp.models.sampling import GREEDY
    from sharp.models.tokenizer import BYTES
    from sharp.serving.engine import matcher as g
    from sharp.serving.grammar import compile_grammar

    computed = []  # per mask asked for: whether llguidance computed it (not found kept)
    real = g.Matcher._fill
    miss = lambda m: m._taken is None or m._taken not in m._openings
    monkeypatch.setattr(g.Matcher, "_fill", lambda self: (computed.append(miss(self)), real(self))[1])
    grammars, schema = g.Grammars(BYTES, BYTES.vocab_size), compile_grammar("json_schema", json.dumps(SCHEMA))
    truth = lambda text: _masks_along(g.Grammars(BYTES, BYTES.vocab_size).matcher(schema, GREEDY), text)
    first, same, parted = '{"ok":true,"color":"red"', '{"ok":true,"color":"red"', '{"ok":false,"color":"red"'
    opening, shared = g.OPENING_TOKENS + 1, len('{"ok":') + 1  # states kept per text; states `parted` shares
    for text, fills, kept in [
        (first, len(first), opening),  # every state computed; the first 17 kept
        (same, len(same) - opening, opening),  # those 17 found
        (parted, len(parted) - shared, 2 * opening - shared),  # the 7 it shares found; its own 10 kept
    ]:
        want = truth(text)  # a fresh Grammars' matcher: every mask computed
        computed.clear()
        masks = _masks_along(grammars.matcher(schema, GREEDY), text, checked=text is same)
        assert all(np.array_equal(a, b) for a, b in zip(masks, want, strict=True)), text
        assert (sum(computed), len(grammars._fresh(schema)[1])) == (fills, kept), text
    monkeypatch.setattr(g, "OPENINGS", opening + 3)
    runs = compile_grammar("regex", "[ab]{20}")
    for text in ("a" * 20, "b" * 20):  # 17 states kept, then 3 of the second opening's 16 new ones
        _masks_along(grammars.matcher(runs, GREEDY), text)
    assert len(grammars._fresh(runs)[1]) == g.OPENINGS


def _masks_along(m, text: str, checked: bool = False) -> list:
    """The allowed-token masks of matcher `m` before each character of `text`, taken in turn (`checked`: as a
    checked row's sampled tokens are, by `accepts`)."""
    import numpy as np

    from sharp.models.tokenizer import BYTES

    masks = []
    for char in text:
        masks.append(np.isfinite(_masked(m, BYTES.vocab_size)))
        assert m.accepts(ord(char)) if checked else m.take(ord(char)) is None
    return masks


def test_the_vocabulary_is_compiled_in_the_background_from_the_engines_start():
    """The engine's Grammars compiles the model's vocabulary for llguidance in a worker thread as soon as it is
    built — not in the first structured request, where it held up every stream (and llguidance's import, in the
    event loop, held up the server); a vocabulary that cannot compile fails the requests that need it, not the
    engine."""
    import sys
    import threading

    from sharp.models.tokenizer import BYTES
    from sharp.serving.engine.matcher import Grammars
    from sharp.serving.grammar import GrammarError, compile_grammar, preload

    class Watched:
        """BYTES, noting which thread read its tokenizer.json and when it is readable."""

        def __init__(self, fail: bool = False):
            self.fail, self.readers, self.readable = fail, [], threading.Event()

        def __getattr__(self, name):
            return getattr(BYTES, name)

        def tokenizer_json(self):
            self.readable.wait(10)
            self.readers.append(threading.current_thread().name)
            if self.fail:
                raise GrammarError("no tokenizer.json")
            return BYTES.tokenizer_json()

    tok = Watched()
    grammars = Grammars(tok, BYTES.vocab_size)
    tok.readable.set()  # the compile waited for this: it began with the constructor, not with a request
    grammars._compiled.result(timeout=30)
    assert tok.readers == [tok.readers[0]] and tok.readers[0].startswith("sharp-grammar")  # once, in the worker
    assert grammars.matcher(compile_grammar("regex", "ab")) is not None and len(tok.readers) == 1
    broken = Watched(fail=True)
    grammars = Grammars(broken, BYTES.vocab_size)  # the engine is built all the same
    broken.readable.set()
    with pytest.raises(GrammarError, match="no tokenizer"):
        grammars.matcher(compile_grammar("regex", "ab"))
    assert preload().result(timeout=30) is sys.modules["llguidance"]


def _sampled(matchers: list, params, logits_row, generators: list | None = None, **request) -> list:
    """Executor.sample over one row per matcher, all with `logits_row` and `params`, row i drawing from
    generators[i] (default: seeded i) (`request`: fields of the rows' request other than the defaults here)."""
    from types import SimpleNamespace

    import numpy as np

    from sharp.models.sampling import generator
    from sharp.serving.backends.sampler import Sampler
    from sharp.serving.engine.executor import Executor
    from sharp.serving.engine.scheduler import Sequence

    fields = {"logprobs": None, "min_tokens": 0, "stop_token_ids": (), "ignore_eos": False, "prompt_ids": [1]}
    request = SimpleNamespace(sampling=params, **(fields | request))
    generators = generators or [generator(i) for i in range(len(matchers))]
    seqs = [Sequence(request, generators[i], matcher=m) for i, m in enumerate(matchers)]
    backend = SimpleNamespace(sampler=Sampler())  # the executor's sampling stage reads only the backend's sampler
    logits = np.tile(np.asarray(logits_row, np.float32), (len(seqs), 1))
    return Executor(backend).sample(seqs, logits)[0]


def test_a_checked_row_samples_first_and_keeps_the_masked_distribution():
    """A row that neither is greedy nor truncates, and a greedy one, sample unmasked and are masked only when the
    grammar refuses the token: the tokens keep the masked distribution (a draw kept when allowed, else drawn again
    from the allowed tokens, gives each p(x)/p(A)). A row that truncates (top-k) is masked first: its top two are
    taken among the allowed tokens, as before."""
    import numpy as np

    from sharp.models.sampling import SamplingParams
    from sharp.models.tokenizer import BYTES
    from sharp.serving.engine.matcher import Grammars
    from sharp.serving.grammar import compile_grammar

    grammars, grammar = Grammars(BYTES, BYTES.vocab_size), compile_grammar("regex", "[abc]")
    row = np.full(BYTES.vocab_size, -np.inf, np.float32)
    row[[ord("x"), ord("a"), ord("b"), ord("c")]] = np.log([0.5, 0.3, 0.15, 0.05])  # x: refused
    n = 3000
    for params, checked, want in [
        (SamplingParams(temperature=1.0), True, {"a": 0.6, "b": 0.3, "c": 0.1}),
        (SamplingParams(temperature=0.0, top_k=2), True, {"a": 1.0}),  # greedy: top-k does not apply
        (SamplingParams(temperature=1.0, top_k=2), False, {"a": 2 / 3, "b": 1 / 3}),  # not 0.79 / 0.21 (checked)
        (SamplingParams(temperature=1.0, min_p=0.2), False, {"a": 2 / 3, "b": 1 / 3}),
    ]:
        matchers = [grammars.matcher(grammar, params) for _ in range(n)]
        assert {m.checked for m in matchers} == {checked}, params
        tokens = _sampled(matchers, params, row)
        got = {chr(t): tokens.count(t) / n for t in set(tokens)}
        assert set(got) == set(want), (params, got)
        for token, share in want.items():
            assert abs(got[token] - share) < 0.035, (params, got)  # 4σ at n = 3000


def test_the_engine_checks_the_rows_that_do_not_truncate(chat_files):
    """A request's matcher is checked (sampled first) when it is greedy or samples its whole distribution, and
    masked first when top-k, top-p or min-p truncate it."""
    from sharp.serving.backends.loading import load_backend
    from sharp.serving.config import EngineConfig
    from sharp.serving.engine.engine import Engine
    from sharp.serving.metrics import ServingMetrics
    from sharp.serving.requests import RequestParams, validate

    backend = load_backend(chat_files["onnxruntime"], "onnxruntime")
    engine = Engine(backend, EngineConfig(), ServingMetrics(backend.spec))
    for sampling, checked in [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.0, "top_p": 0.5}, True),
        ({"temperature": 0.7}, True),
        ({"temperature": 0.7, "top_p": 0.9}, False),
        ({"temperature": 0.7, "top_k": 5}, False),
        ({"temperature": 0.7, "min_p": 0.1}, False),
    ]:
        params = RequestParams(input_ids=[1, 2], max_new_tokens=2, regex="[ab]", **sampling)
        seq = engine.submit(validate(params, engine.limits, engine.tokenizer.encode), lambda event: None)
        assert seq.matcher.checked is checked, sampling


def test_a_checked_row_computes_no_mask_while_the_grammar_takes_its_tokens(monkeypatch):
    """The saving: a checked row's mask (every token of the vocabulary tested) is computed only in a step whose
    sampled token the grammar refuses; a masked row's, every step."""
    import numpy as np

    from sharp.models.sampling import GREEDY
    from sharp.models.tokenizer import BYTES
    from sharp.serving.engine.matcher import Grammars, Matcher
    from sharp.serving.grammar import compile_grammar

    fills = []
    fill = Matcher._fill
    monkeypatch.setattr(Matcher, "_fill", lambda self: (fills.append(self), fill(self))[1])
    grammars, grammar = Grammars(BYTES, BYTES.vocab_size), compile_grammar("regex", "[abc]+")
    row = np.zeros(BYTES.vocab_size, np.float32)
    for top, refused in ((ord("b"), False), (ord("x"), True)):
        row[top] = 6.0 if refused else 5.0
        matchers = [grammars.matcher(grammar, GREEDY) for _ in range(4)]
        fills.clear()
        assert _sampled(matchers, GREEDY, row) == [ord("b")] * 4  # the allowed argmax, refused or not
        assert len(fills) == (4 if refused else 0)
    unchecked = [grammars.matcher(grammar) for _ in range(4)]
    fills.clear()
    assert _sampled(unchecked, GREEDY, row) == [ord("b")] * 4 and len(fills) >= 4


def test_a_token_the_grammar_forces_is_taken_without_a_mask_or_a_draw(monkeypatch):
    """Where a kept opening state allows one token only, a checked row takes it: no mask, no second draw — unless
    the row may not take it this step (short of min_tokens, the token a stop token): masked, it has nothing left."""
    import numpy as np

    from sharp.models.sampling import SamplingParams, generator
    from sharp.models.tokenizer import BYTES
    from sharp.serving.backends.sampler import Sampler
    from sharp.serving.engine import matcher as g
    from sharp.serving.grammar import compile_grammar

    masks = []
    mask = Sampler.mask
    monkeypatch.setattr(Sampler, "mask", lambda self, *a: (masks.append(a[1]), mask(self, *a))[1])
    grammars, grammar = g.Grammars(BYTES, BYTES.vocab_size), compile_grammar("regex", "ab[xy]")
    greedy = SamplingParams(temperature=0.0)
    row = np.zeros(BYTES.vocab_size, np.float32)
    row[ord("x")] = 3.0  # the model's choice everywhere: refused until [xy]
    for fresh in (True, False):
        m = grammars.matcher(grammar, greedy)
        assert m.forced() == (None if fresh else ord("a"))  # known once a request has been through
        masks.clear()
        assert [_sampled([m], greedy, row)[0] for _ in range(3)] == [ord("a"), ord("b"), ord("x")]
        assert len(masks) == (2 if fresh else 0)  # refused and masked twice; then neither
    drawn, wide = SamplingParams(temperature=1.0), compile_grammar("regex", "ab[a-z]{6}")
    runs = [[_sampled([m], drawn, row, [gen])[0] for _ in range(8)] for m, gen in (
        (g.Grammars(BYTES, BYTES.vocab_size).matcher(wide, drawn), generator(7)),  # nothing kept yet
        *((grammars.matcher(wide, drawn), generator(7)) for _ in range(2)),  # its opening kept by the first
    )]  # fmt: skip
    assert runs[0][:2] == [ord("a"), ord("b")] and runs[0] == runs[1] == runs[2]  # a seed's tokens: the same
    for stop, want in ((ord("a"), None), (ord("q"), ord("a"))):  # `a` banned while short: nothing to sample
        m = grammars.matcher(grammar, greedy)
        assert _sampled([m], greedy, row, min_tokens=2, stop_token_ids=(stop,)) == [want]


def test_what_a_matcher_accepts_is_what_its_mask_allows():
    """`accepts` (the check) and the mask agree on every token, in every state of a JSON schema's grammar along an
    output: the check may stand for the mask."""
    import numpy as np

    from sharp.models.tokenizer import BYTES
    from sharp.serving.engine.matcher import Grammars
    from sharp.serving.grammar import compile_grammar

    m = Grammars(BYTES, BYTES.vocab_size).matcher(compile_grammar("json_schema", json.dumps(SCHEMA)))
    for char in '{"ok":true,"color":"red","size":42}':
        allowed = np.isfinite(_masked(m, BYTES.vocab_size))
        for token in range(BYTES.vocab_size):
            took = m.accepts(token)
            assert took == allowed[token], (char, token)
            if took:
                m.matcher.rollback(1)
        m.take(ord(char))


def _masked(m, vocab: int):
    import numpy as np

    logits = np.zeros(vocab, np.float32)
    m.mask(logits)
    return logits


def test_a_steps_masks_are_computed_and_applied_together_as_each_alone():
    """mask_rows: rows of one step in different places of their grammars (one mask computed ahead, the rest
    together, in one pass) get exactly the masks each gets alone."""
    import numpy as np

    from sharp.models.tokenizer import BYTES
    from sharp.serving.engine.matcher import Grammars, mask_rows, prefetch
    from sharp.serving.grammar import compile_grammar

    grammars = Grammars(BYTES, BYTES.vocab_size)
    specs = [
        ("regex", "ab|ac"),
        ("regex", "[0-9]+x"),
        ("choice", '["red", "green"]'),
        ("json_schema", '{"type": "object"}'),
    ]
    matchers = [grammars.matcher(compile_grammar(kind, spec)) for kind, spec in specs]
    for m, token in zip(matchers, (ord("a"), ord("7"), ord("g"), ord("{")), strict=True):
        m.mask(np.zeros(BYTES.vocab_size, np.float32))
        m.take(token)
    alone = np.stack([_masked(_copy(m), BYTES.vocab_size) for m in matchers])
    matchers[0].handoff = 0.0
    prefetch(matchers[:1])  # this one's mask computed ahead, in the worker
    assert matchers[0]._next is not None and matchers[1]._next is None
    together = np.zeros((len(matchers), BYTES.vocab_size), np.float32)
    mask_rows(matchers, together)
    assert np.array_equal(np.isfinite(together), np.isfinite(alone))
    assert set(np.flatnonzero(np.isfinite(together[0]))) == {ord("b"), ord("c")}


def _copy(m):
    from sharp.serving.engine.matcher import Matcher

    return Matcher(m.matcher.deep_copy(), m.vocab_size)
