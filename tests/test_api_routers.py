"""sharp-serve replicas behind the LLM routers users put in front of them — vllm-router and sglang-router, their
PyPI wheels (real Rust routers) on loopback — driven by the openai SDK: what the routers add to each request is
accepted, the endpoints they call answer, and a replica that dies or restarts under load loses no request that
was sent after the router could know."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from helpers import WEATHER, free_port

BIN = Path(sys.executable).parent
MODEL = "tiny"


def _router_command(kind: str, port: int, workers: list[str], policy: str) -> list[str]:
    exe = {"vllm": BIN / "vllm-router", "sglang": BIN / "sglang-router"}[kind]
    head = [str(exe)] if kind == "vllm" else [str(exe), "launch"]
    return [*head, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()), "--policy",
            policy, "--worker-urls", *workers, "--log-level", "warning" if kind == "vllm" else "warn",
            "--health-check-interval-secs", "1", "--worker-startup-timeout-secs", "60"]  # fmt: skip


class Replica:
    """One sharp-serve with its HTTP API on a fixed port (a restart comes back at the same address)."""

    def __init__(self, model: Path, log: Path):
        self.model, self.log, self.port, self.proc = model, log, free_port(), None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Replica:
        cmd = [sys.executable, "-m", "sharp.serving.cli", str(self.model), "--port", "0", "--metrics-port", "-1",
               "--http-port", str(self.port), "--metrics-names", "vllm", "--drain-timeout", "30"]  # fmt: skip
        # stderr to a file: the access log writes a line per request, and a pipe nobody reads fills and blocks it
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline()
        assert "OpenAI API" in line, line + self.log.read_text()[-2000:]
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Router:
    def __init__(self, kind: str, replicas: list[Replica], policy: str = "cache_aware"):
        self.kind, self.port = kind, free_port()
        cmd = _router_command(kind, self.port, [r.url for r in replicas], policy)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{kind}-router exited: {self.proc.stderr.read()[-2000:]}"
            try:
                if self.completion("ready", max_tokens=1).choices:
                    return
            except (openai.APIError, httpx.HTTPError):
                time.sleep(0.5)
        raise AssertionError(f"{kind}-router never routed a request")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60, **kw)

    def completion(self, prompt: str, **kw):
        return self.client().completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def replicas(chat_files, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    started = [Replica(chat_files["onnxruntime"], logs / f"{i}.log") for i in range(2)]
    try:
        yield [r.start() for r in started]
    finally:
        for r in started:
            r.stop()


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def router(request, replicas):
    r = Router(request.param, replicas)
    yield r
    r.stop()


def direct(replica: Replica) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{replica.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_the_openai_sdk_works_unchanged_through_the_router(router, replicas):
    """Completions, chat, their streams and logprobs: through the router (which adds its extension fields to
    every request) the same answer as from a replica directly."""
    via, alone = router.client(), direct(replicas[0])
    ask = {"model": MODEL, "prompt": "The router", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    got, want = via.completions.create(**ask), alone.completions.create(**ask)
    assert got.choices[0].text == want.choices[0].text and got.choices[0].finish_reason == "length"
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert got.usage.completion_tokens == 12
    streamed = "".join(c.choices[0].text for c in via.completions.create(**ask, stream=True) if c.choices)
    assert streamed == want.choices[0].text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10, "temperature": 0}
    got, want = (
        via.chat.completions.create(**chat, logprobs=True, top_logprobs=2),
        alone.chat.completions.create(**chat),
    )
    assert got.choices[0].message.content == want.choices[0].message.content
    assert len(got.choices[0].logprobs.content) == 10 and len(got.choices[0].logprobs.content[0].top_logprobs) == 2
    chunks = list(via.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10


def test_what_agents_send_passes_through_the_router(router, replicas):
    """Structured outputs, a forced tool call and the Responses API (plain and streamed) through the router: the
    same answers as from a replica directly (greedy: either replica gives them)."""
    via, alone = router.client(), direct(replicas[0])
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": WEATHER, "strict": True}}
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "json"}], "temperature": 0, "max_tokens": 40}
    got, want = (c.chat.completions.create(**ask, response_format=fmt) for c in (via, alone))
    assert got.choices[0].message.content == want.choices[0].message.content
    jsonschema.validate(json.loads(got.choices[0].message.content), WEATHER)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "a forecast", "parameters": WEATHER}}
    got, want = (c.chat.completions.create(**ask | {"max_tokens": 200}, tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False) for c in (via, alone))  # fmt: skip
    assert got.choices[0].finish_reason == "tool_calls" and got.choices[0].message.tool_calls[0].function.name == (
        "get_weather"
    )
    call, wanted = got.choices[0].message.tool_calls[0].function, want.choices[0].message.tool_calls[0].function
    assert call.arguments == wanted.arguments and jsonschema.validate(json.loads(call.arguments), WEATHER) is None
    asked = {"model": MODEL, "input": "tell", "max_output_tokens": 16, "temperature": 0}
    if router.kind == "sglang":  # it rewrites every Responses body with store: true, which a stateless server refuses
        with pytest.raises(openai.BadRequestError) as refused:
            via.responses.create(**asked)
        assert refused.value.body["param"] == "store", refused.value.body
        return
    got, want = via.responses.create(**asked), alone.responses.create(**asked)
    assert got.output_text == want.output_text and got.status == want.status
    events = list(via.responses.create(**asked, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.output_text
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_a_conversation_stays_on_the_replica_that_holds_its_prefix(router):
    """Cache-aware routing (both routers' default) sends each turn of a conversation to the replica whose prefix
    cache holds the transcript so far: every later turn finds all of its previous prompt cached."""
    client, transcript, previous = router.client(), "A long document about routers. " * 12, None
    for turn in range(4):
        transcript += f"\nQ{turn}: what next?\nA:"
        r = client.completions.create(model=MODEL, prompt=transcript, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        cached = r.usage.prompt_tokens_details.cached_tokens
        if previous is not None:
            assert cached >= previous, (turn, cached, previous)
        previous = r.usage.prompt_tokens
        transcript += r.choices[0].text


def test_the_probes_a_router_sends_are_answered(replicas):
    """sglang-router's server and model information, vLLM's render endpoints, the load poll of power-of-two."""
    base = replicas[0].url
    info = httpx.get(f"{base}/server_info").json()
    assert info["model_path"] == MODEL and info["vllm_config"]["cache_config"]["block_size"] >= 1
    assert httpx.get(f"{base}/get_model_info").json()["model_path"] == MODEL
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "ignore_eos": True}
    (rendered,) = httpx.post(f"{base}/v1/completions/render", json=body).json()
    assert rendered["token_ids"] == [256, 97, 98, 99] and rendered["sampling_params"]["ignore_eos"] is True
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    rendered = httpx.post(f"{base}/v1/chat/completions/render", json=chat).json()
    assert bytes(rendered["token_ids"][1:]).decode() == "<|user|>hi\n<|assistant|>"
    assert httpx.get(f"{base}/get_load").json() == {"load": 0, "num_reqs": 0, "num_waiting_reqs": 0,
                                                    "kv_cache_usage": 0.0}  # fmt: skip


def _load(router: Router, stop: float, results: list, prompt: str) -> None:
    """Requests one after another until `stop` (monotonic): each (sent, ok or the error)."""
    client = router.client()
    while time.monotonic() < stop:
        sent = time.monotonic()
        try:
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
            results.append((sent, r.usage.completion_tokens == 24))
        except Exception as e:  # what a client sees: counted as a failure
            results.append((sent, f"{type(e).__name__}: {e}"))


def _under_load(chat_files, tmp_path, seconds: float, disrupt) -> tuple[list, float]:
    """Two replicas behind vllm-router (round-robin) under 6 clients' load for `seconds`; 3 s in, `disrupt(pair)`
    runs. Each request's (sent, ok or the error), and when the disruption began."""
    pair = [Replica(chat_files["onnxruntime"], tmp_path / f"{i}.log").start() for i in range(2)]
    router = Router("vllm", pair, policy="round_robin")
    try:
        results: list = []
        stop = time.monotonic() + seconds
        with cf.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(_load, router, stop, results, f"load {i}") for i in range(6)]
            time.sleep(3)
            began = time.monotonic()
            disrupt(pair)
            for f in futures:
                f.result(timeout=120)
        return results, began
    finally:
        router.stop()
        for r in pair:
            r.stop()


