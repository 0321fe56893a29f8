"""`sharp-bench` as a user meets it: the command list, where results are written (and where not), the command line
recorded as given, one-line mistakes, and `kernels --smoke` choosing the interpreter itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from sharp.benchmarks import COMMANDS, main
from sharp.benchmarks.harness import DOCS_PAGE, output_page
from sharp.benchmarks.normalizers import run as normalizers

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_command_and_no_command_is_a_mistake(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS) and "--write PATH" in out
    assert main([]) == 2 and "commands:" in capsys.readouterr().err


def test_results_are_written_only_in_a_checkout_or_where_asked(tmp_path, monkeypatch, capsys):
    """Run from anywhere else, a benchmark writes no docs/benchmarks.md into the working directory."""
    monkeypatch.chdir(tmp_path)
    page = tmp_path / "results.md"
    argv = ["--lengths", "64", "--norms", "softmax", "--repeats", "1", "--memory-budget-gib", "1"]
    assert normalizers(argv) == 0
    assert "not in a sharp checkout" in capsys.readouterr().err and not (tmp_path / "docs").exists()
    assert normalizers([*argv, "--write", str(page)]) == 0
    text = page.read_text()  # the command as given, every flag
    assert "Command: `sharp-bench normalizers --lengths 64 --norms softmax --repeats 1 --memory-budget-gib 1" in text
    assert "| 64 | softmax |" in text
    monkeypatch.chdir(ROOT)
    args = type("Args", (), {"no_write": False, "write": None})()
    assert output_page(args) == DOCS_PAGE  # inside the checkout: its page (not written here)
    args.no_write = True
    assert output_page(args) is None


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["repro", "copy", "--sizes", "8"], "--sizes applies to max-retrieval"),
        (["normalizers", "--lengths", "x"], "invalid int value"),
        (["kernels", "--norms", "sparsemax"], "invalid choice"),
        (["sparse-serve", "--lengths", "0"], "must be ≥ 1"),
        (["sparse-serve", "--lengths", "--prompt", "0"], "--prompt 0 needs --lengths"),
        (["sparse-serve", "--entmax", "/nonexistent.pt"], "is not a file"),
        (["sparse-serve", "--entmax", str(ROOT / "models/zoo/ssa.pt")], "not of the entmax family"),
    ],
)
def test_mistakes_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and err.startswith("sharp-bench ")


@pytest.mark.bench
def test_kernels_smoke_turns_the_interpreter_on_itself(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-c", "from sharp.benchmarks import main; raise SystemExit(main())"]
    proc = subprocess.run([*cmd, "kernels", "--smoke", "--norms", "softmax", "entmax"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=900, check=False)  # fmt: skip
    refused = proc.returncode == 2 and "CPU interpreter does not run with numpy" in proc.stderr
    if refused and os.environ.get("CI") != "true":
        pytest.skip(proc.stderr.strip())  # e.g. a CUDA image's Triton 3.6 with numpy 2.5: the refusal is one line
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| softmax |" in proc.stdout and not (tmp_path / "docs").exists()
    assert "| entmax (paged, 16-key pages, sparse: 16 planted keys, " in proc.stdout  # the skipping kernel's row


@pytest.mark.bench
def test_kernels_writes_its_section_as_it_measures_so_a_run_cut_short_keeps_it(tmp_path, monkeypatch):
    """The GPU check runs `kernels` under a time limit: the decode rows come first and the section is written after
    them and after each prefill case, marked partial until the last. Here the second prefill case fails."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("in process, the smoke run needs the interpreter chosen before triton was imported (conftest)")
    from sharp.benchmarks import kernels

    page = tmp_path / "bench.md"
    page.write_text("# Benchmarks\n")
    measure = kernels._prefill_rows

    def cut_short(*args):
        if args[-1] == (40, 16, True):  # the second case: causal
            raise TimeoutError("the step's time limit")
        return measure(*args)

    monkeypatch.setattr(kernels, "_prefill_rows", cut_short)
    with pytest.raises(TimeoutError):
        kernels.run(["--smoke", "--norms", "softmax", "--write", str(page)])
    text = page.read_text()
    assert "**Partial: 1 of 2 prefill cases measured so far.**" in text
    assert re.search(r"^\| 100 \| softmax \(paged, 16-key pages\) \|", text, re.M)  # the decode rows
    assert re.search(r"^\| 40 \| 16 \| full \| softmax \|", text, re.M)  # the first prefill case
    assert not re.search(r"^\| 40 \| 16 \| causal \|", text, re.M)
    monkeypatch.setattr(kernels, "_prefill_rows", measure)
    assert kernels.run(["--smoke", "--norms", "softmax", "--write", str(page)]) == 0
    text = page.read_text()
    assert "Partial" not in text and text.count("## Triton kernels on GPU") == 1
    assert re.search(r"^\| 40 \| 16 \| causal \| softmax \|", text, re.M)


