"""`python -m sharp.zoo`: train the committed demo models on the Python standard library's sources.

Every machine with Python has the corpus, so the models are reproducible anywhere with one command
(`make zoo`). Four byte-level SharpLMs of the same size, data and seed: `ssa.pt` (SSA attention), its
softmax twin `softmax.pt` (on which `adaptive` can be shown at export/serve time), its α-entmax twin
`entmax.pt` (α learned per head from 1.5; exact zeros, which its decode skips) and `asentmax.pt` (ASEntmax: the
same, its logits scaled per query with the position). Writes models/zoo/README.md, the
model card, with the measured losses and the learned SSA and entmax parameters. `--only NAME` retrains one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from sharp.benchmarks.harness import machine, today
from sharp.models.checkpoint import load, zoo_dir
from sharp.models.corpus import STDLIB_MODULES, stdlib_corpus
from sharp.models.tasks import TextData
from sharp.models.train import main as train_main

ZOO = zoo_dir()
ARCH = ["--layers", "4", "--heads", "4", "--dim", "128"]
TWINS = ("ssa", "softmax", "entmax", "asentmax")
# RoPE, but NAPE for entmax (half the heads ALiBi, half no position; the ASEntmax paper's choice): a model that
# still works far past its 128-byte training sequences, served at 32K tokens to show its decode skipping pages
POS = {"ssa": "rope", "softmax": "rope", "entmax": "nape", "asentmax": "nape"}
# The context each declares (metadata only: training never reads it): NAPE has no position table to outgrow
CONTEXT = {"rope": 2048, "nape": 65536}


def build_corpus(out: Path) -> Path:
    """Write the corpus (models/corpus.py) to `out`."""
    out.write_bytes(stdlib_corpus())
    return out


def _card(steps: int, corpus: Path, only: str | None) -> str:
    data = TextData(corpus)
    rows = []
    for name in TWINS:
        path = ZOO / f"{name}.pt"
        meta = torch.load(path, weights_only=True)["meta"]
        model = load(path)
        val = _val_loss(model, data)
        rows.append(
            f"| `{name}.pt` | {name} | {meta['first_loss']:.3f} | {meta['final_loss']:.3f} | {val:.3f} |"
            f" {path.stat().st_size / 2**20:.1f} MiB |"
        )
    ssa = load(ZOO / "ssa.pt")
    learned = []
    for i, block in enumerate(ssa.blocks):
        p = block.attn.head_params()
        learned.append(
            f"| {i} | {', '.join(f'{x:.3f}' for x in p['ssa_n'])} | {', '.join(f'{x:.3f}' for x in p['ssa_b'])} |"
        )
    alphas = [
        f"| {i} | {', '.join(f'{x:.3f}' for x in a.attn.head_params()['alpha'])} |"
        f" {', '.join(f'{x:.3f}' for x in b.attn.head_params()['alpha'])} |"
        for i, (a, b) in enumerate(zip(load(ZOO / "entmax.pt").blocks, load(ZOO / "asentmax.pt").blocks, strict=True))
    ]
    return "\n".join(
        [
            "# Demo models",
            "",
            "Byte-level SharpLMs trained by `make zoo` (`python -m sharp.zoo`) on "
            f"{len(STDLIB_MODULES)} modules of the Python standard library ({corpus.stat().st_size / 1e6:.1f} MB here;"
            " first 90% train, last 10% validation). "
            + (
                f"`{only}.pt` trained on {today()}, {machine()}; the others earlier by the same command."
                if only
                else f"Trained on {today()}, {machine()}."
            ),
            "",
            "Architecture: 4 layers, 4 heads, dim 128, SwiGLU, RMSNorm, tied embeddings, context limit 2048 (entmax and"
            f" asentmax: 65,536, which NAPE allows);"
            f" {steps:,} steps of batch 32 × 128 bytes, AdamW lr 1e-3, seed 0. `ssa.pt` and `softmax.pt` differ only in"
            " the attention normalizer (RoPE); `entmax.pt` is α-entmax with NAPE (heads 0–1 ALiBi with slopes 1 and"
            " 1/2, heads 2–3 no position), which carries it far past its training length; `asentmax.pt` is ASEntmax"
            " with the same NAPE: α-entmax whose logits are scaled per query by λ = δ + β·log(pos + 2)^γ (β, γ"
            " learned from the hidden state), sharper as the context grows.",
            "",
            "| file | norm | first loss | final train loss (last 50 steps) | validation loss | size |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            "Learned SSA parameters per layer (heads 0–3): `p ∝ (1 + b|z|)^{sgn(z)·n}`",
            "",
            "| layer | n | b |",
            "|---|---|---|",
            *learned,
            "",
            "Learned entmax α per layer (heads 0–3; from 1.5): keys below the threshold get exactly zero weight",
            "",
            "| layer | entmax α | asentmax α |",
            "|---|---|---|",
            *alphas,
            "",
            "They are small demo models: they produce Python-looking text, not good code.",
        ]
    )


@torch.no_grad()
def _val_loss(model, data: TextData, batches: int = 8) -> float:
    g = torch.Generator().manual_seed(123)
    losses = []
    for _ in range(batches):
        b = data.batch(16, 128, g, split="val")
        logits = model(b.input_ids)
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.targets.flatten()).item())
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sharp.zoo", description=__doc__)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--only", choices=TWINS, help="retrain this model only (the card is rewritten from all of them)")
    args = ap.parse_args(argv)
    ZOO.mkdir(exist_ok=True)
    corpus = build_corpus(ZOO / "corpus.txt")
    try:
        for norm in [args.only] if args.only else TWINS:
            out = ZOO / f"{norm}.pt"
            common = ["--data", str(corpus), "--steps", str(args.steps), "--batch", "32", "--size", "128", "128"]
            arch = [*ARCH, "--pos", POS[norm], "--context", str(CONTEXT[POS[norm]])]
            train_main(["text", "--norm", norm, *arch, *common, "--seed", "0", "--out", str(out), "--save-every", "0"])
        (ZOO / "README.md").write_text(_card(args.steps, corpus, args.only) + "\n")
    finally:
        corpus.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
