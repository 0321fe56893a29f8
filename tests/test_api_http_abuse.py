"""Hostile HTTP traffic against real servers on loopback: compressed bodies (a gzip bomb), bytes that are not UTF-8
in headers, bodies that are not JSON, huge chat bodies, malformed framing, idle and slow connections — each answered
in OpenAI's JSON shape without a traceback, without inflating or parsing on the event loop, and without locking
Prometheus out; and grpc.health.v1 Watch, which gRPC's client-side health checking uses."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import threading
import time
import urllib.request
import zlib

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import HTTP, scrape, server, serving

from sharp.serving import Client
from sharp.serving.api import openai_api


def raw(port: int, head: bytes, body: bytes = b"", timeout: float = 30) -> tuple[int, dict, bytes]:
    """One request over a plain socket (headers exactly as given); (status, headers, body) of the answer. The
    server may close before the whole body is sent: what it answered is still read."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(head + b"\r\n" + body)
        data = b""
        while chunk := _recv(s):
            data += chunk
            if b"\r\n\r\n" in data:
                top, _, rest = data.partition(b"\r\n\r\n")
                fields = dict(line.decode().split(": ", 1) for line in top.split(b"\r\n")[1:] if b": " in line)
                length = int({k.lower(): v for k, v in fields.items()}.get("content-length", -1))
                if 0 <= length <= len(rest):
                    return int(top.split()[1]), fields, rest[:length]
        top, _, rest = data.partition(b"\r\n\r\n")
        return int(top.split()[1]), {}, rest
    finally:
        s.close()


def _recv(s: socket.socket) -> bytes:
    try:
        return s.recv(1 << 16)
    except ConnectionResetError:
        return b""


def post_head(path: str, length: int, *extra: bytes, content_type: bytes = b"application/json") -> bytes:
    lines = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: x", b"Content-Length: %d" % length, *extra]
    if content_type:
        lines.append(b"Content-Type: " + content_type)
    return b"\r\n".join(lines) + b"\r\n"


def _bomb(inflated: int) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    parts = [z.compress(b'{"model": "tiny", "prompt": "')]
    block = b"a" * (1 << 20)
    parts += [z.compress(block) for _ in range(inflated >> 20)]
    return b"".join(parts) + z.flush()


