"""The engine core in its own process (engine/core.py): the same tokens as the model through both APIs, rows that
never disturb each other, cancellation and the queue limit kept on the server's side, a drain's deadline, the
core's crash reported to every waiting client (and sharp-serve exiting 1), and a pipe that unpickles nothing but
the classes it carries."""

from __future__ import annotations

import asyncio
import io
import os
import pickle
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
from helpers import scrape, start_sharp_serve

from sharp.serving import Client
from sharp.serving.api.server import BackgroundServer, ServerConfig
from sharp.serving.config import EngineConfig
from sharp.serving.engine.core import CoreSpec, EngineProcess, _Unpickler
from sharp.serving.engine.output import Delta, Failed, Finished
from sharp.serving.requests import RequestError, RequestParams, validate
from sharp.serving.stats import StepStats
from sharp.serving.status import Status
from sharp.v1 import generator_pb2 as pb


def _engine(model_files, **config) -> EngineProcess:
    return EngineProcess(CoreSpec(str(model_files["onnxruntime"]), config=EngineConfig(**config), entropy="head"))


def _request(engine, prompt: str, n: int, **kw):
    return validate(RequestParams(prompt=prompt, max_new_tokens=n, temperature=0, **kw), engine.limits,
                    engine.tokenizer.encode)  # fmt: skip


def _collect(engine, req) -> tuple[list, threading.Event]:
    """Submit `req`; its events (from the pipe's thread) go into the list; the event is set at its last one."""
    events, ended = [], threading.Event()

    def sink(ev):
        events.append(ev)
        if not isinstance(ev, Delta):
            ended.set()

    return events, ended, engine.submit(req, sink)


def _tokens(events) -> list[int]:
    return [t for ev in events if isinstance(ev, Delta) for t in ev.token_ids]


def _wait(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_grpc_and_http_answer_the_models_tokens_with_rows_side_by_side(model_files, reference):
    """Eight streams at once through gRPC and the OpenAI API, each equal to the model's greedy tokens; the
    server's metrics count what the core's steps did (tokens, per-head entropy, outcomes)."""
    engine = _engine(model_files, max_batch=8)
    config = ServerConfig(port=0, metrics_port=0, http_port=0)
    with BackgroundServer(engine, config) as srv, Client(srv.target) as c:
        assert f"attention: {c.info().attention}" == engine.attention  # the field says it once
        prompts = [f"row {i}: " + "xyz" * i for i in range(8)]
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            if i % 2:  # its text, compared below with the same prompt's alone through gRPC
                oa = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server.http_port}/v1", api_key="x", max_retries=0)
                results[i] = oa.completions.create(model="tiny", prompt=prompts[i], max_tokens=30, temperature=0)
            else:
                results[i] = [t for ch in c.generate_stream(prompts[i], max_new_tokens=30, temperature=0)
                              for t in ch.token_ids]  # fmt: skip

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, prompt in enumerate(prompts):
            ids = c.tokenize(prompt, add_bos=True)
            if i % 2:
                alone = c.generate(prompt, max_new_tokens=30, temperature=0)
                assert list(alone.token_ids) == reference(ids, 30) and results[i].choices[0].text == alone.text, i
            else:
                assert results[i] == reference(ids, 30), i
        families = scrape(srv)
        tokens = sum(s.value for s in families["sharp_generation_tokens"].samples if s.name.endswith("_total"))
        assert tokens == 12 * 30
        entropy = families["sharp_attention_entropy_nats"].samples
        assert sum(s.value for s in entropy if s.name.endswith("_count")) > 0
        ok = [s.value for s in families["sharp_requests"].samples if s.labels.get("status") == "ok"]
        assert sum(ok) == 12
        assert engine.idle()


def test_queue_limit_draining_and_cancel_are_kept_on_the_servers_side(model_files, reference):
    engine = _engine(model_files, max_queue=2, max_batch=1)
    try:
        first = _collect(engine, _request(engine, "first", 400))
        second = _collect(engine, _request(engine, "second", 5))
        with pytest.raises(RequestError) as refused:  # not started: all are waiting, and the limit is 2
            engine.submit(_request(engine, "third", 5), lambda ev: None)
        assert refused.value.code is Status.RESOURCE_EXHAUSTED and refused.value.transient
        engine.start()
        _wait(lambda: len(first[0]) >= 2)
        engine.cancel(first[2])  # a cancelled request frees its row: the second one runs
        assert second[1].wait(30) and isinstance(second[0][-1], Finished)
        ids = engine.tokenizer.encode("second")
        assert _tokens(second[0]) == reference(ids, 5)
        _wait(engine.idle)
        assert not first[1].is_set()  # a cancelled request gets no further answer
        engine.draining = True
        with pytest.raises(RequestError) as refused:
            engine.submit(_request(engine, "late", 5), lambda ev: None)
        assert refused.value.code is Status.UNAVAILABLE
    finally:
        engine.stop()


