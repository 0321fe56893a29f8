"""sharp-serve's gRPC server (docs/serving.md): the sharp.v1.Generator service over the engine, grpc.health.v1
and reflection, one validation with the documented status codes, deadlines and cancellation that free work, a bounded
queue, graceful drain, optional bearer-token auth and TLS, the Prometheus endpoint, and (with http_port) the
OpenAI-compatible HTTP API on the same event loop, draining together.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import socket
import threading
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from sharp.serving.api.calls import Calls
from sharp.serving.api.grpc_service import SERVICE, GeneratorService, Guard
from sharp.serving.api.metrics_http import MetricsServer
from sharp.serving.api.tools import FORMATS as TOOL_FORMATS
from sharp.serving.config import option
from sharp.serving.engine.engine_client import EngineClient
from sharp.serving.engine.warmup import WarmUp
from sharp.serving.grammar import preload
from sharp.serving.stats import RequestOutcome
from sharp.serving.status import Status
from sharp.v1 import generator_pb2 as pb
from sharp.v1 import generator_pb2_grpc as pb_grpc

log = logging.getLogger("sharp.serving")

DRAIN_DEADLINE = "the server is draining: drain deadline reached before this request finished"


@dataclass(frozen=True)
class ServerConfig:
    """The server's settings; those made with `option` are sharp-serve flags of the same name (serving/cli.py)."""

    host: str = option("127.0.0.1", "address to listen on (0.0.0.0 in containers)")
    port: int = option(50051, "gRPC port (0: any free port)")
    metrics_port: int | None = 9400  # 0: any free port; None: no metrics endpoint (the flag's -1)
    metrics_host: str | None = option(None, "address of the Prometheus endpoint (default: --host)")
    health_port: int | None = option(
        None, "also answer grpc.health.v1 in plaintext on this port (for kubelet probes when --tls-cert is on)"
    )
    drain_timeout: float = option(30.0, "seconds in-flight calls get after SIGTERM")
    auth_token: str | None = None  # bearer token every call but health must carry (the flag names its file)
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    warm_up: bool = False  # run the model's shapes (compiles, tile tuning) before health reports SERVING
    http_port: int | None = option(
        None,
        "also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) on this"
        " port (0: any free port); same token, TLS, limits and metrics as gRPC",
    )
    http_host: str | None = option(None, "address of the HTTP API (default: --host)")
    http_keepalive_timeout: float = option(
        75.0, "seconds an idle keep-alive connection is held (the HTTP API and the metrics port)"
    )
    http_body_timeout: float = option(30.0, "seconds an HTTP client has to send a request's body (then 408)")
    tool_call_parser: str | None = option(
        None,
        f"how the model writes tool calls: {', '.join(TOOL_FORMATS)} (default: the format its chat template writes,"
        " else hermes)",
    )

    def busy_port(self) -> str | None:
        """The first port this server would listen on that it cannot, with the flag that sets it and a way out;
        None when all are free. Said before any work (a model's export), as the servers say it again if a port is
        taken meanwhile."""
        hosts = {"metrics_port": self.metrics_host, "http_port": self.http_host}
        for name in ("port", "health_port", "http_port", "metrics_port"):
            port, host = getattr(self, name), hosts.get(name) or self.host
            if port and (problem := bind_problem(host, port)) is not None:
                flag = "--" + name.replace("_", "-")
                return f"{flag} {port}: cannot listen on {host}:{port}: {problem}{_WAY_OUT}"
        return None

    def check(self) -> None:
        """Raise ValueError naming the first setting out of range (in backquotes: the CLI names its flag)."""
        ports = ("port", "metrics_port", "health_port", "http_port")
        for name in ports:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535):
                raise ValueError(f"`{name}` must be in [0, 65535] (0: any free port), got {value!r}")
        for name, least in (("drain_timeout", 0), ("http_keepalive_timeout", 1e-3), ("http_body_timeout", 1e-3)):
            timeout = getattr(self, name)
            number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
            if not (number and math.isfinite(timeout) and timeout >= least):
                above = ">= 0" if least == 0 else "> 0"
                raise ValueError(f"`{name}` must be a finite number of seconds {above}, got {timeout!r}")
        taken: dict[tuple[str, int], str] = {}  # fixed ports by address
        hosts = {"metrics_port": self.metrics_host, "http_port": self.http_host}
        for name in ports:
            if value := getattr(self, name):
                where = (hosts.get(name) or self.host, value)
                if where in taken:
                    raise ValueError(f"`{name}` {value} is taken by `{taken[where]}`; listeners need their own port")
                taken[where] = name
        if self.http_host is not None and self.http_port is None:
            raise ValueError("`http_host` needs `http_port` (the HTTP API is off without it)")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_FORMATS:
            raise ValueError(
                f"`tool_call_parser` must be one of {', '.join(TOOL_FORMATS)}, got {self.tool_call_parser!r}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("`tls_cert` and `tls_key` go together; give both or neither")


_WAY_OUT = " (give the flag another port, or 0 for any free one; --metrics-port -1 turns the metrics port off)"


def bind_problem(host: str, port: int) -> str | None:
    """Why (host, port) cannot be bound, in words, or None when it can."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"{host!r} is not a resolvable address ({e.strerror})"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            # as the servers bind: a port whose last connections linger in TIME_WAIT (a replica restarted at
            # the same address) is free; only a listener makes it busy
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return f"port {port} is already in use (another sharp-serve or program listens there)"
                if e.errno == errno.EADDRNOTAVAIL:
                    return f"{host} is not an address of this machine"
                return e.strerror or str(e)
    return None


def _reflection_pool() -> descriptor_pool.DescriptorPool:
    """Only the served APIs' descriptors (not every proto the process happens to import)."""
    pool = descriptor_pool.DescriptorPool()
    for file in (pb.DESCRIPTOR, health_pb2.DESCRIPTOR):
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
    return pool


class _Noted:
    """A Watch call's context that remembers the last status it wrote (drain waits for NOT_SERVING to be sent)."""

    def __init__(self, context) -> None:
        self._context, self.sent = context, None

    async def write(self, message: health_pb2.HealthCheckResponse) -> None:
        await self._context.write(message)
        self.sent = message.status

    def __getattr__(self, name: str):
        return getattr(self._context, name)


class Health(HealthServicer):
    """grpcio-health-checking's servicer plus Health/List, which the library leaves unimplemented, and drain's
    wait for every open Watch to have been sent NOT_SERVING (stopping the server first would cancel the stream
    before the status a load balancer or kubelet watches for)."""

    def __init__(self) -> None:
        super().__init__()
        self.statuses = {"": health_pb2.HealthCheckResponse.SERVING}
        self.shutting_down = False
        self._watches: set[_Noted] = set()

    async def Watch(self, request, context) -> None:
        noted = _Noted(context)
        self._watches.add(noted)
        try:
            await super().Watch(request, noted)
        finally:
            self._watches.discard(noted)

    async def told(self, timeout: float) -> None:
        """Until every open Watch has been sent NOT_SERVING (or `timeout` seconds: a stalled client cannot hold
        the drain)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while any(w.sent != not_serving for w in self._watches) and loop.time() < deadline:
            await asyncio.sleep(0.01)

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        await super().set(service, status)
        if not self.shutting_down:  # after a graceful shutdown began, the library ignores changes too
            self.statuses[service] = status

    async def enter_graceful_shutdown(self) -> None:
        self.shutting_down = True
        self.statuses = dict.fromkeys(self.statuses, health_pb2.HealthCheckResponse.NOT_SERVING)
        await super().enter_graceful_shutdown()

    async def List(self, request, context) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=s) for name, s in self.statuses.items()}
        )


class SharpServer:
    """The engine behind a grpc.aio server and a metrics endpoint; `drain` is what SIGTERM does."""

    def __init__(self, engine: EngineClient, config: ServerConfig):
        config.check()
        self.engine, self.config = engine, config
        self.calls = Calls(engine)
        self.service = GeneratorService(engine, self.calls)
        self.health = Health()
        self.server: grpc.aio.Server | None = None
        self.port = self.metrics_port = self.health_port = self.http_port = None
        self.http = None  # the OpenAIServer, with http_port
        self.warm_up: WarmUp | None = None
        self._metrics_http = None
        self._health_server: grpc.aio.Server | None = None

    async def start(self) -> None:
        cfg = self.config
        preload()  # llguidance, for the first structured request's validate (its engine may be another process)
        options = [
            ("grpc.so_reuseport", 0),  # a busy port is an error, never a second server sharing the traffic
            ("grpc.max_receive_message_length", self.engine.limits.message_bytes()),
        ]
        metrics = self.engine.metrics

        def unread() -> None:  # a call whose deadline passed (or whose client left) before its message was read
            metrics.log_outcome(RequestOutcome("cancelled", "grpc"))

        self.server = grpc.aio.server(interceptors=[Guard(cfg.auth_token, unread)], options=options)
        pb_grpc.add_GeneratorServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server, pool=_reflection_pool())
        address = f"{cfg.host}:{cfg.port}"
        if (problem := bind_problem(cfg.host, cfg.port)) is not None:  # before gRPC tries, and logs its own lines
            raise OSError(f"--port {cfg.port}: cannot listen on {address}: {problem}")
        try:
            if cfg.tls_cert and cfg.tls_key:
                creds = grpc.ssl_server_credentials([(cfg.tls_key, cfg.tls_cert)])
                self.port = self.server.add_secure_port(address, creds)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise OSError(f"--port {cfg.port}: cannot listen on {address}: the gRPC runtime refused the address")
        if cfg.health_port is not None and (problem := bind_problem(cfg.host, cfg.health_port)) is not None:
            raise OSError(f"--health-port {cfg.health_port}: cannot serve health on {cfg.host}:{cfg.health_port}:"
                          f" {problem}")  # fmt: skip
        http_host = cfg.http_host or cfg.host
        if cfg.http_port is not None and (problem := bind_problem(http_host, cfg.http_port)) is not None:
            raise OSError(f"--http-port {cfg.http_port}: cannot serve HTTP on {http_host}:{cfg.http_port}: {problem}")
        if cfg.metrics_port is not None:
            metrics_host = cfg.metrics_host or cfg.host
            self._metrics_http = MetricsServer(
                self.engine.metrics.registry, self.engine.metrics.load_registry, cfg.http_keepalive_timeout
            )
            try:
                self.metrics_port = await self._metrics_http.start(metrics_host, cfg.metrics_port)
            except OSError as e:
                problem = bind_problem(metrics_host, cfg.metrics_port) or e.strerror
                raise OSError(f"--metrics-port {cfg.metrics_port}: cannot serve metrics on {metrics_host}:"
                              f"{cfg.metrics_port}: {problem}") from None  # fmt: skip
        spec = self.engine.spec
        # the ports are ours: starting
        log.info("%s: %s weights, %s KV cache, %s; %s", spec.name, spec.precision, spec.kv_dtype,
                 self.engine.prefix_cache, self.engine.attention)  # fmt: skip
        for name in ("", SERVICE):  # until the engine runs (and, with warm_up, has run the model's shapes)
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if cfg.health_port is not None:
            await self._start_health(cfg.host, cfg.health_port)
        if cfg.http_port is not None:  # before the engine runs: requests wait in its queue meanwhile, as gRPC's do
            from sharp.serving.api.openai_api import HTTPTimeouts, OpenAIServer  # aiohttp, pydantic: only when it is on

            serving = lambda: self.health.statuses.get("") == health_pb2.HealthCheckResponse.SERVING
            timeouts = HTTPTimeouts(cfg.http_keepalive_timeout, cfg.http_body_timeout)
            self.http = OpenAIServer(self.engine, self.calls, cfg.auth_token, serving, timeouts, cfg.tool_call_parser)
            tls = (cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None
            self.http_port = await self.http.start(http_host, cfg.http_port, tls)
        if cfg.warm_up:  # in a worker thread: probes keep being answered (NOT_SERVING) meanwhile
            try:
                self.warm_up = await asyncio.get_running_loop().run_in_executor(None, self.engine.warm_up)
            except BaseException:
                await self.stop()
                raise
        self.engine.start()
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def _start_health(self, host: str, port: int) -> None:
        """grpc.health.v1 alone, in plaintext: the same statuses as the main port, nothing else reachable."""
        address = f"{host}:{port}"
        self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        self.health_port = self._health_server.add_insecure_port(address)
        if not self.health_port:
            raise OSError(f"cannot serve health on {address}: the gRPC runtime refused the address")
        await self._health_server.start()

    async def drain(self) -> None:
        """Health NOT_SERVING, new calls UNAVAILABLE, in-flight calls finish within drain_timeout, then stop."""
        self.engine.draining = True
        await self.health.enter_graceful_shutdown()
        await self.health.told(timeout=min(1.0, self.config.drain_timeout))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout
        while (self.calls.inflight or not self.engine.idle()) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.calls.inflight or not self.engine.idle():  # the deadline: calls end with a status that says so
            self.engine.end_all(Status.UNAVAILABLE, DRAIN_DEADLINE)
            deadline = loop.time() + 5
            while self.calls.inflight and loop.time() < deadline:
                await asyncio.sleep(0.02)
        await self.stop()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
        if self._health_server is not None:
            await self._health_server.stop(grace=None)
        if self.http is not None:
            await self.http.stop()
        self.engine.stop()
        if self._metrics_http is not None:
            await self._metrics_http.stop()
            self._metrics_http = None

    async def wait(self) -> None:
        await self.server.wait_for_termination()


class BackgroundServer:
    """A SharpServer on its own event loop in a thread: for tests, benchmarks and in-process embedding."""

    def __init__(self, engine: EngineClient, config: ServerConfig):
        self.server = SharpServer(engine, config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sharp-grpc", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        try:
            self._call(self.server.start(), timeout=None)  # a warm-up takes what it takes
        except BaseException:
            self.stop()
            raise
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
