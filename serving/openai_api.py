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

import contextlib
import dataclasses
import json
import logging
import os
import ssl
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import grpc
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sharp.models.tokenizer import ChatTemplateError, render_chat
from sharp.serving.auth import bearer_matches
from sharp.serving.calls import Calls
from sharp.serving.engine import Delta, Engine, Event, Failed, Finished
from sharp.serving.requests import GenerationRequest, RequestError, validate
from sharp.serving.stats import RequestOutcome
from sharp.v1 import generator_pb2 as pb

log = logging.getLogger("sharp.serving")

JSON_EXPANSION = 6  # a body may spell each prompt character as a \uXXXX escape
SHUTDOWN_SECONDS = 5.0  # after a drain, what open connections get to close
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length"}  # OpenAI has no separate end-of-sequence reason
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=0, lt=2**64)]


def http_status(code: grpc.StatusCode, transient: bool = False) -> int:
    """The HTTP status of a refusal or failure with this gRPC status (docs/serving.md has the table)."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return 429 if transient else 413  # a full queue passes; a request larger than the KV budget never fits
    return {
        grpc.StatusCode.INVALID_ARGUMENT: 400,
        grpc.StatusCode.OUT_OF_RANGE: 400,
        grpc.StatusCode.NOT_FOUND: 404,
        grpc.StatusCode.UNAUTHENTICATED: 401,
        grpc.StatusCode.UNAVAILABLE: 503,
        grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    }.get(code, 500)


class APIError(Exception):
    """A refusal or failure, answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    @classmethod
    def of(cls, code: grpc.StatusCode, message: str, transient: bool = False) -> APIError:
        return cls(http_status(code, transient), message, code.name.lower())

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


class StreamOptions(_Body):
    include_usage: bool = False


