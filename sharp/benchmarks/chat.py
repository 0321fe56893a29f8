"""`sharp-bench chat`: multi-turn conversations over a long document on CPU, sharp-serve (its prefix cache on, and
off as its own baseline) against llama.cpp's llama-server with its default prompt cache.

The model and peers are `sharp-bench peers`' (a random-weight Llama of a real shape, a BPE trained here, weights
converted as each peer's users convert them). A conversation, as a stateless OpenAI client holds one: a document of
about --document tokens (text of the standard library's packages, a different one per conversation), then --questions
questions; each turn sends the whole transcript — document, earlier questions and the server's own answers as
text — to /v1/completions, streamed, and times its first token at the client. Measured: TTFT per turn of one
conversation at a time (peers take turns, medians over --repeats), and the wall time of --conversations
conversations run --at-once at a time. The answers are --answer-tokens greedy tokens (EOS never wins on this model).
onnxruntime-genai is not run: it has no server, and its multi-turn mode (`append_tokens` on a live generator) is a
different contract from a client re-sending its transcript.
"""

from __future__ import annotations

import json
import statistics
import sysconfig
import threading
import time
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
from sharp.benchmarks.peers import (
    SHAPES,
    Peer,
    PeerUnavailable,
    _fmt,
    convert_gguf,
    sharp_export,
    start_llama_server,
    start_sharp,
    workspace,
)

QUESTIONS = [
    "What does the first function in this file do?",
    "Which names does it import, and why?",
    "Summarise the error handling in two sentences.",
    "Which class is the most important one here?",
    "What would you test first?",
    "Name one thing you would change.",
    "Where is the state kept?",
    "What is the longest function?",
]


def documents(hf: Path, count: int, tokens: int) -> list[str]:
    """`count` documents of about `tokens` tokens each: consecutive stretches of the standard library's packages."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    ids: list[int] = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*/*.py")):  # packages: not the tokenizer's text
        if len(ids) >= count * tokens:
            break
        ids += tok.encode(f.read_text(errors="ignore").encode("ascii", "ignore").decode()).ids
    if len(ids) < count * tokens:
        raise SystemExit(f"sharp-bench chat: the sources hold {len(ids):,} tokens, fewer than {count} × {tokens:,}")
    return [tok.decode(ids[i * tokens : (i + 1) * tokens]) for i in range(count)]


def _turn(url: str, model: str, prompt: str, new_tokens: int, extra: dict) -> tuple[float, str, int, int]:
    """One streamed completion: TTFT, the answer's text, the prompt tokens the server counted as cached, and the
    prompt's tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip
    req = urllib.request.Request(f"{url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start, first, text, cached, prompt_tokens = time.perf_counter(), None, [], -1, -1
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["text"])
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
            prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
    if first is None:
        raise RuntimeError("no token streamed")
    return first - start, "".join(text), cached, prompt_tokens


def conversation(
    peer: Peer, extra: dict, document: str, questions: int, new_tokens: int
) -> list[tuple[float, int, int]]:
    """TTFT, reported cached tokens and prompt tokens of each turn."""
    transcript, out = f"Read this file.\n\n{document}\n", []
    for q in QUESTIONS[:questions]:
        transcript += f"\nQ: {q}\nA:"
        ttft, answer, cached, prompt_tokens = _turn(peer.url, peer.model, transcript, new_tokens, extra)
        transcript += answer
        out.append((ttft, cached, prompt_tokens))
    return out


