"""`sharp-bench sparse-serve`: entmax decode against softmax decode as sharp-serve runs them on CPU — the exported
file in onnxruntime with sharp's native op, whose entmax decode reads the values of each row's support only
(docs/op.md) — at growing context, and through sharp-serve itself after a long prompt.

The zoo's entmax model (α-entmax, NAPE; --entmax takes others too, e.g. the zoo's ASEntmax model) and its softmax
twin (RoPE) of the same shape are exported with `sharp-export` into the workdir. A model whose recorded context is
shorter than the longest prompt is exported from a copy with that context raised (the softmax twin: RoPE past its
training length, so its text is poor — it is the speed reference, not a quality one; the NAPE models record 65,536).

Decode steps: each file is loaded as sharp-serve loads it (`load_backend`, the onnxruntime backend with the native
op), prefills the same stdlib text to each length in the server's chunks, then rounds of decode steps take turns
between the models (greedy, per-head entropies asked for, as the metrics do). Served: sharp-serve on each file in its
own process (prefix cache off), rounds taking turns, each request a fresh window of stdlib text of --prompt tokens
at its own offset and --new-tokens greedy tokens streamed over the OpenAI API; decode tokens/s at the client after
the first token. Medians and ranges; ratios of medians.
"""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import time
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
from sharp.benchmarks.peers import Reading, start_sharp
from sharp.models import load, save
from sharp.models.checkpoint import zoo_dir
from sharp.models.corpus import stdlib_corpus
from sharp.models.lm import SharpLM

CHUNK = 256  # sharp-serve's default --prefill-chunk


def _log(message: str) -> None:
    print(f"sparse-serve: {message}", file=sys.stderr, flush=True)


def _offset(r: int) -> int:
    """Where served round r's prompt starts in the corpus: a fresh window each round."""
    return 1000 + r * 7919