class SharpOptions(_Body):
    attention_stats: bool = False


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    sharp: SharpOptions = SharpOptions()

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a field set to something sharp does not do."""
        if self.n != 1:
            return "n", "n must be 1: one choice per request (send several requests, they batch together)"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty", "presence_penalty and frequency_penalty are not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true"
        return None

    def message(self, max_tokens: int | None) -> pb.GenerateRequest:
        """Every field but the prompt, as the gRPC request carries it."""
        msg = pb.GenerateRequest(
            top_k=self.top_k,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            return_attention_stats=self.sharp.attention_stats,
        )
        for name, value in (("max_new_tokens", max_tokens), ("temperature", self.temperature)):
            if value is not None:
                setattr(msg, name, value)
        for name in ("top_p", "seed"):
            if (value := getattr(self, name)) is not None:
                setattr(msg, name, value)
        return msg


class CompletionRequest(_Generation):
    prompt: str | list[TokenId] | list[str]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def refused(self) -> tuple[str, str] | None:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            return "prompt", "one prompt per request (send several requests, they batch together)"
        for name, ok in (("echo", not self.echo), ("best_of", self.best_of in (None, 1))):
            if not ok:
                return name, f"{name} is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        return super().refused()

    def to_message(self) -> pb.GenerateRequest:
        msg = self.message(self.max_tokens)
        prompt = self.prompt
        if isinstance(prompt, str):
            msg.prompt = prompt
        elif prompt and isinstance(prompt[0], str):
            msg.prompt = prompt[0]
        else:
            msg.input_ids.extend(prompt)
        return msg


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        return {"role": self.role, "content": content} | ({"name": self.name} if self.name else {})


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "max_tokens", "give max_completion_tokens or max_tokens, not both"
        return super().refused()


# ---- responses ---------------------------------------------------------------------------------------------------
def _usage(ev: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
    }


def _extension(ev: Finished, norm: str) -> dict[str, Any]:
    """sharp's fields of a response: the attention statistics, in gRPC's AttentionStats shape."""
    if ev.attention is None:
        return {}
    heads = [dataclasses.asdict(h) for h in ev.attention]
    return {"sharp": {"attention_stats": {"norm": norm, "positions": ev.positions, "heads": heads}}}


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

    def choice(self, text: str | None, finish: str | None, chunk: bool, role: bool = False) -> dict[str, Any]:
        """One choice: a completion's text, a chat chunk's delta (`role`: the first, naming it) or a chat message."""
        if not self.chat:
            body = {"text": text or ""}
        elif chunk:
            body = {"delta": ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


# ---- the server ----------------------------------------------------------------------------------------------
class OpenAIServer:
    """The HTTP API of one engine on the running event loop; `start` binds, `stop` closes."""

    def __init__(self, engine: Engine, calls: Calls, auth_token: str | None):
        self.engine, self.calls = engine, calls
        self.token = auth_token.encode() if auth_token else None
        self.started = int(time.time())
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._errors, self._auth],
            client_max_size=JSON_EXPANSION * self.engine.request_bytes(),
        )
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def start(self, host: str, port: int, tls: tuple[bytes, bytes] | None) -> int:
        # handler_cancellation: a client that disconnects cancels its handler, so its request is cancelled too
        self.runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_SECONDS
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=_ssl_context(*tls) if tls else None, reuse_port=False)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # ---- middlewares ----
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every error in OpenAI's shape: ours, aiohttp's (404 path, 405 method, 413 body) and a bug's (500)."""
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return APIError(e.status, e.reason if e.status != 413 else _too_large(e)).response()
        except Exception:
            log.exception("HTTP handler failed: %s %s", request.method, request.path)
            return APIError(500, "internal error; see the server log").response()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.token is not None and not bearer_matches(request.headers.get("Authorization"), self.token):
            raise APIError(401, "missing or wrong bearer token (Authorization: Bearer <token>)", "unauthenticated")
        return await handler(request)

    # ---- routes ----
    async def models(self, request: web.Request) -> web.Response:
        self._serving()
        model = {"id": self.engine.spec.name, "object": "model", "created": self.started, "owned_by": "sharp"}
        return web.json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._parse(request, CompletionRequest)
        return await self._generate(request, body, body.to_message(), self.engine.tokenizer.encode, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._parse(request, ChatRequest)
        try:
            prompt = render_chat(self.engine.tokenizer, [m.for_template() for m in body.messages])
        except ChatTemplateError as e:
            raise self._refuse(APIError(400, str(e), "invalid_argument", "messages")) from None
        msg = body.message(body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens)
        msg.prompt = prompt
        tokenizer = self.engine.tokenizer
        return await self._generate(request, body, msg, lambda text: tokenizer.encode(text, bos=False), chat=True)

    # ---- helpers ----
    def _serving(self) -> None:
        if self.engine.draining:
            raise APIError(503, "the server is draining and accepts no new requests", "unavailable")

    def _refuse(self, error: APIError) -> APIError:
        """Count a refusal made before the one validation (as that validation's are counted)."""
        self.engine.metrics.log_outcome(RequestOutcome(error.code or "invalid_argument", "http"))
        return error

    async def _parse(self, request: web.Request, kind: type[_Generation]) -> _Generation:
        raw = await request.read()  # over client_max_size: aiohttp's 413
        try:
            body = kind.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            why = "unsupported field" if first["type"] == "extra_forbidden" else first["msg"]
            raise self._refuse(APIError(400, f"{where}: {why}", "invalid_argument", where or None)) from None
        if (refusal := body.refused()) is not None:
            raise self._refuse(APIError(400, refusal[1], "invalid_argument", refusal[0]))
        if body.model != self.engine.spec.name:
            raise self._refuse(
                APIError(404, f"model {body.model!r} is not served here; GET /v1/models lists it", "not_found", "model")
            )
        return body

    async def _generate(
        self, request: web.Request, body: _Generation, msg: pb.GenerateRequest, encode, chat: bool
    ) -> web.StreamResponse:
        if (request_id := request.headers.get("X-Request-Id")) is not None:
            msg.request_id = request_id
        limits = self.engine.limits
        events = self.calls.events(lambda: validate(msg, limits, encode, api="http"), "http", len(msg.prompt))
        async with contextlib.aclosing(events):
            try:
                req, first = await anext(events)
            except RequestError as e:
                raise APIError.of(e.code, e.message, e.transient) from None
            if isinstance(first, Failed):  # before any text: the status line can still say so
                raise APIError.of(first.code, first.message)
            reply = _Reply(chat, req.request_id, self.engine.spec.name)
            if body.stream:
                return await self._stream(request, body, reply, req, first, events)
            text = []
            ev = first
            while isinstance(ev, Delta):
                text.append(ev.text)
                _, ev = await anext(events)
            if isinstance(ev, Failed):
                raise APIError.of(ev.code, ev.message)
            out = reply.envelope(chunk=False) | {
                "choices": [reply.choice("".join(text), FINISH_REASON[ev.reason], chunk=False)],
                "usage": _usage(ev),
            }
            return web.json_response(out | _extension(ev, self.engine.spec.norm))

    async def _stream(
        self,
        request: web.Request,
        body: _Generation,
        reply: _Reply,
        req: GenerationRequest,
        first: Event,
        events: AsyncIterator[tuple[GenerationRequest, Event]],
    ) -> web.StreamResponse:
        """Server-sent events as OpenAI sends them: a chunk per piece of text, one with the finish reason, one with
        the usage when stream_options.include_usage, then `data: [DONE]`; sharp's extension in the last chunk."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        usage = body.stream_options is not None and body.stream_options.include_usage
        base = reply.envelope(chunk=True) | ({"usage": None} if usage else {})
        if reply.chat:  # the first chunk names the role
            await resp.write(_sse(base | {"choices": [reply.choice("", None, chunk=True, role=True)]}))
        ev = first
        while isinstance(ev, Delta):
            if ev.text:
                await resp.write(_sse(base | {"choices": [reply.choice(ev.text, None, chunk=True)]}))
            _, ev = await anext(events)
        if isinstance(ev, Failed):  # the status line is sent: the error travels as an event, as OpenAI's does
            await resp.write(_sse(APIError.of(ev.code, ev.message).body()))
        else:
            last = [base | {"choices": [reply.choice(None, FINISH_REASON[ev.reason], chunk=True)]}]
            if usage:
                last.append(base | {"choices": [], "usage": _usage(ev)})
            last[-1] |= _extension(ev, self.engine.spec.norm)
            for chunk in last:
                await resp.write(_sse(chunk))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


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
