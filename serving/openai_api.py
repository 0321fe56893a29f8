"""sharp-serve's OpenAI-compatible HTTP API (docs/serving.md): GET /v1/models, POST /v1/completions and
POST /v1/chat/completions, streamed as server-sent events as OpenAI streams them, served by aiohttp on the gRPC
server's event loop from the same engine, limits, token and TLS files.

A body is checked field by field (pydantic, strict types, unknown fields refused as OpenAI refuses them), then
becomes a `GenerateRequest` message for the one validation gRPC requests go through (serving.requests); refusals
and failures get OpenAI's error shape with the HTTP status of their gRPC status. A client that disconnects cancels
its request (its slot and cache are freed at the next engine step). sharp's own extension: `"sharp":
{"attention_stats": true}` returns the request's per-layer, per-head entropy, as gRPC's attention_stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import ssl
import tempfile
import time
import typing
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sharp import __version__
from sharp.models.tokenizer import ChatTemplateError, render_chat, takes_tools
from sharp.serving.auth import bearer_matches
from sharp.serving.calls import Calls
from sharp.serving.engine_client import EngineClient
from sharp.serving.grammar import schema_text
from sharp.serving.metrics_http import LOAD_PATH, scrape
from sharp.serving.output import Delta, Event, Failed, Finished, TokenLogprob
from sharp.serving.requests import GenerationRequest, RequestError, RequestParams, validate
from sharp.serving.stats import RequestOutcome
from sharp.serving.status import Status
from sharp.serving.tools import TOOL_NAME, CallReader, Format, Tool, ToolCall, ToolUse, format_for, system_block

log = logging.getLogger("sharp.serving")

JSON_EXPANSION = 6  # a body may spell each prompt character as a \uXXXX escape
PARSE_OFF_LOOP = 1 << 16  # bytes: a larger body is parsed in a worker thread (the loop serves every stream)
SHUTDOWN_SECONDS = 5.0  # after a drain, what open connections get to close
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length"}  # OpenAI has no separate end-of-sequence reason
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=0, lt=2**64)]


# answered without the bearer token: probes, Prometheus, and the routers' load polls (numbers, no content)
OPEN_PATHS = frozenset(("/health", "/metrics", LOAD_PATH, "/get_load"))


HTTP_STATUS = {  # docs/serving.md has the table
    Status.INVALID_ARGUMENT: 400,
    Status.OUT_OF_RANGE: 400,
    Status.RESOURCE_EXHAUSTED: 413,
    Status.UNAVAILABLE: 503,
    Status.INTERNAL: 500,
}


def http_status(code: Status, transient: bool = False) -> int:
    """The HTTP status of a refusal or failure: a full queue passes (429); a request larger than the KV budget
    never fits (413)."""
    return 429 if code is Status.RESOURCE_EXHAUSTED and transient else HTTP_STATUS[code]


class APIError(Exception):
    """A refusal or failure, answered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        outcome: str = "invalid_argument",
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.outcome = outcome  # the Status it is counted under (sharp_requests_total's status label)

    @classmethod
    def of(
        cls,
        code: Status,
        message: str,
        transient: bool = False,
        param: str | None = None,
        reason: str | None = None,
    ) -> APIError:
        """A Status as OpenAI's error: its HTTP status, `reason` (or the status's name) as the code."""
        return cls(http_status(code, transient), message, reason or code.value, param, code.value)

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPE.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.status in (429, 503):
            headers["Retry-After"] = "1"
        return web.json_response(self.body(), status=self.status, headers=headers)


# ---- request bodies ------------------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


_B = TypeVar("_B", bound=_Body)
_G = TypeVar("_G", bound="_Generation")


class TokenizeRequest(_Body):
    """vLLM's /tokenize body (text prompts)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool = False  # a padding field of OpenAI's streams: nothing to pad here


class SharpOptions(_Body):
    attention_stats: bool = False


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` is pydantic's own name
    strict: bool | None = None  # sharp always decodes to the schema (llguidance), strict or not
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema(self) -> str | None:
        """The JSON text of the schema the output must follow; None for text."""
        if self.type == "text":
            return None
        return schema_text(None if self.type == "json_object" else self.json_schema.schema_)


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` extension: the output follows one of these."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | None = Field(None, alias="json")  # a JSON schema (`json` is pydantic's own name)
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark

    def put(self, msg: RequestParams) -> None:
        if self.json_ is not None or self.json_object:
            msg.json_schema = schema_text(self.json_)
        msg.regex, msg.choice, msg.grammar = self.regex, self.choice, self.grammar


Refusal = tuple[str, str]  # (field, why): a field set to something sharp does not do


class _Generation(_Body):
    """The fields completions and chat share. Fields OpenAI has that sharp does not do are accepted only at their
    neutral value, so a request never silently gets something other than what it asked for."""

    model: str
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 = 0  # an extension, as vLLM names it
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit
    # accepted, changing nothing: who asks, where to bill, what to keep for them (nothing is kept)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # vLLM's and SGLang's extensions (what their clients, and the routers in front of replicas, send)
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's name
    no_stop_trim: bool = False  # SGLang's name for the same
    priority: Int32 = 0
    repetition_penalty: float | None = None
    min_p: float | None = None
    return_hidden_states: bool = False
    structured_outputs: StructuredOutputs | None = None
    sharp: SharpOptions = SharpOptions()

    def refused(self) -> Refusal | None:
        if not 1 <= self.n <= MAX_CHOICES:
            return "n", f"n must be in [1, {MAX_CHOICES}]"
        for key in self.logit_bias or {}:
            if not key.isdecimal() or not key.isascii():
                return "logit_bias", f"logit_bias keys are token ids (strings of digits), got {key[:20]!r}"
        if self.store:
            return "store", "store: true is not supported: the server keeps no completions"
        if self.return_hidden_states:
            return "return_hidden_states", "return_hidden_states: true is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true"
        return None

    @property
    def runs(self) -> int:
        """Choices generated for this request (all returned)."""
        return self.n

    def params(self, max_tokens: int | None) -> RequestParams:
        """Every field but the prompt, as the engine's transport-neutral request."""
        msg = RequestParams(
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            return_attention_stats=self.sharp.attention_stats,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids or (),
            skip_special_tokens=self.skip_special_tokens,
            include_stop=self.include_stop_str_in_output or self.no_stop_trim,
            priority=self.priority,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
        )
        if self.structured_outputs is not None:
            self.structured_outputs.put(msg)
        return msg


