"""`sharp-bench quality [MODEL]`: does a sharpening setting keep a real model's attention sharp as the context grows,
and what does it cost? Passkey retrieval, perplexity and attention entropy by position, per setting.

MODEL is a GGUF file or a Hugging Face directory (default: SmolLM2-135M-Instruct's GGUF, `sharp.smollm2`). Each
setting is a change of the model's config.json that `sharp-export` and `sharp-serve` take as they are — the
normalizer `config.sharp_attention` names and a RoPE scaling as Hugging Face configs state it — so a setting that
helps is one a user can ship. The model runs through models/hf_lm.py (sharp's own modules, tested equal to the
export for every normalizer): on a GPU with the Triton kernels, on CPU with the reference and streamed attention
(and, for the passkeys of a setting whose every layer is a row-scaled softmax, torch's fused SDPA: no entropy there).

- **passkey**: a five-digit key hidden at a depth in real prose (the Python documentation's topics, which ship with
  Python: `pydoc_data.topics`), asked for at the end through the model's chat template; scored by exact match of
  the first number in the greedy answer; each cell `k/n` with a Wilson 95% interval. Depths spread evenly over the
  trials, keys and filler differ per trial, the same for every setting (`--seed` draws another set: held-out prompts
  for choosing a setting's strength). Beside it, the mean log-probability of the key's tokens after the prompt
  (teacher-forced): a continuous score that tells settings apart at few trials, where counts cannot.
- **sweeps**: `adaptive@C` and `ssmax@N` are members of a family at a strength (FAMILIES), so a calibration is a
  list of settings, e.g. `--settings softmax adaptive@0.1 adaptive@0.3 ssmax@512 --seed 1`.
- **retrieval heads**: `--find-heads K` names the K heads that put the most weight on the key while the model writes
  it (retrieval_heads.py) and the `sharp-export --scaled-heads` flags that length-scale only them; the setting
  `heads@K` finds them on the next draw (`--seed` + 1) and scores them on this one.
- **perplexity by position**: one long text (the same topics, past the passkey filler) scored once; the mean
  negative log-likelihood per position bin, as perplexity.
- **attention entropy by position**: every head's normalized entropy (entropy / log(keys)) at the same positions,
  averaged over heads and layers per bin — the mechanism beside the outcome.
- **`--llama-server`**: the same passkey prompts (the same token ids) answered greedily by llama.cpp's
  `llama-server` on the same GGUF (`make peers`), a row beside each setting llama.cpp can run as it is — softmax,
  and softmax with a RoPE scaling (`yarn@F`: its `--rope-scaling yarn`); where a peer row's interval and its
  setting's do not overlap, the page says so. The check that the harness, sharp's softmax path and its RoPE scaling
  are right.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sharp.benchmarks.harness import (
    BenchParser,
    add_output,
    command_line,
    markdown_table,
    output_page,
    today,
    write_section,
)

PAGE = Path("docs/quality.md")
INSTRUCTION = (
    "Below is some text. Somewhere inside it there is a pass key, a five-digit number. Read the text, find the pass"
    " key and remember it; you will be asked for it at the end.\n\n{body}\n\nThe text is over. What is the pass key"
    " mentioned in the text? Answer with the number only."
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
ANSWER = "The pass key is"  # the assistant's reply begins so; the key is the number it writes next
NEW_TOKENS = 8
FIND_LENGTH, FIND_TRIALS = 1024, 8  # the prompts the retrieval heads are found on (`--find-heads`, heads@K)
SCALED_FROM = 512  # where heads@K's heads start sharpening: well inside SmolLM2's comfortable range


@dataclass(frozen=True)
class Setting:
    """A change of config.json: `attention` becomes config.sharp_attention, `rope` updates rope_parameters (with
    `context` the new max_position_embeddings)."""

    attention: dict | None = None
    rope: dict | None = None
    context_factor: float = 1.0
    find_heads: int = 0  # length-scale this many heads, found on the model (retrieval_heads) before it runs


def settings_for(train_length: int) -> dict[str, Setting]:
    """The named settings compared, for a model trained at `train_length` tokens."""
    s = 1 / math.log(train_length)  # SSMax's s·log n = 1 at the training length: softmax there, sharper beyond
    yarn = _yarn(4.0, train_length)
    return {
        "softmax": Setting(),
        "adaptive": Setting({"norm": "adaptive"}),
        "ssmax": Setting({"norm": "ssmax", "ssmax_s": s}),
        "yarn-4x": Setting(rope=yarn, context_factor=4.0),
        "yarn-4x+ssmax": Setting({"norm": "ssmax", "ssmax_s": s}, rope=yarn, context_factor=4.0),
        # a setting that destroys attention (logits × ~0.02 at 600 keys: temperature ~50): the harness's own check
        "flat": Setting({"norm": "ssmax", "ssmax_s": 0.003}),
    }


def _yarn(factor: float, train_length: int) -> dict:
    """YaRN's rope_parameters as Hugging Face configs state them: `factor`× the training length."""
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": train_length}


