"""`sharp-bench serve`: a gRPC load generator against sharp-serve, with its baselines in the same run.

Closed loop (each of C clients sends its next request when the previous one ends) at concurrency 1/4/16/64
and open loop (Poisson arrivals at --rate), measured at the client from streamed chunks: completed/failed,
requests/s, output tokens/s, time to first token and inter-token latency p50/p99. Baselines side by side:
continuous batching vs `--max-batch 1`, the gRPC path vs calling the engine in-process, and
`--entropy-metrics head` vs `off` (what the attention metrics cost). Every cell is the median of --repeats.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import tempfile
import time
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
from sharp.serving.backends import load_backend
from sharp.serving.client import AsyncClient, make_request
from sharp.serving.engine import Delta, Engine, EngineConfig, Finished
from sharp.serving.metrics import ServingMetrics
from sharp.serving.requests import validate
from sharp.serving.server import BackgroundServer, ServerConfig


@dataclass
class Run:
    completed: int = 0
    failed: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def _prompts(n: int, length: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["def", "import", "return", "self", "class", "value", "path", "for", "in", "if", "None", "os"]
    return [" ".join(rng.choice(words) for _ in range(length))[:length] for _ in range(n)]


async def _one(send, prompt: str, new_tokens: int, run: Run) -> None:
    """send(prompt, n) yields (token_count, done) per chunk; records TTFT and inter-token gaps."""
    start = last = time.perf_counter()
    got = 0
    try:
        async for n in send(prompt, new_tokens):
            now = time.perf_counter()
            if n:
                (run.ttft if got == 0 else run.itl).append(now - (start if got == 0 else last))
                got, last = got + n, now
        run.completed += 1
        run.tokens += got
    except Exception:
        run.failed += 1


def grpc_sender(client: AsyncClient):
    async def send(prompt, n):
        async for chunk in client.generate_stream(prompt, max_new_tokens=n, temperature=0):
            yield len(chunk.token_ids)

    return send


def engine_sender(engine: Engine):
    async def send(prompt, n):
        req = validate(make_request(prompt, max_new_tokens=n, temperature=0.0), engine.limits, engine.tokenizer.encode)
        async for ev in engine.stream(req):
            if isinstance(ev, Delta):
                yield len(ev.token_ids)
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
    return [
        name,
        f"{med([r.completed for r in runs]):g}/{med([r.failed for r in runs]):g}",
        f"{med([r.completed / r.seconds for r in runs]):.2f}",
        f"{med([r.tokens / r.seconds for r in runs]):.0f}",
        f"{pct('ttft', 50):.1f}",
        f"{pct('ttft', 99):.1f}",
        f"{pct('itl', 50):.2f}",
        f"{pct('itl', 99):.2f}",
    ]


def _server(model: Path, max_batch: int, entropy: str, native: bool = True) -> BackgroundServer:
    backend = load_backend(model, native=native)
    engine = Engine(backend, EngineConfig(max_batch=max_batch, max_queue=4096), ServingMetrics(backend.spec, entropy))
    return BackgroundServer(engine, ServerConfig(port=0, metrics_port=None))


def bench(model: Path, args) -> str:
    prompts = _prompts(args.requests, args.prompt_chars)
    rows = []

    def measure(name, max_batch, entropy, scenario, in_process=False, native=True):
        runs = []
        for _ in range(args.repeats):
            with _server(model, max_batch, entropy, native) as srv:

                async def go():
                    if in_process:
                        return await asyncio.wrap_future(
                            asyncio.run_coroutine_threadsafe(scenario(engine_sender(srv.server.engine)), srv.loop)
                        )
                    async with AsyncClient(srv.target) as c:
                        return await scenario(grpc_sender(c))

                runs.append(asyncio.run(go()))
        rows.append(_row(name, runs))
        print(" | ".join(rows[-1]), flush=True)

    n = args.new_tokens
    for c in args.concurrency:
        measure(f"gRPC, closed loop C={c}", args.max_batch, "head", lambda s, c=c: closed_loop(s, prompts, c, n))
    c = args.baseline_concurrency
    measure(f"gRPC, closed loop C={c}, --max-batch 1", 1, "head", lambda s: closed_loop(s, prompts, c, n))
    measure(f"in-process engine, C={c}", args.max_batch, "head", lambda s: closed_loop(s, prompts, c, n), True)
    measure(
        f"gRPC, closed loop C={c}, --no-native (the file's dense fallback bodies)",
        args.max_batch,
        "head",
        lambda s: closed_loop(s, prompts, c, n),
        native=False,
    )
    measure(
        f"gRPC, closed loop C={c}, --entropy-metrics off",
        args.max_batch,
        "off",
        lambda s: closed_loop(s, prompts, c, n),
    )
    measure(
        f"gRPC, open loop Poisson {args.rate:g} req/s",
        args.max_batch,
        "head",
        lambda s: open_loop(s, prompts, args.rate, n),
    )
    header = [
        "scenario",
        "completed/failed",
        "req/s",
        "out tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
    ]
    return "\n".join(
        [
            "## Serving (sharp-bench serve)",
            "",
            f"Measured {today()} on {machine()}. Command: {args.command}. Model: {args.model_source},"
            " onnxruntime CPU backend with sharp's native kernel"
            " unless stated; server and load"
            " generator in one process (server on its own thread and event loop, the load generator streaming over"
            f" loopback gRPC). {args.requests} requests of {args.prompt_chars}-character prompts, {n} greedy new"
            f" tokens each, --max-batch {args.max_batch} unless stated; medians of {args.repeats} runs, each on a"
            " fresh server. TTFT and inter-token latency (ITL) are measured at the client.",
            "",
            markdown_table(header, rows),
        ]
    )


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench serve", description=__doc__)
    ap.add_argument("--model", type=Path, help="an exported .onnx (default: export models/zoo/ssa.pt)")
    ap.add_argument("--requests", type=int, default=64)
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
        model = args.model
        if model is None:
            from sharp.exporter.cli import main as export

            model = Path(tmp) / "ssa.onnx"
            if export([str(zoo_model("ssa")), "-o", str(model), "--no-check"]) != 0:
                return 1
        body = bench(model, args)
    print(body)
    if (page := output_page(args)) is not None:
        write_section("serve", body, page)
    return 0
