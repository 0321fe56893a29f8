"""`sharp-bench`: one command, one subcommand per benchmark. Benchmarks live here, at the top of the package,
so they may use every layer and no layer carries measurement code."""

from __future__ import annotations

import sys
from importlib import import_module

# subcommand -> module with run(argv) -> int; imported only when chosen, so each needs only its own extras
COMMANDS = {
    "normalizers": "sharp.benchmarks.normalizers",
    "kernels": "sharp.benchmarks.kernels",
    "repro": "sharp.benchmarks.repro",
    "export": "sharp.benchmarks.export",
    "serve": "sharp.benchmarks.serve",
    "genai": "sharp.benchmarks.genai",
    "long-context": "sharp.benchmarks.longctx",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: sharp-bench {{{','.join(COMMANDS)}}} [options]   (sharp-bench NAME --help for options)")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"sharp-bench: unknown benchmark {name!r}; choose from: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return import_module(COMMANDS[name]).run(rest)


if __name__ == "__main__":
    sys.exit(main())