def _at_once(run_one, items: list, width: int) -> float:
    """Wall time of running `run_one` on each item, `width` at a time."""
    pending, errors, lock = list(items), [], threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                item = pending.pop(0)
            try:
                run_one(item)
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)
                return

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def bench(args) -> str:
    work, hf = workspace(args.workdir, args.shape, "chat")
    log = work / "chat.log"
    _, about = SHAPES[args.shape]
    # fresh documents for every round (a document seen before is a hit on both servers): per round the concurrent
    # conversations' and one for the one-at-a-time conversation, and one for the untimed warm-up
    per_round = args.conversations + 1
    docs = documents(hf, args.repeats * per_round + 1, args.document)
    onnx = sharp_export(hf, work, args.norm, log)
    context = args.at_once * (args.document + args.questions * (args.answer_tokens + 32) + 64)
    peers: list[tuple[Peer, dict]] = []
    for name, start, extra in (
        (f"sharp-serve {args.norm}", lambda n: start_sharp(onnx, n, 0, work / "sharp.log", prefix_cache_mb=4096), {}),
        (f"sharp-serve {args.norm}, no prefix cache",
         lambda n: start_sharp(onnx, n, 0, work / "sharp-off.log"), {}),
        ("llama-server f32", lambda n: start_llama_server(
            work / "model-f32.gguf" if (work / "model-f32.gguf").exists() else convert_gguf(hf, work, "f32", log),
            n, context, args.at_once, 0, work / "llama.log", cache_prompt=True), {"ignore_eos": True}),
    ):  # fmt: skip
        if name.endswith("no prefix cache") and args.no_baseline:
            continue
        print(f"starting {name}", flush=True)
        try:
            peer = start(name)
        except PeerUnavailable as e:
            raise SystemExit(f"sharp-bench chat: {name} cannot run: {e}") from None
        peers.append((peer, extra))
    turns: dict[str, list[list[tuple[float, int, int]]]] = {}
    totals: dict[str, list[float]] = {}
    try:
        for p, extra in peers:  # one untimed short conversation each (first-request costs)
            conversation(p, extra, docs[-1][:2000], 1, 4)
        for r in range(args.repeats):
            mine = docs[r * per_round : (r + 1) * per_round]
            for p, extra in peers:
                got = conversation(p, extra, mine[-1], args.questions, args.answer_tokens)
                turns.setdefault(p.name, []).append(got)
                print(f"{p.name:<40} turns TTFT " + " ".join(f"{t:.2f}" for t, *_ in got)
                      + "  cached " + " ".join(str(c) for _, c, _ in got), flush=True)  # fmt: skip
            for p, extra in peers:
                if "no prefix cache" in p.name:
                    continue  # its conversations cost as its first turns do: the TTFT rows say it
                total = _at_once(
                    lambda d, p=p, extra=extra: conversation(p, extra, d, args.questions, args.answer_tokens),
                    mine[:-1],
                    args.at_once,
                )
                totals.setdefault(p.name, []).append(total)
                print(f"{p.name:<40} {args.conversations} conversations, {args.at_once} at a time: {total:.1f} s",
                      flush=True)  # fmt: skip
    finally:
        for p, _ in peers:
            p.stop()
    return report(args, about, [p for p, _ in peers], turns, totals)


def report(args, about, peers, turns, totals) -> str:
    sharp, llama = peers[0].name, peers[-1].name
    rows = []
    for k in range(args.questions):
        row = [str(k + 1)]
        for p in peers:
            row.append(_fmt([conv[k][0] for conv in turns[p.name]], ".2f"))
        mine = statistics.median(conv[k][0] for conv in turns[sharp])
        row.append(f"{mine / statistics.median(conv[k][0] for conv in turns[llama]):.2f}×")
        row.append(f"{mine / statistics.median(conv[0][0] for conv in turns[sharp]):.2f}×")
        row.append(" / ".join(str(conv[k][1]) for conv in turns[sharp]))
        rows.append(row)
    header = ["turn", *(f"{p.name} TTFT s" for p in peers), f"{sharp} ÷ {llama}", f"{sharp} ÷ its turn 1",
              "sharp cached tokens (each round)"]  # fmt: skip
    total_rows = [[name, _fmt(xs, ".1f")] for name, xs in totals.items()]
    ratio = statistics.median(totals[llama]) / statistics.median(totals[sharp]) if totals else float("nan")
    return "\n".join([
        "## Multi-turn chat over a long document, prefix cache against llama-server's (sharp-bench chat)",
        "",
        f"Measured {today()} on {machine()}. Command: {args.command}. Model: a random-weight Llama, {about};"
        f" sharp-serve {args.norm} (onnxruntime, native op, fp32 KV cache); llama-server f32 (flash attention, f16"
        f" KV cache, its default prompt cache, {args.at_once} slots). A conversation: a document of"
        f" {args.document:,} tokens, then {args.questions} questions, each turn re-sending the transcript as text"
        f" with {args.answer_tokens}-token answers; one conversation at a time per peer, peers taking turns,"
        f" medians of {args.repeats} rounds (lowest–highest).",
        "",
        markdown_table(header, rows),
        "",
        f"{args.conversations} conversations (other documents, new in each round), {args.at_once} at a time, wall time"
        " s:",
        "",
        markdown_table(["peer", "total s"], total_rows),
        "",
        f"{llama} ÷ {sharp} total: {ratio:.2f}× (above 1 favours sharp).",
    ])  # fmt: skip


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench chat", description=__doc__)
    ap.add_argument("--shape", choices=SHAPES, default="llama-11m")
    ap.add_argument("--norm", choices=["softmax", "adaptive", "ssmax"], default="softmax")
    ap.add_argument("--document", type=int, default=10000, help="tokens of each conversation's document")
    ap.add_argument("--questions", type=int, default=6, help=f"turns of each conversation (at most {len(QUESTIONS)})")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--at-once", type=int, default=4)
    ap.add_argument("--no-baseline", action="store_true", help="skip sharp-serve without its prefix cache")
    ap.add_argument("--workdir", help="keep the model and the peers' files here (reused when present)")
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("chat", [] if argv is None else list(argv))
    if not 1 <= args.questions <= len(QUESTIONS):
        ap.error(f"--questions must be 1–{len(QUESTIONS)}")
    if min(args.document, args.answer_tokens, args.repeats, args.conversations, args.at_once) < 1:
        ap.error("--document, --answer-tokens, --repeats, --conversations and --at-once must be >= 1")
    body = bench(args)
    print(body)
    if (page := output_page(args)) is not None:
        write_section("chat", body, page)
    return 0