FAMILIES = {
    "adaptive": "adaptive@C: the paper's polynomial moved toward 1 by C (β = 1 + C·(poly(H) − 1); C = 1 is 'adaptive')",
    "ssmax": "ssmax@N: SSMax equal to softmax at N keys (s = 1 / log N)",
    "yarn": "yarn@F: YaRN, factor F > 1 from the training length",
    "heads": f"heads@K (or heads@K:N): the K heads with the most weight on the key (found on passkey draw seed + 1"
    f" at {FIND_LENGTH:,} tokens) length-scaled from {SCALED_FROM} keys (or N), as --scaled-heads exports them",
}
"""The settings that take a strength, for a calibration sweep (`--settings adaptive@0.1 adaptive@0.3 ssmax@512`).
Settings join with '+' (`yarn@2+heads@8`): one RoPE scaling at most, and one normalizer besides softmax."""


def setting(name: str, train_length: int) -> Setting:
    """A named setting, a family's member `FAMILY@VALUE`, or settings joined by '+'; ValueError says what is
    allowed."""
    table = settings_for(train_length)
    if name in table:
        return table[name]
    allowed = f"valid: {', '.join(table)}, or {'; '.join(FAMILIES.values())}; or such settings joined by '+'"
    if "+" in name:
        return _joined(name, [setting(part, train_length) for part in name.split("+")])
    family, at, text = name.partition("@")
    try:
        value = float(text) if at and family in FAMILIES else math.nan
    except ValueError:
        value = math.nan
    if family == "adaptive" and math.isfinite(value) and value > 0:
        from sharp.models.registry import PAPER_POLY

        poly = [value * c for c in PAPER_POLY]
        poly[-1] += 1 - value  # 1 + C·(poly − 1): the constant term takes the rest
        return Setting({"norm": "adaptive", "poly": poly})
    if family == "ssmax" and math.isfinite(value) and value >= 2:
        return Setting({"norm": "ssmax", "ssmax_s": 1 / math.log(value)})
    if family == "yarn" and math.isfinite(value) and value > 1:
        return Setting(rope=_yarn(value, train_length), context_factor=value)
    count, colon, start = text.partition(":")  # heads@K or heads@K:N
    good_start = not colon or (start.isdigit() and int(start) >= 2)
    if family == "heads" and count.isdigit() and int(count) >= 1 and good_start:
        return Setting({"norm": "softmax", "scaled_from": int(start or SCALED_FROM)}, find_heads=int(count))
    raise ValueError(f"unknown setting {name!r}; {allowed}")


def _joined(name: str, parts: list[Setting]) -> Setting:
    """Settings applied together: their RoPE scalings (one at most), normalizers (one besides softmax at most) and
    scaled heads."""
    ropes = [p for p in parts if p.rope is not None]
    norms = {p.attention["norm"] for p in parts if p.attention and p.attention.get("norm", "softmax") != "softmax"}
    if len(ropes) > 1 or len(norms) > 1 or sum(p.find_heads > 0 for p in parts) > 1:
        raise ValueError(f"{name!r} joins two RoPE scalings, two normalizers or two head counts; join one of each")
    attention = {}
    for p in sorted(parts, key=lambda p: p.attention is not None and p.attention.get("norm") != "softmax"):
        attention.update(p.attention or {})  # a normalizer besides softmax is merged last: its "norm" stays
    rope = ropes[0] if ropes else Setting()
    return Setting(attention or None, rope.rope, rope.context_factor, max(p.find_heads for p in parts))


