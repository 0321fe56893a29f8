"""`make demo`: the problem, then the product on the embedded default (onnxruntime, CPU).

1. Dispersion: (a) the weight one query puts on its target key as the number of keys grows, per normalizer,
   through the reference and streamed implementations (checked to agree), each row explained in one line (the
   registry's summary); (b) how much one out-of-range logit pulls from the target.
2. The committed SSA demo model exported with `sharp-export --norm ssa` (sharp::SharpAttention nodes with
   their standard-op fallback).
3. `sharp-serve` on that file (onnxruntime, CPU); 4. `sharp-client generate --stream --stats` prints the text
   as it arrives and the request's own per-head entropy; 5. the server's Prometheus metrics, scraped over HTTP;
   6. SIGTERM drains the server and it exits 0.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.request import Request, urlopen

import torch

from sharp import smollm2
from sharp.models import NORMS, attend, registry

# The bare "What is the capital of France?" is a near-tie on the Q4_1 file's first token once activations are int8
# (as llama.cpp's Q4_1 kernels and onnxruntime's level-4 MatMulNBits have them): "The" 24.59 against "L" 24.82, and
# llama-server on the same file answers "L'Étoile, la Marseillaise…"; asked for one sentence the margin is 1.4.
QUESTION = "What is the capital of France? Answer in one sentence."
STREAMED = "Write one sentence about the sea."


def _problem(n: int, seed: int = 0, deviant: float | None = None) -> tuple[torch.Tensor, ...]:
    """q·k/√d equals the designed logits: uniform in [−2, 2] with one target key at 3; v one-hot on it (channel 0).
    `deviant`: one more key with that logit, v one-hot on channel 1."""
    g = torch.Generator().manual_seed(seed)
    z = torch.rand(n, generator=g) * 4 - 2
    target, odd = n // 3, n // 2
    z[target] = 3.0
    d = 16
    v = torch.zeros(1, 1, n, d)
    v[0, 0, target, 0] = 1.0
    if deviant is not None:
        z[odd] = deviant
        v[0, 0, odd, 1] = 1.0
    q = torch.zeros(1, 1, 1, d)
    q[..., 0] = d**0.5
    k = torch.zeros(1, 1, n, d)
    k[0, 0, :, 0] = z
    # ASEntmax's λ = δ + β·log(pos + 2)^γ with δ = 1, β = 0.5, γ = 1 (a trained model learns β, γ per query)
    qs = torch.full((1, 1, 1), 1.0 + 0.5 * torch.log(torch.tensor(n + 2.0)).item())
    return q, k, v, qs


def _attend(norm: str, n: int, deviant: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and entropy of the reference, checked against the streamed implementation."""
    q, k, v, qs = _problem(n, deviant=deviant)
    kw = dict(norm=norm, query_scale=qs if registry.get(norm).query_scale else None, return_entropy=True)
    out, ent = attend(q, k, v, impl="reference", **kw)
    out_s, ent_s = attend(q, k, v, impl="streamed", block_size=256, **kw)
    assert torch.allclose(out, out_s, atol=1e-5) and torch.allclose(ent, ent_s, atol=1e-5)
    return out[0, 0, 0], ent[0, 0, 0]


def dispersion() -> None:
    lengths = [16, 128, 1024, 8192]
    print("1. Dispersion\n")
    print("(a) Weight on the target key (row entropy, nats) as the context grows: logits uniform in [-2, 2], the")
    print("    target's 3; each normalizer with its default parameters\n")
    print(f"{'norm':<10}" + "".join(f"{'n=' + str(n):>18}" for n in lengths))
    for norm in NORMS:
        cells = [f"{o[0].item():.3f} (H={h.item():.2f})" for o, h in (_attend(norm, n) for n in lengths)]
        print(f"{norm:<10}" + "".join(f"{c:>18}" for c in cells))
    print()
    for norm in NORMS:
        summary = registry.get(norm).summary
        print(textwrap.fill(summary, 112, initial_indent=f"  {norm:<9} ", subsequent_indent=" " * 12))
    deviants, n = [6.0, 12.0, 30.0], 1024
    print(f"\n(b) One key's logit far outside the others' range, {n:,} keys: weight on the target / on that key\n")
    print(f"{'norm':<10}" + "".join(f"{'logit ' + str(int(x)):>18}" for x in deviants))
    for norm in NORMS:
        cells = [f"{o[0].item():.3f} / {o[1].item():.3f}" for o, _ in (_attend(norm, n, x) for x in deviants)]
        print(f"{norm:<10}" + "".join(f"{c:>18}" for c in cells))
    print("\nreference and streamed implementations agree on every row (checked).\n")


def _scrape(port: int) -> list[str]:
    text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [line for line in text.splitlines() if line.startswith("sharp_")]