def test_a_gzip_bomb_is_refused_without_inflating_it(model_files, caplog):
    """A body that inflates to 256 MiB costs the server no more CPU than an identity body of its compressed size;
    the connection is closed rather than drained. Corrupt gzip gets the same answer."""
    bomb = _bomb(256 << 20)
    with server(model_files, **HTTP) as srv:
        port = srv.server.http_port

        def cpu_of(head: bytes, body: bytes) -> tuple[float, int, dict]:
            t = time.process_time()
            status, headers, answer = raw(port, head, body)
            if status == 415:  # refused unread: the connection closes instead of draining the body
                assert headers.get("Connection") == "close", headers
            return time.process_time() - t, status, json.loads(answer)

        plain = cpu_of(post_head("/v1/completions", len(bomb)), b"x" * len(bomb))
        gzip = cpu_of(post_head("/v1/completions", len(bomb), b"Content-Encoding: gzip"), bomb)
        corrupt = cpu_of(post_head("/v1/completions", 64, b"Content-Encoding: gzip"), b"\x1f\x8b" + b"\0" * 62)
        assert plain[1] == 400  # read and refused as JSON: the comparison's baseline did the work it should
        for _, status, body in (gzip, corrupt):
            assert status == 415 and body["error"]["code"] == "unsupported_content_encoding", body
        assert gzip[0] < 3 * plain[0] + 0.15, (gzip[0], plain[0])  # inflating 256 MiB takes ~0.5 s of CPU
        r = raw(port, post_head("/v1/completions", 0, b"Content-Encoding: identity", content_type=b""), b"")
        assert r[0] == 415  # identity is fine, but a body must say it is JSON
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize(
    ("header", "value"),
    [(b"Authorization", b"Bearer \xff\xfe"), (b"X-Request-Id", b"\xff\xfe"), (b"X-Anything", b"caf\xe9")],
)
def test_header_bytes_that_are_not_utf8_get_a_400_not_a_500(model_files, caplog, header, value):
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'
    with server(model_files, auth_token="s3cret", **HTTP) as srv:
        status, _, answer = raw(srv.server.http_port, post_head("/v1/completions", len(body), header + b": " + value),
                                body)  # fmt: skip
        error = json.loads(answer)["error"]
        assert status == 400 and error["code"] == "invalid_header", error
        assert header.decode().lower() in error["message"].lower(), error
        assert "\\x" not in error["message"] and "\ufffd" not in error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize(
    "content_type",
    [b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x", b""],
)
def test_only_json_bodies_are_read(model_files, content_type):
    """What a web page can send cross-site without a CORS preflight (text/plain, a form) never runs a generation."""
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'
    with server(model_files, **HTTP) as srv:
        port = srv.server.http_port
        status, _, answer = raw(port, post_head("/v1/completions", len(body), content_type=content_type), body)
        assert status == 415 and json.loads(answer)["error"]["code"] == "unsupported_media_type"
        ok = raw(port, post_head("/v1/completions", len(body), content_type=b"application/json; charset=utf-8"), body)
        assert ok[0] == 200
        m = scrape(srv)
        assert sum(s.value for s in m["sharp_requests"].samples if s.labels.get("status") == "ok") == 1


def test_big_chat_bodies_are_parsed_off_the_event_loop_and_hopeless_ones_not_at_all(model_files, monkeypatch):
    parsed_on_loop: list[bool] = []
    original = openai_api.ChatRequest.model_validate_json

    def spy(data, *a, **kw):
        try:
            asyncio.get_running_loop()
            parsed_on_loop.append(True)
        except RuntimeError:
            parsed_on_loop.append(False)
        return original(data, *a, **kw)

    monkeypatch.setattr(openai_api.ChatRequest, "model_validate_json", spy)
    with server(model_files, **HTTP) as srv:
        port = srv.server.http_port
        context = srv.server.engine.spec.context_length
        many = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * (context + 1)}
        body = json.dumps(many).encode()
        status, _, answer = raw(port, post_head("/v1/chat/completions", len(body)), body)
        assert status == 400 and "cannot fit the model's context" in json.loads(answer)["error"]["message"]
        assert parsed_on_loop == []  # refused before parsing
        big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
        small = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode()
        for body in (big, small):
            raw(port, post_head("/v1/chat/completions", len(body)), body)  # 400 (no chat template): parsed first
        assert parsed_on_loop == [False, True]  # the big one in a worker thread, the small one inline


def test_malformed_framing_gets_json_without_the_bytes_and_no_traceback(model_files, caplog):
    with server(model_files, **HTTP) as srv:
        port = srv.server.http_port
        for junk in (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n",
                     b"BR\xffKEN /x HTTP/1.1\r\nHost: x\r\n",
                     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"Content-Type: application/json\r\n\r\nzz\r\n"):  # fmt: skip
            status, headers, answer = raw(port, junk)
            error = json.loads(answer)["error"]
            assert status == 400 and error["message"] == "malformed HTTP request", answer
            assert headers.get("Content-Type", "").startswith("application/json")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_idle_keepalive_and_slow_bodies_time_out(model_files):
    with server(model_files, **HTTP, http_keepalive_timeout=0.5, http_body_timeout=0.5) as srv:
        port = srv.server.http_port
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in s.recv(4096)
        t = time.monotonic()
        assert s.recv(4096) == b""  # the idle keep-alive connection is closed by the server
        assert time.monotonic() - t < 10
        s.close()
        status, _, answer = raw(port, post_head("/v1/completions", 100), b'{"model":')  # 9 of 100 bytes, then silence
        assert status == 408 and json.loads(answer)["error"]["code"] == "request_timeout"


