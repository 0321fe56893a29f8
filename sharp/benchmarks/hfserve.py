"""`sharp-bench hf-serve`: a Hugging Face model served by the torch backend (sharp's paged cache and Triton kernels)
against transformers' own continuous batching (`generate_batch`, paged attention) on the same GPU.

The model is a Hugging Face directory (--model), or by default SmolLM2-135M-Instruct's shape (its config as the GGUF
states it: 30 layers, hidden 576, 9 query / 3 KV heads, vocabulary 49,152, RoPE θ 100,000, tied embeddings) with
random weights, written where the command runs: speed does not depend on the weights' values, and a GPU machine
cannot fetch the real ones. Its context is raised to the longest prompt asked. Both sides load the same directory:
sharp through `load_backend(DIR, "torch")` (models/hf_lm.py), transformers through `from_pretrained`.

Measured, in this order (each section written as it is measured):
1. **parity**: three 64-token random prompts, 64 greedy tokens each, both in fp32 (sharp's engine, one batch;
   transformers' `generate` with SDPA): the tokens equal up to the first difference;
2. **throughput**: C concurrent requests of --prompt random tokens and --new-tokens greedy tokens each (EOS
   ignored), in --dtype: sharp's engine (max batch ≥ C) against `generate_batch`; output tokens/s, medians of
   --repeats after one warm-up;
3. **TTFT**: one prompt of each --ttft length, one token: sharp's chunked prefill against transformers' one SDPA
   forward (`logits_to_keep=1`);
4. **decode at length**: one sequence after --decode-length tokens, 32 greedy steps: the time per step and the
   bytes a step must read (weights + the KV cache) over it, against a device-to-device copy's bandwidth.
"""

from __future__ import annotations

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
from sharp.models.tokenizer import BYTES
from sharp.serving.backends.loading import load_backend
from sharp.serving.config import EngineConfig
from sharp.serving.engine.engine import Engine
from sharp.serving.engine.output import Delta
from sharp.serving.requests import RequestParams, validate

SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip
TINY = dict(SMOLLM2, vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=3,
            num_key_value_heads=1)  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TITLE = "## A Hugging Face model on the torch backend vs transformers' continuous batching (GPU)"


def _progress(t0: float, message: str) -> None:
    print(f"hf-serve [{time.perf_counter() - t0:6.1f} s] {message}", file=sys.stderr, flush=True)


