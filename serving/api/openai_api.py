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
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server
from pydantic import BaseModel, ValidationError

from sharp import __version__
from sharp.models.tokenizer import ChatTemplateError, render_chat, takes_tools
from sharp.serving.api.auth import bearer_matches
from sharp.serving.api.calls import Calls
from sharp.serving.api.metrics_http import LOAD_PATH, scrape
from sharp.serving.api.openai_bodies import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Generation,
    TokenizeRequest,
)
from sharp.serving.api.responses_api import Reply, ResponsesRequest, renamed
from sharp.serving.api.responses_api import usage as responses_usage
from sharp.serving.api.tools import CallReader, ToolCall, ToolUse, format_for, system_block
from sharp.serving.engine.engine_client import EngineClient
from sharp.serving.engine.output import Delta, Event, Failed, Finished, TokenLogprob
from sharp.serving.requests import GenerationRequest, RequestError, RequestParams, validate
from sharp.serving.stats import RequestOutcome
from sharp.serving.status import Status

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


# answered without the bearer token: probes, Prometheus, and the routers' load polls (numbers, no content)
OPEN_PATHS = frozenset(("/health", "/metrics", LOAD_PATH, "/get_load"))


_B = TypeVar("_B", bound=BaseModel)
_G = TypeVar("_G", bound=Generation)


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


# ---- responses ---------------------------------------------------------------------------------------------------
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
    "input": "a string or an array of input items",
    "content": "a string or an array of content parts",
    "stop": "a string or an array of strings",
    "tool_choice": '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": …}}',
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


FIELDS = _field_names(CompletionRequest, ChatRequest, ResponsesRequest)


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
        self.tool_format = format_for(engine.tokenizer.chat_template, tool_call_parser).bound(engine.tokenizer)
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
        app.router.add_post("/v1/responses", self.responses)
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

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses: the chat request the body means, run as chat runs, answered as a Response."""
        body = await self._parse(request, ResponsesRequest)
        try:
            chat = body.as_chat()
            if (refusal := chat.refused()) is not None:
                raise APIError(400, refusal[1], "unsupported_value", renamed(refusal[0]), "invalid_argument")
            tools = chat.tool_use(self.tool_format)
            prompt = self._chat_prompt(chat, tools)
        except ValidationError as e:
            error = _refusal(e)
            raise self._refuse(APIError(400, error.message, error.code, renamed(error.param))) from None
        except APIError as e:
            e.param = renamed(e.param)
            raise self._refuse(e) from None
        encode = lambda text: self.engine.tokenizer.encode(text, bos=False)
        names = {k: renamed(v) for k, v in self._chat_names(chat).items()}
        events = self._events(request, chat.to_params(prompt, tools), encode, names, 1)
        async with contextlib.aclosing(events):
            req, _, first = await _first(events)
            reply = Reply(body, req.request_id, self.engine.spec.name)
            reader = tools.reader() if tools is not None else None
            if body.stream:
                return await self._respond_stream(request, reply, reader, first, events)
            ev, text = first, []
            while not isinstance(ev, Finished):
                if isinstance(ev, Failed):
                    raise APIError.of(ev.code, ev.message)
                text.append(ev.text)
                ev = (await anext(events))[2]
            content, calls = "".join(text), []
            if reader is not None:
                content = reader.push(content)
                rest, calls = reader.finish()
                content += rest
            status = "incomplete" if ev.reason == "length" and not calls else "completed"
            reply.text(content)
            reply.end_text(status)
            reply.calls(calls)
            used = responses_usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)
            return web.json_response(reply.response(status, used, incomplete=status == "incomplete"))

    async def _respond_stream(
        self,
        request: web.Request,
        reply: Reply,
        reader: CallReader | None,
        ev: Event,
        events: AsyncIterator[tuple[GenerationRequest, int, Event]],
    ) -> web.StreamResponse:
        """A Response as OpenAI streams it: created, in progress, the message item's text deltas, each function
        call item, then completed (or incomplete: cut by max_output_tokens) with the whole Response."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(*items: dict[str, Any]) -> None:
            for item in items:
                await resp.write(f"event: {item['type']}\n".encode() + _sse(item))

        opened = reply.response("in_progress")
        await send(reply.event("response.created", response=opened), reply.event("response.in_progress",
                                                                                response=opened))  # fmt: skip
        while not isinstance(ev, Finished | Failed):
            await send(*reply.text(reader.push(ev.text) if reader is not None else ev.text))
            ev = (await anext(events))[2]
        if isinstance(ev, Failed):
            error = APIError.of(ev.code, ev.message)
            await send(reply.event("error", code=error.code, message=error.message, param=None))
        else:
            rest, calls = reader.finish() if reader is not None else ("", [])
            status = "incomplete" if ev.reason == "length" and not calls else "completed"
            await send(*reply.text(rest), *reply.end_text(status), *reply.calls(calls))
            used = responses_usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)
            final = reply.response(status, used, incomplete=status == "incomplete")
            await send(reply.event(f"response.{status}", response=final))
        await resp.write_eof()
        return resp

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
        listed = {ChatRequest: "messages", ResponsesRequest: "input"}.get(kind)
        if listed is not None and (count := raw.count(b'"role"')) > context:
            raise APIError(400, f"{listed}: {count} messages cannot fit the model's context of {context} tokens",
                           "context_length_exceeded", listed)  # fmt: skip
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

    async def _parse(self, request: web.Request, kind: type[_B]) -> _B:
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

    def _events(self, request: web.Request, msg: RequestParams, encode, names: dict[str, str], runs: int):
        """The events of a request's `runs` choices, validated as they start (the X-Request-Id header its id)."""
        if (request_id := request.headers.get("X-Request-Id")) is not None:
            msg.request_id = request_id
        limits = self.engine.limits
        check = lambda: validate(msg, limits, encode, api="http", names=names)
        return self.calls.choices(check, "http", len(msg.prompt), runs)

    async def _generate(
        self,
        request: web.Request,
        body: Generation,
        msg: RequestParams,
        encode,
        choice: _Choice,
        names: dict[str, str],
    ) -> web.StreamResponse:
        runs = body.runs
        events = self._events(request, msg, encode, names, runs)
        async with contextlib.aclosing(events):
            req, index, first = await _first(events)
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
        body: Generation,
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


async def _first(events: AsyncIterator[tuple[GenerationRequest, int, Event]]) -> tuple[GenerationRequest, int, Event]:
    """A request's first event; its refusal, or a failure before any text (the status line can still say so), as
    an APIError."""
    try:
        req, index, first = await anext(events)
    except RequestError as e:
        raise APIError.of(e.code, e.message, e.transient, e.field, e.reason) from None
    if isinstance(first, Failed):
        raise APIError.of(first.code, first.message)
    return req, index, first


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
