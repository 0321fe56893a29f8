"""The export check: the written file run in onnxruntime against the PyTorch model it came from.

An fp32 file must agree within TOLERANCE at lengths other than the traced one and on a past cache (`verify`); a
file of lower precision (weights or KV cache) is judged on held-out text against the bounds of docs/op.md
(`verify_text`). `run_check` prints the table and answers 0 (passed) or 1 (over its bound).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch

from sharp.exporter import kept_logits, metadata
from sharp.exporter.precision import BOUNDS, CPU_RUNS, Agreement
from sharp.exporter.settings import ExportSettings
from sharp.models.config import ModelShape
from sharp.models.lm import SharpLM

TOLERANCE = 1e-4
TEXT_LENGTH = 256  # tokens per window of the precision check's text
DECODE_STEPS = 32


def cuda_available() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def session(path: Path, library: str | None, cuda: bool = False):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if library:
        opts.register_custom_ops_library(library)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    return ort.InferenceSession(str(path), opts, providers=providers)


Reference = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # ids → logits, entropy (whole sequence)


def verify(
    path: Path, shape: ModelShape, kv_cache: bool, reference: Reference, library: str | None = None
) -> list[tuple[str, float, float]]:
    """Run the file against PyTorch (with the op `library` registered, if any): prefill at two lengths other than
    the traced 5, then decode on a cache."""
    from sharp.exporter.export import io_names

    sess = session(path, library)
    names, _ = io_names(shape.layers, kv_cache)
    g = torch.Generator().manual_seed(0)
    rows = []

    inputs = [i.name for i in sess.get_inputs()]

    def run(ids: torch.Tensor, past: list[torch.Tensor], mask: torch.Tensor, pos: torch.Tensor, keep: int = 0):
        feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "position_ids": pos.numpy()}
        if kv_cache:
            feed.update({n: t.numpy() for n, t in zip(names[3:], past, strict=True)})
        return sess.run(None, feed | kept_logits.feed(inputs, keep))

    vocab = min(shape.vocab_size, 256)
    for batch, length in ((1, 9), (3, 2)):
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        pos = torch.arange(length).expand(batch, length).contiguous()
        mask = torch.ones(batch, length, dtype=torch.int64)
        empty = [torch.zeros(batch, shape.kv_heads, 0, shape.head_dim) for _ in range(2 * shape.layers)]
        got = run(ids, empty, mask, pos)
        logits, entropy = reference(ids)
        rows.append((f"prefill B={batch} L={length}", *_diffs(got, logits, entropy)))
        if kept_logits.INPUT in inputs:  # the last position's logits alone, as a server's prefill asks for them
            last = run(ids, empty, mask, pos, keep=1)
            rows.append((f"prefill B={batch} L={length} last", *_diffs(last, logits[:, -1:], entropy)))
        if kv_cache and length == 9:
            past = got[1:-1]
            nxt = torch.randint(0, vocab, (1, 1), generator=g)
            got2 = run(
                nxt, [torch.from_numpy(p) for p in past], torch.ones(1, 10, dtype=torch.int64), torch.tensor([[9]]), 1
            )
            logits, entropy = reference(torch.cat((ids, nxt), 1))
            rows.append(("decode with past=9", *_diffs(got2, logits[:, -1:], entropy[..., -1:])))
    return rows


def sharplm_reference(model: SharpLM) -> Reference:
    def run(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out = model.step(ids, return_entropy=True)
        return out.logits, out.entropy

    return run


def _diffs(got, logits: torch.Tensor, entropy: torch.Tensor) -> tuple[float, float]:
    return float(np.abs(got[0] - logits.numpy()).max()), float(np.abs(got[-1] - entropy.numpy()).max())


def run_check(
    settings: ExportSettings, path: Path, shape: ModelShape, reference: Reference, library: str | None, attention: str
) -> int:
    """The check of the file at `path`: 0 when it passes, 1 with the numbers when it does not."""
    onnx.checker.check_model(str(path), full_check=True)
    if settings.fallback == "none" and library is None:
        print(f"check: onnx.checker passed; not run (no fallback body and no kernel; {attention})")
        return 0
    # weights below fp32 are judged by their bound; an fp16 cache under fp32 weights by fp16's
    dtype, kv = settings.dtype, settings.kv_dtype
    precision = dtype if dtype in BOUNDS else kv if kv in BOUNDS else None
    if precision is not None:
        cuda = dtype not in CPU_RUNS
        rows = verify_text(path, shape, settings.kv_cache, reference, library, cuda)
        return _judge_precision(precision, rows, attention + (" (onnxruntime CUDA)" if cuda else ""))
    rows = verify(path, shape, settings.kv_cache, reference, library)
    print(f"{'check':<22}{'max |Δ logits|':>16}{'max |Δ entropy|':>17}")
    for name, dl, de in rows:
        print(f"{name:<22}{dl:>16.2e}{de:>17.2e}")
    worst = max(max(dl, de) for _, dl, de in rows)
    if not worst <= TOLERANCE:  # NaN fails too
        print(f"check FAILED: {worst:.2e} > {TOLERANCE:.0e}", file=sys.stderr)
        return 1
    print(f"check passed (tolerance {TOLERANCE:.0e}, onnxruntime CPU; {attention})")
    return 0


def _judge_precision(precision: str, rows: list[tuple[str, Agreement]], attention: str) -> int:
    bound = BOUNDS[precision]
    print(
        f"{'check (' + precision + ')':<24}{'positions':>10}{'max |Δ logit|':>15}{'top-1':>8}"
        f"{'top-1 confident':>17}{'mean KL':>10}{'mean |Δ ent|':>14}{'max |Δ ent|':>13}"
    )
    for name, a in rows:
        confident = f"{a.confident_top1:.1%} of {a.confident}" if a.confident else "none"
        print(
            f"{name:<24}{a.positions:>10}{a.max_logit_error:>15.3f}{a.top1:>8.1%}{confident:>17}"
            f"{a.kl:>10.2e}{a.entropy_error:>14.2e}{a.max_entropy_error:>13.2e}"
        )
    total = rows[-1][1]
    if problems := total.problems(bound):
        print(f"check FAILED ({precision}): {'; '.join(problems)}", file=sys.stderr)
        return 1
    print(
        f"check passed ({precision}: mean KL <= {bound.kl:.0e}, top-1 >= {bound.top1:.0%} where fp32 is confident,"
        f" mean |Δ entropy| <= {bound.entropy:.0e}; docs/op.md; onnxruntime CPU; {attention})"
    )
    return 0


def verify_text(
    path: Path, shape: ModelShape, kv_cache: bool, reference: Reference, library: str | None = None, cuda: bool = False
) -> list[tuple[str, Agreement]]:
    """A precision file against the fp32 model on held-out text (models/corpus.py): two windows prefilled, and
    the second's last DECODE_STEPS tokens decoded one at a time on a cache; the last row is all of them."""
    from sharp.exporter.export import io_names
    from sharp.models.corpus import validation_text

    tokens = metadata.read(path).tokenizer.encode(validation_text(), bos=False)
    length = min(TEXT_LENGTH, shape.context_length - 1, len(tokens) // 2)
    ids = torch.tensor([tokens[:length], tokens[length : 2 * length]])
    ref_logits, ref_entropy = (t.numpy() for t in reference(ids))
    sess = session(path, library, cuda)
    names, _ = io_names(shape.layers, kv_cache)

    inputs = [i.name for i in sess.get_inputs()]

    def run(x: np.ndarray, past: list[np.ndarray], start: int):
        batch, n = x.shape
        feed = {
            "input_ids": x,
            "attention_mask": np.ones((batch, start + n), np.int64),
            "position_ids": np.tile(np.arange(start, start + n), (batch, 1)),
        }
        if kv_cache:
            feed.update(zip(names[3:], past, strict=True))
        return sess.run(None, feed | kept_logits.feed(inputs, 1 if n == 1 else 0))  # a step: its one position

    kv = metadata.read(path).kv_numpy_dtype
    empty = [np.zeros((2, shape.kv_heads, 0, shape.head_dim), kv) for _ in range(2 * shape.layers)]
    got = run(ids.numpy(), empty, 0)
    logits, entropy = [got[0]], [got[-1]]
    rows = [(f"prefill 2×{length} text", Agreement.of(ref_logits, got[0], ref_entropy, got[-1]))]
    if kv_cache:
        steps = min(DECODE_STEPS, length - 1)
        start = length - steps
        got = run(ids[1:, :start].numpy(), [p[1:] for p in empty], 0)
        step_logits, step_entropy = [], []
        for t in range(start, length):
            got = run(ids[1:, t : t + 1].numpy(), got[1:-1], t)
            step_logits.append(got[0])
            step_entropy.append(got[-1])
        step_logits, step_entropy = np.concatenate(step_logits, 1), np.concatenate(step_entropy, -1)
        ref_l, ref_e = ref_logits[1:, start:], ref_entropy[1:, ..., start:]
        rows.append((f"decode {steps} steps", Agreement.of(ref_l, step_logits, ref_e, step_entropy)))
        logits.append(step_logits)
        entropy.append(step_entropy)
        ref_logits = np.concatenate([ref_logits.reshape(-1, ref_logits.shape[-1]), ref_l.reshape(-1, ref_l.shape[-1])])
        ref_entropy = np.concatenate([ref_entropy.ravel(), ref_e.ravel()])
    all_logits = np.concatenate([x.reshape(-1, x.shape[-1]) for x in logits])
    all_entropy = np.concatenate([x.ravel() for x in entropy])
    rows.append(("all", Agreement.of(ref_logits, all_logits, ref_entropy, all_entropy)))
    return rows
