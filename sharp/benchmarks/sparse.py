"""`sharp-bench sparse-decode`: a decode step of an entmax model that skips the KV pages with zero weight (exact
sparse decode, models/sparse_decode.py) against the same model reading every page, and against a softmax model of
the same shape — on the torch backend's paged cache, CPU, at growing context.

Each model prefills the same text (the Python standard library's sources, the zoo's corpus) to each length in
chunks, as the torch backend does; then rounds of decode steps take turns between the variants (entmax sparse,
entmax dense, softmax), entmax's two sides decoding on one cache. Reported per length: the median ms per decode
step of each variant with its spread over rounds, the ratios, and the share of (query head, page) pairs the sparse
steps skipped, per layer.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

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
from sharp.models import load
from sharp.models.checkpoint import zoo_dir
from sharp.models.corpus import stdlib_corpus
from sharp.models.lm import SharpLM
from sharp.serving.backends.torch_backend import REFERENCE_DECODE_LOGITS, STREAMED_FROM_KEYS
from sharp.serving.kv.pages import PagedKVCache

PAGE = 16
CHUNK = 1024  # prefill chunk (tokens)
NAMES = ("entmax sparse", "entmax dense", "softmax")


@dataclass
class Variant:
    """One side of the comparison: a model on a prefilled cache (entmax sparse and dense share theirs), decoding
    with or without skipping pages."""

    name: str
    model: SharpLM
    cache: PagedKVCache
    sparse: bool
    times: list[float] = field(default_factory=list)
    skipped: list[list[float]] = field(default_factory=list)
    weighed: list[list[float]] = field(default_factory=list)
    by_head: list[list[tuple]] = field(default_factory=list)  # per step and layer: (pages, kept, weighted) a head


def _log(message: str) -> None:
    print(f"sparse-decode: {message}", file=sys.stderr, flush=True)


def _impl(keys: int, heads: int, decoding: bool) -> str:
    """The CPU torch backend's choice (serving/backends/torch_backend.py): streamed for long prefill chunks."""
    small = decoding and heads * keys <= REFERENCE_DECODE_LOGITS
    return "streamed" if keys >= STREAMED_FROM_KEYS and not small else "reference"


@torch.inference_mode()
def _prefill(model: SharpLM, cache: PagedKVCache, ids: torch.Tensor) -> None:
    for start in range(0, ids.numel(), CHUNK):
        chunk = ids[start : start + CHUNK][None]
        cache.reserve("s", start + chunk.shape[1])
        step = cache.step(["s"], chunk.shape[1])
        positions = torch.arange(start, start + chunk.shape[1])[None]
        model.step(chunk, cache=step, positions=positions, impl=_impl(step.longest, model.cfg.heads, False))
        step.commit()


@torch.inference_mode()
def _decode(v: Variant, token: int) -> tuple[float, list[float], list[float], list[tuple]]:
    """One decode step: its time, and per layer the share of pages skipped, the share of keys whose values were
    read and each query head's (pages, kept, weighted) counts (all empty for a dense step)."""
    length = v.cache.lengths["s"]
    v.cache.reserve("s", length + 1)
    step = v.cache.step(["s"], 1)
    step.skip_pages = v.sparse  # the dense side writes the summaries too (the sparse side reads them next)
    began = time.perf_counter()
    impl = _impl(length + 1, v.model.cfg.heads, True)
    v.model.step(torch.tensor([[token]]), cache=step, positions=torch.tensor([[length]]), impl=impl)
    took = time.perf_counter() - began
    step.commit()
    rows = v.model.cfg.heads * (length + 1)
    layers = sorted(step.sparse)
    stats = [step.sparse[i] for i in layers]
    return took, [s.skipped for s in stats], [s.values / rows for s in stats], [s.by_head for s in stats]