def write_model(where: Path, shape: dict, context: int) -> Path:
    """A random-weight Llama of `shape` as a Hugging Face directory (sharp's byte tokenizer as its tokenizer.json:
    the benchmark sends token ids)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**shape, max_position_embeddings=context)
    AutoModelForCausalLM.from_config(config).save_pretrained(where)
    (where / "tokenizer.json").write_text(BYTES.tokenizer_json(), encoding="utf-8")
    return where


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


def _rate(tokens_per_s: float) -> str:
    """Tokens/s for the table: whole numbers, but a slow side (the CPU smoke run under load) keeps 3 digits."""
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.3g}"


def sharp_generate(backend, prompts: list[list[int]], new_tokens: int, chunk: int = 2048) -> tuple[list, float, list]:
    """Every prompt through one fresh engine at once (greedy, EOS ignored): the tokens, the seconds from submission
    to the last token, and each request's first-token time."""
    longest = max(len(p) for p in prompts) + new_tokens
    kv_mb = len(prompts) * (longest + 32) * backend.kv_bytes_per_token / 2**20 * 1.05
    engine = Engine(backend, EngineConfig(kv_cache_mb=kv_mb, max_batch=max(len(prompts), 1), prefill_chunk=chunk))
    out: list[list[int]] = [[] for _ in prompts]
    first: list[float] = [0.0] * len(prompts)
    start = time.perf_counter()

    def sink(i: int):
        def put(ev) -> None:
            if isinstance(ev, Delta):
                if not out[i]:
                    first[i] = time.perf_counter() - start
                out[i].extend(ev.token_ids)

        return put

    for i, ids in enumerate(prompts):
        params = RequestParams(input_ids=ids, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engine.submit(validate(params, engine.limits, engine.tokenizer.encode), sink(i))
    while not engine.idle():
        engine.step()
    return out, time.perf_counter() - start, first


def transformers_batch(
    model, prompts: list[list[int]], new_tokens: int, device: str, warm_up: bool = False
) -> tuple[list, float]:
    """transformers' continuous batching on the same prompts (greedy, no EOS): the tokens and the seconds.

    Its manager is kept between calls (`persistent_manager`) but sized for the requests of the call that made it,
    so `warm_up` — the untimed first round of each concurrency — drops the previous one, makes one for these
    prompts and captures its CUDA graphs (on a GPU); the timed rounds reuse it as it is, warm-up left out. A manager
    made for one request and reused for 16 ran them at a fraction of its speed (2026-11-29, H200)."""
    from transformers import GenerationConfig

    if warm_up and hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    _sync(device)
    start = time.perf_counter()
    result = model.generate_batch(
        prompts, generation_config=config, progress_bar=False, persistent_manager=True,
        warmup=warm_up and device == "cuda",
    )  # fmt: skip
    _sync(device)
    seconds = time.perf_counter() - start
    by_id = sorted(result.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    return [list(r.generated_tokens) for r in by_id], seconds


def _transformers(directory: Path, dtype: torch.dtype, device: str, attention: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, attn_implementation=attention)
    return model.to(device).eval()


def parity(directory: Path, device: str, tokens: int) -> list[str]:
    """fp32 greedy tokens, sharp against transformers' generate: how many agree before the first difference."""
    backend = load_backend(directory, "torch", device, dtype="fp32")
    prompts = _prompts(3, 64, backend.spec.vocab_size, seed=1)
    ours, _, _ = sharp_generate(backend, prompts, tokens)
    model = _transformers(directory, torch.float32, device, "sdpa")
    model.generation_config.eos_token_id = None
    rows = []
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            want = model.generate(torch.tensor([ids], device=device), max_new_tokens=tokens, do_sample=False)
        want = want[0, len(ids) :].tolist()
        same = next((j for j, (a, b) in enumerate(zip(ours[i], want, strict=True)) if a != b), len(want))
        rows.append(f"{i}: {same}/{len(want)} greedy tokens equal" + (" ✓" if same == len(want) else " ✗"))
    return rows


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench hf-serve", description=__doc__)
    ap.add_argument("--model", type=Path, help="a Hugging Face directory (default: SmolLM2's shape, random weights)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ttft", type=int, nargs="+", default=[8192, 32768], help="prompt lengths for TTFT")
    ap.add_argument("--decode-length", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape and short lengths on CPU: checks the script")
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("hf-serve", [] if argv is None else list(argv))
    if min(*args.concurrency, args.prompt, args.new_tokens, *args.ttft, args.decode_length, args.repeats) < 1:
        ap.error("--concurrency, --prompt, --new-tokens, --ttft, --decode-length and --repeats must be >= 1")
    gpu = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.concurrency, args.prompt, args.new_tokens, args.ttft = [1, 3], 24, 6, [96]
        args.decode_length, args.repeats, args.dtype = 128, 1, "fp32"
        args.no_write = args.no_write or args.write is None
    elif not gpu:
        print("sharp-bench hf-serve: no CUDA GPU here; use --smoke to check the script on CPU", flush=True)
        return 2
    device = "cuda" if gpu else "cpu"
    name = torch.cuda.get_device_name() if gpu else "CPU (smoke run: numbers meaningless)"
    page = output_page(args)
    sections: dict[str, str] = {}  # title → text, in the order first measured; a table grown by a row replaces itself
    t0 = time.perf_counter()

    def add(title: str, text: str) -> None:  # written as it goes: a run cut short keeps what it measured
        sections[title] = text
        body = (
            f"{TITLE}\n\n{today()}, {name}, {args.command}; model "
            f"{args.model or 'SmolLM2-135M shape, random weights'}, {args.dtype} unless said.\n\n"
            + "\n\n".join(f"**{t}**\n\n{x}" for t, x in sections.items())
        )
        if page is not None:
            write_section("hf-serve", body, page)
        print(f"{title}\n{text}\n", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        context = max(*args.ttft, args.decode_length, args.prompt) + args.new_tokens + 64
        directory = args.model or write_model(Path(tmp) / "model", TINY if args.smoke else SMOLLM2, context)
        _progress(t0, f"model at {directory}")
        add("Greedy parity, fp32", "\n".join(f"- {r}" for r in parity(directory, device, 64 if gpu else 8)))
        _progress(t0, "parity done")
        dtype = DTYPES[args.dtype]
        backend = load_backend(directory, "torch", device, dtype=args.dtype)
        model = _transformers(directory, dtype, device, "sdpa")
        vocab = backend.spec.vocab_size
        rows = []
        for c in args.concurrency:
            prompts = _prompts(c, args.prompt, vocab)
            sharp_s, theirs_s = [], []
            warm = 0 if args.smoke else 1  # the first round: warm-up (compiles, graph captures), untimed
            for r in range(args.repeats + warm):
                _, s, _ = sharp_generate(backend, prompts, args.new_tokens)
                _, t = transformers_batch(model, prompts, args.new_tokens, device, warm_up=r == 0)
                if r >= warm:
                    sharp_s.append(s)
                    theirs_s.append(t)
            total = c * args.new_tokens
            ours, theirs = total / statistics.median(sharp_s), total / statistics.median(theirs_s)
            rows.append([str(c), _rate(ours), _rate(theirs), f"{ours / theirs:.2f}×"])
            _progress(t0, f"C={c}: sharp {ours:,.0f} tok/s, transformers {theirs:,.0f} tok/s")
            add("Throughput", markdown_table(["C", "sharp tok/s", "transformers CB tok/s", "ratio"], rows))
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        rows = []
        for length in args.ttft:
            ids = _prompts(1, length, vocab)
            sharp_t, theirs_t = [], []
            for r in range(args.repeats + 1):
                _, _, first = sharp_generate(backend, ids, 1)
                _sync(device)
                start = time.perf_counter()
                with torch.inference_mode():
                    model(torch.tensor(ids, device=device), logits_to_keep=1).logits.argmax(-1).tolist()
                _sync(device)
                if r:
                    sharp_t.append(first[0])
                    theirs_t.append(time.perf_counter() - start)
            ours, theirs = statistics.median(sharp_t), statistics.median(theirs_t)
            rows.append([f"{length:,}", f"{ours:.3f}", f"{theirs:.3f}", f"{ours / theirs:.2f}×"])
            _progress(t0, f"TTFT {length}: sharp {ours:.3f} s, transformers {theirs:.3f} s")
            add("TTFT", markdown_table(["prompt", "sharp s", "transformers SDPA s", "ratio"], rows))
        del model
        ids = _prompts(1, args.decode_length, vocab)
        steps = 32
        _, total, first = sharp_generate(backend, ids, steps + 1)
        per_step = (total - first[0]) / steps
        spec = backend.spec
        weights = sum(p.numel() * p.element_size() for p in backend.model.parameters())
        kv = 2 * spec.layers * spec.kv_heads * spec.head_dim * args.decode_length * dtype.itemsize
        copy = _copy_bandwidth(device)
        used = (weights + kv) / per_step
        add(
            f"Decode after {args.decode_length:,} tokens",
            f"{per_step * 1e3:.2f} ms a step; reads {(weights + kv) / 2**20:,.0f} MiB (weights {weights / 2**20:,.0f},"
            f" KV {kv / 2**20:,.0f}): {used / 1e9:,.0f} GB/s = {used / copy:.0%} of a device copy's"
            f" {copy / 1e9:,.0f} GB/s",
        )
    return 0


def _copy_bandwidth(device: str) -> float:
    """Bytes a second a device-to-device copy of 1 GiB moves (read + write), best of five."""
    n = (1 << 30) // 4 if device == "cuda" else (1 << 24)
    a = torch.empty(n, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        b.copy_(a)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * a.numel() * a.element_size() / best
