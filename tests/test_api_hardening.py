"""sharp-serve against hostile and careless clients: one request never disturbs another, every request ends with
exactly one status and is counted once, work per request is bounded, and the protocol surface is tight.

Real servers on loopback and real clients throughout; the only stand-ins are backend wrappers that make the model
emit NaN logits for, or raise on, one marked request (a broken model cannot be trained on purpose here).
"""

from __future__ import annotations

import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import (
    BREAKS_DECODE,
    BREAKS_PREFILL,
    POISON,
    Bystander,
    NaNForMarkedRows,
    RaisesForMarkedRows,
    SlowEndless,
    Wrapped,
    _wait_idle,
    sample_value,
    scrape,
    server,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sharp.serving import (
    Client,
)
from sharp.serving.engine.text import StopText
from sharp.v1 import generator_pb2 as pb


def test_nan_logits_end_only_that_request(model_files, reference):
    with server(model_files, wrap=NaNForMarkedRows) as srv, Client(srv.target) as c:
        with Bystander(srv.target, "bystander", 60) as b:
            assert b.started.wait(60)
            with pytest.raises(grpc.RpcError) as err:
                c.generate([256, 1, POISON, 2], max_new_tokens=20, temperature=0.8)
            assert err.value.code() == grpc.StatusCode.INTERNAL and "non-finite logits" in err.value.details()
            b.check(reference)
        after = c.generate("after", max_new_tokens=3, temperature=0.0)  # greedy: sampling may end at EOS early
        assert list(after.token_ids) == reference(c.tokenize("after", add_bos=True), 3)
        _wait_idle(srv)
        m = scrape(srv)
    assert sample_value(m, "sharp_requests", "sharp_requests_total", status="internal") == 1
    assert sample_value(m, "sharp_requests", "sharp_requests_total", status="ok") == 2
    assert sample_value(m, "sharp_running_requests", "sharp_running_requests") == 0


def test_a_model_failure_ends_only_the_rows_it_fails_on(model_files, reference):
    with server(model_files, wrap=RaisesForMarkedRows) as srv, Client(srv.target) as c:
        # 1,500 tokens: still running when the broken rows decode (a few steps later), however fast the engine
        with Bystander(srv.target, "bystander", 1500) as b:
            assert b.started.wait(60)
            for marker, where in ((BREAKS_PREFILL, "prefill"), (BREAKS_DECODE, "decode")):
                with pytest.raises(grpc.RpcError) as err:
                    c.generate([256, 1, marker, 2], max_new_tokens=20, temperature=0.8)
                assert err.value.code() == grpc.StatusCode.INTERNAL, err.value.details()
                assert f"the model failed on this request ({where}" in err.value.details()
            b.check(reference)
        assert srv.server.engine.backend.stand_in.batch_failures >= 1  # the broken row was decoded beside the bystander
        after = c.generate("after", max_new_tokens=3, temperature=0.0)  # greedy: sampling may end at EOS early
        assert list(after.token_ids) == reference(c.tokenize("after", add_bos=True), 3)
        _wait_idle(srv)
        m = scrape(srv)
    assert sample_value(m, "sharp_requests", "sharp_requests_total", status="internal") == 2
    assert sample_value(m, "sharp_requests", "sharp_requests_total", status="ok") == 2
    assert sample_value(m, "sharp_running_requests", "sharp_running_requests") == 0


class BlockingEncode:
    """Wraps the engine's tokenizer: encode() waits until released, holding a call before it reaches the engine."""

    def __init__(self, tokenizer):
        self.inner, self.entered, self.release = tokenizer, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        self.entered.set()
        self.release.wait(30)
        return self.inner.encode(text, bos=bos)


def test_a_call_cancelled_before_the_engine_is_counted_once(model_files):
    with server(model_files, engine={"max_prompt_bytes": 1 << 18}) as srv, Client(srv.target) as c:
        engine = srv.server.engine
        engine.tokenizer = blocker = BlockingEncode(engine.tokenizer)
        call = c.generate_stream("x" * (1 << 17), max_new_tokens=3)  # large: validated in a worker thread
        assert blocker.entered.wait(10)
        call.cancel()
        end = time.monotonic() + 10
        while sample_value(scrape(srv), "sharp_requests", "sharp_requests_total", status="cancelled") != 1:
            assert time.monotonic() < end, "the cancelled call was never counted"
            time.sleep(0.02)
        blocker.release.set()  # validation finishes after the cancel: nothing more may be counted or submitted
        time.sleep(0.2)
        assert engine.idle()
        m = scrape(srv)
    counted = {
        (s.labels["api"], s.labels["status"]): s.value
        for s in m["sharp_requests"].samples
        if s.name == "sharp_requests_total"
    }
    assert counted.pop(("grpc", "cancelled")) == 1
    assert set(counted.values()) == {0}, counted


def test_a_tiny_temperature_samples_greedily(model_files, reference):
    with server(model_files) as srv, Client(srv.target) as c:
        ids = c.tokenize("tiny", add_bos=True)
        r = c.generate("tiny", max_new_tokens=12, temperature=1e-38)
        assert list(r.token_ids) == reference(ids, 12)


ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED}
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 1e-38, 1e-45, -0.0, 1.0, 3.4e38]),
)
requests = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.text(max_size=300),
        "input_ids": st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(0, 300), max_size=50),
        "max_new_tokens": st.integers(-(2**31), 2**31 - 1) | st.integers(0, 8),
        "temperature": floats,
        "top_k": st.integers(-(2**31), 2**31 - 1) | st.integers(0, 300),
        "top_p": floats,
        "seed": st.integers(0, 2**64 - 1),
        "stop": st.lists(st.text(max_size=300), max_size=20),
        "return_attention_stats": st.booleans(),
        "request_id": st.text(max_size=200),
    },
)