def _native(variants: list[Variant], token: int, args) -> list[str]:
    """The native op's cells of one length: each side's median ms per step's attention ± its range, the ratios and
    the largest difference between the sparse and dense outputs (sharp.benchmarks.sparse_native)."""
    from sharp.benchmarks import sparse_native as native

    entmax, softmax = (
        native.capture(lambda: _decode(variants[1], token)),
        native.capture(lambda: _decode(variants[2], token)),
    )
    sides = {NAMES[0]: [native.Layer(c, True, args.threads) for c in entmax],
             NAMES[1]: [native.Layer(c, False, args.threads) for c in entmax],
             NAMES[2]: [native.Layer(c, False, args.threads) for c in softmax]}  # fmt: skip
    delta = max(
        float(np.abs(s.run()[1] - d.run()[1]).max()) for s, d in zip(sides[NAMES[0]], sides[NAMES[1]], strict=True)
    )
    for layers in sides.values():  # warm: each session's first run allocates
        native.step_time(layers)
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    for r in range(args.rounds):
        for name in NAMES if r % 2 == 0 else NAMES[::-1]:
            times[name] += [native.step_time(sides[name]) for _ in range(args.steps)]
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    spread = {n: (max(t) - min(t)) * 1e3 for n, t in times.items()}
    _log("native: " + ", ".join(f"{k} {x:.2f} ms" for k, x in med.items()))
    return [
        *(f"{med[n]:.2f} ± {spread[n]:.2f}" for n in NAMES),
        f"{med[NAMES[0]] / med[NAMES[1]]:.2f}×", f"{med[NAMES[0]] / med[NAMES[2]]:.2f}×",
        f"{med[NAMES[1]] / med[NAMES[2]]:.2f}×", f"{delta:.1e}",
    ]  # fmt: skip