def export(checkpoint: Path, model: SharpLM, context: int, workdir: Path) -> tuple[Path, bool]:
    """`sharp-export` of the checkpoint (`model`, loaded), or of a copy whose recorded context is raised to `context`
    when it is shorter; returns the file and whether a copy was made."""
    raised = model.cfg.context_length < context
    source = checkpoint
    if raised:
        model.cfg = dataclasses.replace(model.cfg, context_length=context)
        source = save(model, workdir / f"{checkpoint.stem}-{context}.pt")
    out = workdir / f"{source.stem}.onnx"
    if not out.is_file() or out.stat().st_mtime < source.stat().st_mtime:
        _log(f"exporting {source.name}")
        subprocess.run([sys.executable, "-m", "sharp.exporter.cli", str(source), "-o", str(out)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    return out, raised


def decode_steps(files: dict[str, Path], ids: np.ndarray, rounds: int, steps: int) -> dict[str, list[float]]:
    """ms per decode step of each file after prefilling `ids`, the files taking turns each round."""
    from sharp.serving import load_backend

    backends = {}
    for name, path in files.items():
        be = load_backend(path)
        be.allocate((ids.size + rounds * steps + 8) * be.kv_bytes_per_token)
        if not be.reserve("s", ids.size + rounds * steps + 1):
            raise RuntimeError(f"{path.name}: no room for {ids.size} tokens")
        began = time.perf_counter()
        for start in range(0, ids.size, CHUNK):
            be.prefill("s", ids[None, start : start + CHUNK], start, entropy=False)
        be.join("s")
        _log(f"{ids.size} tokens: {name} prefilled in {time.perf_counter() - began:.1f} s")
        backends[name] = be
    token = {name: np.array([[int(ids[-1])]]) for name in files}
    times: dict[str, list[float]] = {name: [] for name in files}
    order = list(files)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            be = backends[name]
            for _ in range(steps):
                began = time.perf_counter()
                out = be.decode(["s"], token[name], entropy=True)
                times[name].append((time.perf_counter() - began) * 1e3)
                token[name] = np.array([[int(np.argmax(out.logits[0]))]])
    for be in backends.values():
        be.release("s")
    return times


def served(files: dict[str, Path], corpus: bytes, prompt: int, new: int, rounds: int, workdir: Path,
           threads: int) -> dict[str, list[Reading]]:  # fmt: skip
    """Each file behind its own sharp-serve; per round one fresh prompt to each, taking turns."""
    peers = {name: start_sharp(path, name, threads, workdir / f"serve-{name}.log") for name, path in files.items()}
    readings: dict[str, list[Reading]] = {name: [] for name in files}
    try:
        order = list(files)
        for r in range(rounds + 1):  # round 0 warms each server up and is not counted
            ids = list(corpus[_offset(r) : _offset(r) + prompt])
            for name in order if r % 2 == 0 else order[::-1]:
                reading = peers[name].generate([ids], new)[0]
                _log(f"round {r}: {name} TTFT {reading.ttft:.1f} s, decode {reading.decode:.0f} tok/s")
                if r:
                    readings[name].append(reading)
    finally:
        for p in peers.values():
            p.stop()
    return readings


def _med(xs: list[float], spec: str = ".2f") -> str:
    return f"{statistics.median(xs):{spec}} ({min(xs):{spec}}–{max(xs):{spec}})"


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench sparse-serve", description=__doc__)
    zoo = zoo_dir()
    ap.add_argument("--entmax", type=Path, nargs="+", default=[zoo / "entmax.pt"],
                    help="entmax-family SharpLM checkpoints (e.g. models/zoo/asentmax.pt too)")  # fmt: skip
    ap.add_argument("--softmax", type=Path, default=zoo / "softmax.pt", help="a softmax SharpLM of the same shape")
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 16384, 32768],
                    help="contexts of the in-process decode steps (none: skip them)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5, help="rounds, the models taking turns")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per model per round")
    ap.add_argument("--prompt", type=int, default=30000, help="prompt tokens of the served requests (0: skip them)")
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per served request")
    ap.add_argument("--serve-rounds", type=int, default=3, help="served requests per model (after a warm-up one)")
    ap.add_argument("--threads", type=int, default=0, help="sharp-serve --threads (0: its default)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/sharp-sparse-serve"), help="exports go here")
    add_output(ap)
    args = ap.parse_args(argv)
    checkpoints = {p.stem: p for p in args.entmax}
    if len(checkpoints) < len(args.entmax) or "softmax" in checkpoints:
        ap.error("--entmax files need distinct names, none of them `softmax`")
    checkpoints["softmax"] = args.softmax
    for name, path in checkpoints.items():
        if not path.is_file():
            ap.error(f"--{'softmax' if name == 'softmax' else 'entmax'} {path} is not a file")
    if any(n < 1 for n in args.lengths) or min(args.rounds, args.steps, args.serve_rounds, args.new_tokens) < 1:
        ap.error("--lengths, --rounds, --steps, --serve-rounds and --new-tokens must be ≥ 1")
    if args.prompt < 0 or (args.prompt == 0 and not args.lengths):
        ap.error("--prompt must be ≥ 0, and --prompt 0 needs --lengths")
    corpus = stdlib_corpus()
    longest = max([*args.lengths, _offset(args.serve_rounds) + args.prompt])
    if longest > len(corpus):
        ap.error(f"the corpus holds {len(corpus):,} bytes, fewer than the {longest:,} asked for")
    models = {name: load(path) for name, path in checkpoints.items()}
    shapes = {name: model.cfg for name, model in models.items()}
    same = ("layers", "heads", "kv_heads", "head_dim", "vocab_size")
    for name, cfg in shapes.items():
        if cfg.norm not in ("entmax", "asentmax") and name != "softmax":
            ap.error(f"--entmax {checkpoints[name]} is a {cfg.norm} model, not of the entmax family")
        if any(getattr(cfg, k) != getattr(shapes["softmax"], k) for k in same):
            ap.error(
                f"{checkpoints[name]} and --softmax differ in shape (layers, heads, KV heads, head dim or vocabulary)"
            )
    names = list(checkpoints)
    entmaxes = names[:-1]
    args.workdir.mkdir(parents=True, exist_ok=True)
    context = max([*args.lengths, args.prompt]) + max(args.rounds * args.steps, args.new_tokens) + 64
    files, raised = {}, []
    for name, path in checkpoints.items():
        files[name], copied = export(path, models[name], context, args.workdir)
        if copied:
            raised.append(f"`{path.name}`")

    step_rows = []
    for length in args.lengths:
        ids = np.frombuffer(corpus[:length], np.uint8).astype(np.int64)
        times = decode_steps(files, ids, args.rounds, args.steps)
        med = {n: statistics.median(t) for n, t in times.items()}
        step_rows.append([f"{length:,}", *(_med(times[n]) for n in names),
                          *(f"{med[n] / med['softmax']:.2f}×" for n in entmaxes)])  # fmt: skip
        _log(f"{length} tokens: " + ", ".join(f"{n} {m:.2f} ms" for n, m in med.items()))
    serve_rows = []
    if args.prompt:
        readings = served(files, corpus, args.prompt, args.new_tokens, args.serve_rounds, args.workdir, args.threads)
        rate = {n: [r.decode for r in rs] for n, rs in readings.items()}
        ttft = {n: [r.ttft for r in rs] for n, rs in readings.items()}
        for n in names:
            ratio = statistics.median(rate[n]) / statistics.median(rate["softmax"])
            serve_rows.append([n, f"{args.prompt:,}", _med(ttft[n], ".1f"), _med(rate[n], ".0f"), f"{ratio:.2f}×"])

    cfg = shapes["softmax"]
    parts = [
        "## Entmax decode against softmax decode in onnxruntime and through sharp-serve (`sharp-bench sparse-serve`)",
        f"Measured {today()} on {machine()}. Command: {command_line('sparse-serve', argv or [])}. Models: "
        + ", ".join(f"`{p.name}` ({shapes[n].norm})" for n, p in checkpoints.items())
        + f", {cfg.layers} layers × {cfg.heads} heads, head dim "
        f"{cfg.head_dim}, exported with `sharp-export` (fp32; onnxruntime with sharp's native op, whose entmax "
        "decode reads every key but the values of each row's support only)"
        + (f"; {', '.join(raised)} from a copy with the recorded context raised to {context:,} (for `softmax.pt`, "
           "RoPE past its training length: the speed reference, not a quality one)" if raised else "")
        + ". Prompts are the standard library's sources (the zoo's corpus), one byte a token.",
    ]  # fmt: skip
    if step_rows:
        parts += [
            f"Decode steps in process, as sharp-serve runs them (`load_backend`; prefill in {CHUNK}-token chunks, "
            f"then {args.rounds} rounds of {args.steps} greedy steps per model, taking turns; per-head entropies "
            "asked for). ms per step: median (lowest–highest).",
            markdown_table(
                ["context", *(f"{n} ms/step" for n in names), *(f"{n} / softmax" for n in entmaxes)], step_rows
            ),
        ]
    if serve_rows:
        parts += [
            f"Through sharp-serve (its own process per model, prefix cache off, OpenAI API streamed): after one "
            f"warm-up request each, {args.serve_rounds} round(s) taking turns, each request a fresh window of "
            f"{args.prompt:,} tokens and {args.new_tokens} greedy tokens. Median (lowest–highest); decode rate "
            "ratio against softmax's (above 1: faster).",
            markdown_table(["model", "prompt", "TTFT s", "decode tok/s", "decode ÷ softmax's"], serve_rows),
        ]
    body = "\n\n".join(parts)
    print(body)
    page = output_page(args)
    if page is not None:
        write_section("sparse-serve", body, page)
    return 0
