"""The sharp-serve command (serving/cli.py) as a process: signals and draining, JSON logs, usage errors, its flags
reaching the server, its help, and what an ONNX server never imports or parses."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from helpers import start_sharp_serve

from sharp.serving import (
    Client,
    load_backend,
)
from sharp.serving.backends.interface import BackendError
from sharp.v1 import generator_pb2 as pb


def test_sharp_serve_sigterm_drains_and_exits_0(model_files):
    proc, line = start_sharp_serve(model_files["onnxruntime"])
    try:
        port = re.search(r" on 127\.0\.0\.1:(\d+)", line).group(1)
        with Client(f"127.0.0.1:{port}") as c:
            stream = c.generate_stream("sigterm", max_new_tokens=600, temperature=0)
            next(stream)
            proc.send_signal(signal.SIGTERM)
            rest = list(stream)
            assert rest[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read()
        assert "draining" in out and "stopped" in out
    finally:
        proc.kill()


def test_an_onnx_server_never_imports_torch(model_files, tmp_path):
    """`sharp-serve MODEL.onnx` serves gRPC (with per-head stats), the OpenAI API and metrics without torch nor any
    torch-backed module of sharp: the interpreter's own import log (`-X importtime`, every module the process ever
    imports) is read after a drain."""
    log = tmp_path / "imports.txt"
    cmd = [sys.executable, "-X", "importtime", "-m", "sharp.serving.cli", str(model_files["onnxruntime"]),
           "--port", "0", "--metrics-port", "0", "--http-port", "0"]  # fmt: skip
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        port = re.search(r" on 127\.0\.0\.1:(\d+)", line).group(1)
        with Client(f"127.0.0.1:{port}") as c:
            reply = c.generate("lean", max_new_tokens=4, temperature=0.8, seed=1, attention_stats=True)
            assert len(reply.token_ids) == 4 and len(reply.attention_stats.heads) > 0
        api = re.search(r"OpenAI API (http://[\d.:]+/v1)", line).group(1)
        body = json.dumps({"model": "tiny", "prompt": "lean", "max_tokens": 3, "temperature": 0}).encode()
        request = urllib.request.Request(f"{api}/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            assert json.load(r)["usage"]["completion_tokens"] == 3
        metrics = re.search(r"metrics (http://\S+/metrics)", line).group(1)
        with urllib.request.urlopen(metrics, timeout=10) as r:
            assert b"sharp_attention_entropy" in r.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    imported = {m.group(1).strip() for m in re.finditer(r"^import time:.*\|\s*(\S+)\s*$", log.read_text(), re.M)}
    assert {"onnxruntime", "sharp.serving.engine.engine", "sharp.models.sampling"} <= imported  # the log is read right
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "triton", "transformers"))
    torch_backed = sorted(imported & {"sharp.models.lm", "sharp.models.normalizers", "sharp.models.attention"})
    assert heavy == [] and torch_backed == [], (heavy[:5], torch_backed)


def test_sharp_serve_logs_one_json_object_per_event_and_reports_its_attention(model_files):
    """`--log-format json`: every stderr line is one JSON object (a cluster's log collector needs no parser), the
    first says what runs the attention, and GetModelInfo reports the same."""
    cmd = [sys.executable, "-m", "sharp.serving.cli", str(model_files["onnxruntime"]), "--port", "0",
           "--metrics-port", "-1", "--log-format", "json"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = re.search(r" on 127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1)
        with Client(f"127.0.0.1:{port}") as c:
            attention = c.info().attention
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        lines = [json.loads(line) for line in proc.stderr.read().splitlines()]
    finally:
        proc.kill()
    assert re.fullmatch(r"the native sharp::SharpAttention kernel \(x86-64-v[234]\)", attention), attention
    first = lines[0]
    assert first["level"] == "info" and first["logger"] == "sharp.serving"
    assert first["message"] == f"tiny: fp32 weights, fp32 KV cache, prefix cache 256 MiB; attention: {attention}"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])


def test_a_second_signal_stops_the_drain(model_files):
    """SIGTERM starts a drain that would wait for a long stream; a second SIGTERM exits at once (status 1)."""
    cmd = [sys.executable, "-m", "sharp.serving.cli", str(model_files["onnxruntime"]), "--port", "0"]
    proc = subprocess.Popen([*cmd, "--metrics-port", "-1", "--drain-timeout", "600"], stdout=subprocess.PIPE, text=True)
    try:
        port = re.search(r" on 127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1)
        with Client(f"127.0.0.1:{port}") as c:
            stream = c.generate_stream("second signal", max_new_tokens=4000, temperature=0, stop=["never"])
            next(stream)
            proc.send_signal(signal.SIGTERM)
            assert proc.stdout.readline().strip() == "sharp-serve: draining"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["/nonexistent.onnx"], "no such file"),
        (["MODEL", "--tls-cert", "x.pem"], "--tls-cert and --tls-key go together"),
        (["MODEL", "--max-batch", "0"], "max-batch must be an integer >= 1"),
        (["MODEL.pt"], "export it with sharp-export"),
        (["MODEL", "--entropy-metrics", "all"], "invalid choice"),
        (["MODEL", "--served-model-name", "has space"], "--served-model-name 'has space': 1-128 characters"),
        (["MODEL", "--served-model-name", "a", "b", "a"], "--served-model-name names one id twice: a b a"),
        (["MODEL", "--served-model-name"], "expected at least one argument"),
        (["MODEL", "--health-port", "70000"], "--health-port must be in [0, 65535]"),
        (["MODEL", "--port", "5000", "--health-port", "5000"], "--health-port 5000 is taken"),
        (["MODEL", "--http-port", "70000"], "--http-port must be in [0, 65535]"),
        (["MODEL", "--port", "5000", "--http-port", "5000"], "--http-port 5000 is taken"),
        (["MODEL", "--http-host", "0.0.0.0"], "--http-host needs --http-port"),
        (["MODEL", "--dtype", "bf16"], "--dtype applies to --backend torch"),
        (["MODEL", "--sparse-decode"], "--sparse-decode applies to --backend torch, not onnxruntime"),
        (["MODEL.pt", "--backend", "torch", "--dtype", "fp8"], "invalid choice"),
        (["MODEL.pt", "--backend", "torch", "--kv-cache-mb", "0.0001"], "holds no page of 16 tokens"),
        (["MODEL", "--backend", "torch"], "an ONNX file; --backend torch serves a model.pt checkpoint"),
    ],
)
def test_sharp_serve_usage_errors_exit_2_with_one_line(model_files, args, says):
    args = [
        a.replace("MODEL.pt", str(model_files["torch"])).replace("MODEL", str(model_files["onnxruntime"])) for a in args
    ]
    r = subprocess.run([sys.executable, "-m", "sharp.serving.cli", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_sharp_serve_model_name_and_health_port_options_reach_the_server(model_files):
    from sharp.serving.cli import build_server, serve_parser

    args = serve_parser().parse_args(
        [str(model_files["onnxruntime"]), "--model-name", "prod-model", "--health-port", "0", "--port", "0"]
    )  # --model-name: the older spelling of --served-model-name, still taken (manifests written with it)
    engine, config = build_server(args)
    assert engine.spec.name == "prod-model" and config.health_port == 0
    assert engine.metrics.registry.get_sample_value("sharp_queue_capacity", {"model": "prod-model"}) == 256


def test_served_model_names_are_the_id_and_its_aliases_on_every_route(model_files):
    """vLLM's --served-model-name: the first id in replies and metrics, every id listed and accepted."""
    import httpx
    import openai
    from helpers import HTTP, api

    from sharp.serving.api.server import BackgroundServer
    from sharp.serving.cli import build_server, serve_parser

    args = serve_parser().parse_args([str(model_files["onnxruntime"]), "--served-model-name", "my-llama", "gpt-4o"])
    engine, config = build_server(args)
    assert engine.spec.names == ("my-llama", "gpt-4o")
    with BackgroundServer(engine, dataclasses.replace(config, port=0, metrics_port=0, **HTTP)) as srv:
        client = api(srv)
        assert [m.id for m in client.models.list()] == ["my-llama", "gpt-4o"]
        assert client.models.retrieve("gpt-4o").id == "gpt-4o"
        for name in ("my-llama", "gpt-4o"):
            assert client.completions.create(model=name, prompt="x", max_tokens=2).model == "my-llama"
        with pytest.raises(openai.NotFoundError, match="'tiny' is not served here"):
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        base = f"http://127.0.0.1:{srv.server.http_port}"
        assert httpx.get(f"{base}/v1/models/tiny").status_code == 404
    assert engine.metrics.registry.get_sample_value("sharp_queue_capacity", {"model": "my-llama"}) == 256


def test_sharp_serve_help_shows_the_defaults_the_engine_and_server_use(capsys):
    """One source per setting: every sharp-serve option that is an EngineConfig or ServerConfig field defaults to
    that field's default, and --help prints it."""
    from sharp.serving.api.server import ServerConfig
    from sharp.serving.cli import serve_parser
    from sharp.serving.config import EngineConfig

    ap = serve_parser()
    options = {a.dest for a in ap._actions} - {"warm_up"}  # auto|on|off, resolved into the field per --device
    shared = 0
    for config in (EngineConfig(), ServerConfig()):
        for f in dataclasses.fields(config):
            if f.name in options:
                assert ap.get_default(f.name) == getattr(config, f.name), f.name
                shared += 1
    assert shared >= 14
    with pytest.raises(SystemExit):
        ap.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"sequences decoded together (default: {EngineConfig.max_batch})" in text
    assert f"after SIGTERM (default: {ServerConfig.drain_timeout})" in text


def test_the_onnx_server_never_parses_the_graph_itself(model_files, tmp_path, monkeypatch):
    """sharp-serve reads a file's metadata by scanning its top-level fields; onnxruntime alone loads the graph and
    its weights (onnx.load would hold a second copy of every weight at start-up: +400 MiB of peak memory for a
    SmolLM2-sized model). The scan agrees with onnx.load, and refuses what is not an ONNX file."""
    import onnx

    from sharp.exporter import metadata

    path = model_files["onnxruntime"]
    full = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert metadata.file_properties(path) == full and metadata.KEY in full

    def no_load(*a, **kw):
        raise AssertionError("onnx.load called while loading a backend")

    monkeypatch.setattr(onnx, "load", no_load)
    monkeypatch.setattr(onnx, "load_model", no_load)
    be = load_backend(path)
    assert be.spec.metadata == metadata.parse(full[metadata.KEY], full.get(metadata.TOKENIZER_KEY))
    for name, data in (("empty.onnx", b""), ("junk.onnx", b"\xff" * 64), ("text.onnx", b"not a model at all\n")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(BackendError) as err:
            load_backend(tmp_path / name)
        assert str(tmp_path / name) in str(err.value)


def test_sparse_decode_reaches_the_torch_backend(tmp_path):
    """--sparse-decode turns on the torch backend's page-skipping decode for an entmax model (off by default)."""
    from sharp.models import ModelConfig, SharpLM, save
    from sharp.serving.cli import build_server, serve_parser

    save(SharpLM(ModelConfig(vocab_size=258, dim=32, layers=1, heads=2, norm="entmax")), tmp_path / "e.pt")
    for flag, on in (([], False), (["--sparse-decode"], True)):
        args = serve_parser().parse_args([str(tmp_path / "e.pt"), "--backend", "torch", "--port", "0", *flag])
        engine, _ = build_server(args)
        assert engine.backend.sparse is on and (engine.backend.cache.bounds is not None) is on