def test_scrapes_work_under_an_idle_and_slow_connection_flood(model_files):
    with server(model_files) as srv:
        port = srv.server.metrics_port
        before, rss = threading.active_count(), _rss()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
        slow = []
        for _ in range(50):  # ask for the page and never read it
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            slow.append(s)
        time.sleep(0.5)
        for _ in range(5):
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            assert "sharp_requests_total" in text
        workers = min(32, (os.cpu_count() or 1) + 4)  # the event loop's default executor renders the pages
        assert threading.active_count() <= before + workers < 350  # no thread per connection
        assert _rss() - rss < 64 << 20  # and no per-connection memory to speak of (each slow reader's page included)
        for s in idle + slow:
            s.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_client_that_leaves_mid_stream_is_no_error(model_files, caplog):
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 2000, "stream": true}'
    with server(model_files, **HTTP) as srv:
        s = socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=30)
        s.sendall(post_head("/v1/completions", len(body)) + b"\r\n" + body)
        received = b""
        while b"data: " not in received:  # the head may arrive in a read of its own, before the first event
            chunk = s.recv(4096)
            assert chunk, received
            received += chunk
        s.close()
        deadline = time.monotonic() + 30
        while srv.server.calls.inflight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.server.calls.inflight == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_a_write_to_a_departed_client_is_a_quiet_disconnect_not_a_500(caplog):
    """The race the test above can lose: the handler's write fails with aiohttp's own reset error, which reaches
    the connection handler's error hook; it must drop the connection quietly (INFO), never log an HTTP 500."""
    from types import SimpleNamespace

    from aiohttp import ClientConnectionResetError

    from sharp.serving.api.http_app import _Handler

    request = SimpleNamespace(remote="127.0.0.1", writer=SimpleNamespace(output_size=0))
    with caplog.at_level(logging.INFO, logger="sharp.serving"), pytest.raises(ConnectionError):
        _Handler.handle_error(None, request, 500, ClientConnectionResetError("Cannot write to closing transport"))
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "left" in caplog.records[0].getMessage()


def test_grpc_health_watch_streams_serving_then_not_serving_on_drain(model_files):
    with server(model_files) as srv:
        channel = grpc.insecure_channel(srv.target)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        drain = threading.Thread(target=srv.drain, daemon=True)
        drain.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        channel.close()
        drain.join(timeout=60)


def test_a_reset_mid_response_is_one_info_line_not_a_traceback(caplog):
    """When a write meets a closed connection (the race a cancelled handler does not always win), the error is
    the client's leaving: logged as one INFO line and handed back to aiohttp, which drops the connection."""
    from aiohttp.test_utils import make_mocked_request

    async def leaves(request):
        raise ConnectionResetError("Cannot write to closing transport")

    api = openai_api.OpenAIServer.__new__(openai_api.OpenAIServer)  # the middleware needs no engine
    request = make_mocked_request("POST", "/v1/completions")
    with caplog.at_level(logging.INFO, logger="sharp.serving"), pytest.raises(ConnectionResetError):
        asyncio.run(api._errors(request, leaves))
    assert [r.levelno for r in caplog.records] == [logging.INFO] and not caplog.records[0].exc_info


def test_more_choices_than_the_queue_holds_are_refused_once_and_never_told_to_retry(model_files):
    """n = 16 against --max-queue 12 can never be queued: a 400 naming n and the flag (not a 429 with Retry-After),
    counted once — over HTTP and gRPC alike."""
    with serving(model_files, server=HTTP, max_queue=12) as srv, Client(srv.target) as c:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 16}
        r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/completions", json=body, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and "Retry-After" not in r.headers, r.text
        assert error["param"] == "n" and "--max-queue" in error["message"] and "12" in error["message"]
        with pytest.raises(grpc.RpcError) as err:
            c.generate("x", max_new_tokens=2, n=16)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-queue" in err.value.details()
        m = scrape(srv)
        counted = collections.Counter()
        for s in m["sharp_requests"].samples:
            counted[s.labels["status"]] += s.value if s.name == "sharp_requests_total" else 0
        assert (
            counted.get("invalid_argument") == 2
            and not counted.get("cancelled")
            and not counted.get("resource_exhausted")
        ), counted
        assert (
            r.status_code == 400
            and httpx.post(
                f"http://127.0.0.1:{srv.server.http_port}/v1/completions", json=body | {"n": 12}, timeout=30
            ).status_code
            == 200
        )  # as many as the queue holds run


def test_a_schema_nested_past_the_parsers_limit_is_refused_for_its_depth(model_files):
    """A JSON schema 250 levels deep is refused naming its nesting and the limit, not as "not valid JSON"."""
    schema: dict = {"type": "object"}
    for _ in range(250):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}  # fmt: skip
    with serving(model_files, server=HTTP) as srv:
        r = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/chat/completions", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "nesting_too_deep" and "200 levels" in error["message"], r.text
