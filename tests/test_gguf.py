"""GGUF files in: what sharp-export and sharp-serve refuse, with one line and exit 2, before any work (the real
model's GGUF read, exported and served: tests/test_real_model.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sharp.exporter.cli import main as export_main
from sharp.models import gguf


def _write_gguf(path: Path, arch: str) -> Path:
    """A small, valid GGUF of `arch` (one F32 tensor): what the refusals judge is the header."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((64, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _export(capsys, *args: str) -> tuple[int, list[str]]:
    code = export_main([*args])
    return code, capsys.readouterr().err.strip().splitlines()


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path, capsys):
    model = _write_gguf(tmp_path / "gemma.gguf", "gemma2")
    code, err = _export(capsys, str(model))
    assert code == 2 and len(err) == 1, err
    assert "architecture 'gemma2'" in err[0] and "llama, mistral, qwen2, qwen3" in err[0]
    assert not (tmp_path / "gemma.onnx").exists()


def test_a_truncated_gguf_is_refused(tmp_path, capsys):
    whole = _write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 1024])  # the header intact, the tensor's data cut
    code, err = _export(capsys, str(cut))
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"sharp-export: {cut}: not a complete GGUF file, truncated or corrupt")
    assert gguf.read_header(tmp_path / "whole.gguf").architecture == "llama"  # the same file whole is read


def test_a_file_named_gguf_that_is_not_one_is_refused(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    code, err = _export(capsys, str(fake))
    assert code == 2 and err == [f"sharp-export: {fake}: not a GGUF file (it does not start with the bytes GGUF)"]


def test_a_directory_holding_two_ggufs_asks_which(tmp_path, capsys):
    for name in ("a.gguf", "b.gguf"):
        _write_gguf(tmp_path / name, "llama")
    code, err = _export(capsys, str(tmp_path))
    assert code == 2 and len(err) == 1 and "holds 2 GGUF files (a.gguf, b.gguf)" in err[0]


def test_the_gguf_a_directory_holds_is_the_model(tmp_path):
    model = _write_gguf(tmp_path / "m.gguf", "llama")
    assert gguf.find(tmp_path) == model and gguf.find(model) == model
    (tmp_path / "config.json").write_text("{}")  # a Hugging Face directory is one, whatever else it holds
    assert gguf.find(tmp_path) is None


@pytest.mark.parametrize(
    ("arch", "backend", "says"),
    [
        ("qwen35", "onnxruntime", "sharp reads GGUF files of llama, mistral, qwen2, qwen3"),
        ("llama", "tensorrt", "a GGUF file; --backend tensorrt serves an engine"),
    ],
)
def test_sharp_serve_refuses_before_exporting(tmp_path, arch, backend, says):
    model = _write_gguf(tmp_path / "m.gguf", arch)
    env = {**os.environ, "SHARP_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "sharp.serving.cli", str(model), "--backend", backend, "--port", "0"]
    proc = subprocess.run([*cmd, "--metrics-port", "-1"], capture_output=True, text=True, env=env, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "cache").exists()  # refused from the header alone: nothing read, nothing exported


def test_a_busy_port_is_said_before_the_export_with_a_way_out(tmp_path):
    """A second sharp-serve on the default ports is told at once which flag's port is taken and how to choose
    another — not after minutes of exporting the model."""
    import socket

    model = _write_gguf(tmp_path / "m.gguf", "llama")  # would fail to export: the refusal must come first
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "SHARP_CACHE": str(tmp_path / "cache")}
        cmd = [sys.executable, "-m", "sharp.serving.cli", str(model), "--port", "0", "--http-port", str(port)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, err
    assert err[0].startswith(f"sharp-serve: --http-port {port}: cannot listen on 127.0.0.1:{port}: port {port} is")
    assert "or 0 for any free one" in err[0]
    assert not (tmp_path / "cache").exists()  # nothing exported