def _cache(model: SharpLM, tokens: int, bounds: bool) -> PagedKVCache:
    c = model.cfg
    return PagedKVCache(c.layers, c.kv_heads, c.head_dim, -(-tokens // PAGE) + 4, PAGE, bounds=bounds)


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench sparse-decode", description=__doc__)
    zoo = zoo_dir()
    ap.add_argument("--entmax", type=Path, default=zoo / "entmax.pt", help="an entmax-family SharpLM checkpoint")
    ap.add_argument("--softmax", type=Path, default=zoo / "softmax.pt", help="a softmax SharpLM of the same shape")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768], help="context lengths (tokens)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of decode steps, the variants taking turns")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per variant per round")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--native", action="store_true", help="also time the steps' attention on the native onnxruntime op")
    add_output(ap)
    args = ap.parse_args(argv)
    for name in ("entmax", "softmax"):
        if not getattr(args, name).is_file():
            ap.error(f"--{name} {getattr(args, name)} is not a file")
    if min(args.lengths) < 1 or args.rounds < 1 or args.steps < 1:
        ap.error("--lengths, --rounds and --steps must be ≥ 1")
    torch.set_num_threads(args.threads)
    entmax, softmax = load(args.entmax).eval(), load(args.softmax).eval()
    sizes = lambda m: replace(m.cfg.shape, context_length=1)  # a decode step's cost: not the recorded context
    if sizes(entmax) != sizes(softmax):
        ap.error(f"--entmax and --softmax differ in shape: {entmax.cfg.shape} vs {softmax.cfg.shape}")
    corpus = stdlib_corpus()
    rows, skip_rows, value_rows, head_rows, native_rows = [], [], [], [], []
    for length in args.lengths:
        ids = torch.tensor(list(corpus[:length]), dtype=torch.long)
        if ids.numel() < length:
            ap.error(f"the corpus holds {ids.numel()} bytes, fewer than --lengths {length}")
        tokens = length + 2 * args.rounds * args.steps + 1
        shared, own = _cache(entmax, tokens, bounds=True), _cache(softmax, tokens, bounds=False)
        for model, cache in ((entmax, shared), (softmax, own)):
            began = time.perf_counter()
            _prefill(model, cache, ids)
            _log(f"{length} tokens: {model.cfg.norm} prefilled in {time.perf_counter() - began:.1f} s")
        variants = [Variant(NAMES[0], entmax, shared, True), Variant(NAMES[1], entmax, shared, False),
                    Variant(NAMES[2], softmax, own, False)]  # fmt: skip
        token = int(corpus[length])
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                for _ in range(args.steps):
                    took, skipped, weighed, by_head = _decode(v, token)
                    v.times.append(took)
                    if skipped:
                        v.skipped.append(skipped)
                        v.weighed.append(weighed)
                        v.by_head.append(by_head)
        med = {v.name: statistics.median(v.times) * 1e3 for v in variants}
        spread = {v.name: (max(v.times) - min(v.times)) * 1e3 for v in variants}
        rows.append([
            f"{length:,}", *(f"{med[v.name]:.1f} ± {spread[v.name]:.1f}" for v in variants),
            f"{med['entmax sparse'] / med['entmax dense']:.2f}×", f"{med['entmax sparse'] / med['softmax']:.2f}×",
            f"{med['entmax dense'] / med['softmax']:.2f}×",
        ])  # fmt: skip
        per_layer = torch.tensor(variants[0].skipped).mean(0).tolist()
        skip_rows.append([f"{length:,}", *(f"{x:.1%}" for x in per_layer), f"{statistics.fmean(per_layer):.1%}"])
        per_layer = torch.tensor(variants[0].weighed).mean(0).tolist()
        value_rows.append([f"{length:,}", *(f"{x:.2%}" for x in per_layer), f"{statistics.fmean(per_layer):.2%}"])
        counts = torch.tensor(variants[0].by_head, dtype=torch.float64).sum(0)  # (layers, heads, 3) over the steps
        for layer, heads in enumerate(counts):
            head_rows.append([f"{length:,}", str(layer), *(f"{k / n:.1%} ({w / n:.1%})" for n, k, w in heads.tolist())])
        _log(f"{length} tokens: " + ", ".join(f"{k} {x:.1f} ms" for k, x in med.items()))
        if args.native:
            native_rows.append([f"{length:,}", *_native(variants, token, args)])
    layers = entmax.cfg.layers

    def past(model: SharpLM, name: str) -> str:
        beyond = [n for n in args.lengths if n > model.cfg.context_length]
        if not beyond:
            return ""
        return (
            f" The {name} model decodes past its recorded context of {model.cfg.context_length:,} at"
            f" {', '.join(f'{n:,}' for n in beyond)} keys: a speed reference there, not a quality one."
        )

    body = "\n\n".join([
        "## Exact sparse entmax decode on CPU (`sharp-bench sparse-decode`)",
        f"Measured {today()} on {machine()}, {args.threads} torch threads. "
        f"Command: {command_line('sparse-decode', argv or [])}. "
        f"Models: `{args.entmax.name}` ({entmax.cfg.norm}) and `{args.softmax.name}` ({softmax.cfg.norm}), "
        f"{layers} layers × {entmax.cfg.heads} heads, head dim {entmax.cfg.head_dim}, on the torch backend's paged "
        "cache (16-key pages; CPU attention as the backend picks it: the reference for these decode steps). "
        "Each prefilled the same stdlib text to the "
        f"length (entmax once: its sparse and dense sides decode on one cache, the summaries kept by both), then "
        f"{args.rounds} rounds of {args.steps} decode steps per variant, taking turns; a step is the model's whole "
        "forward (all layers). Medians ± the range over all steps; ratios of medians."
        + past(entmax, "entmax")
        + past(softmax, "softmax"),
        markdown_table(
            ["context", *(f"{n} ms/step" for n in NAMES), "sparse / dense", "sparse / softmax",
             "dense / softmax"],
            rows,
        ),
        "Share of (query head, page) pairs the sparse steps did not read, per layer (mean over its steps):",
        markdown_table(["context", *(f"layer {i}" for i in range(layers)), "mean"], skip_rows),
        "Share of (query head, key) pairs whose values the sparse steps read — the keys above the floor on the "
        "threshold that the Newton steps raise, the candidates for the support (mean over its steps):",
        markdown_table(["context", *(f"layer {i}" for i in range(layers)), "mean"], value_rows),
        "Per query head: the share of its pages the sparse steps read, and in brackets the share holding a key with "
        "weight — the fewest pages any bound on a page's keys could read. Far apart, the bound is loose; close "
        "together, the support itself is spread over the pages:",
        markdown_table(["context", "layer", *(f"head {h}" for h in range(entmax.cfg.heads))], head_rows),
    ])  # fmt: skip
    if args.native:
        body += "\n\n" + "\n\n".join([
            "The same steps' attention on the native onnxruntime op (`--native`): each layer of one captured decode "
            "step of each model as a one-node cache-form session run in place (presents bound to the pasts, as "
            "sharp-serve runs it), with the key summary (entmax sparse: pages skipped by their bounds), without it "
            f"(entmax dense: every key read) and for the softmax model; {args.threads} onnxruntime threads; a step is "
            f"the sum over the layers; {args.rounds} rounds of {args.steps} steps per side, taking turns. "
            "`max |Δ|`: the largest difference between the sparse and the dense outputs.",
            markdown_table(["context", *(f"{n} ms/step" for n in NAMES), "sparse / dense", "sparse / softmax",
                            "dense / softmax", "max |Δ|"], native_rows),
        ])  # fmt: skip
    print(body)
    page = output_page(args)
    if page is not None:
        write_section("sparse-decode", body, page)
    return 0
