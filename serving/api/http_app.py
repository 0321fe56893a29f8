"""The HTTP server's plumbing under the OpenAI-compatible API: aiohttp's runner whose connection handler answers what
its parser refuses in OpenAI's error shape, the timeouts, TLS from PEM bytes, a client that left."""

from __future__ import annotations

import dataclasses
import logging
import os
import ssl
import tempfile
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from sharp.serving.api.errors import APIError

log = logging.getLogger("sharp.serving")

JSON_EXPANSION = 6  # a body may spell each prompt character as a \uXXXX escape
PARSE_OFF_LOOP = 1 << 16  # bytes: a larger body is parsed in a worker thread (the loop serves every stream)
SHUTDOWN_SECONDS = 5.0  # after a drain, what open connections get to close


@dataclasses.dataclass(frozen=True)
class HTTPTimeouts:
    """How long a connection may idle between requests, and how long a request's body may take to arrive."""

    keepalive: float = 75.0
    body: float = 30.0


DEFAULT_TIMEOUTS = HTTPTimeouts()


class _Handler(RequestHandler):
    """aiohttp's connection handler, answering a request its parser refuses (malformed framing, bad method, a
    header too long) in OpenAI's JSON error shape, without echoing the offending bytes, logged as one line."""

    def handle_error(self, request, status=500, exc=None, message=None):
        if exc is not None and client_gone(exc):  # a write to a client that has left (aiohttp's own reset error)
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


class Runner(web.AppRunner):
    """aiohttp's AppRunner whose server's connections get `_Handler`."""

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server, whose connections get _Handler
        return server


def client_gone(e: BaseException) -> bool:
    return isinstance(e, ConnectionResetError | ConnectionAbortedError | BrokenPipeError)


def too_large(e: web.HTTPException) -> str:
    return f"request body too large: {e.text or e.reason}"


def ssl_context(cert: bytes, key: bytes) -> ssl.SSLContext:
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