@pytest.mark.bench
def test_sparse_serve_times_both_models_in_process_and_through_sharp_serve(tmp_path):
    """`sharp-bench sparse-serve` at a small size: both zoo models exported (the softmax twin from a copy whose
    context covers the prompt), decode steps timed in process and requests streamed through two sharp-serves."""
    from sharp.benchmarks.sparse_serve import run as sparse_serve

    page = tmp_path / "results.md"
    argv = ["--lengths", "600", "--rounds", "2", "--steps", "3", "--prompt", "2500", "--new-tokens", "8",
            "--serve-rounds", "1", "--workdir", str(tmp_path / "work"), "--write", str(page)]  # fmt: skip
    assert sparse_serve(argv) == 0
    text = page.read_text()
    import re

    raised = re.search(r"; `softmax.pt` from a copy with the recorded context raised to ([\d,]+)", text)
    assert raised and int(raised[1].replace(",", "")) >= 2500 + 8 and "`entmax.pt` from" not in text
    rows = {c[0]: c for c in ([x.strip() for x in line.strip("|").split("|")] for line in text.splitlines()) if c}
    assert float(rows["600"][1].split()[0]) > 0 and float(rows["600"][2].split()[0]) > 0, rows["600"]
    for name in ("entmax", "softmax"):  # every request streamed its tokens
        assert rows[name][1] == "2,500" and float(rows[name][3].split()[0]) > 0, rows[name]
    assert rows["softmax"][4] == "1.00×"


@pytest.mark.bench
def test_serve_runs_sharp_serve_in_its_own_process_and_reports_the_engine_host_time(tmp_path, capsys):
    """`sharp-bench serve` on a small model: a fresh sharp-serve process per run, the engine's own counters read
    back (host µs per step, rows per decode step) and the host-time fit across concurrencies."""
    import re

    from sharp.benchmarks.serve import run as serve

    page = tmp_path / "results.md"
    # 16 new tokens each: C=4 decodes ~4 rows a step, at least one more than C=1 (the host-time fit needs that)
    argv = ["--requests", "8", "--new-tokens", "16", "--concurrency", "1", "4", "--baseline-concurrency", "4"]
    assert serve([*argv, "--repeats", "1", "--rate", "50", "--write", str(page)]) == 0
    text = page.read_text()
    assert "sharp-serve runs in its own process" in text
    rows = {c[0]: c for c in ([x.strip() for x in line.strip("|").split("|")] for line in text.splitlines()) if c}
    for name in ("gRPC, closed loop C=1", "gRPC, closed loop C=4", "gRPC, closed loop C=4, --max-batch 1"):
        cells = rows[name]
        assert cells[1] == "8/0", cells  # every request completed
        assert float(cells[8]) > 0 and float(cells[9]) >= 1  # host µs per step; rows per decode step
        low, high = map(float, cells[10].split("–"))
        assert low <= float(cells[3]) <= high  # the rounds' spread holds the median
    for name in ("HTTP (openai SDK, streaming), closed loop C=1", "HTTP (openai SDK, streaming), closed loop C=4"):
        assert rows[name][1] == "8/0" and float(rows[name][3]) > 0, rows[name]  # the OpenAI API under the same load
        per_request = lambda cells: float(cells[3]) / float(cells[2])  # out tok/s ÷ req/s: tokens per request
        assert per_request(rows[name]) == pytest.approx(per_request(rows["gRPC, closed loop C=1"]), rel=0.05)
    assert float(rows["gRPC, closed loop C=4, --max-batch 1"][9]) == 1
    assert float(rows["gRPC, closed loop C=4"][9]) > 1  # continuous batching: several rows per decode step
    assert rows["in-process engine, C=4"][1] == "8/0"  # the engine driven directly completes every request
    assert rows["gRPC, closed loop C=4, --engine-process on"][1] == "8/0"  # the engine core in a process of its own
    assert rows["gRPC, closed loop C=4, --kv-cache-dtype fp16"][1] == "8/0"  # the zoo model with an fp16 KV cache
    assert rows["in-process engine, C=4"][8] == "—"  # no server to read counters from
    assert re.search(r"rows: -?\d+ µs \+ -?[\d.]+ µs per running row\.", text)
    for k in (1, 4):  # structured decoding under the same load: every output runs to the token budget, as plain's
        cells, plain = rows[f"gRPC, closed loop C={k}, json_schema"], rows[f"gRPC, closed loop C={k}"]
        assert cells[1] == "8/0" and float(cells[3]) / float(cells[2]) == pytest.approx(16, rel=0.02), cells
        assert float(plain[3]) / float(plain[2]) == pytest.approx(16, rel=0.02), plain
    ratio = r"[\d.]+× \(rounds [\d.]+–[\d.]+×\)"
    assert re.search(rf"round's ratio: C=1: {ratio}, C=4: {ratio}\. A new 50-property schema compiles", text)
    assert re.search(r"compiles \(llguidance, with its matcher's first mask\) in [\d.]+ ms \(median of 5", text)


