"""The sharp.v1.Generator service over an engine client: a gRPC request becomes `RequestParams` for the one
validation, its events become replies and stream messages, refusals and failures become gRPC status codes
(`GRPC_CODES`); `Guard` refuses undecodable messages and, with a token, unauthenticated calls."""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable

import grpc

from sharp.serving.api.auth import bearer_matches
from sharp.serving.api.calls import Calls
from sharp.serving.engine.engine_client import EngineClient
from sharp.serving.engine.output import Delta, Failed, Finished, TokenLogprob
from sharp.serving.requests import RequestError, RequestParams, validate
from sharp.serving.status import Status
from sharp.v1 import generator_pb2 as pb
from sharp.v1 import generator_pb2_grpc as pb_grpc

log = logging.getLogger("sharp.serving")

SERVICE = pb.DESCRIPTOR.services_by_name["Generator"].full_name  # "sharp.v1.Generator"
GRPC_CODES = {status: getattr(grpc.StatusCode, status.name) for status in Status}  # the names are gRPC's own
_OPTIONAL = ("max_new_tokens", "temperature", "top_p", "seed", "logprobs", "prompt_logprobs", "skip_special_tokens",
             "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "json_schema", "regex",
             "grammar", "cache_salt")  # fmt: skip


def params_of(msg: pb.GenerateRequest) -> RequestParams:
    """The transport-neutral request of a gRPC GenerateRequest (an unset optional field is None)."""
    params = RequestParams(
        prompt=msg.prompt,
        input_ids=msg.input_ids,
        top_k=msg.top_k,
        stop=msg.stop,
        return_attention_stats=msg.return_attention_stats,
        request_id=msg.request_id,
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        stop_token_ids=msg.stop_token_ids,
        include_stop=msg.include_stop,
        priority=msg.priority,
        logit_bias=dict(msg.logit_bias),
        choice=list(msg.choice) or None,
        n=msg.n or 1,
    )
    for name in _OPTIONAL:
        if msg.HasField(name):
            setattr(params, name, getattr(msg, name))
    return params


FINISH = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP, "eos": pb.FINISH_REASON_EOS}


def _stats(ev: Finished, norm: str) -> pb.AttentionStats | None:
    if ev.attention is None:
        return None
    heads = [
        pb.HeadStats(
            layer=h.layer, head=h.head, mean_entropy=h.mean_entropy, mean_normalized_entropy=h.mean_normalized_entropy
        )
        for h in ev.attention
    ]
    return pb.AttentionStats(norm=norm, positions=ev.positions, heads=heads)


def _usage(ev: Finished) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens, cached_tokens=ev.cached_tokens
    )