class CompletionRequest(_Generation):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def refused(self) -> Refusal | None:
        if isinstance(self.prompt, list) and len(self.prompt) > 1 and isinstance(self.prompt[0], str | list):
            return "prompt", "one prompt per request (send several requests, they batch together)"
        if self.best_of is not None and not self.n <= self.best_of <= MAX_CHOICES:
            return "best_of", f"best_of must be in [n, {MAX_CHOICES}]"
        if self.best_of not in (None, self.n) and self.stream:
            return "best_of", "best_of > n cannot be streamed (the best choices are known at the end)"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens: 0 only with echo: true (to score the prompt)"
        return super().refused()

    @property
    def runs(self) -> int:
        """Choices generated: best_of, of which the n most likely are returned."""
        return self.best_of or self.n

    @property
    def single_prompt(self) -> str | list[int]:
        """The prompt: a string or token ids (a batch of one unwrapped)."""
        nested = isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list)
        return self.prompt[0] if nested else self.prompt

    def to_params(self) -> RequestParams:
        msg = self.params(self.max_tokens)
        prompt = self.single_prompt
        if isinstance(prompt, str):
            msg.prompt = prompt
        else:
            msg.input_ids = prompt
        msg.logprobs = self.logprobs
        if self.runs > self.n and msg.logprobs is None:
            msg.logprobs = 0  # best_of ranks the choices by their tokens' log-probabilities (not shown)
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            msg.prompt_logprobs = self.logprobs or 0  # max_tokens 0 runs the prompt only: as a scoring request
        return msg


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow", strict=True)  # image_url, input_audio, file: refused by type
    type: str
    text: str | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; none: no arguments
    strict: bool | None = None  # a forced call always follows the schema; an `auto` one is the model's own text


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef

    def tool(self) -> Tool:
        fn = self.function
        return Tool(fn.name, fn.description) if fn.parameters is None else Tool(fn.name, fn.description, fn.parameters)


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Body):
    name: str
    arguments: str  # a JSON object's text, as the reply gave it


