"""Tool calling: `tools` rendered by the chat template (or, for a template that takes none, a system block),
`tool_choice: "required"` and a named function enforced by a grammar — every call's arguments validate against its
tool's schema at temperature 1 — `auto` read from the model's own text by the format its template implies, streamed
as deltas the openai SDK and LangChain accumulate, results sent back as `role: "tool"`."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Literal

import httpx
import jsonschema
import pytest
from helpers import HTTP, WEATHER, api, serving
from pydantic import BaseModel, ConfigDict, Field

from sharp.serving.api.tools import FORMATS, CallReader, Tool, format_for

# a Hermes-style template that renders tools, calls and results (as Qwen's and Hermes' do)
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>Tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "{% if m.get('tool_call_id') %} (answers {{ m['tool_call_id'] }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "a forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def tool_files(model_files, tmp_path_factory):
    """The tiny model with a tokenizer whose chat template renders tools."""
    import onnx

    from sharp.exporter import metadata
    from sharp.models.tokenizer import BYTES, HFTokenizer

    proto = onnx.load(model_files["onnxruntime"])
    tok = HFTokenizer(BYTES.tokenizer_json(), BYTES.bos, (BYTES.eos,), BYTES.vocab_size, chat_template=TOOL_TEMPLATE)
    dataclasses.replace(metadata.read(proto), tokenizer=tok).write(proto)
    path = tmp_path_factory.mktemp("tools") / "tiny.onnx"
    onnx.save(proto, path)
    return {"onnxruntime": path}


@pytest.fixture(scope="module")
def srv(tool_files):
    with serving(tool_files, server=HTTP) as s:
        yield s


@pytest.fixture(scope="module")
def plain(chat_files):
    """A model whose chat template takes no tools."""
    with serving(chat_files, server=HTTP) as s:
        yield s


def _valid(call) -> None:
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"


def test_required_calls_follow_their_schemas_at_temperature_one(srv):
    oa = api(srv)
    names = set()
    for seed in range(10):
        r = oa.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=seed, max_tokens=2000)  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert len(choice.message.tool_calls) >= 1
        for call in choice.message.tool_calls:
            _valid(call)
            names.add(call.function.name)
    assert names == {"get_weather", "get_time"}  # the model chose, among the tools
    # (this random model, free to go on, often writes several calls: a budget that cuts them says `length`)


def test_a_named_function_and_one_call_without_parallel_calls(srv):
    oa = api(srv)
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(6):
        r = oa.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=named, seed=seed,
                                       temperature=1.0, max_tokens=200, parallel_tool_calls=False)  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_time", calls
        _valid(calls[0])


def test_a_named_function_gets_one_call_even_with_parallel_calls_allowed(srv):
    """A named tool_choice is one call to that function (vLLM's and OpenAI's answer): a model left free to go on
    after it must not write more calls until its budget cuts it."""
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(4):
        r = api(srv).chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=named, seed=seed,
                                             temperature=1.0, max_tokens=400)  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize(("stream", "budget"), [(False, 12), (False, 50), (True, 50)])
def test_a_call_cut_by_max_tokens_is_a_call_whose_arguments_do_not_parse(srv, stream, budget):
    """A forced call cut by its token budget comes back as a tool call — its name, and its arguments as far as they
    got, which no JSON parser takes for finished ones — with finish_reason `length`, never as the markup in
    `content`, which an agent loop would take for the answer."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=budget)
    if not stream:
        r = api(srv).chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and not choice.message.content, choice
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    else:
        got, finish = {}, None
        for chunk in api(srv).chat.completions.create(**kw, stream=True):
            assert not chunk.choices[0].delta.content
            for d in chunk.choices[0].delta.tool_calls or ():
                name, args = got.get(d.index, ("", ""))
                got[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "length"
        calls = list(got.values())
    ((name, arguments),) = calls
    assert name == "get_weather"
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


def test_streamed_calls_arrive_as_deltas(srv):
    oa = api(srv)
    for seed in range(4):
        stream = oa.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=seed, max_tokens=2000, stream=True)  # fmt: skip
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            for d in chunk.choices[0].delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            assert not chunk.choices[0].delta.content
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and calls
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_reads_calls_from_the_models_text_and_passes_plain_text_through(srv):
    """`auto`: the reply's own text is read as calls where it writes them (here a regular expression makes this
    random model write one), and is content where it does not."""
    oa = api(srv)
    call = r'\{"name": "get_weather", "arguments": \{"city": "(Oslo|Rome)", "days": [1-3]\}\}'
    written = r"Sure\. <tool_call>\n" + call + r"\n</tool_call>"
    extra = {"structured_outputs": {"regex": written}}
    r = oa.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=120, extra_body=extra)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Sure. ", msg
    (call,) = msg.tool_calls
    _valid(call)
    stream = oa.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=120, extra_body=extra,
                                        stream=True)  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure. "
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    plain = oa.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=20, seed=3)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    assert plain.choices[0].message.content


