"""Every command that reads a model, fed what careless and hostile users feed it: random bytes, truncated files,
configs and metadata with wrong types and impossible values, bad paths and bad options. Each case must exit 2
with one line on stderr, never a traceback, and never change an input file."""

from __future__ import annotations

import copy
import hashlib
import json
import random
import socket
from pathlib import Path

import onnx
import pytest
import torch

from sharp.exporter.cli import main as export_main
from sharp.exporter.export import ExportSettings, export_model
from sharp.models import ModelConfig, SharpLM, save
from sharp.serving.cli import serve_main

CONFIG_VALUES = {  # field → values that must be refused
    "vocab_size": [0, -1, "258", 2.5, None, True, 10**12],
    "dim": [0, -16, 10**7, "16", 1.5],
    "layers": [0, -2, "1", None],
    "heads": [0, -2, 3, "2"],
    "kv_heads": [0.5, "2", 3],
    "context_length": [0, -5, "64", float("nan")],
    "norm": ["sparsemax", 7, None],
    "pos": ["rotary", 1],
    "rope_base": [0.0, -1.0, float("inf"), "x"],
    "ssmax_s": [float("nan")],
    "adaptive_poly": [[], [float("nan")], "abc", [1, "x"]],
    "layer_norms_override": [["ssa"], "ssa", [1, 2]],
    "mlp": ["relu"],
}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"


def _expect_usage_error(run, capsys, inputs: list[Path]) -> str:
    before = [_digest(p) for p in inputs]
    try:
        code = run()
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert [_digest(p) for p in inputs] == before
    return err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("fuzz")
    model = SharpLM(ModelConfig(dim=16, layers=1, heads=2, norm="ssmax", context_length=64))
    ckpt = save(model, d / "tiny.pt")
    onnx_path = d / "tiny.onnx"
    onnx.save(export_model(model, ExportSettings(norm="ssmax")), onnx_path)
    return {"pt": ckpt, "onnx": onnx_path, "dir": d}