def test_fuzzed_requests_get_a_status_and_never_disturb_a_bystander(model_files, reference):
    with (
        server(model_files, engine=dict(max_stop_length=64, max_stop_strings=8)) as srv,
        Client(srv.target, timeout=30) as c,
    ):
        codes: dict[str, int] = {}

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(requests)
        @example({"prompt": "an answer", "max_new_tokens": 2})  # both kinds always run, whatever is drawn
        @example({"prompt": "a refusal", "temperature": float("nan")})
        def one(fields):
            msg = pb.GenerateRequest(**fields)
            try:
                c.stub.Generate(msg, timeout=30)
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.RpcError as e:
                assert e.code() in ALLOWED, (e.code(), e.details(), fields)
                assert e.details() and "Traceback" not in e.details()
                codes[e.code().name] = codes.get(e.code().name, 0) + 1

        with Bystander(srv.target, "a bystander's prompt", 200) as b:
            one()
            b.check(reference)
        assert c.health() == "SERVING"
        _wait_idle(srv)
        m = scrape(srv)
    assert sum(codes.values()) >= 50 and len(codes) >= 2  # both answers and refusals were exercised
    counted = sample_value(m, "sharp_requests", "sharp_requests_total")
    assert counted == sum(codes.values()) + 1  # each fuzzed request and the bystander, once each
    assert sample_value(m, "sharp_running_requests", "sharp_running_requests") == 0
    assert sample_value(m, "sharp_queue_size", "sharp_queue_size") == 0


