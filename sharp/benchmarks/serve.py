"""`sharp-bench serve`: a gRPC and HTTP load generator against sharp-serve, with its baselines in the same run.

sharp-serve runs in its own process, as users run it; the load generator (this process) streams over loopback
gRPC. Closed loop (each of C clients sends its next request when the previous one ends) at concurrency 1/4/16/64
and open loop (Poisson arrivals at --rate), measured at the client from streamed chunks: completed/failed,
requests/s, output tokens/s, time to first token and inter-token latency p50/p99; and from the server's own
counters, the engine's host time per step with the model's forwards taken out, and rows per decode step.
Baselines side by side: continuous batching vs `--max-batch 1`, the engine in the server's process (the default on
CPU) vs its core in a process of its own (`--engine-process on`), the zoo model's KV cache in fp32 vs fp16
(`sharp-export --kv-cache-dtype fp16`, when the bench exports it), the gRPC path vs the engine called in-process and
vs the OpenAI-compatible HTTP API driven by the official `openai` SDK (streaming), `--entropy-metrics head` vs
`off` (what the attention metrics cost), and structured decoding (every token masked by a JSON schema's grammar) vs
plain at C=1 and the baseline concurrency, with the time to compile a new 50-property schema. Every cell is the
median of --repeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sharp.benchmarks.harness import (
    BenchParser,
    add_output,
    command_line,
    machine,
    markdown_table,
    output_page,
    today,
    write_section,
)
from sharp.models.checkpoint import zoo_model
from sharp.plugins.onnxruntime import NativeOpUnavailable, library_path
from sharp.serving.api.client import AsyncClient
from sharp.serving.backends.loading import load_backend
from sharp.serving.config import EngineConfig
from sharp.serving.engine.engine import Engine
from sharp.serving.engine.output import Delta, Finished
from sharp.serving.metrics import ServingMetrics
from sharp.serving.requests import RequestParams, validate


@dataclass
class Run:
    completed: int = 0
    failed: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    engine: dict[str, float] = field(default_factory=dict)  # the server's sharp_engine_* and batch counters

    def host_us_per_step(self) -> float:
        """The engine's time per step outside the model's forwards (µs)."""
        e = self.engine
        return (e["busy"] - e["forward"]) / e["steps"] * 1e6 if e.get("steps") else float("nan")

    def rows_per_decode(self) -> float:
        e = self.engine
        return e["rows"] / e["decodes"] if e.get("decodes") else float("nan")


COUNTERS = {  # what a run reads back from the server's /metrics
    "steps": "sharp_engine_steps_total",
    "busy": "sharp_engine_busy_seconds_total",
    "forward": "sharp_engine_forward_seconds_total",
    "rows": "sharp_batch_size_sum",
    "decodes": "sharp_batch_size_count",
}


@dataclass
class Served:
    """A sharp-serve process: its gRPC target, metrics endpoint and OpenAI API base URL."""

    target: str
    metrics_url: str
    openai_url: str

    def engine_stats(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(self.metrics_url, timeout=30).read().decode()
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        return {key: values.get(name, 0.0) for key, name in COUNTERS.items()}


@contextlib.contextmanager
def sharp_serve(
    model: Path, max_batch: int, entropy: str, native: bool = True, engine_process: str = "auto"
) -> Iterator[Served]:
    """`sharp-serve MODEL` in its own process (the load generator must not share its interpreter), stopped with
    SIGTERM."""
    cmd = [
        sys.executable,
        "-m",
        "sharp.serving.cli",
        str(model),
        f"--served-model-name={model.stem}",  # the id the HTTP scenarios send
        "--port=0",
        "--metrics-port=0",
        f"--max-batch={max_batch}",
        "--max-queue=4096",
        f"--entropy-metrics={entropy}",
        f"--engine-process={engine_process}",
        "--http-port=0",
        "--log-level=warning",
        *([] if native else ["--no-native"]),
    ]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            line = proc.stdout.readline()
            found = re.search(r" on (\S+?):(\d+), metrics (http://\S+/metrics)", line)
            api = re.search(r"OpenAI API (http://\S+/v1)", line)
            if found is None or api is None:
                proc.wait(timeout=60)
                log.seek(0)
                raise RuntimeError(f"sharp-serve did not start: {(line + log.read()).strip()[-800:]}")
            yield Served(f"{found[1]}:{found[2]}", found[3], api[1])
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _prompts(n: int, length: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["def", "import", "return", "self", "class", "value", "path", "for", "in", "if", "None", "os"]
    return [" ".join(rng.choice(words) for _ in range(length))[:length] for _ in range(n)]


async def _one(send, prompt: str, new_tokens: int, run: Run) -> None:
    """send(prompt, n) yields (token_count, timed) per chunk; records TTFT and inter-token gaps of timed chunks
    (an untimed count is a total the stream reports at its end)."""
    start = last = time.perf_counter()
    got = 0
    try:
        async for n, timed in send(prompt, new_tokens):
            now = time.perf_counter()
            if n and timed:
                (run.ttft if got == 0 else run.itl).append(now - (start if got == 0 else last))
                last = now
            got += n
        run.completed += 1
        run.tokens += got
    except Exception:
        run.failed += 1


# a structured output as long as a plain one: a string of at least 400 characters runs to the token budget
LONG_JSON = {"type": "object", "properties": {"notes": {"type": "string", "minLength": 400}}, "required": ["notes"],
             "additionalProperties": False}  # fmt: skip


def grpc_sender(client: AsyncClient, **fields):
    async def send(prompt, n):
        async for chunk in client.generate_stream(prompt, max_new_tokens=n, temperature=0, **fields):
            yield len(chunk.token_ids), True

    return send


def compile_times(model: Path, schemas: int = 5, properties: int = 50) -> tuple[float, list[float]]:
    """Seconds to compile the first schema (the vocabulary compiled with it) and each of `schemas` new ones of
    `properties` properties after it — compiled by llguidance and turned into a matcher with its first mask, as a
    request's first step needs."""
    from sharp.serving.engine.matcher import Grammars
    from sharp.serving.grammar import compile_grammar

    spec = load_backend(model).spec
    began = time.perf_counter()  # the first time counts the vocabulary's compile, begun with Grammars
    grammars, vocab = Grammars(spec.tokenizer, spec.vocab_size), spec.vocab_size
    kinds = [{"type": "integer"}, {"type": "string", "maxLength": 20}, {"type": "boolean"}, {"enum": ["a", "b", "c"]}]
    times = []
    for i in range(schemas + 1):
        props = {f"field_{i}_{k}": kinds[k % len(kinds)] for k in range(properties)}
        schema = json.dumps({"type": "object", "properties": props, "required": sorted(props)})
        began = began if i == 0 else time.perf_counter()
        grammars.matcher(compile_grammar("json_schema", schema)).mask(np.zeros(vocab, np.float32))
        times.append(time.perf_counter() - began)
    return times[0], times[1:]