class MessageToolCall(_Body):
    """A call of an earlier assistant reply, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    # what clients send back from a reply (the SDK's model_dump, LangChain, agent frameworks): accepted when empty
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def refused(self, where: str) -> Refusal | None:
        for i, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.type != "text" or part.text is None:
                return f"{where}.content[{i}]", f"{part.type!r} content parts are not supported (text only)"
        for name in ("function_call", "audio"):
            if getattr(self, name):
                return f"{where}.{name}", f"{name} in messages is not supported (send tool_calls)"
        for i, call in enumerate(self.tool_calls or ()):
            if self.role != "assistant":
                return f"{where}.tool_calls", "tool_calls belong to assistant messages"
            if not isinstance(_json_object(call.function.arguments), dict):
                return f"{where}.tool_calls[{i}].function.arguments", "arguments must be a JSON object's text"
        return None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content or ())

    def for_template(self, fmt: Format, native: bool) -> dict[str, Any]:
        """As a chat template reads it: a template that takes tools gets the calls (arguments as objects, as
        transformers passes them); any other gets them written into the content as the model writes calls."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        out |= {"name": self.name} if self.name else {}
        out |= {"tool_call_id": self.tool_call_id} if self.tool_call_id else {}
        calls = [(c.id, c.function.name, _json_object(c.function.arguments)) for c in self.tool_calls or ()]
        if calls and native:
            out["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in calls]  # fmt: skip
        elif calls:
            out["content"] += fmt.render([(n, a) for _, n, a in calls])
        return out


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM's extensions: how the chat template renders the messages
    continue_final_message: bool = False
    # SGLang's and vLLM's reasoning switches: they separate a reasoning parser's output, and sharp runs none (all
    # text is content), so any value gives the same reply
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True

    def refused(self) -> Refusal | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "max_tokens", "give max_completion_tokens or max_tokens, not both"
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
            return "response_format", "response_format json_schema needs json_schema.schema"
        if self.functions or self.function_call not in (None, "none", "auto"):
            return "functions", "functions and function_call are deprecated and not supported: send tools"
        if (refusal := self._tools_refused()) is not None:
            return refusal
        if self.modalities not in (None, ["text"]) or self.audio:
            return "modalities", "only text output is supported"
        for name in ("prediction", "reasoning_effort", "web_search_options"):
            if getattr(self, name):
                return name, f"{name} is not supported"
        for i, m in enumerate(self.messages):
            if (refusal := m.refused(f"messages[{i}]")) is not None:
                return refusal
        if self.max_completion_tokens == 0 or self.max_tokens == 0:
            return "max_completion_tokens", "max_completion_tokens must be >= 1"
        return super().refused()

    def _tools_refused(self) -> Refusal | None:
        names = [t.function.name for t in self.tools or ()]
        for i, name in enumerate(names):
            if not TOOL_NAME.fullmatch(name):
                return f"tools[{i}].function.name", f"a tool's name is 1-64 of a-z A-Z 0-9 _ . : -, got {name[:70]!r}"
            if name in names[:i]:
                return f"tools[{i}].function.name", f"two tools are named {name!r}"
        if self.tool_choice not in (None, "none", "auto"):
            if not names:
                return "tool_choice", "tool_choice 'required' or a named function needs tools"
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                return "tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools"
            if self.structured_outputs is not None or (self.response_format and self.response_format.type != "text"):
                return (
                    "tool_choice",
                    "a forced tool call decides the output's form: give it or response_format, not both",
                )
        return None

    def tool_use(self, fmt: Format) -> ToolUse | None:
        """The request's tools and how the reply may call them (None without tools)."""
        if not self.tools:
            return None
        choice = self.tool_choice or "auto"
        name = choice if isinstance(choice, str) else choice.function.name
        return ToolUse(tuple(t.tool() for t in self.tools), name, self.parallel_tool_calls, fmt)

    def to_params(self, prompt: str, tools: ToolUse | None = None) -> RequestParams:
        msg = self.params(self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens)
        msg.prompt = prompt
        if self.logprobs:
            msg.logprobs = self.top_logprobs or 0
        if self.response_format is not None:
            msg.json_schema = self.response_format.schema()
        if tools is not None:
            msg.grammar = tools.grammar() or msg.grammar
        return msg


# ---- responses ---------------------------------------------------------------------------------------------------
MAX_CHOICES = 16  # n and best_of: choices of one request
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token the model rules out is reported at this, as vLLM reports it


def _usage(ends: list[Finished]) -> dict:
    """The usage of a request's choices: the prompt counted once (the first choice prefilled it), the tokens of
    every choice generated."""
    first, completion = ends[0], sum(ev.completion_tokens for ev in ends)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def _extension(ev: Finished, norm: str) -> dict[str, Any]:
    """sharp's fields of a response: the attention statistics, in gRPC's AttentionStats shape."""
    if ev.attention is None:
        return {}
    heads = [dataclasses.asdict(h) for h in ev.attention]
    return {"sharp": {"attention_stats": {"norm": norm, "positions": ev.positions, "heads": heads}}}


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class _Logprobs:
    """One choice's log-probabilities in OpenAI's shapes: tokens as strings (a piece that is not UTF-8 alone as
    `bytes:\\xNN…`, chat's `bytes` arrays exact), completions' text offsets into the choice's text (counted by
    decoding the tokens in order, as the text itself is decoded)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = tokenizer.stream()
        self.offset = 0

    def string(self, token: int) -> str:
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def completion(self, ids: list[int], items: list[TokenLogprob | None]) -> dict[str, Any]:
        """`items[i]` for ids[i]; None: nothing predicts it (a prompt's first token)."""
        offsets = []
        for t in ids:
            offsets.append(self.offset)
            self.offset += len(self.text.step(t))
        return {
            "tokens": [self.string(t) for t in ids],
            "token_logprobs": [None if x is None else _lp(x.logprob) for x in items],
            "top_logprobs": [None if x is None else {self.string(i): _lp(v) for i, v in x.top} for x in items],
            "text_offset": offsets,
        }

    def chat(self, items: list[TokenLogprob]) -> dict[str, Any]:
        def entry(token: int, value: float) -> dict[str, Any]:
            return {
                "token": self.string(token),
                "logprob": _lp(value),
                "bytes": list(self.tokenizer.token_bytes(token)),
            }

        content = [entry(x.token, x.logprob) | {"top_logprobs": [entry(i, v) for i, v in x.top]} for x in items]
        return {"content": content, "refusal": None}


@dataclasses.dataclass
class _Reply:
    """The envelope of one response's objects: completions and chat differ only in these names."""

    chat: bool
    request_id: str
    model: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.request_id, "object": kind, "created": self.created, "model": self.model}

    def choice(
        self,
        text: str | None,
        finish: str | None,
        chunk: bool,
        role: bool = False,
        logprobs: dict | None = None,
        index: int = 0,
        calls: list[ToolCall] = (),
    ) -> dict[str, Any]:
        """One choice: a completion's text, a chat chunk's delta (`role`: the first, naming it) or a chat message
        (with its tool calls)."""
        if not self.chat:
            body = {"text": text or ""}
        elif chunk:
            body = {"delta": ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})}
        else:
            message = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
            if calls:
                message["tool_calls"] = [_call(c) for c in calls]
            body = {"message": message}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish}

    def call_chunks(self, calls: list[ToolCall], index: int) -> list[dict[str, Any]]:
        """A chat stream's deltas of a choice's tool calls: each call opened (id, name), then its arguments."""
        out = []
        for k, c in enumerate(calls):
            opened = {"index": k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
            for delta in (opened, {"index": k, "function": {"arguments": c.arguments}}):
                out.append({"index": index, "delta": {"tool_calls": [delta]}, "logprobs": None, "finish_reason": None})
        return out


def _call(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _finish(ev: Finished, calls: list[ToolCall]) -> str:
    """A choice's finish reason: `tool_calls` when it ended on calls (not cut by its budget)."""
    return "tool_calls" if calls and ev.reason != "length" else FINISH_REASON[ev.reason]


@dataclasses.dataclass
class _Choice:
    """What one request asked to see of its tokens, and how: echo the prompt, log-probabilities (the choice's
    `logprobs` object per piece of text)."""

    chat: bool
    echo_text: str | None  # the prompt, when echoed
    logprobs: bool
    shapes: _Logprobs
    prompt_ids: tuple[int, ...] = ()
    tools: ToolUse | None = None  # chat: the calls are read from the text

    def reader(self) -> CallReader | None:
        return None if self.tools is None else self.tools.reader()

    def piece(self, ev: Delta, first: bool) -> tuple[str, dict | None]:
        """The text and the logprobs object of one Delta (the first: with the echoed prompt)."""
        text = ev.text
        ids, items = list(ev.token_ids), list(ev.logprobs or ())
        if first and self.echo_text is not None:
            text = self.echo_text + text
            ids = list(self.prompt_ids) + ids
            items = [None, *(ev.prompt_logprobs or ()), *items]
        if not self.logprobs:
            return text, None
        return text, self.shapes.chat(items) if self.chat else self.shapes.completion(ids, items)


def _join(pieces: list[dict | None], chat: bool) -> dict | None:
    """The logprobs objects of a choice's pieces as one."""
    real = [p for p in pieces if p is not None]
    if not real:
        return None
    if chat:
        return {"content": [c for p in real for c in p["content"]], "refusal": None}
    return {k: [v for p in real for v in p[k]] for k in real[0]}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


# ---- the server ----------------------------------------------------------------------------------------------
STRUCTURED_NAMES = {k: f"structured_outputs.{k}" for k in ("regex", "choice", "grammar")}
COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "input_ids": "prompt", "prompt_logprobs": "logprobs",
                    "json_schema": "structured_outputs.json"} | STRUCTURED_NAMES  # fmt: skip
CHAT_NAMES = {"prompt": "messages", "input_ids": "messages", "logprobs": "top_logprobs",
              "json_schema": "response_format"} | STRUCTURED_NAMES  # fmt: skip
UNION_HINTS = {  # what a field of several shapes takes, for a value that fits none of them
    "prompt": "a string, an array of token ids, or an array of one string or one token-id array",
    "content": "a string or an array of content parts",
    "stop": "a string or an array of strings",
    "tool_choice": "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": …}}",
    "function_call": "a string or an object",
}


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    names, todo = set(), list(models)
    while todo:
        model = todo.pop()
        for name, info in model.model_fields.items():
            names.add(name)
            kinds, seen = [info.annotation], []
            while kinds:  # the annotation, its union's members, their items
                kind = kinds.pop()
                seen.append(kind)
                kinds += typing.get_args(kind)
            todo += [t for t in seen if isinstance(t, type) and issubclass(t, BaseModel)]
    return frozenset(names)


