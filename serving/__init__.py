"""sharp.serving — the engine (continuous batching, chunked prefill, KV budget), the onnxruntime and torch
backends, the gRPC server with entropy metrics, and its clients."""

from sharp.serving.backends import BACKENDS, Backend, BackendError, ModelSpec, load_backend
from sharp.serving.client import AsyncClient, Client, make_request
from sharp.serving.engine import Engine, EngineConfig, GenerationRequest, RequestError
from sharp.serving.metrics import ServingMetrics
from sharp.serving.server import BackgroundServer, ServerConfig, SharpServer

__all__ = [
    "BACKENDS",
    "AsyncClient",
    "Backend",
    "BackendError",
    "BackgroundServer",
    "Client",
    "Engine",
    "EngineConfig",
    "GenerationRequest",
    "ModelSpec",
    "RequestError",
    "ServerConfig",
    "ServingMetrics",
    "SharpServer",
    "load_backend",
    "make_request",
]
