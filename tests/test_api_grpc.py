"""The gRPC server (serving/api/server.py, api/grpc_service.py) on loopback ports with real gRPC clients:
greedy text equal to the model's, batching, seeded sampling, refusals and their status codes, the queue, deadlines,
auth and TLS, health and draining, sharp-client. The served model is a small random SharpLM (exported once per
session) whose weights are drawn wide so that greedy tokens vary and top-2 logit gaps are wide: batched results are
compared token for token with `SharpLM.generate`, one sequence at a time."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from helpers import greedy_request, sample_value, scrape, serving
from prometheus_client.parser import text_string_to_metric_families

from sharp.models.tokenizer import BYTES
from sharp.serving import (
    Client,
    Engine,
    EngineConfig,
    ServerConfig,
    load_backend,
)
from sharp.serving.engine.output import Delta, Finished
from sharp.v1 import generator_pb2 as pb
from sharp.v1 import generator_pb2_grpc as pb_grpc

CONTEXT = 4096


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_generate_matches_the_model_and_streams_the_same_text(model_files, reference, backend):
    with serving(model_files, backend) as srv, Client(srv.target) as c:
        prompt = "def main():\n"
        r = c.generate(prompt, max_new_tokens=24, temperature=0, attention_stats=True)
        ids = c.tokenize(prompt, add_bos=True)
        assert f"attention: {c.info().attention}" == srv.server.engine.backend.attention  # the field says it once
        assert list(r.token_ids) == reference(ids, 24)
        assert len(set(r.token_ids)) > 3  # the check above is not about a constant sequence
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(r.token_ids)
        assert r.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
        stats = r.attention_stats
        assert stats.norm == "ssa" and len(stats.heads) == 4 and stats.positions == len(ids) + len(r.token_ids) - 1
        assert all(0 <= h.mean_normalized_entropy <= 1 and h.mean_entropy >= 0 for h in stats.heads)
        chunks = list(c.generate_stream(prompt, max_new_tokens=24, temperature=0))
        assert "".join(ch.text for ch in chunks) == r.text
        assert [t for ch in chunks for t in ch.token_ids] == list(r.token_ids)
        assert chunks[-1].finish_reason == r.finish_reason
        usage = chunks[-1].usage  # the same prompt again: all but its last token from the prefix cache
        assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)
        assert r.usage.cached_tokens == 0 and usage.cached_tokens == (len(ids) - 1 if backend != "torch" else 0)
        assert all(ch.finish_reason == pb.FINISH_REASON_UNSPECIFIED for ch in chunks[:-1])
        info = c.info()
        assert (info.norm, info.layers, info.heads, info.context_length) == ("ssa", 2, 2, CONTEXT)
        assert set(info.layer_info[0].parameters) == {"ssa_n", "ssa_b"}
        assert len(info.layer_info[0].parameters["ssa_n"].values) == 2


def test_32_concurrent_streams_complete_correctly_and_batch_together(model_files, reference):
    prompts = [f"item {i}: " + "x" * (i % 7) for i in range(32)]
    with serving(model_files, max_batch=32) as srv, Client(srv.target) as c:

        def run(p):
            chunks = list(c.generate_stream(p, max_new_tokens=16, temperature=0))
            return [t for ch in chunks for t in ch.token_ids], c.tokenize(p, add_bos=True)

        with cf.ThreadPoolExecutor(32) as ex:
            results = list(ex.map(run, prompts))
        for ids, prompt_ids in results:
            assert list(ids) == reference(prompt_ids, 16)
        m = scrape(srv)
        steps = sample_value(m, "sharp_batch_size", "sharp_batch_size_count")
        rows = sample_value(m, "sharp_batch_size", "sharp_batch_size_sum")
        assert rows / steps > 1, "decode steps should carry several sequences"
        assert sample_value(m, "sharp_batch_size", "sharp_batch_size_bucket", le="1.0") < steps
        assert sample_value(m, "sharp_requests", "sharp_requests_total", status="ok") == 32


def test_seeded_sampling_is_reproducible(model_files):
    with serving(model_files) as srv, Client(srv.target) as c:
        kw = dict(max_new_tokens=20, temperature=1.0, top_k=50, top_p=0.9)
        a, b = (c.generate("seed", seed=7, **kw).token_ids for _ in range(2))
        others = {tuple(c.generate("seed", seed=s, **kw).token_ids) for s in range(8, 12)}
        assert list(a) == list(b)
        assert len(others | {tuple(a)}) > 1


@pytest.mark.parametrize(
    ("kw", "code", "says"),
    [
        (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "empty prompt"),
        (dict(temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, ">= 0"),
        (dict(top_p=-0.1), grpc.StatusCode.INVALID_ARGUMENT, "[0, 1]"),
        (dict(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "[0, 1]"),
        (dict(top_k=-2), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        (dict(max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "[1, 1000]"),
        (dict(max_new_tokens=1001), grpc.StatusCode.INVALID_ARGUMENT, "[1, 1000]"),
        (dict(max_new_tokens=1001), grpc.StatusCode.INVALID_ARGUMENT, "--max-new-tokens-limit"),  # the flag named
        (dict(prompt=[300]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (dict(prompt="x" * 3500, max_new_tokens=1000), grpc.StatusCode.OUT_OF_RANGE, "context of 4096"),
        # written into log lines: a line feed would forge a whole access line, an escape recolour a terminal
        (dict(request_id="r1\nINFO sharp.access: forged"), grpc.StatusCode.INVALID_ARGUMENT, "request_id holds U+000A"),
        (dict(request_id="r1\x1b[31m"), grpc.StatusCode.INVALID_ARGUMENT, "request_id holds U+001B"),
        (dict(request_id="r1\r"), grpc.StatusCode.INVALID_ARGUMENT, "request_id holds U+000D"),
    ],
)
def test_bad_requests_get_their_status_and_the_server_stays_healthy(model_files, kw, code, says):
    with serving(model_files, max_new_tokens_limit=1000) as srv, Client(srv.target) as c:
        kw = {"prompt": "ok", **kw}
        for call in (c.generate, lambda **k: list(c.generate_stream(**k))):
            with pytest.raises(grpc.RpcError) as err:
                call(**kw)
            assert err.value.code() == code
            assert says in err.value.details()
        assert c.generate("fine", max_new_tokens=3).usage.completion_tokens >= 1
        assert c.health() == "SERVING"
        status = code.name.lower()
        assert sample_value(scrape(srv), "sharp_requests", "sharp_requests_total", status=status) == 2


def test_queue_full_is_resource_exhausted_and_cancel_frees_the_slot(model_files):
    with serving(model_files, max_batch=1, max_queue=1) as srv, Client(srv.target) as c:
        long = c.generate_stream("long", max_new_tokens=3000, temperature=0)
        next(long), next(long)  # running
        queued = cf.ThreadPoolExecutor(1).submit(c.generate, "queued", max_new_tokens=5, temperature=0)
        deadline = time.time() + 10
        while sample_value(scrape(srv), "sharp_queue_size", "sharp_queue_size") < 1 and time.time() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            c.generate("one too many", max_new_tokens=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in err.value.details()
        assert not queued.done()
        long.cancel()
        assert queued.result(timeout=30).usage.completion_tokens >= 1  # started once the cancel freed the slot
        m = scrape(srv)
        assert sample_value(m, "sharp_requests", "sharp_requests_total", status="cancelled") == 1


def test_deadline_exceeded_frees_the_work(model_files):
    with serving(model_files) as srv, Client(srv.target, timeout=0.5) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate("slow", max_new_tokens=3000, temperature=0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.time() + 10
        while srv.server.engine.idle() is False and time.time() < deadline:
            time.sleep(0.01)
        assert srv.server.engine.idle()
        # counted when the step that dropped it publishes, a moment after the scheduler is idle
        while (
            cancelled := sample_value(scrape(srv), "sharp_requests", "sharp_requests_total", status="cancelled")
        ) < 1:
            assert time.time() < deadline
            time.sleep(0.01)
        assert cancelled == 1


def test_a_reader_that_falls_behind_gets_the_pending_text_in_one_delta(model_files, reference):
    be = load_backend(model_files["onnxruntime"])
    eng = Engine(be, EngineConfig()).start()
    ids = [256, *b"slow reader"]

    async def read() -> list[Delta]:
        events = eng.stream(greedy_request(eng, ids, 12))
        await asyncio.sleep(1.0)  # the engine produces every token meanwhile
        return [ev async for ev in events]

    try:
        events = asyncio.run(read())
    finally:
        eng.stop()
    deltas = [ev for ev in events if isinstance(ev, Delta)]
    assert isinstance(events[-1], Finished) and len(deltas) < 12
    assert [t for d in deltas for t in d.token_ids] == reference(ids, 12)
    assert "".join(d.text for d in deltas) == BYTES.decode(reference(ids, 12))


def test_auth_token_and_tls(model_files, tmp_path):
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    server = dict(auth_token="s3cret", tls_cert=cert.cert_chain_pems[0].bytes(), tls_key=cert.private_key_pem.bytes())
    with serving(model_files, server=server) as srv:
        root = ca.cert_pem.bytes()
        with Client(srv.target, root_cert=root) as anonymous:
            assert anonymous.health() == "SERVING"  # health is exempt
            with pytest.raises(grpc.RpcError) as err:
                anonymous.generate("x", max_new_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(anonymous.generate_stream("x", max_new_tokens=2))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(srv.target, token="s3cret", root_cert=root) as c:
            assert c.generate("x", max_new_tokens=2).usage.completion_tokens >= 1
        with Client(srv.target, token="s3cret") as plaintext, pytest.raises(grpc.RpcError):
            plaintext.info()  # a plaintext client cannot talk to the TLS port


def test_plaintext_health_port_behind_tls_answers_health_only_and_follows_the_drain(model_files):
    """What a kubelet's gRPC probe needs when the service port speaks TLS: health in plaintext, nothing else."""
    import trustme

    cert = trustme.CA().issue_cert("127.0.0.1")
    tls = dict(tls_cert=cert.cert_chain_pems[0].bytes(), tls_key=cert.private_key_pem.bytes(), health_port=0)
    with serving(model_files, server=tls) as srv:
        port = srv.server.health_port
        assert port and port != srv.server.port
        with Client(f"127.0.0.1:{port}") as probe:
            assert probe.health() == "SERVING" and probe.health("sharp.v1.Generator") == "SERVING"
            with pytest.raises(grpc.RpcError) as err:
                probe.info()
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # the model is not reachable in plaintext
            srv.drain()
            with pytest.raises(grpc.RpcError):  # stopped with the server: the probe fails, as it must
                probe.health()