def _entropy_table(lines: list[str], metric: str) -> list[str]:
    """Mean per layer (and head, when the server labels heads: it does up to 256 of them) from a histogram's _sum
    and _count lines."""
    sums, counts = {}, {}
    for line in lines:
        m = re.match(rf"{metric}_(sum|count)\{{(.*)\}} (\S+)", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = (int(labels["layer"]), int(labels.get("head", -1)))
            (sums if m.group(1) == "sum" else counts)[key] = float(m.group(3))
    means = {key: sums[key] / max(counts[key], 1) for key in counts}
    heads = sorted({h for _, h in means})
    layers = sorted({ly for ly, _ in means})
    if heads == [-1]:  # by layer: ten layers a row
        rows = []
        for start in range(0, len(layers), 10):
            chunk = layers[start : start + 10]
            rows.append(f"   {'layer':<7}" + "".join(f"{ly:>7}" for ly in chunk))
            rows.append(f"   {'':<7}" + "".join(f"{means[ly, -1]:>7.3f}" for ly in chunk))
        return rows
    rows = [f"   {'layer':<7}" + "".join(f"{'head ' + str(h):>8}" for h in heads)]
    for layer in layers:
        rows.append(f"   {layer:<7}" + "".join(f"{means[layer, h]:>8.3f}" for h in heads))
    return rows


def _ask(http: str, model: str, question: str) -> dict:
    """One greedy chat completion through the OpenAI-compatible API, as any OpenAI client sends it."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 64, "temperature": 0}
    req = Request(f"{http}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urlopen(req, timeout=120).read())


def product() -> None:
    """Serve the real model's GGUF, ask it through the OpenAI API and gRPC, scrape the metrics, drain."""
    try:
        model = smollm2.gguf_path()
    except FileNotFoundError as e:
        raise SystemExit(f"sharp demo: cannot run the product demo: {e}") from None
    bin_dir = Path(sys.executable).parent
    print(f"2. sharp-serve {model.name} (onnxruntime, CPU; any free ports)\n")
    print(f"   {smollm2.NAME}, the Q4_1 GGUF llama.cpp users run: read, exported and checked once into sharp's cache\n")
    cmd = [bin_dir / "sharp-serve", str(model), "--port", "0", "--metrics-port", "0", "--http-port", "0"]
    cmd += ["--log-level", "warning"]  # the access lines would land inside the streamed text
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        while (banner := server.stdout.readline()) and not banner.startswith(f"sharp-serve: {model.stem} ("):
            print(f"   {banner.rstrip()}")  # the one-time export's lines
        print(f"   {banner.strip()}")
        found = re.search(r" on ([\d.]+:\d+), metrics http://[\d.]+:(\d+)/.*OpenAI API (http://\S+/v1)", banner)
        if not found:
            raise SystemExit("sharp-serve did not start")
        target, metrics_port, http = found.group(1), int(found.group(2)), found.group(3)
        print(f"\n3. POST {http}/chat/completions (greedy): {QUESTION}\n")
        reply = _ask(http, model.stem, QUESTION)
        print(f"   {reply['choices'][0]['message']['content']}")
        print(f"   ({reply['usage']['prompt_tokens']} prompt tokens, {reply['usage']['completion_tokens']} generated)")
        prompt = f"<|im_start|>user\n{STREAMED}<|im_end|>\n<|im_start|>assistant\n"  # the model's chat format
        print(f"\n4. sharp-client generate --stream --stats over gRPC (temperature 0.7, seed 0): {STREAMED}\n")
        client = [bin_dir / "sharp-client", "--target", target, "generate", prompt, "--stream", "--stats"]
        client += ["--max-new-tokens", "60", "--temperature", "0.7", "--seed", "0"]
        subprocess.run(client, check=True)
        lines = _scrape(metrics_port)
        print("\n5. the server's Prometheus metrics after these requests\n")
        for line in lines:
            if re.match(
                r'sharp_(requests_total\{.*status="ok"|generation_tokens_total|prompt_tokens_total|time_to_first_token_seconds_(sum|count))',
                line,
            ):
                print(f"   {line}")
        print("\n   sharp_attention_normalized_entropy (mean per layer; 1 = uniform over the visible keys):")
        print("\n".join(_entropy_table(lines, "sharp_attention_normalized_entropy")))
    finally:
        server.send_signal(signal.SIGTERM)
        rest, _ = server.communicate(timeout=60)
    print("\n6. SIGTERM: " + "; ".join(line.removeprefix("sharp-serve: ") for line in rest.splitlines()))
    print(f"   sharp-serve exited with {server.returncode}")


def main() -> None:
    print("sharp demo\n")
    dispersion()
    product()


if __name__ == "__main__":
    main()