def test_structured_decoding_is_compared_with_plain_decoding_of_the_same_round():
    """Each round's structured run against that round's plain run, not the medians of each: a machine that slows
    between rounds slows both of a round alike."""
    from sharp.benchmarks.serve import Run, structured_ratios

    runs = lambda *tok: [Run(completed=1, tokens=n, seconds=1.0) for n in tok]
    by_name = {
        "gRPC, closed loop C=1": runs(1000, 500, 800),
        "gRPC, closed loop C=1, json_schema": runs(900, 480, 400),  # 0.90, 0.96, 0.50 of its round
        "gRPC, closed loop C=16": runs(100),  # no structured row at this load: no ratio
    }
    assert structured_ratios(by_name, [1, 16]) == ["C=1: 0.90× (rounds 0.50–0.96×)"]  # medians' ratio: 0.60×


def test_a_serve_row_reports_the_median_and_the_spread_of_its_rounds():
    from sharp.benchmarks.serve import Run, _row

    runs = [Run(completed=4, tokens=n, seconds=1.0, ttft=[0.01], itl=[0.001]) for n in (900, 300, 600)]
    cells = _row("x", runs)
    assert cells[3] == "600" and cells[-1] == "300–900"


@pytest.mark.bench
def test_genai_compares_both_sides_on_one_package_and_reports_each_sides_spread(tmp_path):
    """`sharp-bench genai` end to end on the zoo model (a tiny load): sharp-serve in its own process and
    onnxruntime-genai on the same package, each run twice; a row holds both medians, their ratio and each side's
    lowest–highest run."""
    pytest.importorskip("onnxruntime_genai", reason="the genai extra (onnxruntime-genai) is not installed")
    from sharp.benchmarks.genai import run as genai

    page = tmp_path / "results.md"
    argv = ["--requests", "2", "--new-tokens", "3", "--concurrency", "1", "--repeats", "2", "--write", str(page)]
    assert genai(argv) == 0
    row = next(line for line in page.read_text().splitlines() if line.startswith("| C=1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    ours, theirs = float(cells[1]), float(cells[2])
    assert ours > 0 and theirs > 0 and abs(float(cells[3].rstrip("×")) - ours / theirs) <= 0.01
    for median, spread in ((ours, cells[4]), (theirs, cells[5])):
        low, high = map(float, spread.split("–"))
        assert low <= median <= high


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--lengths", "1"], "--lengths and --new-tokens must be >= 2"),
        (["--lengths", "32768"], "fit llama-11m's context of 32768 tokens"),
        (["--shape", "gpt-9"], "invalid choice: 'gpt-9'"),
        (["--gguf", "q2_k"], "invalid choice: 'q2_k'"),
    ],
)
def test_peers_refuses_what_it_cannot_run_in_one_line(argv, says, capsys):
    from sharp.benchmarks.peers import run as peers

    with pytest.raises(SystemExit) as exit_:
        peers(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err and len(err.strip().splitlines()) == 1


def test_peers_report_holds_each_peers_medians_ratios_to_sharp_and_the_reason_a_peer_did_not_run():
    from types import SimpleNamespace

    from sharp.benchmarks.peers import Peer, Reading, report

    args = SimpleNamespace(
        model="random",
        lengths=[1024, 4096],
        new_tokens=64,
        repeats=2,
        concurrent=8,
        command="`x`",
        shape="llama-11m",
        kv_cache_dtype=["fp32"],
    )
    ours, theirs = Peer("sharp-serve softmax", ready_s=1.5, disk_mib=40.4), Peer("llama-server f32", ready_s=0.2)
    ours.rss, theirs.rss = {1024: 200.0, 4096: 210.0}, {1024: 150.0, 4096: 160.0}
    missing = Peer("onnxruntime-genai fp32", error="onnxruntime-genai is not installed")
    single = {
        ("sharp-serve softmax", 1024): [Reading(0.2, 100.0, 64), Reading(0.4, 300.0, 64)],  # medians 0.3 s, 200
        ("llama-server f32", 1024): [Reading(0.6, 400.0, 64), Reading(0.6, 400.0, 64)],
        ("sharp-serve softmax", 4096): [Reading(1.0, 100.0, 64)] * 2,
        ("llama-server f32", 4096): [Reading(2.0, 50.0, 64)] * 2,
    }
    many = {("llama-server f32", 1024): [(0.5, 800.0), (0.7, 900.0)]}
    text = report(args, "a model", [ours, theirs, missing], single, many)
    assert "| sharp-serve softmax | 1,024 | 0.30 (0.20–0.40) | 200 (100–300) |  | 200 | 40 | 1.5 |" in text
    assert "| llama-server f32 | 1,024 | 0.60 (0.60–0.60) | 400 (400–400) | 0.50× / 0.50× | 150 | nan | 0.2 |" in text
    assert "| llama-server f32 | 4,096 | 2.00 (2.00–2.00) | 50 (50–50) | 0.50× / 2.00× | 160 | nan | 0.2 |" in text
    assert "| onnxruntime-genai fp32 | — | not run | onnxruntime-genai is not installed |" in text
    assert "| llama-server f32 | 1,024×8 | 0.60 (0.50–0.70) | 850 (800–900) |" in text
    assert "sharp-serve softmax 0.50; llama-server f32 0.12" in text  # decode at 4,096 ÷ at 1,024


def test_peers_exports_again_a_file_older_than_the_exporter(tmp_path, monkeypatch):
    """A workdir kept across an upgrade of sharp: its exported file is written again when any exporter module is
    newer than it, and reused when it is not."""
    import sharp.benchmarks.peers as peers
    import sharp.exporter

    ran: list[list[str]] = []
    monkeypatch.setattr(peers, "_run", lambda cmd, what, log: ran.append(cmd))
    target = tmp_path / "softmax.onnx"
    target.write_bytes(b"old")
    newest = max(f.stat().st_mtime for f in Path(sharp.exporter.__file__).parent.glob("*.py"))
    os.utime(target, (newest - 10, newest - 10))
    peers.sharp_export(tmp_path / "hf", tmp_path, "softmax", tmp_path / "log")
    assert len(ran) == 1 and ran[0][-5:] == [str(target), "--weights", "fp32", "--kv-cache-dtype", "fp32"]
    os.utime(target, (newest + 10, newest + 10))
    peers.sharp_export(tmp_path / "hf", tmp_path, "softmax", tmp_path / "log")
    assert len(ran) == 1
    half = peers.sharp_export(tmp_path / "hf", tmp_path, "softmax", tmp_path / "log", "int4", "fp16")
    assert half.name == "softmax-int4-kv16.onnx" and ran[-1][-5:] == [str(half), "--weights", "int4",
                                                                        "--kv-cache-dtype", "fp16"]  # fmt: skip


@pytest.mark.bench
def test_peers_runs_sharp_serve_end_to_end_and_names_a_peer_it_cannot_build(tmp_path, monkeypatch):
    """A small `sharp-bench peers` with sharp-serve only, plus a llama.cpp peer whose build is missing: the model is
    built and exported, sharp-serve measured through its OpenAI API, and the missing peer is a row with its reason."""
    import sharp.benchmarks.peers as peers

    monkeypatch.setattr(peers, "LLAMA_SRC_GLOB", "nowhere/llama.cpp")
    page = tmp_path / "page.md"
    argv = ["--lengths", "16", "48", "--new-tokens", "16", "--repeats", "1", "--concurrent", "2",
            "--concurrent-lengths", "16", "--norms", "softmax", "entmax", "--gguf", "f32", "--no-genai",
            "--workdir", str(tmp_path / "work"), "--write", str(page)]  # fmt: skip
    assert peers.run(argv) == 0
    text = page.read_text()
    assert "| llama-server f32 | — | not run | llama.cpp's sources are not unpacked: run `make peers` |" in text
    for norm in ("softmax", "entmax"):
        rows = [line for line in text.splitlines() if line.startswith(f"| sharp-serve {norm} |")]
        assert len(rows) == 3 and all("not run" not in r for r in rows)  # 16, 48 and 16×2
    assert (tmp_path / "work" / "hf" / "tokenizer.json").exists() and (tmp_path / "work" / "softmax.onnx").exists()
    props = onnx.load(tmp_path / "work" / "entmax.onnx", load_external_data=False).metadata_props
    layers = json.loads({p.key: p.value for p in props}["sharp"])["layers"]
    assert layers[0] == {"norm": "entmax", "parameters": {"alpha": [1.5] * 6}}  # the learned norm, per head


def test_peers_peak_memory_counts_every_process_of_a_peer():
    """A server whose work sits in a child (an engine core) is measured with it: the child's 60 MB show."""
    import os
    import subprocess
    import sys

    from sharp.benchmarks.peers import Peer

    me = Peer("me", pid=os.getpid())
    alone = me.peak_mib()
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = b'x' * 60_000_000; print(1, flush=True);"
                              " time.sleep(60)"], stdout=subprocess.PIPE)  # fmt: skip
    try:
        child.stdout.readline()
        assert me.peak_mib() >= alone + 55
        assert Peer("child", pid=child.pid).peak_mib() >= 55
    finally:
        child.kill()
        child.wait()