def test_stop_matching_is_linear_and_limits_are_enforced(model_files):
    s = StopText(("abcabd", "x" * 200))
    text = "".join(s.push(ch) for ch in "abcabcabd")
    assert text == "abc" and s.stopped  # KMP: the overlapping restart at "abc|abd" is found
    u = StopText(("aab",))
    assert "".join(u.push(ch) for ch in "aaaa") == "aa"  # "aa" may still become "aab"
    limits = dict(max_stop_strings=2, max_stop_length=8, max_prompt_bytes=100)
    with server(model_files, engine=limits) as srv, Client(srv.target) as c:
        for kw, says in (
            (dict(stop=["a", "b", "c"]), "--max-stop-strings"),
            (dict(stop=["x" * 9]), "--max-stop-length"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                c.generate("p", max_new_tokens=2, **kw)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.generate("é" * 60, max_new_tokens=2)  # 60 characters, 120 bytes
        assert "--max-prompt-bytes" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.generate(list(range(5000)), max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        info = c.info()
        assert (info.max_stop_strings, info.max_stop_length, info.max_prompt_bytes) == (2, 8, 100)
        big = pb.GenerateRequest(prompt="y" * (2 << 20))  # over the server's receive limit
        with pytest.raises(grpc.RpcError) as err:
            c.stub.Generate(big, timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_cancels_deadlines_and_killed_clients_leave_nothing_behind(model_files):
    threads_before = threading.active_count()
    with server(model_files, wrap=SlowEndless, engine=dict(max_queue=1024)) as srv:
        rss_after_first = None
        sent = 0
        for wave in range(3):
            killed = [
                subprocess.Popen(
                    [sys.executable, "-c", _STREAM_FOREVER, srv.target],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
                for _ in range(4)
            ]
            for p in killed:
                assert p.stdout.readline().strip() == b"streaming"  # it holds a running request
            with Client(srv.target) as c:
                calls = [c.generate_stream(f"wave {wave} {i}", max_new_tokens=3000) for i in range(6)]
                for call in calls:
                    next(call)
                for call in calls:
                    call.cancel()
                for i in range(6):
                    with pytest.raises(grpc.RpcError) as err:
                        Client(srv.target, timeout=0.2).generate(f"late {i}", max_new_tokens=3000)
                    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for p in killed:
                p.send_signal(signal.SIGKILL)
                p.wait()
            sent += 4 + 6 + 6
            _wait_idle(srv)
            m = scrape(srv)
            assert sample_value(m, "sharp_running_requests", "sharp_running_requests") == 0
            assert sample_value(m, "sharp_queue_size", "sharp_queue_size") == 0
            assert sample_value(m, "sharp_kv_cache_usage_ratio", "sharp_kv_cache_usage_ratio") == 0
            assert sample_value(m, "sharp_requests", "sharp_requests_total", status="cancelled") == sent
            assert sample_value(m, "sharp_requests", "sharp_requests_total") == sent
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            rss_after_first = rss_after_first or rss
        assert rss - rss_after_first < 200 * 1024  # KiB: no per-wave growth beyond noise
        assert threading.active_count() <= threads_before + 8  # the server's own threads, nothing per client


_STREAM_FOREVER = """
import sys
from sharp.serving.api.client import Client
c = Client(sys.argv[1])
for chunk in c.generate_stream("killed client", max_new_tokens=3000):
    print("streaming", flush=True)
    break
import time
time.sleep(600)
"""


def test_metrics_endpoint_bounds_idle_connections(model_files):
    with server(model_files) as srv:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", srv.server.metrics_port)) for _ in range(100)]
        time.sleep(0.5)
        assert threading.active_count() <= before + 8  # bounded handler threads, not one per connection
        for s in idle:
            s.close()
        end = time.monotonic() + 30
        while True:  # the held slots time out; then scraping works again
            try:
                assert "sharp_requests_total" in str(scrape(srv))
                break
            except Exception:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)


def test_protocol_surface(model_files):
    with server(model_files, auth_token="tok3n") as srv:
        channel = grpc.insecure_channel(srv.target)
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        meta = (("authorization", "bearer tok3n"),)  # the scheme is case-insensitive

        def ask(**req):
            return next(
                iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**req)]), metadata=meta))
            )

        listed = {s.name for s in ask(list_services="").list_services_response.service}
        assert listed == {"sharp.v1.Generator", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
        assert ask(file_containing_symbol="sharp.v1.Generator").HasField("file_descriptor_response")
        health = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert {k: v.status for k, v in health.statuses.items()} == {"": serving, "sharp.v1.Generator": serving}
        assert ask(file_containing_symbol="onnx.ModelProto").HasField("error_response")  # not every proto in process
        raw = channel.unary_unary("/sharp.v1.Generator/Generate", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\xff", metadata=meta, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Error" not in err.value.details()
        with Client(srv.target, token="wrong") as c, pytest.raises(grpc.RpcError) as err:
            c.info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(srv.target, token="tok3n") as c:
            assert c.info().name
        channel.close()


def test_status_series_exist_before_any_request(model_files):
    with server(model_files) as srv:
        m = scrape(srv)
    statuses = {s.labels["status"] for s in m["sharp_requests"].samples if s.name == "sharp_requests_total"}
    assert {"ok", "cancelled", "invalid_argument", "internal", "resource_exhausted"} <= statuses


class SleepyDecode(Wrapped):
    """Wraps a real backend: every decode forward (one new token per row) takes 10 ms more."""

    def forward(self, input_ids, *args, **kw):
        if input_ids.shape[1] == 1:
            time.sleep(0.01)
        return self.inner(input_ids, *args, **kw)


def test_the_engine_counts_decode_forwards_as_forward_time(model_files):
    """busy − forward is what sharp-bench serve reports as host overhead: a slow model must not show up there."""
    with server(model_files, SleepyDecode) as srv, Client(srv.target) as c:
        n = c.generate("sleepy", max_new_tokens=12, temperature=0).usage.completion_tokens
        m = scrape(srv)
    decodes = sample_value(m, "sharp_batch_size", "sharp_batch_size_count")
    forward = sample_value(m, "sharp_engine_forward_seconds", "sharp_engine_forward_seconds_total")
    assert decodes == n - 1 > 0
    assert forward >= 0.01 * decodes  # every sleep is inside the counted forwards (a lower bound, not a speed)
    assert sample_value(m, "sharp_engine_busy_seconds", "sharp_engine_busy_seconds_total") >= forward