def _progress(t0: float, message: str) -> None:
    print(f"quality [{time.perf_counter() - t0:6.1f} s] {message}", file=sys.stderr, flush=True)


def prose() -> list[str]:
    """The words of the Python documentation's topics (pydoc_data.topics ships with every CPython)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).split()


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def build(directory: Path, setting: Setting, device: str):
    """The model of `directory` under `setting` (a SharpLM)."""
    from sharp.models import hf, hf_lm

    config = hf.load_config(directory)
    if setting.attention is not None:
        setattr(config, hf.CONFIG_KEY, dict(setting.attention))
    if setting.rope is not None:
        config.rope_parameters = {**(config.rope_parameters or {}), **setting.rope}
        config.max_position_embeddings = int(config.max_position_embeddings * setting.context_factor)
    hf.check_config(config)
    return hf_lm.load(directory, config).to(device)


def retrieval_heads(directory: Path, tok, words: list[str], seed: int, device: str) -> list[tuple[int, int, float]]:
    """Every head of the model as trained, the most weight on the key first (FIND_TRIALS prompts of draw `seed`)."""
    from sharp.benchmarks.retrieval_heads import key_attention, top_heads

    model = build(directory, Setting(), device)
    prompts = passkey_prompts(tok, words, FIND_LENGTH, FIND_TRIALS, seed)
    mass = key_attention(model, prompts, lambda key: key_ids(tok, key))
    return top_heads(mass, mass.numel())


def with_heads(setting: Setting, heads: list[tuple[int, int, float]]) -> Setting:
    """`setting` with its first `find_heads` of `heads` length-scaled (from the keys the setting names)."""
    chosen = [[layer, head] for layer, head, _ in heads[: setting.find_heads]]
    attention = {"scaled_from": SCALED_FROM, **(setting.attention or {}), "scaled_heads": chosen}
    return dataclasses.replace(setting, attention=attention)


def passkey_prompts(tok, words: list[str], length: int, trials: int, seed: int = 0) -> list[tuple[list[int], str]]:
    """`trials` prompts of about `length` tokens, each with its key: depths evenly spread, filler per trial."""
    from sharp.models.tokenizer import render_chat

    rng = random.Random(seed)
    out = []
    for t in range(trials):
        key = str(rng.randint(10000, 99999))
        depth = (t + 0.5) / trials
        start = (t * 7919) % max(1, len(words) // 2)  # a different stretch of prose per trial
        n = max(16, int(length / 1.6))
        while True:  # grow or shrink the filler until the prompt is within 3% of `length` tokens
            filler = [words[(start + i) % len(words)] for i in range(n)]  # the prose again past its end
            cut = int(len(filler) * depth)
            body = " ".join(filler[:cut]) + NEEDLE.format(key=key) + " ".join(filler[cut:])
            text = render_chat(tok, [{"role": "user", "content": INSTRUCTION.format(body=body)}]) + ANSWER
            ids = tok.encode(text, bos=False)
            if abs(len(ids) - length) <= 0.03 * length or n < 16:
                break
            n = max(16, int(n * length / len(ids)))
        out.append((ids, key))
    return out


def _impl(device: str, keys: int, model=None) -> str:
    """The attention the torch backend would run (its kernels on CUDA; on CPU streamed from its threshold). With
    `model` (no entropy wanted) and every layer a row-scaled softmax, CPU runs torch's fused SDPA: the same numbers
    (tests/test_attention.py), faster than the streamed path (docs/quality.md: the trial times)."""
    from sharp.models.attention import sdpa_runs
    from sharp.serving.backends.torch_backend import STREAMED_FROM_KEYS

    if device == "cuda":
        return "triton"
    if model is not None and all(sdpa_runs(norm) for norm in model.cfg.layer_norms()):
        return "sdpa"
    return "streamed" if keys >= STREAMED_FROM_KEYS else "reference"


@torch.inference_mode()
def answer(model, ids: list[int], key_ids: list[int], n: int, device: str) -> tuple[list[int], float]:
    """n greedy tokens after `ids` on a dense cache, and the log-probability of `key_ids` following `ids` (the key
    as the answer writes it, teacher-forced): a continuous score beside the exact match, steadier at few trials."""
    impl = _impl(device, len(ids), model)
    prompt = model.step(torch.tensor([ids], device=device), impl=impl, last_logits=True)
    forced = model.step(torch.tensor([key_ids[:-1]], device=device), cache=prompt.cache, impl=impl)
    logits = torch.cat([prompt.logits[0, -1:], forced.logits[0]]).float().log_softmax(-1)
    logp = float(logits[torch.arange(len(key_ids), device=device), torch.tensor(key_ids, device=device)].sum())
    out, tokens = prompt, []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = model.step(torch.tensor([[nxt]], device=device), cache=out.cache, impl=impl)
    return tokens, logp


def key_ids(tok, key: str) -> list[int]:
    """The key's tokens as the answer writes them after ANSWER (a space, then the digits)."""
    return tok.encode(" " + key, bos=False)


