"""`sharp-bench genai`: sharp-serve against onnxruntime-genai on the same exported file, as a user runs each.

One `sharp-export --genai` package serves both: sharp-serve loads its model.onnx in its own process (gRPC on
loopback, continuous batching, streamed chunks; the load generator is this process); onnxruntime-genai opens the
directory and runs one `Generator` per request (greedy), from C threads at once for concurrency C (a closed loop:
each thread takes the next prompt when its request ends).
Both use sharp's native kernel when the package carries it. Output tokens per second over the whole run, medians
of --repeats, and the sharp/genai ratio.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

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
from sharp.benchmarks.serve import _prompts, closed_loop, grpc_sender, sharp_serve
from sharp.models.checkpoint import zoo_model
from sharp.serving.api.client import AsyncClient


def sharp_serve_tokens_per_s(package: Path, prompts: list[str], concurrency: int, new_tokens: int) -> float:
    with sharp_serve(package / "model.onnx", max_batch=64, entropy="head") as srv:

        async def go():
            async with AsyncClient(srv.target) as c:
                return await closed_loop(grpc_sender(c), prompts, concurrency, new_tokens)

        run = asyncio.run(go())
    if run.failed:
        raise RuntimeError(f"sharp-serve failed {run.failed} requests")
    return run.tokens / run.seconds


def genai_tokens_per_s(package: Path, prompts: list[str], concurrency: int, new_tokens: int) -> float:
    import onnxruntime_genai as og

    model = og.Model(str(package))
    tokenizer = og.Tokenizer(model)
    tokenizer.update_options(add_special_tokens="true")  # BOS as the package's tokenizer says: as sharp-serve's
    queue, lock, produced = list(prompts), threading.Lock(), [0]

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            ids = list(tokenizer.encode(prompt))
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + new_tokens, do_sample=False)
            generator = og.Generator(model, params)
            generator.append_tokens(ids)
            count = 1  # append_tokens already produced the first new token's logits
            while not generator.is_done():
                generator.generate_next_token()
                count += 1
            with lock:
                produced[0] += count - 1

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return produced[0] / (time.perf_counter() - t0)


def bench(package: Path, source: str, args) -> str:
    prompts = _prompts(args.requests, args.prompt_chars)
    where = machine()
    rows = []
    for c in args.concurrency:
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved: a drift of the machine hits both sides alike
            ours.append(sharp_serve_tokens_per_s(package, prompts, c, args.new_tokens))
            theirs.append(genai_tokens_per_s(package, prompts, c, args.new_tokens))
        a, b = statistics.median(ours), statistics.median(theirs)
        spread = [f"{min(ours):.0f}–{max(ours):.0f}", f"{min(theirs):.0f}–{max(theirs):.0f}"]
        rows.append([f"C={c}", f"{a:.0f}", f"{b:.0f}", f"{a / b:.2f}×", *spread])
        print(" | ".join(rows[-1]), flush=True)
    header = [
        "concurrency",
        "sharp-serve out tok/s",
        "onnxruntime-genai out tok/s",
        "sharp / genai",
        "sharp-serve, lowest–highest run",
        "onnxruntime-genai, lowest–highest run",
    ]
    return "\n".join(
        [
            "## sharp-serve vs onnxruntime-genai (sharp-bench genai)",
            "",
            f"Measured {today()} on {where}. Command: {args.command}. Model: {source}, written once with"
            " `sharp-export --genai` (native sharp kernel in the package); sharp-serve, in its own process, serves"
            " its model.onnx over loopback gRPC (continuous batching, --max-batch 64, per-head entropy metrics on),"
            " onnxruntime-genai opens the package and runs one greedy Generator per request from C threads. Closed"
            " loop:"
            f" {args.requests} prompts of {args.prompt_chars} characters, {args.new_tokens} new tokens each;"
            f" output tokens/s over the whole run, medians of {args.repeats} runs, the two sides taking turns.",
            "",
            markdown_table(header, rows),
        ]
    )


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench genai", description=__doc__)
    ap.add_argument("--model", type=Path, help="a SharpLM model.pt or a Hugging Face directory (default: zoo ssa.pt)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-chars", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("genai", [] if argv is None else list(argv))
    if min(args.requests, args.new_tokens, args.repeats, *args.concurrency) < 1:
        ap.error("--requests, --new-tokens, --repeats and --concurrency must be positive")
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError as e:
        why = f"needs onnxruntime-genai ({e}); pip install 'sharp-attention[genai]'"
        print(f"sharp-bench genai: {why}", file=sys.stderr)
        return 1
    from sharp.exporter.cli import main as export

    model = args.model or zoo_model("ssa")
    source = str(args.model) if args.model else "models/zoo/ssa.pt (4 layers × 4 heads, dim 128, SSA, bytes)"
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "package"
        if export([str(model), "--genai", "-o", str(package), "--no-check"]) != 0:
            return 1
        body = bench(package, source, args)
    print(body)
    if (page := output_page(args)) is not None:
        write_section("genai", body, page)
    return 0