def test_drain_in_process_health_and_unavailable(model_files):
    with serving(model_files, server=dict(drain_timeout=30)) as srv, Client(srv.target) as c:
        assert c.health() == "SERVING" and c.health("sharp.v1.Generator") == "SERVING"
        stream = c.generate_stream("draining", max_new_tokens=3000, temperature=0)
        next(stream)
        drainer = threading.Thread(target=srv.drain)
        drainer.start()
        deadline = time.time() + 10
        while c.health() == "SERVING" and time.time() < deadline:
            time.sleep(0.01)
        assert c.health("sharp.v1.Generator") == "NOT_SERVING"
        listed = c.health_stub.List(health_pb2.HealthListRequest(), timeout=10).statuses
        assert {v.status for v in listed.values()} == {health_pb2.HealthCheckResponse.NOT_SERVING} and len(listed) == 2
        with pytest.raises(grpc.RpcError) as err:
            c.generate("new", max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)
        assert rest[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED  # the in-flight call finished normally
        drainer.join(timeout=30)


def test_a_drain_deadline_ends_calls_with_a_status_that_says_so(model_files):
    """In-flight calls that outlive --drain-timeout end UNAVAILABLE with the reason (not gRPC's generic
    cancellation), counted once, and the engine is left empty."""
    with serving(model_files, server=dict(drain_timeout=0.3)) as srv, Client(srv.target) as c:
        stream = c.generate_stream("deadline", max_new_tokens=4000, temperature=0, stop=["never"])
        next(stream)
        srv.drain()
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "the server is draining: drain deadline reached before this request finished"
        assert srv.server.engine.idle() and srv.server.calls.inflight == 0
        from prometheus_client import generate_latest

        text = generate_latest(srv.server.engine.metrics.registry).decode()  # the endpoint stopped with the server
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert sample_value(families, "sharp_requests", "sharp_requests_total", status="unavailable") == 1


def test_sharp_client_commands(model_files, capsys, tmp_path):
    from sharp.serving.client_cli import client_main

    with serving(model_files) as srv:
        run = lambda *a, env=None: subprocess.run(
            [
                sys.executable,
                "-c",
                "import atexit, sys; atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr));"
                "from sharp.serving.client_cli import client_main; raise SystemExit(client_main())",
                "--target",
                srv.target,
                *a,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        health = run("health")
        assert health.stdout.strip() == "SERVING" and health.returncode == 0
        assert health.stderr.strip() == "False"  # the client never loads torch (it starts in a fraction of a second)
        srv._call(srv.server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
        health = run("health")  # a script or probe relies on the status, as with grpc_health_probe
        assert health.stdout.strip() == "NOT_SERVING" and health.returncode == 1
        srv._call(srv.server.health.set("", health_pb2.HealthCheckResponse.SERVING))
        info = run("info").stdout
        assert '"norm": "ssa"' in info and '"attention": "the native sharp::SharpAttention kernel' in info
        # the connection's flags also after the command, where users put them
        assert client_main(["health", "--target", srv.target, "--timeout", "30"]) == 0
        assert capsys.readouterr().out.strip() == "SERVING"
        r = run("generate", "hello", "--stream", "--max-new-tokens", "5", "--stats")
        assert r.returncode == 0 and "attention (ssa)" in r.stdout and "[finish: " in r.stderr
        bad = run("generate", "hello", "--top-p", "2")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
        # gRPC's C core logs only when asked: a tracer alone (as a shell may export) does not turn it on
        quiet = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"} | {"GRPC_TRACE": "api"}
        traced = run("health", env=quiet)
        assert traced.returncode == 0 and traced.stderr.strip() == "False", traced.stderr
        asked = run("health", env=quiet | {"GRPC_VERBOSITY": "INFO"})
        assert asked.returncode == 0 and "grpc_init" in asked.stderr
    # files the client cannot use: one line, exit 2, before any connection
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    (tmp_path / "token").write_text("two words\n")
    for flag, path, says in [
        ("--tls-ca", tmp_path / "ca.pem", "holds no PEM root certificate"),
        ("--auth-token-file", tmp_path / "token", "one word of printable ASCII"),
    ]:
        r = subprocess.run(
            [sys.executable, "-c", "from sharp.serving.client_cli import client_main; raise SystemExit(client_main())",
             "--target", "localhost:1", flag, str(path), "health"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


def test_ctrl_c_on_a_streamed_generate_ends_with_one_line_and_status_130(model_files, reference):
    # greedy, on a prompt whose answer does not reach eos soon: a sampled answer may end before the signal arrives
    assert BYTES.eos not in reference([BYTES.bos, *b"a long answer"], 1000)
    with serving(model_files, max_new_tokens_limit=4000) as srv:
        main = "from sharp.serving.client_cli import client_main; raise SystemExit(client_main())"
        # As from a terminal: a suite started in the background (`make test &`) ignores SIGINT, and a Python started
        # so keeps ignoring it, so the client would never see the Ctrl-C this test sends; the client puts Python's
        # own handler back first. (Not a preexec_fn: it makes subprocess fork rather than vfork, so gRPC's fork
        # handlers run in the child; one suite run here saw that child abort, status −6, "epoll_wait error".)
        code = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); " + main
        proc = subprocess.Popen(
            [sys.executable, "-c", code,
               "--target", srv.target, "generate", "a long answer", "--stream", "--max-new-tokens", "4000",
               "--temperature", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        if not proc.stdout.read(1):  # it is streaming; if not, say what the client said before it ended
            _, err = proc.communicate(timeout=60)
            pytest.fail(f"the client ended (status {proc.returncode}) before streaming a character: {err!r}")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "sharp-client: interrupted", err


def test_async_client(model_files):
    import asyncio

    from sharp.serving import AsyncClient

    async def go(target):
        async with AsyncClient(target) as c:
            unary = await c.generate("async", max_new_tokens=6, temperature=0)
            chunks = [ch async for ch in c.generate_stream("async", max_new_tokens=6, temperature=0)]
            return unary, chunks, await c.info(), await c.health(), await c.tokenize("ab")

    with serving(model_files) as srv:
        unary, chunks, info, health, ids = asyncio.run(go(srv.target))
    assert "".join(ch.text for ch in chunks) == unary.text
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens == 6
    assert (unary.usage.cached_tokens, chunks[-1].usage.cached_tokens) == (0, unary.usage.prompt_tokens - 1)
    assert info.norm == "ssa" and health == "SERVING" and ids == [97, 98]


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (dict(port=70000), "`port` must be in [0, 65535]"),
        (dict(health_port=-1), "`health_port` must be in [0, 65535]"),
        (dict(drain_timeout=math.inf), "`drain_timeout` must be a finite number"),
        (dict(port=5000, http_port=5000), "`http_port` 5000 is taken by `port`"),
        (dict(port=5000, metrics_port=5000, metrics_host="127.0.0.2"), None),  # another address: no clash
        (dict(http_host="0.0.0.0"), "`http_host` needs `http_port`"),
        (dict(tls_cert=b"pem"), "`tls_cert` and `tls_key` go together"),
    ],
)
def test_server_config_checks_itself_as_the_engine_config_does(model_files, config, says):
    """One check() per config: the CLI's refusals come from it (test above), and so do the API's."""
    from sharp.serving import SharpServer

    if says is None:
        ServerConfig(**config).check()
        return
    with pytest.raises(ValueError) as err:
        ServerConfig(**config).check()
    assert says in str(err.value)
    engine = Engine(load_backend(model_files["onnxruntime"]), EngineConfig())
    with pytest.raises(ValueError, match=re.escape(says)):
        SharpServer(engine, ServerConfig(**config))


def test_grpc_stays_at_the_grpc_edge():
    """The engine, request validation, the backends and the HTTP API speak `Status` and `RequestParams`, not gRPC:
    only the gRPC edge imports grpc or the proto's messages."""
    import ast

    edge = {"server.py", "client.py", "calls.py", "auth.py", "client_cli.py", "__init__.py"}
    root = Path(__file__).resolve().parents[1] / "serving"
    for path in sorted(root.glob("*.py")):
        if path.name in edge:
            continue
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m.split(".")[0] == "grpc" or m.startswith("sharp.v1") for m in imported), path.name


def test_every_public_name_of_sharp_serving_resolves():
    """The lazy map of sharp.serving (names imported on first use) points each name at the module that has it."""
    import sharp.serving

    for name in sharp.serving.__all__:
        getattr(sharp.serving, name)  # AttributeError when its home module lacks it


def test_an_access_line_is_one_line_whatever_its_request_id():
    """The access line escapes what is not printable, whichever way a request id reached it."""
    from sharp.serving.stats import RequestOutcome

    line = RequestOutcome("ok", "grpc", 0.5, "a\nINFO sharp.access: forged\x1b[0m").access_line()
    assert "\n" not in line and "\x1b" not in line and line.startswith("a\\nINFO sharp.access: forged\\x1b[0m grpc ok")


def test_calls_whose_deadline_passes_before_their_message_is_read_are_counted(model_files):
    """A call that waits for a busy event loop past its deadline never reaches a handler (gRPC ends it before its
    message is read): counted `cancelled` all the same, when gRPC lets go of it — and a call that was served is
    not counted twice."""
    import gc

    with serving(model_files) as srv:
        channel = grpc.insecure_channel(srv.target)
        stub = pb_grpc.GeneratorStub(channel)
        request = pb.GenerateRequest(prompt="x", max_new_tokens=2)
        stub.Generate(request, timeout=30)
        cancelled = lambda: sample_value(scrape(srv), "sharp_requests", "sharp_requests_total", status="cancelled")
        before = cancelled()
        srv.loop.call_soon_threadsafe(time.sleep, 1.5)  # the server's event loop busy: nothing is read meanwhile
        unary = [stub.Generate.future(request, timeout=0.3) for _ in range(6)]
        streams = [stub.GenerateStream(request, timeout=0.3) for _ in range(2)]
        codes = [call.exception().code() for call in unary]
        for call in streams:
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            codes.append(err.value.code())
        assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 8
        deadline = time.monotonic() + 10
        while cancelled() < before + 8 and time.monotonic() < deadline:
            srv.loop.call_soon_threadsafe(gc.collect)
            time.sleep(0.1)
        assert cancelled() == before + 8
        stub.Generate(request, timeout=30)  # served: counted ok, and never again as unread
        srv.loop.call_soon_threadsafe(gc.collect)
        time.sleep(0.3)
        assert cancelled() == before + 8
        assert sample_value(scrape(srv), "sharp_requests", "sharp_requests_total", status="ok") == 2
        channel.close()