def test_a_replica_killed_under_load_loses_only_what_it_held(chat_files, tmp_path):
    """One of two replicas SIGKILLed under load: every request sent once the router has seen it fail succeeds,
    at least 90% of all succeed, and none hangs (each has a 60 s timeout; the load ends in bounded time)."""
    results, killed = _under_load(chat_files, tmp_path, 12, lambda pair: pair[1].proc.send_signal(signal.SIGKILL))
    ok = [r for r in results if r[1] is True]
    late = [r for r in results if r[0] > killed + 3]  # health checks every second; 3 failures mark it down
    assert late and all(r[1] is True for r in late), [r for r in late if r[1] is not True][:3]
    assert len(ok) >= 0.9 * len(results), [r for r in results if r[1] is not True][:3]


def _restart(pair: list[Replica]) -> None:
    pair[0].proc.send_signal(signal.SIGTERM)
    assert pair[0].proc.wait(timeout=40) == 0
    pair[0].start()


def test_a_rolling_restart_under_load_loses_no_request(chat_files, tmp_path):
    """SIGTERM one replica (it drains: finishes what it holds, answers new requests 503, reports unhealthy),
    start it again at the same address: not one request fails."""
    results, _ = _under_load(chat_files, tmp_path, 14, _restart)
    failed = [r for r in results if r[1] is not True]
    assert len(results) > 20 and not failed, failed[:3]