def scored(answer: str, key: str) -> bool:
    """The answer's first number is the key."""
    found = re.search(r"\d+", answer)
    return bool(found and found.group() == key)


def peer_name(setting_name: str) -> str:
    """The row of llama-server running `setting_name`."""
    return f"llama-server ({setting_name})"


PEER = peer_name("softmax")  # the peer's row beside sharp's softmax


def peer_flags(s: Setting) -> list[str] | None:
    """llama-server's flags for a setting that llama.cpp runs as it is — the model's own softmax, with its RoPE or
    a RoPE scaling llama.cpp implements (YaRN, linear) — or None: a normalizer change or scaled heads it cannot run.
    YaRN's attention factor and β's are left to llama.cpp's defaults, which are Hugging Face's (0.1·ln F + 1; 32, 1)."""
    if s.find_heads or (s.attention and s.attention != {"norm": "softmax"}):
        return None
    if s.rope is None:
        return []
    kind, factor = s.rope.get("rope_type"), s.rope.get("factor")
    if kind not in ("yarn", "linear") or set(s.rope) - {"rope_type", "factor", "original_max_position_embeddings"}:
        return None
    flags = ["--rope-scaling", kind, "--rope-scale", f"{factor:g}"]
    if kind == "yarn" and "original_max_position_embeddings" in s.rope:
        flags += ["--yarn-orig-ctx", str(s.rope["original_max_position_embeddings"])]
    return flags


def llama_server_hits(
    gguf: Path,
    prompts: dict[int, list[tuple[list[int], str]]],
    t0: float,
    name: str = "softmax",
    flags: Sequence[str] = (),
) -> dict[int, int]:
    """How many of each length's prompts llama-server, on the same GGUF with `flags` (setting `name`'s,
    peer_flags), answers with the key (greedy, the prompts' own token ids: the same tokens sharp saw)."""
    import json
    import tempfile
    import urllib.request

    from sharp.benchmarks.peers import start_llama_server

    context = max(len(ids) for cell in prompts.values() for ids, _ in cell) + NEW_TOKENS + 16
    with tempfile.TemporaryDirectory() as tmp:
        row = peer_name(name)
        peer = start_llama_server(gguf, row, context, 1, 0, Path(tmp) / "llama-server.log", extra=flags)
        try:
            hits = {}
            for length, cell in prompts.items():
                hits[length] = 0
                for ids, key in cell:
                    body = {"model": peer.model, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0}
                    request = urllib.request.Request(
                        f"{peer.url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
                    )
                    with urllib.request.urlopen(request, timeout=3600) as r:
                        hits[length] += scored(json.load(r)["choices"][0]["text"], key)
                _progress(t0, f"{row} passkey at {length:,}: {hits[length]}/{len(cell)}")
        finally:
            peer.stop()
    return hits


