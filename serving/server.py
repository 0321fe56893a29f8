"""sharp-serve's gRPC server (docs/serving.md): the sharp.v1.Generator service over the engine, grpc.health.v1
and reflection, one validation with the documented status codes, deadlines and cancellation that free work, a bounded
queue, graceful drain, optional bearer-token auth and TLS, and the Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from sharp.serving.engine import Delta, Engine, Failed, Finished
from sharp.serving.requests import RequestError, validate
from sharp.serving.stats import RequestOutcome
from sharp.v1 import generator_pb2 as pb
from sharp.v1 import generator_pb2_grpc as pb_grpc

log = logging.getLogger("sharp.serving")

SERVICE = pb.DESCRIPTOR.services_by_name["Generator"].full_name  # "sharp.v1.Generator"
FINISH = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP, "eos": pb.FINISH_REASON_EOS}


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port
    metrics_port: int | None = 9400  # 0: any free port; None: no metrics endpoint
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    auth_token: str | None = None  # bearer token every call but health must carry
    tls_cert: bytes | None = None
    tls_key: bytes | None = None


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


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(self, engine: Engine):
        self.engine = engine
        self.inflight = 0

    async def _events(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        """(request, event) pairs of one call. The one place a refusal or a failure becomes a status: validation,
        draining, a full queue (at submission) and a failed sequence all end the call here."""
        self.inflight += 1
        try:
            req = validate(msg, self.engine.limits, self.engine.tokenizer.encode)
            async for ev in self.engine.stream(req):
                if isinstance(ev, Failed):
                    raise RequestError(ev.code, ev.message)
                yield req, ev
        except RequestError as e:
            self.engine.metrics.log_outcome(RequestOutcome(e.code.name.lower()))
            await context.abort(e.code, e.message)
        finally:
            self.inflight -= 1

    async def Generate(self, request, context):
        ids, text = [], []
        async for req, ev in self._events(request, context):
            if isinstance(ev, Delta):
                ids += ev.token_ids
                text.append(ev.text)
            else:
                return pb.GenerateResponse(
                    request_id=req.request_id,
                    text="".join(text),
                    token_ids=ids,
                    finish_reason=FINISH[ev.reason],
                    usage=pb.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens),
                    attention_stats=_stats(ev, self.engine.spec.norm),
                )

    async def GenerateStream(self, request, context):
        async for req, ev in self._events(request, context):
            if isinstance(ev, Delta):
                yield pb.GenerateChunk(request_id=req.request_id, text=ev.text, token_ids=ev.token_ids)
            else:
                yield pb.GenerateChunk(
                    request_id=req.request_id,
                    finish_reason=FINISH[ev.reason],
                    usage=pb.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens),
                    attention_stats=_stats(ev, self.engine.spec.norm),
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
            max_new_tokens_limit=c.max_new_tokens_limit,
            max_batch=c.max_batch,
            kv_cache_mb=c.kv_cache_mb,
        )


class BearerAuth(grpc.aio.ServerInterceptor):
    """Every call but grpc.health.v1 must carry `authorization: Bearer <token>`."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}"

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        if dict(details.invocation_metadata or ()).get("authorization") == self.expected:
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization)")

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)


class SharpServer:
    """The engine behind a grpc.aio server and a metrics endpoint; `drain` is what SIGTERM does."""

    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.service = GeneratorService(engine)
        self.health = HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = self.metrics_port = None
        self._metrics_http = None

    async def start(self) -> None:
        cfg = self.config
        interceptors = [BearerAuth(cfg.auth_token)] if cfg.auth_token else []
        self.server = grpc.aio.server(interceptors=interceptors)
        pb_grpc.add_GeneratorServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), self.server
        )
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert and cfg.tls_key:
            creds = grpc.ssl_server_credentials([(cfg.tls_key, cfg.tls_cert)])
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        self.engine.start()
        await self.server.start()
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if cfg.metrics_port is not None:
            self._metrics_http, _ = start_http_server(cfg.metrics_port, cfg.host, registry=self.engine.metrics.registry)
            self.metrics_port = self._metrics_http.server_port

    async def drain(self) -> None:
        """Health NOT_SERVING, new calls UNAVAILABLE, in-flight calls finish within drain_timeout, then stop."""
        self.engine.draining = True
        await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout
        while (self.service.inflight or not self.engine.idle()) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        await self.stop()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
        self.engine.stop()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None

    async def wait(self) -> None:
        await self.server.wait_for_termination()


class BackgroundServer:
    """A SharpServer on its own event loop in a thread: for tests, benchmarks and in-process embedding."""

    def __init__(self, engine: Engine, config: ServerConfig):
        self.server = SharpServer(engine, config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sharp-grpc", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        self._call(self.server.start())
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def target(self) -> str:
        return f"{self.server.config.host}:{self.server.port}"

    def _call(self, coro, timeout: float | None = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def drain(self) -> None:
        self._call(self.server.drain(), timeout=None)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._call(self.server.stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