FIELDS = _field_names(CompletionRequest, ChatRequest)


def _refusal(e: ValidationError) -> APIError:
    """The first problem pydantic found, in the request's own words: a JSON path (`messages[1].content`), never
    the validator's union branches or internals."""
    first = e.errors(include_url=False)[0]
    where, union, loc = "", False, first["loc"]
    unknown = first["type"] == "extra_forbidden"  # the last item is the unknown field's own name
    for i, part in enumerate(loc):
        if unknown and i == len(loc) - 1:
            where += f".{part}" if where else str(part)
            continue
        if isinstance(part, int):
            where += f"[{part}]"
        elif part in FIELDS and not (union and part in ("str", "int")):
            where += f".{part}" if where else part
        else:
            union = True  # a branch of a union (str, list[int], function-after[…], …)
    where = where or "body"
    last = where.rsplit(".", 1)[-1].split("[")[0]
    if unknown:
        return APIError(400, f"{where}: unknown field", "unknown_parameter", where)
    if first["type"] == "json_invalid":
        return APIError(400, "the body is not valid JSON", "invalid_json", None)
    if union and last in UNION_HINTS:
        return APIError(400, f"{where}: must be {UNION_HINTS[last]}", "invalid_type", where)
    why = first["msg"].replace("Input should be", "must be").replace("Field required", "required")
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_type"
    return APIError(400, f"{where}: {why}", code, where)


@dataclasses.dataclass(frozen=True)
class HTTPTimeouts:
    """How long a connection may idle between requests, and how long a request's body may take to arrive."""

    keepalive: float = 75.0
    body: float = 30.0


class _Handler(RequestHandler):
    """aiohttp's connection handler, answering a request its parser refuses (malformed framing, bad method, a
    header too long) in OpenAI's JSON error shape, without echoing the offending bytes, logged as one line."""

    def handle_error(self, request, status=500, exc=None, message=None):
        if exc is not None and _client_gone(exc):  # a write to a client that has left (aiohttp's own reset error)
            log.info("the client %s left before its response was written", request.remote)
            raise ConnectionError("the client left")  # aiohttp drops the connection quietly
        if status >= 500:
            log.error("HTTP %d for a request from %s: %s", status, request.remote, type(exc).__name__)
        else:
            log.info("refused a malformed HTTP request from %s (%s)", request.remote, type(exc).__name__)
        if request.writer.output_size > 0:  # a response has begun: the connection is beyond repair
            raise ConnectionError("response already started")
        what = "malformed HTTP request" if status == 400 else HTTPStatus(status).phrase
        resp = web.json_response(APIError(status, what, "bad_request" if status == 400 else None).body(), status=status)
        resp.force_close()
        return resp


