"""Warm-up before SERVING (serving/engine/warmup.py): the shapes it runs, the cache it leaves empty, the health it holds
at NOT_SERVING until done, and a failed warm-up that never serves."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

import pytest
import torch

from sharp.models import ModelConfig, SharpLM, load, save
from sharp.models.sampling import GREEDY
from sharp.serving import BackgroundServer, Client, Engine, EngineConfig, ServerConfig, load_backend
from sharp.serving.cli import serve_main
from sharp.serving.engine.warmup import WarmUpError, chunk_classes, schedule, warm_up

CHUNK = 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=258, dim=32, layers=2, heads=2, norm="ssa", context_length=600)
    model = SharpLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return save(model, tmp_path_factory.mktemp("warmup") / "warm.pt")


def test_chunk_classes_and_schedules_cover_every_row_and_key_class():
    assert chunk_classes(256) == [256, 128, 64, 32, 16, 8, 4, 2, 1]
    assert chunk_classes(100) == [100, 64, 32, 16, 8, 4, 2, 1]
    assert chunk_classes(1) == [1]
    for length in (598, 1024, 37):
        for rows in chunk_classes(CHUNK):
            sizes = schedule(length, CHUNK, rows)
            assert sum(sizes) == length and max(sizes) <= CHUNK
            ends = {sum(sizes[: i + 1]): n for i, n in enumerate(sizes)}
            powers = [1 << i for i in range(length.bit_length()) if rows <= 1 << i <= length]
            fits = length - rows >= (powers[-1] if powers and powers[-1] < length else 0)
            for end in powers + [length] * fits:
                assert ends[end] == rows, (length, rows, end)  # a chunk of `rows` ends at every key class


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_warm_up_runs_every_class_and_leaves_the_cache_empty(model_path, tmp_path, backend):
    path = model_path
    if backend == "onnxruntime":
        from sharp.exporter.export import ExportSettings, export_model

        path = tmp_path / "warm.onnx"
        path.write_bytes(export_model(load(model_path), ExportSettings(norm="ssa")).SerializeToString())
    be = load_backend(path, backend)
    be.allocate(64 * 2**20)
    prefills, decodes = [], []
    real_prefill, real_decode = be.prefill, be.decode
    be.prefill = lambda seq, ids, start, ent: (
        prefills.append((ids.shape[1], start, ent)) or real_prefill(seq, ids, start, ent)
    )
    be.decode = lambda seqs, tokens, ent: decodes.append((len(seqs), ent)) or real_decode(seqs, tokens, ent)
    report = warm_up(be, CHUNK)
    assert report.longest == 598 and report.prefill_chunks == len(prefills) and report.decode_steps == len(decodes)
    seen = {(n, start + n) for n, start, _ in prefills}
    for rows in chunk_classes(CHUNK):
        assert {(rows, 1 << i) for i in range(10) if rows <= 1 << i <= 598} | {(rows, 598)} <= seen
    assert {ent for *_, ent in prefills} == {True, False}
    assert set(decodes) == {(1, True), (1, False), (2, True), (2, False)}
    assert be.kv_usage() == 0
    if backend == "torch":
        assert not be.cache.tables and be.cache.allocator.free_pages == be.cache.allocator.num_pages


def test_health_is_not_serving_until_the_warm_up_ran(model_path):
    """Probes get NOT_SERVING while the model's shapes run (here held at the first chunk), then SERVING; the
    server then generates what the model generates."""
    be = load_backend(model_path, "torch")
    gate, entered = threading.Event(), threading.Event()
    real = be.prefill

    def held(seq, ids, start, ent):
        entered.set()
        gate.wait(30)
        return real(seq, ids, start, ent)

    be.prefill = held
    srv = BackgroundServer(Engine(be, EngineConfig(prefill_chunk=CHUNK)), ServerConfig(port=0, metrics_port=None,
                                                                                      warm_up=True))  # fmt: skip
    starter = threading.Thread(target=srv.__enter__)
    starter.start()
    try:
        assert entered.wait(30)
        with Client(f"127.0.0.1:{srv.server.port}", timeout=10) as c:
            assert c.health() == "NOT_SERVING" and c.health("sharp.v1.Generator") == "NOT_SERVING"
            gate.set()
            starter.join(60)
            assert c.health() == "SERVING" and srv.server.warm_up.prefill_chunks > 0
            be.prefill = real
            r = c.generate("warm", max_new_tokens=12, temperature=0)
            ids = c.tokenize("warm", add_bos=True)
            assert list(r.token_ids) == load(model_path).generate(list(ids), 12, GREEDY)
    finally:
        gate.set()
        starter.join(60)
        srv.stop()


def test_a_failed_warm_up_never_serves(model_path, monkeypatch, capsys):
    """The model fails on a warm-up shape: the server stops without reporting SERVING and sharp-serve says why in
    one line (exit 1)."""
    be = load_backend(model_path, "torch")

    def broken(seq, ids, start, ent):
        raise RuntimeError("PassManager::run failed")

    be.prefill = broken
    srv = BackgroundServer(Engine(be, EngineConfig()), ServerConfig(port=0, metrics_port=None, warm_up=True))
    with pytest.raises(WarmUpError, match="prefill of 256 tokens after 0 failed: RuntimeError: PassManager"):
        srv.__enter__()
    assert be.kv_usage() == 0

    def failing(backend, chunk):
        raise WarmUpError("prefill of 256 tokens after 0 failed: RuntimeError: out of memory")

    monkeypatch.setattr("sharp.serving.engine.engine.warm_up", failing)
    argv = [str(model_path), "--backend", "torch", "--port", "0", "--metrics-port", "-1", "--warm-up", "on"]
    assert serve_main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the server's own log lines
    assert err == "sharp-serve: warm-up failed, not serving: prefill of 256 tokens after 0 failed: RuntimeError: out" \
                  " of memory"  # fmt: skip


def test_sharp_serve_reports_its_warm_up_then_serves(model_path):
    """`--warm-up on` (auto turns it on for --device cuda): the warm-up's line, then the listening line."""
    cmd = [sys.executable, "-m", "sharp.serving.cli", str(model_path), "--backend", "torch", "--port", "0",
           "--metrics-port", "-1", "--warm-up", "on", "--prefill-chunk", str(CHUNK)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        steps = 2 * len(chunk_classes(CHUNK)) + 2
        want = rf"sharp-serve: warm-up \d+\.\d s \(\d+ prefill chunks, {steps} decode steps, sequences up to 598"
        want += r" tokens\)\n"
        assert re.fullmatch(want, first), first
        port = re.search(r" on 127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1)
        with Client(f"127.0.0.1:{port}", timeout=10) as c:
            assert c.health() == "SERVING"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