def _logprobs(items: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=t.token, logprob=t.logprob, top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in t.top]
        )
        for t in items or ()
    ]


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(self, engine: EngineClient, calls: Calls):
        self.engine, self.calls = engine, calls

    async def _events(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        """(request, choice, event) of one call's choices; where a refusal or a failure becomes a gRPC status (each
        is counted once, by serving.calls or the engine)."""
        engine, params = self.engine, params_of(msg)
        events = self.calls.choices(
            lambda: validate(params, engine.limits, engine.tokenizer.encode),
            "grpc",
            len(msg.prompt),
            params.n,
            params.constrained,
        )
        try:
            async with contextlib.aclosing(events):
                async for req, index, ev in events:
                    if isinstance(ev, Failed):
                        await context.abort(GRPC_CODES[ev.code], ev.message)
                    yield req, index, ev
        except RequestError as e:
            await context.abort(GRPC_CODES[e.code], e.message)

    async def Generate(self, request, context):
        n = request.n or 1
        choices = [pb.Choice(index=i) for i in range(n)]
        prompt_logprobs: list[pb.TokenLogprob] = []
        ends: dict[int, Finished] = {}
        request_id = ""
        async for req, i, ev in self._events(request, context):
            request_id = req.request_id
            if isinstance(ev, Delta):
                choices[i].token_ids.extend(ev.token_ids)
                choices[i].text += ev.text
                choices[i].logprobs.extend(_logprobs(ev.logprobs))
                prompt_logprobs += _logprobs(ev.prompt_logprobs)
            else:
                ends[i] = ev
                choices[i].finish_reason = FINISH[ev.reason]
        first = choices[0]
        usage = _usage(ends[0])
        usage.completion_tokens = sum(ev.completion_tokens for ev in ends.values())
        return pb.GenerateResponse(
            request_id=request_id,
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            usage=usage,
            attention_stats=_stats(ends[0], self.engine.spec.norm),
            logprobs=first.logprobs,
            prompt_logprobs=prompt_logprobs,
            choices=choices if n > 1 else (),
        )

    async def GenerateStream(self, request, context):
        async for req, i, ev in self._events(request, context):
            if isinstance(ev, Delta):
                yield pb.GenerateChunk(
                    request_id=req.request_id,
                    text=ev.text,
                    token_ids=ev.token_ids,
                    logprobs=_logprobs(ev.logprobs),
                    prompt_logprobs=_logprobs(ev.prompt_logprobs),
                    index=i,
                )
            else:
                yield pb.GenerateChunk(
                    request_id=req.request_id,
                    finish_reason=FINISH[ev.reason],
                    usage=_usage(ev),
                    attention_stats=_stats(ev, self.engine.spec.norm),
                    index=i,
                )

    async def Tokenize(self, request, context):
        if self.engine.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is draining and accepts no new requests")
        return pb.TokenizeResponse(token_ids=self.engine.tokenizer.encode(request.text, bos=request.add_bos))

    async def GetModelInfo(self, request, context):
        if self.engine.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is draining and accepts no new requests")
        s, c = self.engine.spec, self.engine.config
        layer_info = [
            pb.LayerInfo(norm=a.norm, parameters={k: pb.FloatList(values=v) for k, v in a.parameters.items()})
            for a in s.attention
        ]
        return pb.ModelInfo(
            name=s.name,
            backend=s.backend,
            norm=s.norm,
            context_length=s.context_length,
            layers=s.layers,
            heads=s.heads,
            kv_heads=s.kv_heads,
            vocab_size=s.vocab_size,
            layer_info=layer_info,
            max_new_tokens_limit=self.engine.limits.max_new_tokens_limit,
            max_batch=c.max_batch,
            kv_cache_mb=self.engine.limits.kv_budget_bytes / 2**20,  # what the default came to
            default_max_new_tokens=c.default_max_new_tokens or 0,
            max_prompt_bytes=self.engine.limits.max_prompt_bytes,
            max_stop_strings=c.max_stop_strings,
            max_stop_length=c.max_stop_length,
            attention=self.engine.attention.removeprefix("attention: "),  # the field names it already
            precision=s.precision,
        )


class _Undecodable:
    """What a request deserializer returns for bytes that are not the expected message."""

    def __init__(self, error: Exception):
        self.error = error


def _decoding(deserializer):
    def load(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # protobuf's DecodeError and friends: the client sent something else
            return _Undecodable(e)

    return load


GENERATE_METHODS = (f"/{SERVICE}/Generate", f"/{SERVICE}/GenerateStream")


class _Arrived:
    """A generation call that reached the server; collected when gRPC lets go of the call."""


class Guard(grpc.aio.ServerInterceptor):
    """Undecodable request messages get INVALID_ARGUMENT; with a token, every call but grpc.health.v1 must carry
    `authorization: Bearer <token>` (scheme case-insensitive, token compared in constant time). A generation call
    whose message is never read — its deadline passed, or its client left, while it waited for the event loop —
    never reaches a handler, so nothing else would count it: `unread()` is called for it when gRPC drops the call."""

    def __init__(self, token: str | None, unread: Callable[[], None] | None = None):
        self.token = token.encode() if token else None
        self.unread = unread

    def _watch(self, details) -> tuple[list[bool], _Arrived | None]:
        """A flag the call's wrapper sets when it runs, and a token its closure holds as long as gRPC holds the
        call: when the token is collected and the flag was never set, `unread()`."""
        reached = [False]
        if self.unread is None or details.method not in GENERATE_METHODS:
            return reached, None
        arrived, unread = _Arrived(), self.unread
        weakref.finalize(arrived, lambda: None if reached[0] else unread())  # holds the flag, never the token
        return reached, arrived

    def _authorized(self, details) -> bool:
        if self.token is None or details.method.startswith("/grpc.health.v1.Health/"):
            return True
        return bearer_matches(dict(details.invocation_metadata or ()).get("authorization"), self.token)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        allowed = self._authorized(details)
        reached, arrived = self._watch(details)

        async def refuse(request, context, _held=arrived) -> bool:
            reached[0] = True
            if not allowed:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization)")
            if isinstance(request, _Undecodable):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {details.method} message"
                )

        load = _decoding(handler.request_deserializer)
        if handler.response_streaming:
            inner = handler.unary_stream

            if not inspect.isasyncgenfunction(inner):  # a coroutine that writes with context.write (health Watch)

                async def written(request, context):
                    await refuse(request, context)
                    await inner(request, context)

                return grpc.unary_stream_rpc_method_handler(written, load, handler.response_serializer)

            async def stream(request, context):
                await refuse(request, context)
                async for item in inner(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, load, handler.response_serializer)
        inner = handler.unary_unary

        async def unary(request, context):
            await refuse(request, context)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, load, handler.response_serializer)
