"""sharp-serve's OpenAI-compatible HTTP API (docs/serving.md): its routes — GET /v1/models, POST /v1/completions,
/v1/chat/completions and /v1/responses (streamed as server-sent events as OpenAI streams them), tokenizing, health,
metrics and what the LLM routers poll — served by aiohttp on the gRPC server's event loop from the same engine,
limits, token and TLS files.

A body is checked field by field (pydantic, strict types, unknown fields refused as OpenAI refuses them), then
becomes a `RequestParams` for the one validation gRPC requests go through (serving.requests); refusals and failures
get OpenAI's error shape (api/errors.py). A request's events become its reply in api/replies.py. A client that
disconnects cancels its request (its slot and cache are freed at the next engine step). sharp's own extension:
`"sharp": {"attention_stats": true}` returns the request's per-layer, per-head entropy, as gRPC's attention_stats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from sharp import __version__
from sharp.models.tokenizer import ChatTemplateError, render_chat, takes_tools
from sharp.serving.api.auth import bearer_matches
from sharp.serving.api.calls import Calls
from sharp.serving.api.errors import CHAT_NAMES, COMPLETION_NAMES, APIError, not_served, validation_refusal
from sharp.serving.api.http_app import (
    DEFAULT_TIMEOUTS,
    JSON_EXPANSION,
    PARSE_OFF_LOOP,
    SHUTDOWN_SECONDS,
    HTTPTimeouts,
    Runner,
    client_gone,
    ssl_context,
    too_large,
)
from sharp.serving.api.metrics_http import LOAD_PATH, scrape
from sharp.serving.api.openai_bodies import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Generation,
    TokenizeRequest,
)
from sharp.serving.api.replies import Choice, Logprobs, generate, rendered, respond
from sharp.serving.api.responses_api import ResponsesRequest, renamed
from sharp.serving.api.tools import ToolUse, format_for, system_block
from sharp.serving.engine.engine_client import EngineClient
from sharp.serving.requests import GenerationRequest, RequestError, RequestParams, validate
from sharp.serving.stats import RequestOutcome

log = logging.getLogger("sharp.serving")

# answered without the bearer token: probes, Prometheus, and the routers' load polls (numbers, no content)
OPEN_PATHS = frozenset(("/health", "/metrics", LOAD_PATH, "/get_load"))


_B = TypeVar("_B", bound=BaseModel)
_G = TypeVar("_G", bound=Generation)


class OpenAIServer:
    """The HTTP API of one engine on the running event loop; `start` binds, `stop` closes. `serving()` is the
    server's health (GET /health answers it, as grpc.health does)."""

    def __init__(
        self,
        engine: EngineClient,
        calls: Calls,
        auth_token: str | None,
        serving: Callable[[], bool] = lambda: True,
        timeouts: HTTPTimeouts = DEFAULT_TIMEOUTS,
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
        self.runner = Runner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=SHUTDOWN_SECONDS,
            auto_decompress=False,
            keepalive_timeout=self.timeouts.keepalive,
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=ssl_context(*tls) if tls else None, reuse_port=False)
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
            resp = APIError(e.status, e.reason if e.status != 413 else too_large(e)).response()
        except Exception as e:
            if client_gone(e):  # the client left mid-response: nothing to answer, nothing wrong here
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
    def _model(self, name: str) -> dict[str, Any]:
        spec = self.engine.spec
        return {"id": name, "object": "model", "created": self.started, "owned_by": "sharp",
                "max_model_len": spec.context_length, "root": spec.name}  # fmt: skip

    async def models(self, request: web.Request) -> web.Response:
        """Every id the model answers to, its own first (vLLM lists each --served-model-name)."""
        self._serving()
        return web.json_response({"object": "list", "data": [self._model(n) for n in self.engine.spec.names]})

    async def model(self, request: web.Request) -> web.Response:
        self._serving()
        name = request.match_info["model"]
        if name not in self.engine.spec.names:
            raise not_served(name)
        return web.json_response(self._model(name))

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
        return web.json_response([rendered(req, "cmpl-", body.model)])

    async def render_chat(self, request: web.Request) -> web.Response:
        body = await self._read_checked(request, ChatRequest)
        tools = body.tool_use(self.tool_format)
        prompt = self._chat_prompt(body, tools)
        encode = lambda text: self.engine.tokenizer.encode(text, bos=False)
        req = await self._validated(body.to_params(prompt, tools), encode, self._chat_names(body))
        return web.json_response(rendered(req, "chatcmpl-", body.model))

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
        choice = Choice(False, echo, body.logprobs is not None, Logprobs(tokenizer))
        events = self._events(request, body.to_params(), tokenizer.encode, COMPLETION_NAMES, body.runs)
        return await generate(request, body, events, choice, self.engine.spec)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._parse(request, ChatRequest)
        tools = body.tool_use(self.tool_format)
        try:
            prompt = self._chat_prompt(body, tools)
        except APIError as e:
            raise self._refuse(e) from None
        tokenizer = self.engine.tokenizer
        choice = Choice(True, None, body.logprobs, Logprobs(tokenizer), tools=tools)
        encode = lambda text: tokenizer.encode(text, bos=False)  # the template wrote BOS, if any
        events = self._events(request, body.to_params(prompt, tools), encode, self._chat_names(body), body.runs)
        return await generate(request, body, events, choice, self.engine.spec)

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
            error = validation_refusal(e)
            raise self._refuse(APIError(400, error.message, error.code, renamed(error.param))) from None
        except APIError as e:
            e.param = renamed(e.param)
            raise self._refuse(e) from None
        encode = lambda text: self.engine.tokenizer.encode(text, bos=False)
        names = {k: renamed(v) for k, v in self._chat_names(chat).items()}
        events = self._events(request, chat.to_params(prompt, tools), encode, names, 1)
        return await respond(request, body, tools, events, self.engine.spec.name)

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
            raise validation_refusal(e) from None

    async def _read_checked(self, request: web.Request, kind: type[_G]) -> _G:
        """A generation body, read and checked as a generation's (not counted: nothing runs)."""
        self._serving()
        body = await self._read(request, kind)
        if (refusal := body.refused()) is not None:
            raise APIError(400, refusal[1], "unsupported_value", refusal[0], "invalid_argument")
        if body.model not in self.engine.spec.names:
            raise not_served(body.model)
        return body

    async def _validated(self, msg: RequestParams, encode, names: dict[str, str]) -> GenerationRequest:
        """The one validation, for a request that is not run (a render); tokenized off the event loop."""
        try:
            return await asyncio.to_thread(validate, msg, self.engine.limits, encode, "http", names)
        except RequestError as e:
            raise APIError.refused(e) from None

    async def _parse(self, request: web.Request, kind: type[_B]) -> _B:
        try:
            body = await self._read(request, kind)
        except APIError as e:
            raise self._refuse(e) from None
        if (refusal := body.refused()) is not None:
            raise self._refuse(APIError(400, refusal[1], "unsupported_value", refusal[0], "invalid_argument"))
        if body.model not in self.engine.spec.names:
            raise self._refuse(not_served(body.model))
        return body

    def _events(self, request: web.Request, msg: RequestParams, encode, names: dict[str, str], runs: int):
        """The events of a request's `runs` choices, validated as they start (the X-Request-Id header its id)."""
        if (request_id := request.headers.get("X-Request-Id")) is not None:
            msg.request_id = request_id
        limits = self.engine.limits
        check = lambda: validate(msg, limits, encode, api="http", names=names)
        return self.calls.choices(check, "http", len(msg.prompt), runs, msg.constrained)
