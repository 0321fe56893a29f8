"""Helpers shared by test modules (a test module never imports another one): servers on loopback and their
metrics, requests for an engine stepped by hand, stand-ins around a real backend, the OpenAI client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from sharp.serving import (
    BackgroundServer,
    Client,
    CoreSpec,
    Engine,
    EngineConfig,
    EngineProcess,
    ServerConfig,
    ServingMetrics,
    load_backend,
)
from sharp.serving.requests import RequestParams, validate


def greedy_request(eng: Engine, ids, n, **kw):
    """A validated greedy request for an engine stepped by hand."""
    return validate(RequestParams(input_ids=list(ids), max_new_tokens=n, temperature=0.0, **kw), eng.limits,
                    eng.tokenizer.encode)  # fmt: skip


def run_until_idle(eng: Engine, steps: int = 2000) -> None:
    for _ in range(steps):
        if eng.idle():
            return
        eng.step()
    raise AssertionError(f"the engine is still busy after {steps} steps")


@contextmanager
def serving(model_files, backend="onnxruntime", entropy="head", server: dict | None = None, names="sharp", **engine):
    be = load_backend(model_files[backend], backend)
    eng = Engine(be, EngineConfig(**engine), ServingMetrics(be.spec, entropy=entropy, names=names))
    with BackgroundServer(eng, ServerConfig(port=0, metrics_port=0, **(server or {}))) as srv:
        yield srv


def scrape(srv) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample_value(families, family, name, **labels) -> float:
    return sum(
        s.value
        for s in families[family].samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def free_port() -> int:
    """A port free now (another process may take it before it is bound again: tests that need it fixed accept that)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sharp_serve(model: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`sharp-serve MODEL --port 0 --metrics-port -1 FLAGS` in its own process, and its first stdout line."""
    cmd = [sys.executable, "-m", "sharp.serving.cli", str(model), "--port", "0", "--metrics-port", "-1", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ})
    return proc, proc.stdout.readline()


POISON = 255  # a prompt (of two or more ids) containing this id gets NaN logits from the wrapped backend


BREAKS_PREFILL, BREAKS_DECODE = 254, 253  # ... makes the wrapped backend raise in prefill, or in decode


class Wrapped:
    """A real backend whose graph forward goes through a stand-in that changes what it does (`inner` is the real
    forward); `backend` is the backend to serve."""

    def __init__(self, backend):
        self.backend, self.spec, self.inner = backend, backend.spec, backend.forward
        backend.forward, backend.stand_in = self.forward, self


class NaNForMarkedRows(Wrapped):
    """Wraps a real backend; a prompt that contains POISON gets NaN logits."""

    def forward(self, input_ids, attention_mask, position_ids, past, entropy, last=None, **kw):
        out = self.inner(input_ids, attention_mask, position_ids, past, entropy, last, **kw)
        for row in range(input_ids.shape[0]):
            if input_ids.shape[1] > 1 and (input_ids[row] == POISON).any():  # prompts only, never sampled ids
                out.logits[row] = float("nan")
        return out


class RaisesForMarkedRows(Wrapped):
    """Wraps a real backend. A prompt holding BREAKS_PREFILL makes its prefill raise; a prompt holding BREAKS_DECODE
    leaves NaN keys in its own cache, and any forward given such a cache raises, as a backend that checks its inputs
    would — so a decode batch holding that row fails as a whole."""

    def __init__(self, backend):
        super().__init__(backend)
        self.batch_failures = 0

    def forward(self, input_ids, attention_mask, position_ids, past, entropy, last=None, **kw):
        if input_ids.shape[1] > 1 and (input_ids == BREAKS_PREFILL).any():
            raise RuntimeError("prefill refused")
        if any(np.isnan(t).any() for t in past):
            self.batch_failures += input_ids.shape[0] > 1
            raise RuntimeError("non-finite keys in the cache")
        out = self.inner(input_ids, attention_mask, position_ids, past, entropy, last, **kw)
        if input_ids.shape[1] > 1:
            for row in range(input_ids.shape[0]):
                if (input_ids[row] == BREAKS_DECODE).any():
                    out.presents[0][row] = float("nan")
                    out.logits[row, self.spec.tokenizer.eos] = float("-inf")  # its first token never ends it
        return out


class SlowEndless(Wrapped):
    """Wraps a real backend: a prefill takes 0.3 s more (a short deadline expires before the first token) and the
    model never emits EOS (a stream runs until it is cancelled, never ending by chance)."""

    def forward(self, input_ids, *args, **kw):
        if input_ids.shape[1] > 1:
            time.sleep(0.3)
        out = self.inner(input_ids, *args, **kw)
        out.logits[:, self.spec.tokenizer.eos] = float("-inf")
        return out


class EosEveryFourth(Wrapped):
    """Wraps a real backend: at every fourth position of a decode step the model's end-of-sequence token is its
    most likely by a margin (the tiny model never picks it greedily on its own)."""

    def forward(self, input_ids, attention_mask, position_ids, *args, **kw):
        out = self.inner(input_ids, attention_mask, position_ids, *args, **kw)
        if input_ids.shape[1] == 1:
            for row in range(input_ids.shape[0]):
                if position_ids[row, -1] % 4 == 0:
                    out.logits[row, self.spec.tokenizer.eos] = out.logits[row].max() + 5
        return out


@contextmanager
def server(model_files, wrap=None, engine: dict | None = None, names="sharp", **config):
    """sharp-serve's server with the engine core in its own process, as sharp-serve runs it; with a stand-in
    (`wrap`) around the real backend, the engine in the test's process."""
    if wrap is None:
        config_ = EngineConfig(**(engine or {}))
        spec = CoreSpec(str(model_files["onnxruntime"]), config=config_, entropy="head", metric_names=names)
        eng = EngineProcess(spec)
    else:
        be = wrap(load_backend(model_files["onnxruntime"])).backend
        eng = Engine(be, EngineConfig(**(engine or {})), ServingMetrics(be.spec, entropy="head", names=names))
    with BackgroundServer(eng, ServerConfig(port=0, metrics_port=0, **config)) as srv:
        yield srv


class Bystander:
    """A greedy stream running beside the abuse; afterwards its tokens must equal the model's own."""

    def __init__(self, target: str, prompt: str, n: int):
        self.client, self.prompt, self.n = Client(target), prompt, n
        self.tokens: list[int] = []
        self.error: Exception | None = None
        self.started = threading.Event()  # its first tokens arrived: it is in the engine's batch
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            for chunk in self.client.generate_stream(self.prompt, max_new_tokens=self.n, temperature=0):
                self.tokens.extend(chunk.token_ids)
                self.started.set()
        except Exception as e:  # reported by check()
            self.error = e

    def __enter__(self) -> Bystander:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join(timeout=120)
        self.client.close()

    def check(self, reference) -> None:
        self.thread.join(timeout=120)
        assert self.error is None, self.error
        ids = self.client.tokenize(self.prompt, add_bos=True)
        assert self.tokens == reference(ids, self.n)


def _wait_idle(srv, timeout: float = 30) -> None:
    """Until the engine is empty and the step that emptied it has logged its record (no request running)."""
    end = time.monotonic() + timeout
    while not (srv.server.engine.idle() and _running(srv) == 0):
        assert time.monotonic() < end, "the engine never went idle"
        time.sleep(0.01)


HTTP = {"http_port": 0}


def api(srv, token: str = "none", scheme: str = "http", **kw) -> openai.OpenAI:
    base = f"{scheme}://127.0.0.1:{srv.server.http_port}/v1"
    return openai.OpenAI(base_url=base, api_key=token, max_retries=0, timeout=60, **kw)


def _log_softmax(model, ids: list[int]):
    """The model's own log-probabilities (positions, V) over `ids`, in PyTorch."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return torch.log_softmax(getattr(out, "logits", out).double(), -1)[0]


def _running(srv) -> float:
    return sample_value(scrape(srv), "sharp_running_requests", "sharp_running_requests")


# a tool's arguments whose every value is bounded: a random model's forced call ends within a few dozen tokens
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
