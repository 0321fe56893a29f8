"""sharp.serving — the engine (continuous batching, chunked prefill, KV budget), the onnxruntime and torch
backends, the gRPC server with entropy metrics, and its clients.

Names are imported on first use, so a client (`sharp-client`, `sharp.serving.api.client`) never loads torch or
onnxruntime.
"""

from importlib import import_module

_HOMES = {
    "BACKENDS": "backends.interface",
    "Backend": "backends.interface",
    "BackendError": "backends.interface",
    "ModelSpec": "spec",
    "load_backend": "backends.loading",
    "AsyncClient": "api.client",
    "Client": "api.client",
    "make_request": "api.client",
    "Engine": "engine.engine",
    "EngineClient": "engine.engine_client",
    "EngineProcess": "engine.core",
    "CoreSpec": "engine.core",
    "EngineConfig": "config",
    "GenerationRequest": "requests",
    "RequestError": "requests",
    "RequestParams": "requests",
    "Status": "status",
    "validate": "requests",
    "ServingMetrics": "metrics",
    "BackgroundServer": "api.server",
    "ServerConfig": "api.server",
    "SharpServer": "api.server",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'sharp.serving' has no attribute {name!r}")
    return getattr(import_module(f"sharp.serving.{_HOMES[name]}"), name)