def test_a_tool_request_keeps_special_tokens_in_the_text_it_reads(srv):
    """A call's marker may be a special token (Mistral's [TOOL_CALLS], Llama's <|python_tag|>): with tools (and
    tool_choice not "none") the reply's text spells special tokens, as vLLM's tool parsers ask, unless the request
    says skip_special_tokens itself."""
    oa = api(srv)
    ask = {"model": "tiny", "messages": USER, "max_tokens": 2, "logit_bias": {"256": 100}}  # <bos>, a special token
    with_tools = oa.chat.completions.create(tools=TOOLS, **ask).choices[0].message.content
    assert with_tools == "<bos><bos>", with_tools
    assert oa.chat.completions.create(**ask).choices[0].message.content == ""  # without tools: skipped
    for extra in ({"tool_choice": "none"}, {"extra_body": {"skip_special_tokens": True}}):
        assert oa.chat.completions.create(tools=TOOLS, **ask, **extra).choices[0].message.content == "", extra


def test_tools_and_results_reach_the_template(srv):
    """The tools and a tool result sent back are rendered (the prompt has them); the answer follows."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]  # fmt: skip
    url = f"http://127.0.0.1:{srv.server.http_port}"
    rendered = httpx.post(f"{url}/v1/chat/completions/render", json={"model": "tiny", "messages": history,
                          "tools": TOOLS}, timeout=30).json()  # fmt: skip
    text = bytes(t for t in rendered["token_ids"] if t < 256).decode()  # the byte tokenizer: id = byte
    assert '"name": "get_weather"' in text and "a forecast" in text  # the tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text  # the earlier call
    assert "sunny, 21 C (answers call_1)" in text  # the result
    r = api(srv).chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8, seed=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_template_without_tools_gets_a_system_block_and_forced_calls_still_hold(plain):
    url = f"http://127.0.0.1:{plain.server.http_port}"
    body = {"model": "tiny", "messages": USER, "tools": TOOLS}
    rendered = httpx.post(f"{url}/v1/chat/completions/render", json=body, timeout=30).json()
    text = bytes(t for t in rendered["token_ids"] if t < 256).decode()
    assert text.startswith("<|system|>You may call one or more functions") and "<tool_call>" in text, text[:200]
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    history = [*USER, {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "noon"}]  # fmt: skip
    rendered = httpx.post(f"{url}/v1/chat/completions/render", json=body | {"messages": history}, timeout=30).json()
    text = bytes(t for t in rendered["token_ids"] if t < 256).decode()
    # the earlier call, written into the assistant's text as the model writes calls
    assert 'Checking.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in text, text
    r = api(plain).chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=5, max_tokens=2000)  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"
    for call in r.choices[0].message.tool_calls:
        _valid(call)


@pytest.mark.parametrize(
    "change, param",
    [
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "tools"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)  # fmt: skip
def test_tool_mistakes_are_400s_naming_the_field(srv, change, param):
    body = {"model": "tiny", "messages": USER, "tools": TOOLS} | change
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_langchain_bind_tools_any_and_with_structured_output(srv):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    weather = tool(get_weather)
    llm = ChatOpenAI(model="tiny", base_url=f"http://127.0.0.1:{srv.server.http_port}/v1", api_key="none",
                     temperature=1.0, max_tokens=400, seed=1)  # fmt: skip
    msg = llm.bind_tools([weather], tool_choice="any", parallel_tool_calls=False).invoke("weather in Oslo?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    args = msg.tool_calls[0]["args"]
    assert args["city"] in ("Oslo", "Rome") and 1 <= args["days"] <= 9, args
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Answer, method=method).invoke("answer")
        assert isinstance(out, Answer), (method, out)


def get_weather(city: Literal["Oslo", "Rome"], days: Annotated[int, Field(ge=1, le=9)]) -> str:
    """A forecast."""
    return "sunny"


class Answer(BaseModel):
    """Its schema closed (additionalProperties false): an open one lets a random model's arguments run on in keys
    of their own until max_tokens, and then no call parses."""

    model_config = ConfigDict(extra="forbid")
    ok: bool
    count: Annotated[int, Field(ge=0, le=99)]


# ---- the formats, without a server ----
CALLS = [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_reads_back_what_it_writes_whole_and_streamed(name):
    fmt = FORMATS[name]
    lead = "" if fmt.at_start else "Let me check. "
    text = lead + fmt.render(CALLS)
    content, calls = fmt.parse(text)
    assert content == lead and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    for parallel in (True, False):
        reader = CallReader(fmt, parallel, forced=False)
        streamed = "".join(reader.push(ch) for ch in text)  # one character at a time: markers split anywhere
        rest, calls = reader.finish()
        assert streamed + rest == lead and len(calls) == (2 if parallel else 1)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_text_that_is_not_a_call_is_content(name):
    fmt = FORMATS[name]
    for text in ("plain words", "{not json", fmt.render(CALLS)[:-9], "a < b and {x}"):
        reader = CallReader(fmt, True, forced=False)
        out = "".join(reader.push(ch) for ch in text)
        rest, calls = reader.finish()
        if not calls:
            assert out + rest == text, (name, text)
        # a whole reply read at once (not streamed), as api/replies.py reads one: the held-back tail is content too
        whole, calls = read_calls(CallReader(fmt, True, forced=False), text)
        if not calls:
            assert whole == text, (name, text)
    tail = fmt.render(CALLS)[:3]  # text that could be the start of a call, ending the reply
    assert read_calls(CallReader(fmt, True, forced=False), "well " + tail) == ("well " + tail, [])


def read_calls(reader: CallReader, text: str) -> tuple[str, list]:
    """A whole reply read at once, as api/replies.py reads a reply that is not streamed."""
    content = reader.push(text)
    rest, calls = reader.finish()
    return content + rest, calls


def test_the_template_picks_the_format_and_the_flag_overrides_it():
    assert format_for("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert format_for("<|python_tag|>{{ x }}").name == "llama3_json"
    assert format_for(TOOL_TEMPLATE).name == "hermes" and format_for(None).name == "hermes"
    assert format_for(TOOL_TEMPLATE, "mistral").name == "mistral"


def test_a_forced_call_writes_the_tags_the_vocabulary_holds_as_tokens():
    """Where the served model's vocabulary holds a format's tag as one added token (Mistral's `[TOOL_CALLS]`,
    Qwen's `<tool_call>`), a forced call's grammar writes that token — as the model writes it — and not the tag's
    text in pieces; the HTTP server binds its format to the model's tokenizer so."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    from sharp.models.tokenizer import BYTES, HFTokenizer
    from sharp.serving.api.openai_api import OpenAIServer
    from sharp.serving.engine.matcher import Grammars
    from sharp.serving.grammar import GrammarError, compile_grammar

    backend = Tokenizer.from_str(BYTES.tokenizer_json())
    backend.add_special_tokens(["[TOOL_CALLS]"])  # 258
    backend.add_tokens(["<tool_call>", "</tool_call>"])  # 259, 260: added, not special (as Qwen's)
    tok = HFTokenizer(backend.to_str(), BYTES.bos, (BYTES.eos,), 261)
    assert (tok.added_id("[TOOL_CALLS]"), tok.added_id("</tool_call>"), tok.added_id("[TOOL")) == (258, 260, None)
    assert (BYTES.added_id("<eos>"), BYTES.added_id("<tool_call>")) == (BYTES.eos, None)
    grammars, tools = Grammars(tok, 261), [Tool("get_weather", None, SCHEMAS["get_weather"])]
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, separators=(",", ":"))

    def accepts(fmt, ids: list[int]) -> bool:
        m = grammars.matcher(compile_grammar("grammar", fmt.grammar(tools, parallel=False)))
        try:
            for token in ids:
                m.take(token)
        except GrammarError:
            return False
        return m.matcher.is_accepting()

    text = lambda s: BYTES.encode(s, bos=False)
    mistral, hermes = FORMATS["mistral"].bound(tok), FORMATS["hermes"].bound(tok)
    assert mistral.token_ids == (("[TOOL_CALLS]", 258),) and hermes.token_ids == (("<tool_call>", 259),
                                                                                    ("</tool_call>", 260))  # fmt: skip
    assert FORMATS["llama3_json"].bound(tok).token_ids == ()  # no <|python_tag|> in this vocabulary
    assert accepts(mistral, [258, *text(f"[{call}]")])
    assert not accepts(mistral, text(f"[TOOL_CALLS][{call}]"))  # the tag's text: not what the model writes
    assert accepts(hermes, [259, *text(f"\n{call}\n"), 260])
    assert not accepts(hermes, text(f"<tool_call>\n{call}\n</tool_call>"))
    assert accepts(FORMATS["mistral"], text(f"[TOOL_CALLS][{call}]"))  # unbound: the text, as before
    server = OpenAIServer(SimpleNamespace(tokenizer=tok), None, None, tool_call_parser="mistral")
    assert server.tool_format.token_ids == (("[TOOL_CALLS]", 258),)


