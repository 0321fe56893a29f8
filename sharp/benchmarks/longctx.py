"""`sharp-bench long-context`: one long prompt served by the torch backend on its paged KV cache, per model shape,
prompt length and norm, softmax alongside as the baseline, and the same shape in transformers (a Llama with SDPA
attention, random weights, its own KV cache) as the peer.

Per shape and norm it builds a random-weight SharpLM (the demo models' shape, or a ~1B-parameter Llama-3.2-1B
shape), saves it as a model.pt, loads it once and serves each run as `sharp-serve model.pt --backend torch --device
cuda` serves a request (TorchBackend + a fresh Engine, stepped in-process; each step reported on stderr): a prompt
of --prompt tokens prefilled in --prefill-chunk chunks, then --new-tokens greedy tokens. Reported per run: time to
first token (the whole prefill), decode tokens/s, tokens generated (a random model may hit EOS early), and the peak
GPU memory; ratios are against sharp's softmax of the same shape and length. The transformers row runs the same
prompt in the same chunks (only the last position's logits formed) and the same greedy tokens, one host read per
token as a server streams it. Every cell is the median of --repeats runs after one warm-up run (kernel compiles,
prefill tile tuning). The section is written after each cell, so a run cut short by a time limit leaves what it
measured.
"""

from __future__ import annotations

import gc
import inspect
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
from sharp.serving.backends.loading import load_backend
from sharp.serving.config import EngineConfig
from sharp.serving.engine.engine import Engine
from sharp.serving.engine.output import Delta
from sharp.serving.requests import RequestParams, validate

SHAPES = {
    "demo": dict(vocab_size=258, dim=128, layers=4, heads=4, kv_heads=4),
    "llama-1b": dict(vocab_size=128256, dim=2048, layers=16, heads=32, kv_heads=8, mlp_hidden=8192, rope_base=5e5),
}

TRANSFORMERS = "transformers (SDPA)"
HEADER = ["shape", "params", "norm", "prompt", "TTFT s", "× softmax", "decode tok/s", "× softmax", "tokens", "peak GiB"]


def _progress(t0: float, message: str) -> None:
    """A line on stderr per step: a run cut short by a time limit still shows how far it got and what took long."""
    print(f"long-context [{time.perf_counter() - t0:6.1f} s] {message}", file=sys.stderr, flush=True)


def _timings(start: float, stamps: list[float], device: str) -> dict:
    """A run's cell from its start and each token's arrival: TTFT (s), decode tokens/s, tokens, peak GPU GiB."""
    decode_s = stamps[-1] - stamps[0]
    return {
        "ttft": stamps[0] - start,
        "tok_s": (len(stamps) - 1) / decode_s if len(stamps) > 1 and decode_s > 0 else float("nan"),
        "tokens": len(stamps),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan"),
    }


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
    return _timings(start, stamps, device)