STALLING_GENAI = '''
import threading, time

_busy = threading.Lock()


class Model:
    def __init__(self, path):
        pass


class GeneratorParams:
    def __init__(self, model):
        pass

    def set_search_options(self, max_length, do_sample):
        self.left = 3


class Generator:
    """Built only once the previous request's prompt is done: each holds the lock for its prompt (0.2 s)."""

    def __init__(self, model, params):
        _busy.acquire()
        self.left = params.left

    def append_tokens(self, ids):
        time.sleep(0.2)
        _busy.release()

    def generate_next_token(self):
        self.left -= 1

    def is_done(self):
        return self.left == 0
'''


def test_genai_ttft_is_timed_from_the_jobs_arrival_as_a_servers_is_from_the_request(tmp_path, monkeypatch):
    """onnxruntime-genai's requests of one job may wait before their Generator exists (seen here: a warm run of 8
    concurrent 1,024-token prompts read a mean TTFT of 0.61 s from each Generator, 1.97 s from the job's arrival).
    The worker times every request from the job's arrival, so 3 requests whose prompts run one after another (a
    stand-in module, 0.2 s each) read at least 0.2, 0.4 and 0.6 s."""
    from sharp.benchmarks.peers import start_genai

    (tmp_path / "onnxruntime_genai.py").write_text(STALLING_GENAI)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    peer = start_genai(tmp_path, "stand-in", tmp_path / "worker.log")
    try:
        readings = peer.generate([[1, 2], [3, 4], [5, 6]], 3)
    finally:
        peer.stop()
    ttfts = sorted(r.ttft for r in readings)
    assert [r.tokens for r in readings] == [3, 3, 3]
    assert all(t >= 0.2 * (i + 1) for i, t in enumerate(ttfts)), ttfts