def test_forced_grammars_accept_the_calls_and_nothing_else():
    from sharp.models.tokenizer import BYTES
    from sharp.serving.engine.matcher import Grammars
    from sharp.serving.grammar import GrammarError, compile_grammar

    grammars = Grammars(BYTES, BYTES.vocab_size)
    tools = [Tool(n, None, SCHEMAS[n]) for n in SCHEMAS]

    def accepts(grammar: str, text: str) -> bool:
        m = grammars.matcher(compile_grammar("grammar", grammar))
        try:
            for token in BYTES.encode(text, bos=False):
                m.take(token)  # as the engine takes tokens: after any mask being computed for it
        except GrammarError:
            return False
        return m.matcher.is_accepting()

    def written(fmt, calls):
        body = [fmt.open + json.dumps({"name": n, fmt.arguments_key: a}, separators=(",", ":")) + fmt.close
                for n, a in calls]  # fmt: skip
        return fmt.lead + fmt.between.join(body) + fmt.tail

    for fmt in FORMATS.values():
        both, one = fmt.grammar(tools, parallel=True), fmt.grammar(tools, parallel=False)
        assert accepts(both, written(fmt, CALLS)) and accepts(one, written(fmt, CALLS[:1])), fmt.name
        assert not accepts(one, written(fmt, CALLS)), fmt.name  # one call only
        assert not accepts(both, written(fmt, [("get_weather", {"city": "Lima", "days": 2})])), fmt.name  # off-schema
        assert not accepts(both, written(fmt, [("get_date", {"zone": "UTC"})])), fmt.name  # no such tool
        only_time = fmt.grammar(tools[1:], parallel=True)
        assert not accepts(only_time, written(fmt, CALLS[:1])), fmt.name  # a named function: no other
