"""`make demo`: the problem, then the product on the embedded default (onnxruntime, CPU).

1. Dispersion: the weight one query puts on its target key as the number of keys grows, per normalizer,
   through the reference and streamed implementations (checked to agree).
2. The committed SSA demo model exported with `sharp-export --norm ssa` (sharp::SharpAttention nodes with
   their standard-op fallback), then a greedy generation in stock onnxruntime with the graph's
   `attention_entropy` output summarised per layer and head.
The gRPC server lands with its issue; it will serve this same file.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from sharp.models import NORMS, ByteTokenizer, SamplingParams, attend
from sharp.models.sampling import sample

ZOO = Path(__file__).resolve().parent.parent / "models" / "zoo"


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
            kw = dict(norm=norm, query_scale=qs if norm == "asentmax" else None, return_entropy=True)
            out, ent = attend(q, k, v, impl="reference", **kw)
            out_s, ent_s = attend(q, k, v, impl="streamed", block_size=256, **kw)
            assert torch.allclose(out, out_s, atol=1e-5) and torch.allclose(ent, ent_s, atol=1e-5)
            cells.append(f"{out[0, 0, 0, 0].item():.3f} (H={ent.item():.2f})")
        print(f"{norm:<10}" + "".join(f"{c:>18}" for c in cells))
    print("\nreference and streamed implementations agree on every row (checked).\n")


def generate_onnx(
    path: Path, prompt: str, new_tokens: int, params: SamplingParams | None = None, seed: int = 0
) -> tuple[str, np.ndarray]:
    """Generation through the exported graph (greedy by default); returns the text and the entropies
    (layers, heads, T) from its attention_entropy output."""
    import onnx
    import onnxruntime as ort

    meta = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    past_names = [n for n in names if n.startswith("past_key_values.")]
    kv_shape = next(i.shape for i in sess.get_inputs() if i.name == past_names[0])
    tok = ByteTokenizer()
    ids = tok.encode(prompt)
    heads_kv, head_dim = int(kv_shape[1]), int(kv_shape[3])
    past = {n: np.zeros((1, heads_kv, 0, head_dim), np.float32) for n in past_names}
    params = params or SamplingParams(temperature=0.0)
    generator = torch.Generator().manual_seed(seed)
    feed_ids, out_ids, entropies = ids, [], []
    for _ in range(new_tokens):
        start = len(ids) + len(out_ids) - len(feed_ids)
        feed = {
            "input_ids": np.array([feed_ids], np.int64),
            "attention_mask": np.ones((1, start + len(feed_ids)), np.int64),
            "position_ids": np.arange(start, start + len(feed_ids), dtype=np.int64)[None],
            **past,
        }
        logits, *presents, entropy = sess.run(None, feed)
        past = dict(zip(past_names, presents, strict=True))
        entropies.append(entropy[0])
        nxt = int(sample(torch.from_numpy(logits[:, -1]), params, generator))
        if nxt == tok.eos:
            break
        out_ids.append(nxt)
        feed_ids = [nxt]
    print(f"   model metadata: norm={meta.get('sharp.norm')}, context={meta.get('sharp.context_length')}")
    return tok.decode(out_ids), np.concatenate(entropies, axis=-1)


def product() -> None:
    from sharp.exporter.cli import main as export_main

    model = ZOO / "ssa.pt"
    if not model.is_file():
        print(f"2. (skipped: {model} is missing — run `make zoo` to train the demo models)")
        return
    print("2. sharp-export models/zoo/ssa.pt --norm ssa, then generation in stock onnxruntime (CPU)\n")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ssa.onnx"
        if export_main([str(model), "--norm", "ssa", "-o", str(out)]) != 0:
            raise SystemExit("export failed")
        prompt = "import os\n\n\ndef read_config(path"
        text, ent = generate_onnx(out, prompt, 120, SamplingParams(temperature=0.8, top_k=40), seed=0)
    print(f"\n   prompt + sampled continuation (temperature 0.8, top-k 40, seed 0):\n{prompt}{text}\n")
    layers, heads, steps = ent.shape
    print(f"   attention entropy (nats) from the graph's attention_entropy output, mean over {steps} positions:")
    print("   " + f"{'layer':<7}" + "".join(f"{'head ' + str(h):>9}" for h in range(heads)))
    for layer in range(layers):
        print("   " + f"{layer:<7}" + "".join(f"{ent[layer, h].mean():>9.3f}" for h in range(heads)))


def main() -> None:
    print("sharp demo\n")
    dispersion()
    product()


if __name__ == "__main__":
    main()