def test_chat_reports_each_turn_against_llama_server_and_its_own_first_turn():
    from types import SimpleNamespace

    from sharp.benchmarks.chat import report
    from sharp.benchmarks.peers import Peer

    args = SimpleNamespace(questions=2, repeats=2, conversations=8, at_once=4, document=10000, answer_tokens=32,
                              norm="softmax", command="`x`")  # fmt: skip
    peers = [Peer("sharp-serve softmax"), Peer("sharp-serve softmax, no prefix cache"), Peer("llama-server f32")]
    turns = {
        "sharp-serve softmax": [[(10.0, 0), (0.2, 9000)], [(12.0, 0), (0.4, 9001)]],  # medians 11 s, 0.3 s
        "sharp-serve softmax, no prefix cache": [[(11.0, 0), (11.0, 0)]] * 2,
        "llama-server f32": [[(20.0, 0), (0.6, 9000)]] * 2,
    }
    totals = {"sharp-serve softmax": [50.0, 70.0], "llama-server f32": [150.0, 150.0]}
    text = report(args, "a model", peers, turns, totals)
    assert "| 1 | 11.00 (10.00–12.00) | 11.00 (11.00–11.00) | 20.00 (20.00–20.00) | 0.55× | 1.00× | 0 / 0 |" in text
    assert "| 2 | 0.30 (0.20–0.40) | 11.00 (11.00–11.00) | 0.60 (0.60–0.60) | 0.50× | 0.03× | 9000 / 9001 |" in text
    assert "| sharp-serve softmax | 60.0 (50.0–70.0) |" in text and "total: 2.50×" in text


@pytest.mark.parametrize("argv", [["--questions", "0"], ["--questions", "99"], ["--at-once", "0"]])
def test_chat_refuses_what_it_cannot_run(argv, capsys):
    from sharp.benchmarks.chat import run

    with pytest.raises(SystemExit) as e:
        run(argv)
    assert e.value.code == 2 and "must be" in capsys.readouterr().err


def test_routers_counts_a_later_turn_as_a_hit_only_when_its_cache_held_the_earlier_transcript():
    from types import SimpleNamespace

    from sharp.benchmarks.routers import report

    args = SimpleNamespace(questions=3, repeats=1, conversations=2, at_once=2, document=1000, answer_tokens=8,
                           norm="softmax", threads=1, command="`x`")  # fmt: skip
    # (TTFT, cached tokens, prompt tokens) per turn
    turns = {
        "cache_aware": [[(5.0, 0, 1010), (0.2, 1010, 1030), (0.2, 1030, 1050)]] * 2,
        "round_robin": [
            [(5.0, 0, 1010), (4.0, 0, 1030), (0.3, 1010, 1050)],  # turn 3: the document only
            [(5.0, 0, 1010), (4.0, 0, 1030), (0.3, 1030, 1050)],
        ],
    }
    text = report(args, "a model", turns, {"cache_aware": [10.0], "round_robin": [15.0]})
    assert "| cache_aware | 100% | 100% | 10.0 (10.0–10.0) |" in text
    assert "| round_robin | 50% | 25% | 15.0 (15.0–15.0) |" in text and "total: 1.50×" in text
    assert "| 2 | 0.20 (0.20–0.20) | 4.00 (4.00–4.00) |" in text


