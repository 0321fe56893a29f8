"""`sharp-bench normalizers`: time and peak memory of attend(impl="reference") vs impl="streamed" on CPU.

Both implementations run on the same inputs in one invocation, each case in its own process; medians of
repeated runs; the reference is skipped where its Lq × Lk temporaries would not fit the memory budget.
"""

from __future__ import annotations

import json
import sys

import torch
from tqdm import tqdm

from sharp.benchmarks.harness import (
    BenchParser,
    add_output,
    command_line,
    machine,
    markdown_table,
    measure,
    output_page,
    run_isolated,
    today,
    write_section,
)
from sharp.models import registry
from sharp.models.attention import attend
from sharp.models.normalizers import PAPER_POLY
from sharp.models.problem import build_problem
from sharp.models.registry import NORMS
from sharp.models.streamed import QUERY_CHUNK, StreamStats, streamed_attention

# Bytes per Lq·Lk logit that the reference keeps alive at its peak (scores, exp, weights; sort copies and
# int64 indices for entmax). Estimates used only to decide what to skip; the measured peak is what's reported.
_REFERENCE_BYTES_PER_LOGIT = {"entmax": 52, "asentmax": 52}
_DEFAULT_BYTES_PER_LOGIT = 20


def _inputs(length: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, length, dim, generator=g) for _ in range(3))
    qs = torch.rand(1, 1, length, generator=g) + 0.5
    return q, k, v, qs


def _case_worker(case: dict) -> dict:
    """Runs inside the isolated process: build inputs, measure one implementation."""
    torch.manual_seed(0)
    q, k, v, qs = _inputs(case["length"], case["dim"], seed=0)
    kw = dict(
        norm=case["norm"], causal=case["causal"], query_scale=qs if registry.get(case["norm"]).query_scale else None
    )
    result: dict = {}
    if case["impl"] == "streamed":
        problem = build_problem(
            q,
            k,
            v,
            scale=None,
            **registry.HEAD_DEFAULTS,
            poly=PAPER_POLY,
            alibi_slopes=None,
            **kw,
        )
        stats = StreamStats()
        fn = lambda: streamed_attention(problem, case["block"], stats=stats)
        result = measure(fn, case["repeats"])
        chunks = -(-case["length"] // QUERY_CHUNK)
        result["key_passes"] = round(stats.key_passes / case["repeats"] / chunks, 1)
    else:
        with torch.no_grad():
            result = measure(lambda: attend(q, k, v, **kw), case["repeats"])
    return result


def _fmt_ms(r: dict) -> str:
    return f"{r['median_s'] * 1e3:,.0f}" if "median_s" in r else r.get("error", r.get("skipped", "—"))


def _report(args, rows: list, done: bool) -> str:
    header = [
        "L",
        "norm",
        "reference ms",
        "streamed ms",
        "time ratio",
        "reference peak MiB",
        "streamed peak MiB",
        "L² fp32 MiB",
        "key passes",
    ]
    table = []
    for length, norm, ref, st in rows:
        ratio = f"{st['median_s'] / ref['median_s']:.2f}×" if "median_s" in ref and "median_s" in st else "—"
        table.append(
            [
                f"{length:,}",
                norm,
                _fmt_ms(ref),
                _fmt_ms(st),
                ratio,
                f"{ref['peak_mib']:,.0f}" if "peak_mib" in ref else "—",
                f"{st['peak_mib']:,.0f}" if "peak_mib" in st else "—",
                f"{length * length * 4 / 2**20:,.0f}",
                str(st.get("key_passes", "—")),
            ]
        )
    mode = "causal" if args.causal else "non-causal"
    status = "" if done else f" **Run in progress: {len(rows)} cases so far.**"
    return "\n".join(
        [
            "## Normalizers: reference vs streamed (CPU)",
            "",
            f"Measured {today()} on {machine()}.{status}",
            f"Command: {args.command}"
            f" — one head, D={args.dim}, Lq = Lk = L, {mode}, fp32, key block {args.block};"
            f" median of {args.repeats} runs, each implementation in its own process. Peak MiB is resident memory"
            " above the process's size before the call (inputs excluded). Time ratio = streamed / reference."
            " Key passes = streams over K per query chunk (entmax: max pass + threshold passes + output pass).",
            "",
            markdown_table(header, table),
        ]
    )


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench normalizers", description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--norms", nargs="+", default=list(NORMS), choices=NORMS, metavar="NORM")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=128, help="key block of the streamed implementation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--memory-budget-gib", type=float, default=16.0, help="skip reference cases estimated above this")
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("normalizers", [] if argv is None else list(argv))
    if min(args.lengths) < 1 or args.repeats < 1 or args.dim < 1 or args.block < 1:
        ap.error("lengths, repeats, dim and block must be positive integers")

    cases = [(length, norm) for length in args.lengths for norm in args.norms]
    rows = []
    page = output_page(args)
    for length, norm in tqdm(cases, desc="normalizers", unit="case"):
        base = dict(length=length, norm=norm, dim=args.dim, causal=args.causal, block=args.block, repeats=args.repeats)
        need_gib = length * length * _REFERENCE_BYTES_PER_LOGIT.get(norm, _DEFAULT_BYTES_PER_LOGIT) / 2**30
        if need_gib > args.memory_budget_gib:
            ref = {"skipped": f"skipped (~{need_gib:.0f} GiB)"}
        else:
            ref = run_isolated("sharp.benchmarks.normalizers", {**base, "impl": "reference"})
        st = run_isolated("sharp.benchmarks.normalizers", {**base, "impl": "streamed"})
        rows.append((length, norm, ref, st))
        tqdm.write(f"L={length} {norm}: reference {_fmt_ms(ref)} ms, streamed {_fmt_ms(st)} ms")
        if page is not None:  # keep the page current, so an interrupted run still leaves its measured rows
            write_section("normalizers", _report(args, rows, done=False), page)

    body = _report(args, rows, done=True)
    print(body)
    if page is not None:
        write_section("normalizers", body, page)
    return 0


if __name__ == "__main__":  # isolated worker: python -m sharp.benchmarks.normalizers '<case json>'
    print(json.dumps(_case_worker(json.loads(sys.argv[1]))))