def test_end_all_ends_every_running_request_with_the_code_given(model_files):
    engine = _engine(model_files).start()
    try:
        runs = [_collect(engine, _request(engine, f"long {i}", 2000)) for i in range(3)]
        _wait(lambda: all(len(r[0]) >= 1 for r in runs))
        engine.end_all(Status.UNAVAILABLE, "the drain's deadline passed")
        for events, ended, _ in runs:
            assert ended.wait(30)
            assert events[-1] == Failed(Status.UNAVAILABLE, "the drain's deadline passed")
        _wait(engine.idle)
    finally:
        engine.stop()


def test_a_crashed_core_fails_every_waiting_request_and_refuses_new_ones(model_files):
    engine = _engine(model_files).start()
    exited = threading.Event()
    engine.on_exit(exited.set)
    try:
        runs = [_collect(engine, _request(engine, f"long {i}", 2000)) for i in range(3)]
        _wait(lambda: all(len(r[0]) >= 1 for r in runs))
        os.kill(engine._process.pid, signal.SIGKILL)
        assert exited.wait(30)
        for events, ended, _ in runs:
            assert ended.wait(5)
            assert isinstance(events[-1], Failed) and events[-1].code is Status.INTERNAL
            assert "engine process exited (code -9)" in events[-1].message
        assert engine.idle() and engine.exit_code == -9
        with pytest.raises(RequestError) as refused:
            engine.submit(_request(engine, "after", 5), lambda ev: None)
        assert refused.value.code is Status.UNAVAILABLE
    finally:
        engine.stop()


def _cores(pid: int) -> list[int]:
    """The engine processes among `pid`'s children (not multiprocessing's resource tracker)."""
    children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_sharp_serve_exits_1_when_its_engine_process_dies(model_files):
    """A stream waiting on a dead core ends with INTERNAL, not a hang; the server stops and exits 1."""
    proc, line = start_sharp_serve(model_files["onnxruntime"], "--engine-process", "on")
    try:
        port = re.search(r" on 127\.0\.0\.1:(\d+)", line).group(1)
        with Client(f"127.0.0.1:{port}") as c:
            stream = c.generate_stream("crash", max_new_tokens=3000, temperature=0)
            next(stream)
            (core,) = _cores(proc.pid)
            os.kill(core, signal.SIGKILL)
            with pytest.raises(Exception) as failed:
                list(stream)
            assert failed.value.code().name == "INTERNAL" and "engine process exited" in failed.value.details()
        assert proc.wait(timeout=30) == 1
        assert "the engine process exited (code -9); stopping" in proc.stderr.read()
    finally:
        proc.kill()


@pytest.mark.parametrize("flags", [("--engine-process", "off"), ()])  # auto: off on CPU
def test_sharp_serve_in_process_engine_still_serves(model_files, reference, flags):
    proc, line = start_sharp_serve(model_files["onnxruntime"], *flags)
    try:
        port = re.search(r" on 127\.0\.0\.1:(\d+)", line).group(1)
        assert _cores(proc.pid) == []
        with Client(f"127.0.0.1:{port}") as c:
            r = c.generate("in process", max_new_tokens=12, temperature=0)
            assert list(r.token_ids) == reference(c.tokenize("in process", add_bos=True), 12)
            assert r.finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        proc.kill()


