"""`make demo`: the problem, then the product on the embedded default (onnxruntime, CPU).

1. Dispersion: the weight one query puts on its target key as the number of keys grows, per normalizer,
   through the reference and streamed implementations (checked to agree).
2. The committed SSA demo model exported with `sharp-export --norm ssa` (sharp::SharpAttention nodes with
   their standard-op fallback).
3. `sharp-serve` on that file (onnxruntime, CPU); 4. `sharp-client generate --stream --stats` prints the text
   as it arrives and the request's own per-head entropy; 5. the server's Prometheus metrics, scraped over HTTP;
   6. SIGTERM drains the server and it exits 0.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from sharp.models import NORMS, attend, registry
from sharp.models.checkpoint import zoo_model


def _problem(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q·k/√d equals the designed logits: uniform in [−2, 2] with one target key at 3; v one-hot on it."""
    g = torch.Generator().manual_seed(seed)
    z = torch.rand(n, generator=g) * 4 - 2
    target = n // 3
    z[target] = 3.0
    d = 16
    q = torch.zeros(1, 1, 1, d)
    q[..., 0] = d**0.5
    k = torch.zeros(1, 1, n, d)
    k[0, 0, :, 0] = z
    v = torch.zeros(1, 1, n, d)
    v[0, 0, target, 0] = 1.0
    # ASEntmax's λ = δ + β·log(pos + 2)^γ with δ = 1, β = 0.5, γ = 1 (a trained model learns β, γ per query)
    qs = torch.full((1, 1, 1), 1.0 + 0.5 * torch.log(torch.tensor(n + 2.0)).item())
    return q, k, v, qs


def dispersion() -> None:
    lengths = [16, 128, 1024, 8192]
    print("1. Dispersion — weight on the target key (row entropy, nats) as the context grows\n")
    print(f"{'norm':<10}" + "".join(f"{'n=' + str(n):>18}" for n in lengths))
    for norm in NORMS:
        cells = []
        for n in lengths:
            q, k, v, qs = _problem(n)
            kw = dict(norm=norm, query_scale=qs if registry.get(norm).query_scale else None, return_entropy=True)
            out, ent = attend(q, k, v, impl="reference", **kw)
            out_s, ent_s = attend(q, k, v, impl="streamed", block_size=256, **kw)
            assert torch.allclose(out, out_s, atol=1e-5) and torch.allclose(ent, ent_s, atol=1e-5)
            cells.append(f"{out[0, 0, 0, 0].item():.3f} (H={ent.item():.2f})")
        print(f"{norm:<10}" + "".join(f"{c:>18}" for c in cells))
    print("\nreference and streamed implementations agree on every row (checked).\n")


def _scrape(port: int) -> list[str]:
    from urllib.request import urlopen

    text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [line for line in text.splitlines() if line.startswith("sharp_")]


def _entropy_table(lines: list[str], metric: str) -> list[str]:
    """Mean per layer and head from a histogram's _sum and _count lines."""
    sums, counts = {}, {}
    for line in lines:
        m = re.match(rf'{metric}_(sum|count)\{{head="(\d+)",layer="(\d+)",model="[^"]*"\}} (\S+)', line)
        if m:
            (sums if m.group(1) == "sum" else counts)[(int(m.group(3)), int(m.group(2)))] = float(m.group(4))
    heads = max(h for _, h in counts) + 1
    rows = [f"   {'layer':<7}" + "".join(f"{'head ' + str(h):>9}" for h in range(heads))]
    for layer in sorted({ly for ly, _ in counts}):
        cells = [sums[layer, h] / max(counts[layer, h], 1) for h in range(heads)]
        rows.append(f"   {layer:<7}" + "".join(f"{c:>9.3f}" for c in cells))
    return rows


def product() -> None:
    """Export, serve, stream through sharp-client, scrape the metrics, drain: the shipped flow end to end."""
    try:
        model = zoo_model("ssa")
    except FileNotFoundError as e:
        raise SystemExit(f"sharp demo: cannot run the product demo: {e}") from None
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ssa.onnx"
        print("2. sharp-export models/zoo/ssa.pt --norm ssa\n")
        subprocess.run([bin_dir / "sharp-export", str(model), "--norm", "ssa", "-o", str(out)], check=True)
        print("\n3. sharp-serve on onnxruntime (CPU), any free ports\n")
        server = subprocess.Popen(
            [bin_dir / "sharp-serve", str(out), "--port", "0", "--metrics-port", "0"], stdout=subprocess.PIPE, text=True
        )
        try:
            banner = server.stdout.readline().strip()
            print(f"   {banner}")
            found = re.search(r" on ([\d.]+:\d+), metrics http://[\d.]+:(\d+)/", banner)
            if not found:
                raise SystemExit("sharp-serve did not start")
            target, metrics_port = found.group(1), int(found.group(2))
            prompt = "import os\n\n\ndef read_config(path"
            print(f"\n4. sharp-client generate --stream --stats (temperature 0.8, top-k 40, seed 0)\n{prompt}", end="")
            client = [bin_dir / "sharp-client", "--target", target, "generate", prompt, "--stream", "--stats"]
            client += ["--max-new-tokens", "120", "--temperature", "0.8", "--top-k", "40", "--seed", "0"]
            subprocess.run(client, check=True)
            lines = _scrape(metrics_port)
            print("\n5. the server's Prometheus metrics after this request\n")
            for line in lines:
                if re.match(
                    r"sharp_(requests_total|generation_tokens_total|prompt_tokens_total|time_to_first_token_seconds_(sum|count))",
                    line,
                ):
                    print(f"   {line}")
            print("\n   sharp_attention_entropy_nats (mean per layer and head, from the _sum and _count series):")
            print("\n".join(_entropy_table(lines, "sharp_attention_entropy_nats")))
            print("   sharp_attention_normalized_entropy (1 = uniform over the visible keys):")
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