@pytest.mark.parametrize("argv", [["--questions", "1"], ["--conversations", "0"]])
def test_routers_refuses_what_it_cannot_run(argv, capsys):
    from sharp.benchmarks.routers import run

    with pytest.raises(SystemExit) as e:
        run(argv)
    assert e.value.code == 2 and "must be" in capsys.readouterr().err


@pytest.mark.bench
def test_hostile_measures_a_bystander_beside_compiles_and_fails_when_the_load_is_not_that(tmp_path, capsys):
    """`sharp-bench hostile` end to end (small: 600 properties compile fast and are still refused past the parser's
    row limit): a row per engine placement and probe, ratios of loaded to unloaded medians; hostile schemas that are
    served instead (100 properties) are not the load it measures: exit 1 saying so."""
    page = tmp_path / "bench.md"
    argv = ["hostile", "--properties", "600", "--probes", "2", "--repeats", "1", "--write", str(page)]
    assert main(argv) == 0
    rows = [line for line in page.read_text().splitlines() if line.startswith("| in ")]
    assert len(rows) == 4 and all(float(r.split("|")[5].strip().rstrip("×")) > 0 for r in rows), rows
    assert main(["hostile", "--properties", "100", "--probes", "1", "--repeats", "1", "--no-write"]) == 1
    assert "not the parser-limit 400" in capsys.readouterr().err


def test_quality_intervals_are_wilson_and_its_settings_are_what_an_export_takes():
    """docs/quality.md's intervals (Wilson 95%: 5/5 → 57–100%, 0/10 → 0–28%) and its settings: SSMax's s makes
    s·log n_train = 1, YaRN scales from the training length."""
    import math

    from sharp.benchmarks import quality

    assert [round(x, 3) for x in quality.wilson(5, 5)] == [0.566, 1.0]
    assert [round(x, 3) for x in quality.wilson(0, 10)] == [0.0, 0.278]
    assert [round(x, 3) for x in quality.wilson(8, 10)] == [0.49, 0.943]
    table = quality.settings_for(8192)
    assert table["ssmax"].attention["ssmax_s"] * math.log(8192) == pytest.approx(1.0)
    assert table["yarn-4x"].rope["original_max_position_embeddings"] == 8192 and table["softmax"] == quality.Setting()


@pytest.mark.parametrize(("norms", "impl"), [(("softmax", "ssmax"), "sdpa"), (("ssmax", "adaptive"), "streamed")])
def test_quality_answers_passkeys_on_sdpa_only_where_every_layer_is_row_scaled(norms, impl):
    """The passkeys run on torch's fused attention when every layer's norm is softmax or SSMax; one adaptive layer (β
    from the row's entropy) keeps the streamed path; perplexity and entropy by position never ask for SDPA."""
    from sharp.benchmarks import quality
    from sharp.models import ModelConfig, SharpLM

    cfg = ModelConfig(dim=32, layers=2, heads=4, kv_heads=2, layer_norms_override=norms, context_length=64)
    model = SharpLM(cfg)
    assert quality._impl("cpu", 4096, model) == impl
    assert quality._impl("cpu", 4096) == "streamed" and quality._impl("cpu", 512) == "reference"