def disagreements(results: dict, trials: int, reference: str = "softmax") -> list[int]:
    """The lengths at which the Wilson intervals of setting `reference` and of llama-server running it do not
    overlap."""
    peer = peer_name(reference)
    if peer not in results or reference not in results:
        return []
    out = []
    for length, k in results[peer]["passkey"].items():
        mine = results[reference]["passkey"].get(length)
        if mine is None:
            continue
        (a_lo, a_hi), (b_lo, b_hi) = wilson(k, trials), wilson(mine, trials)
        if a_hi < b_lo or b_hi < a_lo:
            out.append(length)
    return out


@torch.inference_mode()
def by_position(model, ids: list[int], bins: list[int], device: str) -> tuple[list[float], list[float]]:
    """Perplexity and mean normalized attention entropy of the text's positions in each bin [bins[i], bins[i+1])."""
    out = model.step(torch.tensor([ids], device=device), return_entropy=True, impl=_impl(device, len(ids)))
    logits = out.logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], device=device), reduction="none")
    positions = torch.arange(1, len(ids), device=device)  # the position of the predicted token
    ent = out.entropy[0].float().mean((0, 1))  # (L,) over layers and heads
    norm = ent[1:] / torch.log(positions.float() + 1)  # entropy / log(keys seen), keys = position + 1
    ppl, entropy = [], []
    for lo, hi in itertools.pairwise(bins):
        inside = (positions >= lo) & (positions < hi)
        ppl.append(math.exp(float(nll[inside].mean())) if inside.any() else float("nan"))
        entropy.append(float(norm[inside].mean()) if inside.any() else float("nan"))
    return ppl, entropy


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench quality", description=__doc__)
    ap.add_argument("model", nargs="?", type=Path, help="a GGUF file or a Hugging Face directory (default: SmolLM2)")
    ap.add_argument(
        "--settings",
        nargs="+",
        help="default: every named setting but 'flat', and heads@8; a sweep adds a family's members: "
        + "; ".join(FAMILIES.values()),
    )
    ap.add_argument(
        "--lengths",
        type=int,
        nargs="*",
        default=[512, 1024, 2048, 4096, 8192, 16384, 32768],
        help="the passkey prompts' lengths in tokens; none: perplexity and entropy by position only",
    )
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument(
        "--seed", type=int, default=0, help="the passkeys' draw: another seed gives held-out prompts for a calibration"
    )
    ap.add_argument("--text", type=int, default=16384, help="tokens of the perplexity text (bins up to it)")
    ap.add_argument(
        "--text-from",
        type=int,
        default=0,
        metavar="N",
        help="the perplexity text starts at its token N: a later stretch scored within a shorter context",
    )
    ap.add_argument(
        "--find-heads",
        type=int,
        metavar="K",
        help=f"only name the K heads of the model that put the most weight on the key ({FIND_TRIALS} passkey prompts"
        f" of draw --seed at {FIND_LENGTH:,} tokens) and the sharp-export flags that length-scale them",
    )
    ap.add_argument("--plot", type=Path, help="write the plot (PNG) here too (default beside docs/quality.md)")
    ap.add_argument("--quick", action="store_true", help="CI size: softmax and 'flat' at ~600 tokens, 5 trials")
    ap.add_argument(
        "--llama-server",
        action="store_true",
        help="also ask llama-server (make peers) the passkeys, on the same GGUF, for each setting llama.cpp runs as it"
        " is (softmax, yarn@F)",
    )
    add_output(ap, PAGE)
    args = ap.parse_args(argv)
    args.command = command_line("quality", [] if argv is None else list(argv))
    if args.quick:
        args.settings, args.lengths, args.trials, args.text = ["softmax", "flat"], [600], 5, 1024
        args.no_write = args.no_write or args.write is None  # only to a page named with --write
    if min([*args.lengths, args.text]) < 64 or args.trials < 1 or args.text_from < 0:
        ap.error("--lengths and --text must be >= 64 tokens, --trials >= 1, --text-from >= 0")
    if args.find_heads is not None and args.find_heads < 1:
        ap.error(f"--find-heads {args.find_heads}: name at least 1 head")
    from sharp.models import gguf

    source = args.model
    if source is None:
        from sharp import smollm2

        source = smollm2.gguf_path()
    try:
        gguf_file = gguf.find(source)
        directory = gguf.hf_directory(gguf_file) if gguf_file is not None else source
    except gguf.GGUFError as e:
        ap.error(str(e))
    if not (directory / "config.json").is_file():
        ap.error(f"{source}: not a GGUF file or a Hugging Face directory")
    if args.llama_server and not args.lengths:
        ap.error("--llama-server answers passkeys: give --lengths")
    if args.llama_server and gguf_file is None:
        ap.error(f"--llama-server reads the GGUF file the model came from; {source} is a directory without one")
    if args.llama_server:
        from sharp.benchmarks.peers import LLAMA_CPP

        if not (LLAMA_CPP / "llama-server").exists():  # said now, not after the minutes sharp's rows take
            ap.error(f"--llama-server: {LLAMA_CPP / 'llama-server'} is not built; run `make peers` (~12 min)")
    from sharp.models import hf

    train = hf.load_config(directory).max_position_embeddings
    names = args.settings or [*(n for n in settings_for(train) if n != "flat"), "heads@8"]
    try:
        table = {name: setting(name, train) for name in names}
    except ValueError as e:
        ap.error(str(e))
    if args.llama_server and not any(peer_flags(s) is not None for s in table.values()):
        ap.error(f"--llama-server runs softmax and yarn@F settings (none of {', '.join(names)}); add softmax")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    machine = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    page = output_page(args, PAGE)
    # the peer check is its own section (and plot): a run of it leaves the settings' table as it was
    section = "quality --llama-server" if args.llama_server else "quality"
    from sharp.exporter.hf import load_tokenizer

    tok = load_tokenizer(directory, hf.load_config(directory))  # no setting changes the tokenizer
    words = prose()
    half = len(words) // 2
    if args.find_heads is not None:
        heads = retrieval_heads(directory, tok, words[:half], args.seed, device)[: args.find_heads]
        print(markdown_table(["layer.head", "weight on the key"], [[f"{la}.{h}", f"{w:.3f}"] for la, h, w in heads]))
        flags = " ".join(f"{la}.{h}" for la, h, _ in heads)
        print(f"\nsharp-export {source} --scaled-heads {flags} --scaled-from {SCALED_FROM}")
        return 0
    prompts = {n: passkey_prompts(tok, words[:half], n, args.trials, args.seed) for n in args.lengths}  # every row's
    text_ids = tok.encode(" ".join(words[half:]), bos=False)
    if len(text_ids) < args.text_from + args.text:
        ap.error(f"--text-from {args.text_from} --text {args.text}: the text has {len(text_ids):,} tokens")
    text_ids = text_ids[args.text_from : args.text_from + args.text]
    bins = [0, *[b for b in (512, 1024, 2048, 4096, 8192, 16384, 32768) if b < args.text], args.text]
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    found: list[tuple[int, int, float]] = []
    for name in names:
        if table[name].find_heads:  # found on another draw than the one scored: the choice is held out
            found = found or retrieval_heads(directory, tok, words[:half], args.seed + 1, device)
            table[name] = with_heads(table[name], found)
            _progress(t0, f"{name}: heads {', '.join(f'{la}.{h}' for la, h in table[name].attention['scaled_heads'])}")
        model = build(directory, table[name], device)
        cells, logps = {}, {}
        for length in args.lengths:
            hits, logp = 0, 0.0
            for ids, key in prompts[length]:
                tokens, lp = answer(model, ids, key_ids(tok, key), NEW_TOKENS, device)
                hits += scored(tok.decode(tokens), key)
                logp += lp
            cells[length], logps[length] = hits, logp / args.trials
            _progress(t0, f"{name} passkey at {length:,}: {hits}/{args.trials}, mean log p(key) {logps[length]:.2f}")
        ppl, ent = by_position(model, text_ids, bins, device)
        _progress(t0, f"{name} perplexity by position: {', '.join(f'{p:.2f}' for p in ppl)}")
        results[name] = {"passkey": cells, "logp": logps, "ppl": ppl, "entropy": ent}
        del model
        if page is not None:
            write_section(section, _body(args, results, bins, machine, source), page, title="Long-context quality")
    if args.llama_server:
        from sharp.benchmarks.peers import PeerUnavailable

        try:
            for name in names:
                if (flags := peer_flags(table[name])) is not None:
                    results[peer_name(name)] = {"passkey": llama_server_hits(gguf_file, prompts, t0, name, flags)}
        except PeerUnavailable as e:
            print(f"sharp-bench quality: llama-server: {e}", file=sys.stderr)
            return 1
        if page is not None:
            write_section(section, _body(args, results, bins, machine, source), page, title="Long-context quality")
    print(_body(args, results, bins, machine, source))
    if page is not None or args.plot is not None:
        tail = "-llama-server" if args.llama_server else ""
        _plot(results, args, bins, args.plot or page.with_name(f"{page.stem}{tail}.png"))
    return 0


