"""`sharp-bench long-context`: one long prompt served by the torch backend on its paged KV cache, per model shape
and norm, softmax alongside as the baseline.

Per shape and norm it builds a random-weight SharpLM (the demo models' shape, or a ~1B-parameter Llama-3.2-1B
shape), saves it as a model.pt, loads it once and serves each run as `sharp-serve model.pt --backend torch --device
cuda` serves a request (TorchBackend + a fresh Engine, stepped in-process; each step reported on stderr): a prompt
of --prompt tokens prefilled in --prefill-chunk chunks, then --new-tokens greedy tokens. Reported per run: time to
first token (the whole prefill), decode tokens/s, tokens generated (a random model may hit EOS early), and the peak
GPU memory; ratios are against softmax of the same shape. Every cell is the median of --repeats runs after one
warm-up run (kernel compiles, prefill tile tuning).
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from sharp.benchmarks.harness import (
    BenchParser,
    add_output,
    command_line,
    markdown_table,
    output_page,
    today,
    write_section,
)
from sharp.models import ModelConfig, SharpLM, save
from sharp.models.registry import NORMS
from sharp.serving.config import EngineConfig
from sharp.serving.engine import Engine
from sharp.serving.loading import load_backend
from sharp.serving.output import Delta
from sharp.serving.requests import RequestParams, validate

SHAPES = {
    "demo": dict(vocab_size=258, dim=128, layers=4, heads=4, kv_heads=4),
    "llama-1b": dict(vocab_size=128256, dim=2048, layers=16, heads=32, kv_heads=8, mlp_hidden=8192, rope_base=5e5),
}

HEADER = ["shape", "params", "norm", "prompt", "TTFT s", "× softmax", "decode tok/s", "× softmax", "tokens", "peak GiB"]


def _progress(t0: float, message: str) -> None:
    """A line on stderr per step: a run cut short by a time limit still shows how far it got and what took long."""
    print(f"long-context [{time.perf_counter() - t0:6.1f} s] {message}", file=sys.stderr, flush=True)


def _serve_once(backend, device: str, prompt: int, new_tokens: int, chunk: int) -> dict:
    """One request through a fresh engine (its own KV cache) on a loaded backend, as a server serves each request:
    TTFT (s), decode tokens/s, tokens, peak GPU memory (GiB)."""
    gc.collect()  # the previous run's engine and KV cache, before the peak is reset
    kv_mb = (prompt + new_tokens + 64) * backend.kv_bytes_per_token / 2**20 * 1.02
    engine = Engine(
        backend, EngineConfig(kv_cache_mb=kv_mb, prefill_chunk=chunk, max_new_tokens_limit=max(new_tokens, 64))
    )
    ids = torch.randint(0, min(backend.spec.vocab_size, 256), (prompt,), generator=torch.Generator().manual_seed(0))
    params = RequestParams(input_ids=ids.tolist(), max_new_tokens=new_tokens, temperature=0.0)
    request = validate(params, engine.limits, engine.tokenizer.encode)
    stamps: list[float] = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine.submit(request, lambda ev: isinstance(ev, Delta) and stamps.append(time.perf_counter()))
    while not engine.idle():
        engine.step()
    decode_s = stamps[-1] - stamps[0]
    return {
        "ttft": stamps[0] - start,
        "tok_s": (len(stamps) - 1) / decode_s if len(stamps) > 1 and decode_s > 0 else float("nan"),
        "tokens": len(stamps),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan"),
    }


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench long-context", description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES, metavar="SHAPE")
    ap.add_argument("--norms", nargs="+", default=["softmax", "ssa", "entmax"], choices=NORMS, metavar="NORM")
    ap.add_argument("--prompt", type=int, default=131072, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a short prompt on CPU (demo shape); writes nothing")
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("long-context", [] if argv is None else list(argv))
    if min(args.prompt, args.new_tokens, args.prefill_chunk, args.repeats) < 1:
        ap.error("--prompt, --new-tokens, --prefill-chunk and --repeats must be >= 1")
    if "softmax" not in args.norms:
        args.norms = ["softmax", *args.norms]  # the baseline runs beside the candidates
    gpu = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.shapes, args.prompt, args.new_tokens, args.prefill_chunk, args.repeats = ["demo"], 300, 4, 128, 1
        args.no_write = True
    elif not gpu:
        print("sharp-bench long-context: no CUDA GPU here; use --smoke to check the script on CPU", flush=True)
        return 2
    device = "cuda" if gpu else "cpu"
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            base = None
            for norm in args.norms:
                torch.manual_seed(0)
                cfg = ModelConfig(**SHAPES[shape], norm=norm, context_length=args.prompt + args.new_tokens)
                path = Path(tmp) / f"{shape}-{norm}.pt"
                model = SharpLM(cfg)
                params = model.num_params()
                save(model, path)
                del model
                _progress(t0, f"{shape} {norm}: built and saved ({params / 1e6:,.0f}M parameters)")
                backend = load_backend(path, "torch", device)  # once, as `sharp-serve` loads it
                _progress(t0, f"{shape} {norm}: loaded on {device}")
                case = (backend, device, args.prompt, args.new_tokens, args.prefill_chunk)
                runs = []
                for i in range(1 + args.repeats):  # run 0 is the warm-up: kernel compiles, prefill tile tuning
                    r = _serve_once(*case)
                    runs += [r] if i else []
                    _progress(t0, f"{shape} {norm}: {'warm-up' if i == 0 else f'run {i}'} TTFT {r['ttft']:.2f} s, "
                              f"{r['tok_s']:.1f} tok/s, {r['tokens']} tokens")  # fmt: skip
                del backend
                cell = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                base = base or cell
                prefill_x, decode_x = base["ttft"] / cell["ttft"], cell["tok_s"] / base["tok_s"]
                peak = f"{cell['peak_gib']:.1f}" if device == "cuda" else "n/a (CPU)"
                rows.append([
                    shape, f"{params / 1e6:,.0f}M", norm, f"{args.prompt:,}", f"{cell['ttft']:.2f}", f"{prefill_x:.2f}",
                    f"{cell['tok_s']:.1f}", f"{decode_x:.2f}", f"{cell['tokens']:.0f}", peak,
                ])  # fmt: skip
                path.unlink()
    name = torch.cuda.get_device_name() if gpu else "CPU (smoke run: numbers meaningless)"
    body = "\n".join(
        [
            "## Long-context serving (torch backend, paged KV cache)",
            "",
            f"Measured {today()} on {name}, torch {torch.__version__}. Command: {args.command}.",
            f"One request: {args.prompt:,} prompt tokens prefilled in chunks of {args.prefill_chunk:,}, then up to"
            f" {args.new_tokens} greedy tokens; random weights, bf16 on GPU; median of {args.repeats} after a warm-up"
            " run."
            " × softmax: softmax's time / this norm's (prefill), this norm's tokens/s / softmax's (decode).",
            "",
            markdown_table(HEADER, rows),
        ]
    )
    print(body)
    if (page := output_page(args)) is not None:
        write_section("long-context", body, page)
    return 0