def test_quality_sweeps_a_family_by_its_strength_and_refuses_what_it_cannot_build():
    """`adaptive@C` is the paper's polynomial moved toward 1 by C (C = 1 is the paper's, C = 0.5 halves β − 1 at
    every entropy); `ssmax@N` is softmax at N keys; a bad member or name exits 2 naming what is allowed."""
    import math

    import torch

    from sharp.benchmarks import quality
    from sharp.models.normalizers import polyval
    from sharp.models.registry import PAPER_POLY

    h = torch.linspace(0.0, 8.0, 33, dtype=torch.float64)
    paper = polyval(PAPER_POLY, h)
    assert torch.allclose(polyval(quality.setting("adaptive@1", 8192).attention["poly"], h), paper)
    half = polyval(quality.setting("adaptive@0.5", 8192).attention["poly"], h)
    assert torch.allclose(half - 1, (paper - 1) / 2)
    assert quality.setting("ssmax@512", 8192).attention["ssmax_s"] * math.log(512) == pytest.approx(1.0)
    assert quality.setting("ssmax", 8192) == quality.settings_for(8192)["ssmax"]
    eight = quality.setting("heads@8", 8192)
    assert eight.find_heads == 8 and eight.attention == {"norm": "softmax", "scaled_from": quality.SCALED_FROM}
    found = [(21, 8, 0.9), (18, 6, 0.8), (3, 1, 0.1)]
    assert quality.with_heads(quality.setting("heads@2:256", 8192), found).attention == {
        "norm": "softmax",
        "scaled_heads": [[21, 8], [18, 6]],
        "scaled_from": 256,
    }
    two = quality.setting("yarn@2", 8192)
    assert two.rope == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192}
    assert two.context_factor == 2.0 and two.attention is None
    assert quality.setting("yarn@4", 8192).rope == quality.settings_for(8192)["yarn-4x"].rope
    joined = quality.setting("yarn@2+heads@8:256", 8192)
    assert (joined.rope, joined.context_factor, joined.find_heads) == (two.rope, 2.0, 8)
    assert joined.attention == {"norm": "softmax", "scaled_from": 256}
    # the normalizer besides softmax keeps its name whichever side it is joined on
    for name in ("heads@8+ssmax@512", "ssmax@512+heads@8"):
        assert quality.setting(name, 8192).attention == {"norm": "ssmax", "ssmax_s": 1 / math.log(512),
                                                         "scaled_from": quality.SCALED_FROM}  # fmt: skip
    for twice in ("yarn@2+yarn-4x", "ssmax+adaptive", "heads@8+heads@4"):
        with pytest.raises(ValueError, match="joins two RoPE scalings"):
            quality.setting(twice, 8192)
    bad_heads = ("heads@0", "heads@1.5", "heads@8:1", "heads@8:x", "heads")
    bad = ("adaptive@0", "adaptive@x", "ssmax@1", "softmax@2", "yarn-4x@2", "yarn@1", "yarn@2+", "sharp")
    for name in (*bad, *bad_heads):
        with pytest.raises(ValueError, match="valid: softmax, adaptive"):
            quality.setting(name, 8192)


def test_quality_scores_the_first_number_and_says_where_the_peer_disagrees():
    """A passkey answer counts when its first number is the key; the page names the lengths at which llama-server's
    interval and sharp softmax's do not overlap (20/20 against 5/20 at 1,024; 18/20 against 16/20 agree)."""
    from sharp.benchmarks import quality

    assert quality.scored("The pass key is 12345.", "12345") and quality.scored("12345", "12345")
    assert not quality.scored("It is 1234 or 12345", "12345") and not quality.scored("I do not know", "12345")
    results = {
        "softmax": {"passkey": {512: 18, 1024: 20}},
        quality.PEER: {"passkey": {512: 16, 1024: 5}},
    }
    assert quality.disagreements(results, 20) == [1024]
    assert quality.disagreements({"softmax": results["softmax"]}, 20) == []


