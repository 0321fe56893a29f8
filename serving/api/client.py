"""Python clients for sharp-serve: `Client` (blocking) and `AsyncClient` (asyncio), both with streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sharp.v1 import generator_pb2 as pb
from sharp.v1 import generator_pb2_grpc as pb_grpc


def make_request(
    prompt: str | Sequence[int],
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    attention_stats: bool = False,
    request_id: str = "",
    **fields,
) -> pb.GenerateRequest:
    """A GenerateRequest; `prompt` is text or token ids. Unset values take the server's defaults; `fields`: any
    other GenerateRequest field (ignore_eos, min_tokens, stop_token_ids, …)."""
    msg = pb.GenerateRequest(
        top_k=top_k, stop=list(stop), return_attention_stats=attention_stats, request_id=request_id, **fields
    )
    if isinstance(prompt, str):
        msg.prompt = prompt
    else:
        msg.input_ids.extend(prompt)
    for name, value in (
        ("max_new_tokens", max_new_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("seed", seed),
    ):
        if value is not None:
            setattr(msg, name, value)
    return msg


def _channel(target: str, root_cert: bytes | None, aio: bool, server_name: str | None):
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    grpc_mod = grpc.aio if aio else grpc
    if root_cert is not None:
        return grpc_mod.secure_channel(target, grpc.ssl_channel_credentials(root_cert), options=options)
    return grpc_mod.insecure_channel(target, options=options)


class _Base:
    def __init__(
        self, target: str, token: str | None, root_cert: bytes | None, timeout: float | None, server_name, aio
    ):
        self.channel = _channel(target, root_cert, aio, server_name)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout


class Client(_Base):
    """Blocking client. `timeout` (seconds) becomes each call's gRPC deadline."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        root_cert: bytes | None = None,
        timeout: float | None = None,
        server_name: str | None = None,
    ):
        super().__init__(target, token, root_cert, timeout, server_name, aio=False)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(self, prompt: str | Sequence[int], **kw) -> pb.GenerateResponse:
        return self.stub.Generate(make_request(prompt, **kw), timeout=self.timeout, metadata=self.metadata)

    def generate_stream(self, prompt: str | Sequence[int], **kw) -> Iterator[pb.GenerateChunk]:
        """Chunks as they are produced; `.cancel()` on the returned call frees the request on the server."""
        return self.stub.GenerateStream(make_request(prompt, **kw), timeout=self.timeout, metadata=self.metadata)

    def tokenize(self, text: str, add_bos: bool = False) -> list[int]:
        msg = pb.TokenizeRequest(text=text, add_bos=add_bos)
        return list(self.stub.Tokenize(msg, timeout=self.timeout, metadata=self.metadata).token_ids)

    def info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self.timeout, metadata=self.metadata)

    def health(self, service: str = "") -> str:
        """SERVING, NOT_SERVING, … of `service` ("" is the whole server)."""
        reply = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class AsyncClient(_Base):
    """asyncio client with the same methods as `Client`."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        root_cert: bytes | None = None,
        timeout: float | None = None,
        server_name: str | None = None,
    ):
        super().__init__(target, token, root_cert, timeout, server_name, aio=True)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, prompt: str | Sequence[int], **kw) -> pb.GenerateResponse:
        return await self.stub.Generate(make_request(prompt, **kw), timeout=self.timeout, metadata=self.metadata)

    async def generate_stream(self, prompt: str | Sequence[int], **kw) -> AsyncIterator[pb.GenerateChunk]:
        call = self.stub.GenerateStream(make_request(prompt, **kw), timeout=self.timeout, metadata=self.metadata)
        async for chunk in call:
            yield chunk

    async def tokenize(self, text: str, add_bos: bool = False) -> list[int]:
        msg = pb.TokenizeRequest(text=text, add_bos=add_bos)
        return list((await self.stub.Tokenize(msg, timeout=self.timeout, metadata=self.metadata)).token_ids)

    async def info(self) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self.timeout, metadata=self.metadata)

    async def health(self, service: str = "") -> str:
        reply = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
