"""`sharp-bench routers`: two sharp-serve replicas behind vllm-router, its cache-aware policy against round-robin,
on the multi-turn conversations of `sharp-bench chat` (a document, then questions; each turn re-sends the
transcript). Cache-aware routing keeps a conversation on the replica whose prefix cache holds its transcript;
round-robin sends every other turn to the replica that has never seen it.

Both routers sit in front of the same two replicas (started once, prefix caches on), and every conversation has a
document of its own, so what one policy's conversations left in the caches never helps the other's; rounds
alternate which policy goes first. Measured per policy: the share of later turns (2 …) that found their earlier
transcript in the cache (`cached_tokens` ≥ the document's tokens), TTFT per turn, and the wall time of the
conversations run --at-once at a time. A later turn's prefix hit is counted two ways: its cache held at least the
document, or it held the whole previous turn's prompt (the transcript up to the question before).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from sharp.benchmarks.chat import _at_once, conversation, documents
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
from sharp.benchmarks.peers import (
    SHAPES,
    Peer,
    PeerUnavailable,
    _fmt,
    _free_port,
    _stop,
    _wait_http,
    sharp_export,
    start_sharp,
    workspace,
)

POLICIES = ("cache_aware", "round_robin")


def start_router(policy: str, replicas: list[Peer], model: str, log: Path) -> Peer:
    """vllm-router (its PyPI wheel, `make install`'s routers extra) with `policy` in front of `replicas`."""
    exe = Path(sys.executable).parent / "vllm-router"
    if not exe.exists():
        raise PeerUnavailable(f"{exe} not installed: pip install 'sharp-attention[routers]'")
    port = _free_port()
    workers = [r.url.removesuffix("/v1") for r in replicas]
    cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(_free_port()), "--policy",
           policy, "--worker-urls", *workers, "--log-level", "warning"]  # fmt: skip
    t0 = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    _wait_http(f"http://127.0.0.1:{port}/v1/models", proc, log)
    return Peer(f"vllm-router {policy}", time.perf_counter() - t0, proc.pid, f"http://127.0.0.1:{port}/v1",
                stop=_stop(proc), model=model)  # fmt: skip


def bench(args) -> str:
    work, hf = workspace(args.workdir, args.shape, "routers")
    log = work / "routers.log"
    _, about = SHAPES[args.shape]
    docs = documents(hf, args.repeats * len(POLICIES) * args.conversations + 1, args.document)
    onnx = sharp_export(hf, work, args.norm, log)
    replicas: list[Peer] = []
    routers: dict[str, Peer] = {}
    turns: dict[str, list[list[tuple[float, int, int]]]] = {p: [] for p in POLICIES}
    totals: dict[str, list[float]] = {p: [] for p in POLICIES}
    try:
        for i in range(2):
            replicas.append(start_sharp(onnx, f"replica {i}", args.threads, work / f"replica{i}.log",
                                        prefix_cache_mb=4096))  # fmt: skip
        for policy in POLICIES:
            routers[policy] = start_router(policy, replicas, replicas[0].model, work / f"router-{policy}.log")
        for r in replicas:  # first-request costs, untimed
            conversation(r, {}, docs[-1][:2000], 1, 4)
        for rnd in range(args.repeats):
            order = POLICIES if rnd % 2 == 0 else POLICIES[::-1]
            for k, policy in enumerate(order):
                start = (rnd * len(POLICIES) + k) * args.conversations
                mine = docs[start : start + args.conversations]
                got: list[list[tuple[float, int, int]]] = []
                total = _at_once(
                    lambda d, p=routers[policy], got=got: got.append(
                        conversation(p, {}, d, args.questions, args.answer_tokens)
                    ),
                    mine,
                    args.at_once,
                )
                turns[policy] += got
                totals[policy].append(total)
                hits = _hits(got, lambda _: args.document)
                print(f"round {rnd + 1} {policy:<12} {total:6.1f} s, later turns hit {hits:.0%}", flush=True)
    finally:
        for p in [*routers.values(), *replicas]:
            p.stop()
    return report(args, about, turns, totals)


def _hits(convs: list[list[tuple[float, int, int]]], least) -> float:
    """The share of turns after the first whose cached prompt tokens reach `least(previous turn)` or more."""
    later = [(conv[k - 1], conv[k]) for conv in convs for k in range(1, len(conv))]
    return sum(turn[1] >= least(before) for before, turn in later) / len(later)


def report(args, about, turns, totals) -> str:
    rows = []
    for k in range(args.questions):
        rows.append([str(k + 1), *(_fmt([conv[k][0] for conv in turns[p]], ".2f") for p in POLICIES)])
    hit_rows = [
        [p, f"{_hits(turns[p], lambda _: args.document):.0%}", f"{_hits(turns[p], lambda before: before[2]):.0%}",
         _fmt(totals[p], ".1f")]
        for p in POLICIES
    ]  # fmt: skip
    ratio = statistics.median(totals["round_robin"]) / statistics.median(totals["cache_aware"])
    return "\n".join([
        "## Two replicas behind vllm-router: cache-aware against round-robin (sharp-bench routers)",
        "",
        f"Measured {today()} on {machine()}. Command: {args.command}. Model: a random-weight Llama, {about};"
        f" two sharp-serve {args.norm} replicas (onnxruntime, prefix cache on, threads each: {args.threads or 'all'})"
        f" behind vllm-router 0.1.17, both policies in front of the same replicas. A conversation: a document of"
        f" {args.document:,} tokens, then {args.questions} questions with {args.answer_tokens}-token answers, each"
        f" turn re-sending the transcript; {args.conversations} conversations per policy per round, {args.at_once}"
        f" at a time, {args.repeats} rounds (medians, lowest–highest).",
        "",
        markdown_table(["policy", "later turns: document cached", "whole previous prompt cached", "total s"],
                       hit_rows),
        "",
        f"round-robin ÷ cache-aware total: {ratio:.2f}× (above 1: cache-aware is faster).",
        "",
        markdown_table(["turn", *(f"{p} TTFT s" for p in POLICIES)], rows),
    ])  # fmt: skip


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench routers", description=__doc__)
    ap.add_argument("--shape", choices=SHAPES, default="llama-11m")
    ap.add_argument("--norm", choices=["softmax", "adaptive", "ssmax"], default="softmax")
    ap.add_argument("--document", type=int, default=2000, help="tokens of each conversation's document")
    ap.add_argument("--questions", type=int, default=4, help="turns of each conversation")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=6, help="per policy per round")
    ap.add_argument("--at-once", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime threads of each replica (0: all)")
    ap.add_argument("--workdir", help="keep the model and the replicas' files here (reused when present)")
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("routers", [] if argv is None else list(argv))
    if not 2 <= args.questions <= 8:
        ap.error("--questions must be 2–8 (the later turns are what routing changes)")
    if min(args.document, args.answer_tokens, args.repeats, args.conversations, args.at_once) < 1:
        ap.error("--document, --answer-tokens, --repeats, --conversations and --at-once must be >= 1")
    body = bench(args)
    print(body)
    if (page := output_page(args)) is not None:
        write_section("routers", body, page)
    return 0