def test_quality_asks_llama_server_the_settings_it_runs_as_they_are_and_compares_each_with_its_own():
    """llama-server runs softmax (no flags) and a RoPE scaling through its own flags — YaRN with the factor and the
    training length the setting names, linear with its factor — and nothing that changes the normalizer or scales
    heads; each peer row is compared with the setting it ran, and the page says so per setting."""
    from argparse import Namespace
    from pathlib import Path

    from sharp.benchmarks import quality

    flags = {n: quality.peer_flags(quality.setting(n, 8192)) for n in ("softmax", "yarn@2", "yarn-4x", "yarn@2.5")}
    assert flags == {
        "softmax": [],
        "yarn@2": ["--rope-scaling", "yarn", "--rope-scale", "2", "--yarn-orig-ctx", "8192"],
        "yarn-4x": ["--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "8192"],
        "yarn@2.5": ["--rope-scaling", "yarn", "--rope-scale", "2.5", "--yarn-orig-ctx", "8192"],
    }
    linear = quality.Setting(rope={"rope_type": "linear", "factor": 2.0}, context_factor=2.0)
    assert quality.peer_flags(linear) == ["--rope-scaling", "linear", "--rope-scale", "2"]
    for name in ("heads@8", "ssmax", "adaptive", "yarn-4x+ssmax", "yarn@2+heads@8", "flat"):
        assert quality.peer_flags(quality.setting(name, 8192)) is None, name
    assert quality.peer_flags(quality.Setting(rope={"rope_type": "dynamic", "factor": 2.0})) is None
    results = {
        "softmax": {"passkey": {512: 18}, "logp": {512: -0.2}, "ppl": [10.0], "entropy": [0.4]},
        "yarn@2": {"passkey": {512: 19}, "logp": {512: -0.1}, "ppl": [11.0], "entropy": [0.4]},
        quality.peer_name("softmax"): {"passkey": {512: 17}},
        quality.peer_name("yarn@2"): {"passkey": {512: 4}},
    }
    assert quality.disagreements(results, 20, "softmax") == [] and quality.disagreements(results, 20, "yarn@2") == [512]
    args = Namespace(lengths=[512], trials=20, seed=0, text_from=0, command="sharp-bench quality")
    body = quality._body(args, results, [0, 512], "CPU", Path("m.gguf"))
    assert "llama-server (softmax) and sharp's softmax: the intervals overlap at every length." in body
    assert "llama-server (yarn@2) and sharp's yarn@2: the intervals do not overlap at 512." in body
    assert "| llama-server (yarn@2) | 4/20 (" in body


def test_quality_without_lengths_writes_perplexity_and_entropy_only():
    """`--lengths` with no value: the page has the position tables and no passkey tables (nothing was asked)."""
    from argparse import Namespace
    from pathlib import Path

    from sharp.benchmarks import quality

    results = {"softmax": {"passkey": {}, "logp": {}, "ppl": [10.0, 12.0], "entropy": [0.4, 0.3]}}
    args = Namespace(lengths=[], trials=20, seed=0, text_from=0, command="sharp-bench quality --lengths")
    body = quality._body(args, results, [0, 512, 1024], "CPU", Path("m.gguf"))
    assert "No passkey cells" in body and "Passkey retrieval" not in body and "log-probability" not in body
    assert "topics):" in body and "from its token" not in body
    args.text_from = 4096  # the text's stretch from its token 4,096: the page says so
    assert "topics, from its token 4,096):" in quality._body(args, results, [0, 512, 1024], "CPU", Path("m.gguf"))
    assert "| softmax | 10.00 | 12.00 |" in body and "| softmax | 0.400 | 0.300 |" in body
    args.lengths = [512]
    results["softmax"].update(passkey={512: 18}, logp={512: -0.25})
    body = quality._body(args, results, [0, 512, 1024], "CPU", Path("m.gguf"))
    assert "| softmax | 18/20 (70%–97%) |" in body and "| softmax | -0.25 |" in body


def test_quality_llama_server_needs_a_gguf_and_a_built_server(tmp_path, monkeypatch, capsys):
    """`--llama-server` is refused with one line and exit 2 on a directory without a GGUF, and when llama-server is
    not built — before any of sharp's rows runs."""
    import numpy as np
    from gguf import GGUFWriter

    from sharp.benchmarks import peers, quality
    from sharp.models import gguf

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        quality.run([str(tmp_path), "--llama-server", "--no-write"])
    assert e.value.code == 2 and "reads the GGUF file the model came from" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        quality.run([str(tmp_path), "--llama-server", "--lengths", "--no-write"])
    assert e.value.code == 2 and "answers passkeys: give --lengths" in capsys.readouterr().err
    model = tmp_path / "m.gguf"
    writer = GGUFWriter(str(model), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setattr(gguf, "hf_directory", lambda path: tmp_path)  # a GGUF read is tested elsewhere
    monkeypatch.setattr(peers, "LLAMA_CPP", tmp_path / "no-llama")
    with pytest.raises(SystemExit) as e:
        quality.run([str(model), "--llama-server", "--no-write"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "llama-server is not built; run `make peers`" in err, err


def test_peers_report_sets_a_quantized_file_against_sharp_at_its_precision():
    """llama-server on the Q4_1 file is held to sharp's int4 export too (the goal compares those two), and a peer
    at fp32 gets no such ratio; without a quantized pair the column is not there."""
    from types import SimpleNamespace

    from sharp.benchmarks.peers import Peer, Reading, report

    args = SimpleNamespace(model="smollm2", lengths=[1024], new_tokens=64, repeats=1, concurrent=1, command="`x`",
                           shape="llama-11m", kv_cache_dtype=["fp32"])  # fmt: skip
    names = ["sharp-serve softmax", "sharp-serve softmax int4", "llama-server f32", "llama-server q4_1"]
    peers = [Peer(n, ready_s=1.0, disk_mib=1.0) for n in names]
    for p in peers:
        p.rss = {1024: 1.0}
    single = {
        ("sharp-serve softmax", 1024): [Reading(1.0, 60.0, 64)],
        ("sharp-serve softmax int4", 1024): [Reading(0.8, 120.0, 64)],
        ("llama-server f32", 1024): [Reading(2.0, 60.0, 64)],
        ("llama-server q4_1", 1024): [Reading(2.0, 100.0, 64)],
    }
    text = report(args, "a model", peers, single, {})
    assert "sharp at the file's precision ÷ peer: TTFT / decode" in text
    assert "| llama-server q4_1 | 1,024 | 2.00 (2.00–2.00) | 100 (100–100) | 0.50× / 0.60× | 0.40× / 1.20× |" in text
    assert "| llama-server f32 | 1,024 | 2.00 (2.00–2.00) | 60 (60–60) | 0.50× / 1.00× |  |" in text
    alone = report(args, "a model", peers[:1] + peers[2:3], single, {})
    assert "file's precision" not in alone