def test_a_model_the_core_cannot_load_is_the_same_one_line_error(model_files, tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(Exception) as in_core:
        EngineProcess(CoreSpec(str(junk)))
    from sharp.serving.engine.core import build_engine

    with pytest.raises(Exception) as in_process:
        build_engine(CoreSpec(str(junk)))
    assert type(in_core.value) is type(in_process.value) and str(in_core.value) == str(in_process.value)


def test_the_pipe_unpickles_its_messages_and_nothing_else():
    st = StepStats(running=3, entropy=[(np.ones((2, 2, 2)), np.arange(2))])
    msg = ("step", st, [(1, Failed(Status.INTERNAL, "x")), (2, Delta([5], "a"))], [1])
    kind, got, events, ended = _Unpickler(io.BytesIO(pickle.dumps(msg, 5))).load()
    assert (kind, got.running, ended) == ("step", 3, [1]) and np.array_equal(got.entropy[0][0], np.ones((2, 2, 2)))
    assert events == msg[2] and events[0][1].code is Status.INTERNAL
    for bad in (os.system, eval, asyncio.run, pickle.loads):
        with pytest.raises(pickle.UnpicklingError):
            _Unpickler(io.BytesIO(pickle.dumps(bad))).load()
    dotted = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x12sharp.serving.engine.core\x8c\x0cpickle.loads\x93."
    with pytest.raises(pickle.UnpicklingError):
        _Unpickler(io.BytesIO(dotted)).load()


def test_a_model_with_a_tokenizer_json_crosses_the_pipe(chat_files, reference):
    """The spec the core sends back carries a `tokenizers` tokenizer (its pickle names the library's classes); a
    warm-up runs in the core."""
    engine = EngineProcess(CoreSpec(str(chat_files["onnxruntime"]), config=EngineConfig(prefill_chunk=32)))
    try:
        warm = engine.warm_up()  # run in the core, answered over the pipe, before the engine starts
        assert warm.prefill_chunks > 0 and warm.decode_steps > 0
        engine.start()
        assert type(engine.tokenizer).__name__ == "HFTokenizer"
        req = _request(engine, "hello", 8)
        events, ended, _ = _collect(engine, req)
        assert ended.wait(30) and isinstance(events[-1], Finished)
        assert _tokens(events) == reference(list(req.prompt_ids), 8)
    finally:
        engine.stop()


@pytest.mark.parametrize(
    "flags, apart",
    [
        ((), False),  # auto on CPU: the runtime's threads take every core; the hop would cost more than it frees
        (("--device", "cuda"), True),  # auto on a GPU: the model's time is the GPU's
        (("--engine-process", "on"), True),
        (("--device", "cuda", "--engine-process", "off"), False),
        (("--backend", "torch"), False),
    ],
)
def test_auto_runs_the_core_in_its_own_process_where_the_model_runs_on_a_gpu(model_files, monkeypatch, flags, apart):
    from sharp.serving import cli
    from sharp.serving.engine import core

    monkeypatch.setattr(core, "EngineProcess", lambda spec: ("process", spec))  # nothing is started or loaded
    monkeypatch.setattr(core, "build_engine", lambda spec: ("in process", spec))
    model = model_files["torch" if "torch" in flags else "onnxruntime"]
    (where, spec), _ = cli.build_server(cli.serve_parser().parse_args([str(model), *flags]))
    assert where == ("process" if apart else "in process") and spec.model == str(model)


KILLED_CLIENT = """
import sys
from sharp.serving import Client
with Client(sys.argv[1]) as c:
    # ignore_eos: a random-weight model's greedy answer can end within a few tokens, before its client is killed
    stream = c.generate_stream("gone " + sys.argv[2], max_new_tokens=4000, temperature=0, ignore_eos=True)
    for i, _ in enumerate(stream):
        if i == 1:
            print("two", flush=True)
"""


@pytest.mark.parametrize("core", ["off", "on"])
def test_clients_killed_mid_stream_are_each_counted_once_and_their_work_stops(model_files, core):
    """Client processes SIGKILLed after two streamed chunks: each request is counted exactly once (cancelled),
    within moments, and nothing of theirs runs on."""
    import subprocess
    import sys

    proc, line = start_sharp_serve(model_files["onnxruntime"], "--engine-process", core, "--metrics-port", "0")
    try:
        target = "127.0.0.1:" + re.search(r" on 127\.0\.0\.1:(\d+)", line).group(1)
        metrics = re.search(r"metrics (http://\S+/metrics)", line).group(1)
        kids = [subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, target, str(i)], stdout=subprocess.PIPE,
                                 text=True) for i in range(6)]  # fmt: skip
        for k in kids:
            assert k.stdout.readline().strip() == "two"
            k.send_signal(signal.SIGKILL)
            k.wait()
        deadline, counted = time.monotonic() + 20, {}
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(metrics, timeout=10).read().decode()
            counted = {
                m[0]: float(m[1])
                for m in re.findall(r'sharp_requests_total\{api="grpc"[^}]*status="(\w+)"\} (\S+)', text)
            }
            running = float(re.search(r"^sharp_running_requests\{[^}]*\} (\S+)", text, re.M).group(1))
            if sum(counted.values()) >= 6 and running == 0:
                break
            time.sleep(0.1)
        assert {k: v for k, v in counted.items() if v} == {"cancelled": 6.0} and running == 0
    finally:
        proc.kill()