def _body(args, results: dict, bins: list[int], machine: str, source: Path) -> str:
    lengths = args.lengths
    acc = []
    for name, r in results.items():
        row = [name]
        for length in lengths:
            k = r["passkey"].get(length)
            if k is None:
                row.append("")
                continue
            lo, hi = wilson(k, args.trials)
            row.append(f"{k}/{args.trials} ({lo:.0%}–{hi:.0%})")
        acc.append(row)
    spans = [f"{lo:,}–{hi:,}" for lo, hi in itertools.pairwise(bins)]
    ours = {name: r for name, r in results.items() if "ppl" in r}  # the peer answers passkeys only
    logp = [[name, *(f"{r['logp'][n]:.2f}" for n in lengths)] for name, r in ours.items()]
    by_length = ["setting", *(f"{n:,}" for n in lengths)]
    ppl = [[name, *(f"{p:.2f}" for p in r["ppl"])] for name, r in ours.items()]
    ent = [[name, *(f"{e:.3f}" for e in r["entropy"])] for name, r in ours.items()]
    said = []
    for name in ours:
        if peer_name(name) not in results:
            continue
        apart = disagreements(results, args.trials, name)
        where = f"do not overlap at {', '.join(f'{n:,}' for n in apart)}" if apart else "overlap at every length"
        said.append(f"{peer_name(name)} and sharp's {name}: the intervals {where}.")
    peer = "".join(f"\n\n{line}" for line in said)
    passkey = (
        f" {args.trials} trials per cell (passkey draw {args.seed}), Wilson 95% intervals."
        "\n\n**Passkey retrieval** (exact match of the five-digit key), by prompt length in tokens:\n\n"
        + markdown_table(by_length, acc)
        + peer
        + "\n\n**Mean log-probability of the key** (its tokens after the prompt, teacher-forced; 0 is certain):\n\n"
        + markdown_table(by_length, logp)
        if lengths
        else " No passkey cells (no --lengths)."
    )
    return (
        f"{today()}, {machine}, {args.command} on {source.name};"
        + passkey
        + "\n\n**Perplexity by position** (one text of the Python documentation's topics"
        + (f", from its token {args.text_from:,}" if args.text_from else "")
        + "):\n\n"
        + markdown_table(["setting", *spans], ppl)
        + "\n\n**Attention entropy by position** (entropy / log keys, mean over layers and heads):\n\n"
        + markdown_table(["setting", *spans], ent)
    )


def _plot(results: dict, args, bins: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    mids = [(lo + hi) / 2 for lo, hi in itertools.pairwise(bins)]
    for name, r in results.items():
        xs = sorted(r["passkey"])
        a.plot(xs, [r["passkey"][x] / args.trials for x in xs], marker="o", label=name)
        if "ppl" in r:
            b.plot(mids, r["ppl"], marker="o", label=name)
    a.set(xscale="log", xlabel="prompt tokens", ylabel="passkey accuracy", ylim=(-0.05, 1.05))
    b.set(xscale="log", xlabel="position", ylabel="perplexity")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