def _payload(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_broken_checkpoints(tiny, tmp_path, capsys):
    rng = random.Random(0)
    good = tiny["pt"].read_bytes()
    cases: list[tuple[str, bytes]] = [("empty", b""), ("text", b"hello, I am a model\n" * 50)]
    cases += [(f"random {n}", rng.randbytes(n)) for n in (1, 100, 10_000)]
    cases += [(f"truncated at {f}", good[: int(len(good) * f)]) for f in (0.1, 0.5, 0.9, 0.999)]
    payload = _payload(tiny["pt"])
    for field, values in CONFIG_VALUES.items():
        for value in values:
            bad = copy.deepcopy(payload)
            bad["config"][field] = value
            cases.append((f"config.{field}={value!r:.20}", _saved(bad, tmp_path)))
    for key, value in (("config", [1, 2]), ("state_dict", [1]), ("config", None), ("format", "other"), ("version", 99)):
        bad = copy.deepcopy(payload)
        bad[key] = value
        cases.append((f"{key}={value!r}", _saved(bad, tmp_path)))
    bad = copy.deepcopy(payload)
    bad["config"]["vocab_size"] = 512  # a config that lies about its weights
    cases.append(("lying vocab", _saved(bad, tmp_path)))
    ran = 0
    for name, data in cases:
        path = tmp_path / "case.pt"
        path.write_bytes(data)
        out = tmp_path / "case.onnx"
        _expect_usage_error(lambda p=path, o=out: export_main([str(p), "-o", str(o), "--no-check"]), capsys, [path])
        assert not out.exists(), name
        _expect_usage_error(lambda p=path: serve_main([str(p), "--backend", "torch", "--port", "0"]), capsys, [path])
        ran += 2
    assert ran >= 100


def _saved(payload: dict, tmp_path: Path) -> bytes:
    path = tmp_path / "payload.pt"
    torch.save(payload, path)
    return path.read_bytes()


def test_broken_onnx_metadata(tiny, tmp_path, capsys):
    proto = onnx.load(tiny["onnx"])
    meta = json.loads(proto.metadata_props[0].value)
    variants = [
        "{not json",
        "[]",
        json.dumps({**meta, "schema": 99}),
        json.dumps({k: v for k, v in meta.items() if k != "layers"}),
        json.dumps({**meta, "config": {**meta["config"], "heads": 0}}),
        json.dumps({**meta, "config": {**meta["config"], "vocab_size": 100_000}}),  # larger than the graph's
        json.dumps({**meta, "config": {**meta["config"], "layers": 3}}),
        json.dumps({**meta, "layers": [{"norm": "ssmax", "parameters": {"ssmax_s": ["x", "y"]}}]}),
        json.dumps({**meta, "tokenizer": {"kind": "sentencepiece"}}),
        json.dumps({**meta, "export": {**meta["export"], "kv_cache": False}}),
    ]
    for i, text in enumerate(variants):
        bad = onnx.ModelProto()
        bad.CopyFrom(proto)
        bad.metadata_props[0].value = text
        path = tmp_path / f"bad{i}.onnx"
        onnx.save(bad, path)
        err = _expect_usage_error(lambda p=path: serve_main([str(p), "--port", "0"]), capsys, [path])
        assert str(path) in err
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(random.Random(1).randbytes(5000))
    _expect_usage_error(lambda: serve_main([str(junk), "--port", "0"]), capsys, [junk])


def test_export_never_overwrites_its_input_and_checks_paths_first(tiny, tmp_path, capsys):
    ckpt = tmp_path / "v.pt"
    ckpt.write_bytes(tiny["pt"].read_bytes())
    err = _expect_usage_error(lambda: export_main([str(ckpt), "-o", str(ckpt)]), capsys, [ckpt])
    assert "is the input" in err
    err = _expect_usage_error(lambda: export_main([str(ckpt), "-o", str(tmp_path)]), capsys, [ckpt])
    assert "is a directory" in err
    _expect_usage_error(lambda: export_main([str(ckpt), "-o", str(tmp_path / "no" / "x.onnx")]), capsys, [ckpt])
    for args in (["--norm", "adaptive", "--poly", "nan", "1"], ["--norm", "ssmax", "--ssmax-s", "inf"]):
        base = tmp_path / "sm.pt"
        save(SharpLM(ModelConfig(dim=16, layers=1, heads=2, context_length=64)), base)
        _expect_usage_error(
            lambda a=args, b=base: export_main([str(b), "-o", str(tmp_path / "o.onnx"), *a]), capsys, [base]
        )


def test_export_check_fails_on_nan_weights(tmp_path, capsys):
    model = SharpLM(ModelConfig(dim=16, layers=1, heads=2, context_length=64))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    ckpt = save(model, tmp_path / "nan.pt")
    assert export_main([str(ckpt), "-o", str(tmp_path / "nan.onnx")]) == 1
    assert "check FAILED" in capsys.readouterr().err


def test_serve_start_up_mistakes(tiny, tmp_path, capsys):
    import trustme

    model = str(tiny["onnx"])
    ca = trustme.CA()
    a, b = ca.issue_cert("127.0.0.1"), ca.issue_cert("127.0.0.1")
    files = {
        "cert": a.cert_chain_pems[0].bytes(),
        "key_a": a.private_key_pem.bytes(),
        "key_b": b.private_key_pem.bytes(),
        "garbage": b"-----BEGIN CERTIFICATE-----\nnot base64\n",
        "latin1": "tökén".encode("latin-1"),
        "empty": b"  \n",
    }
    paths = {k: tmp_path / k for k in files}
    for k, v in files.items():
        paths[k].write_bytes(v)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = [
            (["--port", str(port)], f"--port {port}: cannot listen on 127.0.0.1:{port}: port {port} is already in use"),
            (
                ["--port", "0", "--metrics-port", str(port)],
                f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}: port {port} is already in use",
            ),
            (["--port", "0", "--http-port", str(port)], f"--http-port {port}: cannot listen on 127.0.0.1:{port}"),
            (["--port", "5000", "--metrics-port", "5000"], "their own port"),
            (["--port", "0", "--host", "192.0.2.1"], "not an address of this machine"),
            (["--port", "0", "--kv-cache-mb", "inf"], "--kv-cache-mb"),
            (["--port", "0", "--kv-cache-mb", "nan"], "--kv-cache-mb"),
            (["--port", "0", "--max-batch", "0"], "--max-batch"),
            (["--port", "0", "--default-max-new-tokens", "9000"], "--default-max-new-tokens"),
            (["--port", "0", "--drain-timeout", "nan"], "--drain-timeout"),
            (["--port", "0", "--tls-cert", str(paths["cert"]), "--tls-key", str(paths["key_b"])], "private key"),
            (["--port", "0", "--tls-cert", str(paths["garbage"]), "--tls-key", str(paths["key_a"])], "PEM"),
            (["--port", "0", "--auth-token-file", str(paths["latin1"])], "ASCII"),
            (["--port", "0", "--auth-token-file", str(paths["empty"])], "empty"),
            (["--port", "0", "--auth-token-file", str(tmp_path / "missing")], "cannot read"),
            (["--port", "99999"], "--port"),
            (["--port", "0", "--entropy-metrics", "all"], "invalid choice"),
        ]
        for args, says in cases:
            err = _expect_usage_error(
                lambda a=args: (
                    serve_main([model, "--metrics-port", "-1", *a])
                    if "--metrics-port" not in a
                    else serve_main([model, *a])
                ),
                capsys,
                list(paths.values()),
            )
            assert says in err, (args, err)