def _llama(shape: dict, context: int, device: str) -> torch.nn.Module:
    """The shape as a transformers Llama with SDPA attention (random weights; bf16 on a GPU, fp32 on CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dim = shape["dim"]
    config = LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=dim, num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape.get("mlp_hidden") or 8 * ((8 * dim // 3 + 7) // 8),  # SharpLM's swiglu default
        rope_theta=shape.get("rope_base", 10000.0), max_position_embeddings=context, tie_word_embeddings=True,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def _transformers_once(model, device: str, prompt: int, new_tokens: int, chunk: int) -> dict:
    """One greedy request on the transformers model: the prompt in `chunk`-token forwards into its cache (logits of
    the last position only), then `new_tokens` tokens, each read on the host; as `_serve_once` reports."""
    from transformers import DynamicCache

    vocab = min(model.config.vocab_size, 256)
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    gc.collect()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # the cache argument's name: `cache` since transformers 5.2x (`past_key_values` before, deprecated there)
    named = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    step = {named: DynamicCache(), "use_cache": True, "logits_to_keep": 1}
    stamps: list[float] = []
    with torch.inference_mode():
        start = time.perf_counter()
        for s in range(0, prompt, chunk):
            out = model(input_ids=ids[:, s : s + chunk], **step)
        for _ in range(new_tokens):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            token.item()  # on the host, as a server streams each token
            stamps.append(time.perf_counter())
            if len(stamps) < new_tokens:
                out = model(input_ids=token, **step)
    return _timings(start, stamps, device)


def _body(args, rows: list[list[str]], name: str, cells: int) -> str:
    prompts = ", ".join(f"{n:,}" for n in args.prompt)
    partial = "" if len(rows) == cells else f" **Partial: {len(rows)} of {cells} cells measured so far.**"
    return "\n".join(
        [
            "## Long-context serving (torch backend, paged KV cache)",
            "",
            f"Measured {today()} on {name}, torch {torch.__version__}. Command: {args.command}.",
            f"One request: {prompts} prompt tokens prefilled in chunks of {args.prefill_chunk:,}, then up to"
            f" {args.new_tokens} greedy tokens; random weights, bf16 on GPU; median of {args.repeats} after a warm-up"
            f" run. {TRANSFORMERS}: the same shape as a transformers Llama, the same prompt, chunks and tokens."
            " × softmax: sharp softmax's time / this row's (prefill), this row's tokens/s / sharp softmax's (decode)."
            + partial,
            "",
            markdown_table(HEADER, rows),
        ]
    )


def _cell(shape: str, params: int, norm: str, prompt: int, cell: dict, base: dict, device: str) -> list[str]:
    prefill_x, decode_x = base["ttft"] / cell["ttft"], cell["tok_s"] / base["tok_s"]
    peak = f"{cell['peak_gib']:.1f}" if device == "cuda" else "n/a (CPU)"
    return [shape, f"{params / 1e6:,.0f}M", norm, f"{prompt:,}", f"{cell['ttft']:.2f}", f"{prefill_x:.2f}",
            f"{cell['tok_s']:.1f}", f"{decode_x:.2f}", f"{cell['tokens']:.0f}", peak]  # fmt: skip


def _median_runs(t0: float, label: str, once, case: tuple, repeats: int) -> dict:
    runs = []
    for i in range(1 + repeats):  # run 0 is the warm-up: kernel compiles, prefill tile tuning
        r = once(*case)
        runs += [r] if i else []
        _progress(t0, f"{label}: {'warm-up' if i == 0 else f'run {i}'} TTFT {r['ttft']:.2f} s, "
                      f"{r['tok_s']:.1f} tok/s, {r['tokens']} tokens")  # fmt: skip
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench long-context", description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES, metavar="SHAPE")
    ap.add_argument("--norms", nargs="+", default=["softmax", "ssa", "entmax"], choices=NORMS, metavar="NORM")
    ap.add_argument("--prompt", type=int, nargs="+", default=[32768, 131072], help="prompt tokens, one or more")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-transformers", action="store_true", help="leave out the transformers (SDPA) rows")
    ap.add_argument(
        "--smoke", action="store_true", help="a short prompt on CPU (demo shape); writes only to a --write page"
    )
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("long-context", [] if argv is None else list(argv))
    if min(*args.prompt, args.new_tokens, args.prefill_chunk, args.repeats) < 1:
        ap.error("--prompt, --new-tokens, --prefill-chunk and --repeats must be >= 1")
    if "softmax" not in args.norms:
        args.norms = ["softmax", *args.norms]  # the baseline runs beside the candidates
    gpu = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.shapes, args.prompt, args.new_tokens, args.prefill_chunk, args.repeats = ["demo"], [300], 4, 128, 1
        args.no_write = args.no_write or args.write is None  # only to a page named with --write
    elif not gpu:
        print("sharp-bench long-context: no CUDA GPU here; use --smoke to check the script on CPU", flush=True)
        return 2
    device = "cuda" if gpu else "cpu"
    name = torch.cuda.get_device_name() if gpu else "CPU (smoke run: numbers meaningless)"
    page = output_page(args)
    cells = len(args.shapes) * len(args.prompt) * (len(args.norms) + (not args.no_transformers))
    rows: list[list[str]] = []

    def add(row: list[str]) -> None:  # written as it goes: a run cut short keeps what it measured
        rows.append(row)
        if page is not None:
            write_section("long-context", _body(args, rows, name, cells), page)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            for prompt in args.prompt:
                base = None
                context = prompt + args.new_tokens
                for norm in args.norms:
                    torch.manual_seed(0)
                    cfg = ModelConfig(**SHAPES[shape], norm=norm, context_length=context)
                    path = Path(tmp) / f"{shape}-{norm}.pt"
                    with torch.device(device):  # random init on the GPU: seconds, not the CPU's ~30 s at 1.24B
                        model = SharpLM(cfg)
                    params = model.num_params()
                    save(model, path)
                    del model
                    label = f"{shape} {norm} {prompt:,}"
                    _progress(t0, f"{label}: built and saved ({params / 1e6:,.0f}M parameters)")
                    backend = load_backend(path, "torch", device)  # once, as `sharp-serve` loads it
                    _progress(t0, f"{label}: loaded on {device}")
                    case = (backend, device, prompt, args.new_tokens, args.prefill_chunk)
                    cell = _median_runs(t0, label, _serve_once, case, args.repeats)
                    del backend
                    path.unlink()
                    base = base or cell
                    add(_cell(shape, params, norm, prompt, cell, base, device))
                if not args.no_transformers:
                    torch.manual_seed(0)
                    model = _llama(SHAPES[shape], context, device)
                    label = f"{shape} {TRANSFORMERS} {prompt:,}"
                    _progress(t0, f"{label}: built on {device}")
                    case = (model, device, prompt, args.new_tokens, args.prefill_chunk)
                    cell = _median_runs(t0, label, _transformers_once, case, args.repeats)
                    params = sum(w.numel() for w in model.parameters())
                    del model
                    add(_cell(shape, params, TRANSFORMERS, prompt, cell, base, device))
    print(_body(args, rows, name, cells))
    return 0
