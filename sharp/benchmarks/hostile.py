"""`sharp-bench hostile`: does a bystander keep its pace while other clients send schemas that take seconds to compile?

One sharp-serve process per engine placement (in the server's process, in its own), the zoo model. A bystander
measures `/health` and a streamed completion's time to its first token, alone ("unloaded") and while hostile
clients keep sending large JSON schemas (vLLM's `structured_outputs`; "loaded"): each a new object of
`--properties` optional properties, so no compile is cached, and each refused after its compile (past llguidance's
limits; a run whose hostile requests are answered otherwise fails). Rounds alternate; medians and spreads of every
measurement, and the loaded/unloaded ratio. The bound asked for: loaded within 2× of unloaded.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
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
from sharp.benchmarks.serve import sharp_serve
from sharp.models.checkpoint import zoo_model


def _post(url: str, body: dict, stream: bool = False) -> float:
    """Seconds to the response's first byte of data (a stream's first event), the rest read and dropped."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    began = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            first = None
            for line in r:
                if first is None and (not stream or line.startswith(b"data: {")):
                    first = time.perf_counter() - began
            return first if first is not None else time.perf_counter() - began
    except urllib.error.HTTPError as e:  # the hostile schemas' refusal: read, counted as done
        e.read()
        return time.perf_counter() - began


def _health(base: str) -> float:
    began = time.perf_counter()
    with urllib.request.urlopen(f"{base}/health", timeout=300) as r:
        r.read()
    return time.perf_counter() - began


class Hostile:
    """`clients` threads sending fresh large schemas until stopped; counts what they sent."""

    def __init__(self, api: str, model: str, properties: int, clients: int):
        self.api, self.model, self.properties = api, model, properties
        self.stop, self.sent, self.unexpected = threading.Event(), 0, []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, who: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            props = {f"c{who}r{n}p{i}": {"type": "string"} for i in range(self.properties)}  # new: never cached
            schema = {"type": "object", "properties": props}
            body = {"model": self.model, "prompt": "x", "max_tokens": 2, "structured_outputs": {"json": schema}}
            request = urllib.request.Request(f"{self.api}/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})  # fmt: skip
            try:
                urllib.request.urlopen(request, timeout=300).read()
                self.unexpected.append("200")
            except urllib.error.HTTPError as e:
                if "parser items in a row" not in e.read().decode(errors="replace"):
                    self.unexpected.append(str(e.code))
            self.sent += 1

    def __enter__(self) -> Hostile:
        for t in self.threads:
            t.start()
        time.sleep(0.5)  # their first compiles under way
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def measure(api: str, model: str, probes: int) -> tuple[list[float], list[float]]:
    """`probes` /health times and `probes` streamed first-token times, taken in turn."""
    base = api.removesuffix("/v1")
    plain = {"model": model, "prompt": "def main():", "max_tokens": 4, "stream": True}
    health, ttft = [], []
    for _ in range(probes):
        health.append(_health(base))
        ttft.append(_post(f"{api}/completions", plain, stream=True))
    return health, ttft


def bench(model: Path, args) -> str:
    rows, where = [], machine()
    for placement in ("off", "on"):
        unloaded: tuple[list[float], list[float]] = ([], [])
        loaded: tuple[list[float], list[float]] = ([], [])
        sent = 0
        with sharp_serve(model, 8, "layer", engine_process=placement) as srv:
            measure(srv.openai_url, model.stem, 2)  # warm
            for _ in range(args.repeats):  # rounds alternate: a drift of the machine hits both alike
                for into, got in zip(unloaded, measure(srv.openai_url, model.stem, args.probes), strict=True):
                    into.extend(got)
                with Hostile(srv.openai_url, model.stem, args.properties, args.clients) as hostile:
                    for into, got in zip(loaded, measure(srv.openai_url, model.stem, args.probes), strict=True):
                        into.extend(got)
                sent += hostile.sent
                if hostile.unexpected:  # not the compile-then-refuse load this measures
                    raise RuntimeError(f"hostile requests answered {hostile.unexpected[:3]}, not the parser-limit 400")
        name = {"off": "in the server's process", "on": "in its own process (--engine-process on)"}[placement]
        for what, a, b in (("/health", *(x[0] for x in (unloaded, loaded))),
                           ("first token, streamed", *(x[1] for x in (unloaded, loaded)))):  # fmt: skip
            ma, mb = statistics.median(a), statistics.median(b)
            rows.append([name, what, f"{ma * 1000:.1f}", f"{mb * 1000:.1f}", f"{mb / ma:.2f}×",
                         f"{min(a) * 1000:.1f}–{max(a) * 1000:.1f}", f"{min(b) * 1000:.1f}–{max(b) * 1000:.1f}",
                         str(sent)])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    header = ["engine", "probe", "unloaded ms (median)", "loaded ms (median)", "loaded / unloaded",
              "unloaded, lowest–highest", "loaded, lowest–highest", "hostile schemas sent"]  # fmt: skip
    return "\n".join(
        [
            "## A bystander while hostile schemas compile (sharp-bench hostile)",
            "",
            f"Measured {today()} on {where}. Command: {args.command}. Model: models/zoo/ssa.pt exported with"
            f" sharp-export; sharp-serve in its own process (--max-batch 8, HTTP API). {args.clients} hostile clients"
            f" keep sending completions whose `structured_outputs.json` is a new object of {args.properties} optional"
            " properties (compiled in a worker, then refused past llguidance's limits); a bystander takes"
            f" {args.probes} /health and {args.probes} streamed first-token times per round, alone and under that"
            f" load, {args.repeats} rounds alternating. The bound asked for: loaded within 2× of unloaded.",
            "",
            markdown_table(header, rows),
        ]
    )


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench hostile", description=__doc__)
    ap.add_argument("--properties", type=int, default=3000, help="optional properties of each hostile schema")
    ap.add_argument("--clients", type=int, default=1, help="hostile clients sending at once")
    ap.add_argument("--probes", type=int, default=10, help="bystander measurements of each kind per round")
    ap.add_argument("--repeats", type=int, default=3)
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("hostile", [] if argv is None else list(argv))
    if min(args.properties, args.clients, args.probes, args.repeats) < 1:
        ap.error("--properties, --clients, --probes and --repeats must be positive")
    import tempfile

    from sharp.exporter.cli import main as export

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "ssa.onnx"
        if export([str(zoo_model("ssa")), "-o", str(model), "--no-check"]) != 0:
            return 1
        try:
            body = bench(model, args)
        except (OSError, RuntimeError) as e:
            print(f"sharp-bench hostile: {e}", file=sys.stderr)
            return 1
    print(body)
    if (page := output_page(args)) is not None:
        write_section("hostile", body, page)
    return 0