class _Server(Server):
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server, whose connections get _Handler
        return server


def _client_gone(e: BaseException) -> bool:
    return isinstance(e, ConnectionResetError | ConnectionAbortedError | BrokenPipeError)


class OpenAIServer:
    """The HTTP API of one engine on the running event loop; `start` binds, `stop` closes. `serving()` is the
    server's health (GET /health answers it, as grpc.health does)."""

    def __init__(
        self,
        engine: EngineClient,
        calls: Calls,
        auth_token: str | None,
        serving: Callable[[], bool] = lambda: True,
        timeouts: HTTPTimeouts = HTTPTimeouts(),
        tool_call_parser: str | None = None,
    ):
        self.engine, self.calls, self.serving, self.timeouts = engine, calls, serving, timeouts
        self.tool_format = format_for(engine.tokenizer.chat_template, tool_call_parser)
        self.token = auth_token.encode() if auth_token else None
        self.started = int(time.time())
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._errors, self._headers, self._auth],
            client_max_size=JSON_EXPANSION * self.engine.limits.message_bytes(),
        )
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get(LOAD_PATH, self.load_metrics)
        # what the LLM routers in front of replicas call (docs/deploy.md): vLLM's render endpoints, SGLang's
        # server and model information (under both of SGLang's names) and load
        app.router.add_post("/v1/completions/render", self.render_completion)
        app.router.add_post("/v1/chat/completions/render", self.render_chat)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        app.router.add_get("/get_load", self.get_load)
        return app

    async def start(self, host: str, port: int, tls: tuple[bytes, bytes] | None) -> int:
        # handler_cancellation: a client that disconnects cancels its handler, so its request is cancelled too
        # auto_decompress off: a compressed body is refused, never inflated (a gzip bomb costs nothing)
        self.runner = _Runner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=SHUTDOWN_SECONDS,
            auto_decompress=False,
            keepalive_timeout=self.timeouts.keepalive,
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=_ssl_context(*tls) if tls else None, reuse_port=False)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        runner, self.runner = self.runner, None  # once, even when a drain and an exit both stop it
        if runner is not None:
            await runner.cleanup()

    # ---- middlewares ----
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every error in OpenAI's shape: ours, aiohttp's (404 path, 405 method, 413 body) and a bug's (500). A
        refusal before the body was read closes the connection: the rest of the body is never read."""
        try:
            return await handler(request)
        except APIError as e:
            resp = e.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            resp = APIError(e.status, e.reason if e.status != 413 else _too_large(e)).response()
        except Exception as e:
            if _client_gone(e):  # the client left mid-response: nothing to answer, nothing wrong here
                log.info("HTTP client went away: %s %s (%s)", request.method, request.path, type(e).__name__)
                raise
            log.exception("HTTP handler failed: %s %s", request.method, request.path)
            resp = APIError(500, "internal error; see the server log").response()
        if request.can_read_body:
            resp.force_close()
        return resp

    @web.middleware
    async def _headers(self, request: web.Request, handler):
        """Before anything reads them: every header UTF-8 (a bearer token or request id of other bytes is a 400,
        not a failure), a body only as identity-encoded JSON (a compressed body could be a bomb; any other type is
        what a web page may send cross-site without a CORS preflight)."""
        for name, value in request.headers.items():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, f"header {name!r} is not valid UTF-8", "invalid_header") from None
        if request.method == "POST":
            encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
            if encoding != "identity":
                raise APIError(415, f"Content-Encoding {encoding!r} is not accepted; send the body uncompressed",
                               "unsupported_content_encoding")  # fmt: skip
            if request.content_type != "application/json":
                raise APIError(415, f"Content-Type must be application/json, got {request.content_type!r}",
                               "unsupported_media_type")  # fmt: skip
        return await handler(request)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        """The token guards the API; /health and /metrics are for probes and Prometheus, as on their own ports."""
        if request.path in OPEN_PATHS:
            return await handler(request)
        if self.token is not None and not bearer_matches(request.headers.get("Authorization"), self.token):
            raise APIError(401, "missing or wrong bearer token (Authorization: Bearer <token>)", "invalid_api_key")
        return await handler(request)

    # ---- routes ----
    def _model(self) -> dict[str, Any]:
        spec = self.engine.spec
        return {"id": spec.name, "object": "model", "created": self.started, "owned_by": "sharp",
                "max_model_len": spec.context_length}  # fmt: skip

    async def models(self, request: web.Request) -> web.Response:
        self._serving()
        return web.json_response({"object": "list", "data": [self._model()]})

    async def model(self, request: web.Request) -> web.Response:
        self._serving()
        name = request.match_info["model"]
        if name != self.engine.spec.name:
            raise APIError(404, f"model {name!r} is not served here; GET /v1/models lists it", "model_not_found")
        return web.json_response(self._model())

    async def health(self, request: web.Request) -> web.Response:
        if self.serving() and not self.engine.draining:
            return web.Response(text="ok\n")
        return web.Response(status=503, text="not serving\n")

    async def metrics(self, request: web.Request) -> web.Response:
        return await scrape(request, self.engine.metrics.registry)

    async def load_metrics(self, request: web.Request) -> web.Response:
        return await scrape(request, self.engine.metrics.load_registry)

    async def get_load(self, request: web.Request) -> web.Response:
        """SGLang's load poll (the routers' power-of-two policy): `load` is the requests this replica holds."""
        load = self.engine.metrics.load
        return web.json_response({"load": load.waiting + load.running, "num_reqs": load.running,
                                  "num_waiting_reqs": load.waiting, "kv_cache_usage": load.kv_used})  # fmt: skip

    async def server_info(self, request: web.Request) -> web.Response:
        """What SGLang's /server_info and vLLM's ?config_format=json answer that routers read: the model, its
        context, the KV cache's block size and count, one replica (no data or tensor parallelism)."""
        spec, metrics = self.engine.spec, self.engine.metrics
        cache = {"block_size": metrics.block_size, "num_gpu_blocks": metrics.blocks}
        return web.json_response(
            {
                "version": __version__,
                "model_path": spec.name,
                "served_model_name": spec.name,
                "context_length": spec.context_length,
                "page_size": metrics.block_size,
                "max_total_num_tokens": metrics.block_size * metrics.blocks,
                "dp_size": 1,
                "tp_size": 1,
                "norm": spec.norm,
                "vllm_config": {"model_config": {"model": spec.name, "max_model_len": spec.context_length},
                                "cache_config": cache},
            }
        )  # fmt: skip

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's /model_info: a generative text model, by its served name."""
        spec = self.engine.spec
        return web.json_response(
            {
                "model_path": spec.name,
                "tokenizer_path": spec.name,
                "is_generation": True,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "max_model_len": spec.context_length,
                "vocab_size": spec.vocab_size,
            }
        )

    async def render_completion(self, request: web.Request) -> web.Response:
        """vLLM's /v1/completions/render: the request as the engine would run it (token ids, sampling), unrun."""
        body = await self._read_checked(request, CompletionRequest)
        req = await self._validated(body.to_params(), self.engine.tokenizer.encode, COMPLETION_NAMES)
        return web.json_response([_rendered(req, "cmpl-", body.model)])

    async def render_chat(self, request: web.Request) -> web.Response:
        body = await self._read_checked(request, ChatRequest)
        tools = body.tool_use(self.tool_format)
        prompt = self._chat_prompt(body, tools)
        encode = lambda text: self.engine.tokenizer.encode(text, bos=False)
        req = await self._validated(body.to_params(prompt, tools), encode, self._chat_names(body))
        return web.json_response(_rendered(req, "chatcmpl-", body.model))

    async def tokenize(self, request: web.Request) -> web.Response:
        self._serving()
        body = await self._read(request, TokenizeRequest)
        if len(body.prompt) > self.engine.limits.max_prompt_bytes:
            raise APIError(400, f"prompt of {len(body.prompt)}+ bytes; at most {self.engine.limits.max_prompt_bytes}",
                           "invalid_value", "prompt")  # fmt: skip
        ids = await asyncio.to_thread(self.engine.tokenizer.encode, body.prompt, body.add_special_tokens)
        return web.json_response({"count": len(ids), "max_model_len": self.engine.spec.context_length, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        self._serving()
        body = await self._read(request, DetokenizeRequest)
        vocab = self.engine.spec.vocab_size
        if bad := [t for t in body.tokens if t >= vocab]:
            raise APIError(400, f"tokens {bad[:3]} outside the vocabulary [0, {vocab})", "invalid_value", "tokens")
        return web.json_response({"prompt": self.engine.tokenizer.decode(body.tokens)})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """What a client needs to tokenize as the server does (lm-evaluation-harness's remote tokenizer reads it)."""
        tok = self.engine.tokenizer
        return web.json_response(
            {
                "tokenizer_class": type(tok).__name__,
                "bos_token": getattr(tok, "bos_text", "") or None,
                "eos_token": getattr(tok, "eos_text", "") or None,
                "pad_token": None,
                "chat_template": tok.chat_template,
                "model_max_length": self.engine.spec.context_length,
                "vocab_size": self.engine.spec.vocab_size,
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._parse(request, CompletionRequest)
        tokenizer = self.engine.tokenizer
        prompt = body.single_prompt
        echo = (prompt if isinstance(prompt, str) else tokenizer.decode(list(prompt))) if body.echo else None
        choice = _Choice(False, echo, body.logprobs is not None, _Logprobs(tokenizer))
        return await self._generate(request, body, body.to_params(), tokenizer.encode, choice, COMPLETION_NAMES)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._parse(request, ChatRequest)
        tools = body.tool_use(self.tool_format)
        try:
            prompt = self._chat_prompt(body, tools)
        except APIError as e:
            raise self._refuse(e) from None
        tokenizer = self.engine.tokenizer
        choice = _Choice(True, None, body.logprobs, _Logprobs(tokenizer), tools=tools)
        encode = lambda text: tokenizer.encode(text, bos=False)  # the template wrote BOS, if any
        params = body.to_params(prompt, tools)
        return await self._generate(request, body, params, encode, choice, self._chat_names(body))

    def _chat_prompt(self, body: ChatRequest, tools: ToolUse | None) -> str:
        """The messages (and tools) through the model's chat template. A template that takes no tools gets them as
        a system block that says how to call them (as the reply is read)."""
        template = self.engine.tokenizer.chat_template
        native = template is not None and takes_tools(template)
        messages = [m.for_template(self.tool_format, native) for m in body.messages]
        if tools is not None and not native:
            block = system_block(list(tools.tools), self.tool_format)
            if messages[0]["role"] in ("system", "developer"):
                messages[0]["content"] = block + "\n\n" + messages[0]["content"]
            else:
                messages.insert(0, {"role": "system", "content": block})
        listed = [t.for_template() for t in tools.tools] if tools is not None and native else None
        try:
            return render_chat(self.engine.tokenizer, messages, body.add_generation_prompt,
                               body.continue_final_message, listed)  # fmt: skip
        except ChatTemplateError as e:
            raise APIError(400, str(e), "invalid_value", "messages", "invalid_argument") from None

    @staticmethod
    def _chat_names(body: ChatRequest) -> dict[str, str]:
        budget = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
        forced = body.tool_choice not in (None, "none", "auto")
        return CHAT_NAMES | {"max_new_tokens": budget} | ({"grammar": "tools"} if forced else {})

    # ---- helpers ----
    def _serving(self) -> None:
        if self.engine.draining:
            raise APIError(503, "the server is draining and accepts no new requests", "unavailable")

    def _refuse(self, error: APIError) -> APIError:
        """Count a refusal made before the one validation (as that validation's are counted)."""
        self.engine.metrics.log_outcome(RequestOutcome(error.outcome, "http"))
        return error

    async def _read(self, request: web.Request, kind: type[_B]) -> _B:
        """The body as `kind`: read within the body timeout (over client_max_size: aiohttp's 413), a chat with more
        messages than the context has tokens refused unparsed, a large body parsed off the event loop."""
        try:
            raw = await asyncio.wait_for(request.read(), self.timeouts.body)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.timeouts.body:g} s",
                           "request_timeout") from None  # fmt: skip
        context = self.engine.spec.context_length
        if kind is ChatRequest and (count := raw.count(b'"role"')) > context:
            raise APIError(400, f"messages: {count} messages cannot fit the model's context of {context} tokens",
                           "context_length_exceeded", "messages")  # fmt: skip
        try:
            if len(raw) > PARSE_OFF_LOOP:
                return await asyncio.to_thread(kind.model_validate_json, raw)
            return kind.model_validate_json(raw)
        except ValidationError as e:
            raise _refusal(e) from None

    async def _read_checked(self, request: web.Request, kind: type[_G]) -> _G:
        """A generation body, read and checked as a generation's (not counted: nothing runs)."""
        self._serving()
        body = await self._read(request, kind)
        if (refusal := body.refused()) is not None:
            raise APIError(400, refusal[1], "unsupported_value", refusal[0], "invalid_argument")
        if body.model != self.engine.spec.name:
            raise APIError(404, f"model {body.model!r} is not served here; GET /v1/models lists it",
                           "model_not_found", "model", "not_found")  # fmt: skip
        return body

    async def _validated(self, msg: RequestParams, encode, names: dict[str, str]) -> GenerationRequest:
        """The one validation, for a request that is not run (a render); tokenized off the event loop."""
        try:
            return await asyncio.to_thread(validate, msg, self.engine.limits, encode, "http", names)
        except RequestError as e:
            raise APIError.of(e.code, e.message, e.transient, e.field, e.reason) from None

    async def _parse(self, request: web.Request, kind: type[_Generation]) -> _Generation:
        try:
            body = await self._read(request, kind)
        except APIError as e:
            raise self._refuse(e) from None
        if (refusal := body.refused()) is not None:
            raise self._refuse(APIError(400, refusal[1], "unsupported_value", refusal[0], "invalid_argument"))
        if body.model != self.engine.spec.name:
            raise self._refuse(
                APIError(
                    404,
                    f"model {body.model!r} is not served here; GET /v1/models lists it",
                    "model_not_found",
                    "model",
                    "not_found",
                )
            )
        return body

    async def _generate(
        self,
        request: web.Request,
        body: _Generation,
        msg: RequestParams,
        encode,
        choice: _Choice,
        names: dict[str, str],
    ) -> web.StreamResponse:
        if (request_id := request.headers.get("X-Request-Id")) is not None:
            msg.request_id = request_id
        limits = self.engine.limits
        runs = body.runs
        events = self.calls.choices(
            lambda: validate(msg, limits, encode, api="http", names=names), "http", len(msg.prompt), runs
        )
        async with contextlib.aclosing(events):
            try:
                req, index, first = await anext(events)
            except RequestError as e:
                raise APIError.of(e.code, e.message, e.transient, e.field, e.reason) from None
            if isinstance(first, Failed):  # before any text: the status line can still say so
                raise APIError.of(first.code, first.message)
            choice.prompt_ids = req.prompt_ids
            choices = [choice] + [dataclasses.replace(choice, shapes=_Logprobs(choice.shapes.tokenizer))
                                  for _ in range(runs - 1)]  # fmt: skip
            reply = _Reply(choice.chat, req.request_id, self.engine.spec.name)
            if body.stream:
                return await self._stream(request, body, reply, choices, (index, first), events)
            text: list[list[str]] = [[] for _ in range(runs)]
            pieces: list[list[dict | None]] = [[] for _ in range(runs)]
            likelihood, ends = [0.0] * runs, {}
            item: tuple[int, Event] | None = (index, first)
            while item is not None:
                i, ev = item
                if isinstance(ev, Failed):
                    raise APIError.of(ev.code, ev.message)
                if isinstance(ev, Finished):
                    ends[i] = ev
                else:
                    piece, logprobs = choices[i].piece(ev, first=not pieces[i])
                    text[i].append(piece)
                    pieces[i].append(logprobs)
                    likelihood[i] += sum(lp.logprob for lp in ev.logprobs or ())
                item = None if len(ends) == runs else (await anext(events))[1:]
            kept = range(runs) if runs == body.n else sorted(range(runs), key=lambda i: -likelihood[i])[: body.n]
            replies = []
            for k, i in enumerate(kept):
                content, calls = "".join(text[i]), []
                if (reader := choice.reader()) is not None:
                    content = reader.push(content)
                    rest, calls = reader.finish()
                    content += rest
                finish = _finish(ends[i], calls)
                logprobs = _join(pieces[i], choice.chat)
                replies.append(reply.choice(content, finish, chunk=False, logprobs=logprobs, index=k, calls=calls))
            out = reply.envelope(chunk=False) | {
                "choices": replies,
                "usage": _usage([ends[i] for i in range(runs)]),
            }
            return web.json_response(out | _extension(ends[0], self.engine.spec.norm))

    async def _stream(
        self,
        request: web.Request,
        body: _Generation,
        reply: _Reply,
        choices: list[_Choice],
        first: tuple[int, Event],
        events: AsyncIterator[tuple[GenerationRequest, int, Event]],
    ) -> web.StreamResponse:
        """Server-sent events as OpenAI sends them: a chunk per piece of text (with its choice's index), one with
        each choice's finish reason, one with the usage when stream_options.include_usage, then `data: [DONE]`;
        sharp's extension in the last chunk. Log-probabilities of tokens whose text is held back (a stop string may
        be starting) travel with the next chunk that has text."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        usage = body.stream_options is not None and body.stream_options.include_usage
        base = reply.envelope(chunk=True) | ({"usage": None} if usage else {})
        runs, chat = len(choices), reply.chat
        if chat:  # the first chunk of each choice names the role
            for i in range(runs):
                await resp.write(_sse(base | {"choices": [reply.choice("", None, chunk=True, role=True, index=i)]}))
        held: list[list[dict | None]] = [[] for _ in range(runs)]
        readers = [c.reader() for c in choices]
        sent, ends, failed = [False] * runs, {}, None
        item: tuple[int, Event] | None = first
        while item is not None:
            i, ev = item
            if isinstance(ev, Failed):  # the status line is sent: the error travels as an event, as OpenAI's does
                failed = ev
                break
            if isinstance(ev, Finished):
                ends[i], calls = ev, []
                if readers[i] is not None:
                    rest, calls = readers[i].finish()
                    if rest:
                        chunk = reply.choice(rest, None, chunk=True, logprobs=_join(held[i], chat), index=i)
                        await resp.write(_sse(base | {"choices": [chunk]}))
                        held[i] = []
                    for chunk in reply.call_chunks(calls, i):
                        await resp.write(_sse(base | {"choices": [chunk]}))
                finish = reply.choice(None, _finish(ev, calls), chunk=True, logprobs=_join(held[i], chat), index=i)
                last = base | {"choices": [finish]}
                if len(ends) < runs:
                    await resp.write(_sse(last))
            else:
                text, logprobs = choices[i].piece(ev, first=not sent[i])
                if readers[i] is not None:
                    text = readers[i].push(text)
                sent[i] = True
                held[i].append(logprobs)
                if text:
                    chunk = reply.choice(text, None, chunk=True, logprobs=_join(held[i], chat), index=i)
                    await resp.write(_sse(base | {"choices": [chunk]}))
                    held[i] = []
            item = None if len(ends) == runs else (await anext(events))[1:]
        if failed is not None:
            await resp.write(_sse(APIError.of(failed.code, failed.message).body()))
        else:
            tail = [last]
            if usage:
                tail.append(base | {"choices": [], "usage": _usage([ends[i] for i in range(runs)])})
            tail[-1] |= _extension(ends[0], self.engine.spec.norm)
            for chunk in tail:
                await resp.write(_sse(chunk))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _rendered(req: GenerationRequest, prefix: str, model: str) -> dict[str, Any]:
    """A validated request in the shape vLLM's render endpoints answer (its GenerateRequest)."""
    sampling = {
        "max_tokens": req.max_new_tokens,
        "min_tokens": req.min_tokens,
        "temperature": req.sampling.temperature,
        "top_p": req.sampling.top_p,
        "top_k": req.sampling.top_k,
        "seed": req.seed,
        "stop": list(req.stop),
        "stop_token_ids": list(req.stop_token_ids),
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop,
        "logprobs": req.logprobs,
        "prompt_logprobs": req.prompt_logprobs,
    }
    return {"request_id": prefix + req.request_id, "model": model, "token_ids": list(req.prompt_ids),
            "sampling_params": sampling, "priority": req.priority}  # fmt: skip


def _too_large(e: web.HTTPException) -> str:
    return f"request body too large: {e.text or e.reason}"


def _ssl_context(cert: bytes, key: bytes) -> ssl.SSLContext:
    """A server context from PEM bytes (the ssl module loads a chain only from files: a private temporary
    directory holds them for the load, then is removed)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for name, data in (("cert.pem", cert), ("key.pem", key)):
            path = os.path.join(d, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            paths.append(path)
        ctx.load_cert_chain(*paths)
    return ctx
