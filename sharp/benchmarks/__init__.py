"""`sharp-bench`: one command, one subcommand per benchmark. Benchmarks live here, at the top of the package,
so they may use every layer and no layer carries measurement code."""

from __future__ import annotations

import sys
from importlib import import_module

# subcommand -> (module with run(argv) -> int, what it measures); imported only when chosen, so each needs only its
# own extras
COMMANDS = {
    "normalizers": ("sharp.benchmarks.normalizers", "reference vs streamed attention on CPU: time and peak memory"),
    "kernels": ("sharp.benchmarks.kernels", "Triton kernels vs SDPA and FlexAttention on a GPU (--smoke: CPU check)"),
    "repro": ("sharp.benchmarks.repro", "the papers' long-context results: max-retrieval, copy"),
    "export": ("sharp.benchmarks.export", "onnxruntime latency and memory of exported files vs torch's own SDPA"),
    "serve": ("sharp.benchmarks.serve", "sharp-serve under gRPC load vs its own baselines"),
    "genai": ("sharp.benchmarks.genai", "sharp-serve vs onnxruntime-genai on the same package"),
    "hostile": ("sharp.benchmarks.hostile", "a bystander's /health and first token while hostile schemas compile"),
    "peers": ("sharp.benchmarks.peers", "long context on CPU vs llama.cpp and onnxruntime-genai (make peers)"),
    "chat": ("sharp.benchmarks.chat", "multi-turn chat over a long document vs llama-server (prefix caches)"),
    "routers": ("sharp.benchmarks.routers", "two replicas behind vllm-router: cache-aware vs round-robin routing"),
    "long-context": ("sharp.benchmarks.longctx", "long-context serving on a GPU vs softmax (--smoke: CPU check)"),
    "quality": (
        "sharp.benchmarks.quality",
        "long-context quality of sharpening settings on a real model: passkey,"
        " perplexity and attention entropy by position (docs/quality.md)",
    ),
    "sparse-decode": (
        "sharp.benchmarks.sparse",
        "entmax decode skipping zero-weight KV pages vs reading them all vs softmax, on CPU (torch backend's cache)",
    ),
    "sparse-serve": (
        "sharp.benchmarks.sparse_serve",
        "entmax decode vs softmax decode in onnxruntime (native op) and through sharp-serve after a long prompt, CPU",
    ),
    "hf-serve": (
        "sharp.benchmarks.hfserve",
        "a Hugging Face model on the torch backend vs transformers' continuous batching, on a GPU (--smoke: CPU check)",
    ),
}
USAGE = "\n".join(
    [
        "usage: sharp-bench COMMAND [options]   (sharp-bench COMMAND --help for its options)",
        "",
        "commands:",
        *(f"  {name:<14}{about}" for name, (_, about) in COMMANDS.items()),
        "",
        "Results go to docs/benchmarks.md inside a sharp checkout; elsewhere only with --write PATH.",
    ]
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"sharp-bench: unknown benchmark {name!r}; choose from: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return import_module(COMMANDS[name][0]).run(rest)


if __name__ == "__main__":
    sys.exit(main())