def http_sender(client, model: str):
    """Streams from the OpenAI API with the official SDK (an `openai.AsyncOpenAI`). A chunk's tokens are not
    numbered in OpenAI's stream: a chunk with text counts one (the engine sends one per step to a reader that keeps
    up), and the usage chunk at the end brings the count to the server's."""

    async def send(prompt, n):
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        counted = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                counted += 1
                yield 1, True
            elif chunk.usage is not None:
                yield chunk.usage.completion_tokens - counted, False

    return send


def engine_sender(engine: Engine):
    async def send(prompt, n):
        given = {"prompt": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
        params = RequestParams(**given, max_new_tokens=n, temperature=0.0)
        req = validate(params, engine.limits, engine.tokenizer.encode)
        async for ev in engine.stream(req):
            if isinstance(ev, Delta):
                yield len(ev.token_ids), True
            elif not isinstance(ev, Finished):
                raise RuntimeError(ev.message)

    return send


async def closed_loop(send, prompts: list[str], concurrency: int, new_tokens: int) -> Run:
    run, queue = Run(), list(prompts)

    async def worker():
        while queue:
            await _one(send, queue.pop(), new_tokens, run)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.seconds = time.perf_counter() - t0
    return run


async def open_loop(send, prompts: list[str], rate: float, new_tokens: int, seed: int = 0) -> Run:
    run, rng, tasks = Run(), random.Random(seed), []
    t0 = time.perf_counter()
    for p in prompts:
        tasks.append(asyncio.ensure_future(_one(send, p, new_tokens, run)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    run.seconds = time.perf_counter() - t0
    return run


def _row(name: str, runs: list[Run]) -> list[str]:
    med = lambda xs: statistics.median(xs)
    pct = lambda attr, q: med(
        [float(np.percentile(getattr(r, attr), q)) * 1e3 if getattr(r, attr) else 0 for r in runs]
    )
    engine = [r for r in runs if r.engine]
    return [
        name,
        f"{med([r.completed for r in runs]):g}/{med([r.failed for r in runs]):g}",
        f"{med([r.completed / r.seconds for r in runs]):.2f}",
        f"{med([r.tokens / r.seconds for r in runs]):.0f}",
        f"{pct('ttft', 50):.1f}",
        f"{pct('ttft', 99):.1f}",
        f"{pct('itl', 50):.2f}",
        f"{pct('itl', 99):.2f}",
        f"{med([r.host_us_per_step() for r in engine]):.0f}" if engine else "—",
        f"{med([r.rows_per_decode() for r in engine]):.1f}" if engine else "—",
        f"{min(r.tokens / r.seconds for r in runs):.0f}–{max(r.tokens / r.seconds for r in runs):.0f}",
    ]


async def warm_up(send) -> None:
    """One untimed request, so that a cold engine's first forwards do not stagger the measured load."""
    warm = Run()
    await _one(send, "A warm-up request.", 4, warm)
    if warm.failed:
        raise RuntimeError("the engine did not answer the warm-up request")


def _in_process(model: Path, max_batch: int, scenario) -> Run:
    """The engine alone, driven from this process's event loop (no gRPC, no second process)."""
    backend = load_backend(model)
    engine = Engine(backend, EngineConfig(max_batch=max_batch, max_queue=4096), ServingMetrics(backend.spec, "head"))
    engine.start()
    try:

        async def go() -> Run:
            send = engine_sender(engine)
            await warm_up(send)
            return await scenario(send)

        return asyncio.run(go())
    finally:
        engine.stop()


@dataclass
class Scenario:
    """One row of the table: a load (send → Run) against sharp-serve with these settings, or the engine in-process."""

    name: str
    load: Callable
    max_batch: int
    entropy: str = "head"
    in_process: bool = False
    native: bool = True
    http: bool = False  # the OpenAI API through the openai SDK, not gRPC
    structured: bool = False  # every request's output constrained to LONG_JSON
    engine_process: str = "auto"
    half_kv: bool = False  # the same model exported with --kv-cache-dtype fp16


def _served(model: Path, sc: Scenario) -> Run:
    """One run against a fresh sharp-serve process: one untimed warm-up request first (a cold server's first
    forwards would stagger the load's requests), then the load, with the engine's counters read back as the
    difference across it."""
    scenario, http = sc.load, sc.http
    with sharp_serve(model, sc.max_batch, sc.entropy, sc.native, sc.engine_process) as srv:

        async def measured(send) -> tuple[Run, dict[str, float]]:
            await warm_up(send)
            before = srv.engine_stats()  # the warm-up's steps are not the load's
            return await scenario(send), before

        async def go():
            if http:
                import openai

                async with openai.AsyncOpenAI(base_url=srv.openai_url, api_key="none", max_retries=0) as client:
                    return await measured(http_sender(client, model.stem))  # sharp_serve names it so
            async with AsyncClient(srv.target) as client:
                fields = {"json_schema": json.dumps(LONG_JSON)} if sc.structured else {}
                return await measured(grpc_sender(client, **fields))

        run, before = asyncio.run(go())
        after = srv.engine_stats()
        run.engine = {key: after[key] - before[key] for key in after}
        return run


def bench(model: Path, args, half_kv: Path | None = None) -> str:
    prompts = _prompts(args.requests, args.prompt_chars)
    where = machine()  # before an in-process engine changes this process's torch threads
    n, c = args.new_tokens, args.baseline_concurrency
    closed = lambda conc: lambda s: closed_loop(s, prompts, conc, n)

    def plain_and_structured(k: int) -> list[Scenario]:
        """Structured decoding right after plain decoding at the same load: each round's ratio is of neighbours."""
        plain = Scenario(f"gRPC, closed loop C={k}", closed(k), args.max_batch)
        if k not in (1, c):
            return [plain]
        return [plain, Scenario(f"gRPC, closed loop C={k}, json_schema", closed(k), args.max_batch, structured=True)]

    scenarios = [
        *(sc for k in args.concurrency for sc in plain_and_structured(k)),
        Scenario(f"gRPC, closed loop C={c}, --max-batch 1", closed(c), 1),
        *(
            Scenario(f"gRPC, closed loop C={k}, --engine-process on", closed(k), args.max_batch, engine_process="on")
            for k in sorted({1, c, max(args.concurrency)})
        ),
        *(
            Scenario(f"gRPC, closed loop C={k}, --kv-cache-dtype fp16", closed(k), args.max_batch, half_kv=True)
            for k in (sorted({c, max(args.concurrency)}) if half_kv else [])
        ),
        Scenario(f"in-process engine, C={c}", closed(c), args.max_batch, in_process=True),
        Scenario(
            f"gRPC, closed loop C={c}, --no-native (the file's dense fallback bodies)",
            closed(c),
            args.max_batch,
            native=False,
        ),
        Scenario(f"gRPC, closed loop C={c}, --entropy-metrics off", closed(c), args.max_batch, entropy="off"),
        *(
            Scenario(f"HTTP (openai SDK, streaming), closed loop C={k}", closed(k), args.max_batch, http=True)
            for k in sorted({1, c})
        ),
        Scenario(
            f"gRPC, open loop Poisson {args.rate:g} req/s",
            lambda s: open_loop(s, prompts, args.rate, n),
            args.max_batch,
        ),
    ]
    by_name: dict[str, list[Run]] = {sc.name: [] for sc in scenarios}
    for repeat in range(args.repeats):  # every scenario once per round: a drift of the machine hits all alike
        for sc in scenarios:
            path = half_kv if sc.half_kv else model
            run = _in_process(path, sc.max_batch, sc.load) if sc.in_process else _served(path, sc)
            by_name[sc.name].append(run)
            print(f"round {repeat + 1}/{args.repeats}: {sc.name}: {run.tokens / run.seconds:.0f} tok/s", flush=True)
    rows = [_row(name, runs) for name, runs in by_name.items()]
    header = [
        "scenario",
        "completed/failed",
        "req/s",
        "out tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "engine host µs/step",
        "rows/decode step",
        "out tok/s, lowest–highest round",
    ]
    lines = [
        "## Serving (sharp-bench serve)",
        "",
        f"Measured {today()} on {where}. Command: {args.command}. Model: {args.model_source},"
        " onnxruntime CPU backend with sharp's native kernel unless stated. sharp-serve runs in its own process"
        " (a fresh one per run, warmed up by one untimed request whose engine counters are left out), its engine"
        " in the same process unless a row says --engine-process on; the load"
        " generator streams from this one over loopback gRPC, or over its"
        " OpenAI-compatible HTTP API with the official openai SDK in the HTTP rows."
        f" {args.requests} requests of {args.prompt_chars}-character prompts, {n} greedy new"
        f" tokens each, --max-batch {args.max_batch} unless stated; medians of {args.repeats} rounds (each"
        " round runs every scenario once, in the order of the table; the last column is the rounds' spread)."
        " TTFT and inter-token latency (ITL) are measured at the client; engine host µs/step is the server's"
        " own step time with the model's forwards taken out (sharp_engine_busy_seconds_total −"
        " sharp_engine_forward_seconds_total, per sharp_engine_steps_total); the in-process row drives the"
        " engine from the load generator's own event loop, without gRPC.",
        "",
        markdown_table(header, rows),
    ]
    fit = _host_fit(by_name, args)
    if fit:
        lines += ["", fit]
    lines += ["", _structured(by_name, model, c)]
    return "\n".join(lines)


def structured_ratios(by_name: dict[str, list[Run]], loads: list[int]) -> list[str]:
    """Structured decoding's output tokens/s as a share of plain decoding's at each closed-loop load that has both
    rows: per round (the two run back to back, so a drift of the machine between rounds cancels), their median and
    the rounds' range."""
    out = []
    for k in loads:
        plain, structured = (by_name.get(f"gRPC, closed loop C={k}{kind}") for kind in ("", ", json_schema"))
        if plain and structured:
            each = [(s.tokens / s.seconds) / (p.tokens / p.seconds) for p, s in zip(plain, structured, strict=True)]
            out.append(f"C={k}: {statistics.median(each):.2f}× (rounds {min(each):.2f}–{max(each):.2f}×)")
    return out


def _structured(by_name: dict[str, list[Run]], model: Path, c: int) -> str:
    """Structured decoding against plain decoding, and what compiling a schema costs."""
    first, later = compile_times(model)
    return (
        f"Structured decoding (each request's output constrained to a JSON schema, a string of at least 400"
        f" characters so it runs to the token budget) against plain decoding, out tok/s, the median of each"
        f" round's ratio: {', '.join(structured_ratios(by_name, sorted({1, c})))}."
        f" A new 50-property schema compiles (llguidance, with its matcher's first mask) in"
        f" {statistics.median(later) * 1e3:.1f} ms (median of {len(later)}; the slowest {max(later) * 1e3:.1f} ms);"
        f" the first, with the model's vocabulary, {first * 1e3:.0f} ms."
    )


def _host_fit(by_name: dict[str, list[Run]], args) -> str | None:
    """The engine's host time per step as a + b × rows, from the lowest and highest closed-loop concurrency."""
    points = []
    for c in (min(args.concurrency), max(args.concurrency)):
        runs = by_name.get(f"gRPC, closed loop C={c}", [])
        if runs:
            points.append(
                (
                    statistics.median(r.rows_per_decode() for r in runs),
                    statistics.median(r.host_us_per_step() for r in runs),
                )
            )
    if len(points) < 2 or not all(map(math.isfinite, (*points[0], *points[1]))) or points[1][0] - points[0][0] < 1:
        return None
    (r0, h0), (r1, h1) = points
    per_row = (h1 - h0) / (r1 - r0)
    return (
        f"Engine host time per step, fitted through the C={min(args.concurrency)} and C={max(args.concurrency)}"
        f" rows: {h0 - per_row * r0:.0f} µs + {per_row:.1f} µs per running row."
    )


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench serve", description=__doc__)
    ap.add_argument("--model", type=Path, help="an exported .onnx (default: export models/zoo/ssa.pt)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-chars", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--baseline-concurrency", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--rate", type=float, default=20.0, help="open-loop arrivals per second")
    ap.add_argument("--repeats", type=int, default=3)
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("serve", [] if argv is None else list(argv))
    if min(args.requests, args.new_tokens, args.repeats, args.max_batch, *args.concurrency) < 1 or args.rate <= 0:
        ap.error("--requests, --new-tokens, --repeats, --max-batch, --concurrency and --rate must be positive")
    try:
        library_path()  # the native-vs-fallback comparison needs the kernel
    except NativeOpUnavailable as e:
        print(f"sharp-bench serve: {e}", file=sys.stderr)
        return 1
    args.model_source = (
        str(args.model)
        if args.model is not None
        else ("models/zoo/ssa.pt exported with sharp-export (4 layers × 4 heads, dim 128, SSA, dense fallback)")
    )
    with tempfile.TemporaryDirectory() as tmp:
        model, half_kv = args.model, None
        if model is None:  # the zoo model, and the same with an fp16 KV cache for rows of their own
            from sharp.exporter.cli import main as export

            model, half_kv = Path(tmp) / "ssa.onnx", Path(tmp) / "ssa-kv16.onnx"
            for path, kv in ((model, "fp32"), (half_kv, "fp16")):
                if export([str(zoo_model("ssa")), "-o", str(path), "--no-check", "--kv-cache-dtype", kv]) != 0:
                    return 1
        body = bench(model, args, half_kv)
    print(body)
    if (page := output_page(args)) is not None:
        write_section("serve", body, page)
    return 0
