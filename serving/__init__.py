"""sharp.serving — the engine (continuous batching, chunked prefill, KV budget), the onnxruntime and torch
backends, the gRPC server with entropy metrics, and its clients.

Names are imported on first use, so a client (`sharp-client`, `sharp.serving.client`) never loads torch or
onnxruntime.
"""

from importlib import import_module

_HOMES = {
    "BACKENDS": "backends",
    "Backend": "backends",
    "BackendError": "backends",
    "ModelSpec": "spec",
    "load_backend": "loading",
    "AsyncClient": "client",
    "Client": "client",
    "make_request": "client",
    "Engine": "engine",
    "EngineClient": "engine_client",
    "EngineProcess": "core",
    "CoreSpec": "core",
    "EngineConfig": "config",
    "GenerationRequest": "requests",
    "RequestError": "requests",
    "RequestParams": "requests",
    "Status": "status",
    "validate": "requests",
    "ServingMetrics": "metrics",
    "BackgroundServer": "server",
    "ServerConfig": "server",
    "SharpServer": "server",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'sharp.serving' has no attribute {name!r}")
    return getattr(import_module(f"sharp.serving.{_HOMES[name]}"), name)
