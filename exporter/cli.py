"""`sharp-export MODEL`: write an ONNX generation graph with sharp::SharpAttention, then check it.

Norm changes: the checkpoint's own norm always; on a softmax model also `adaptive` (inference-time
sharpening, --poly for fitted coefficients) and `ssmax` (with --ssmax-s). Learned normalizers (entmax α,
ASEntmax λ, SSA n and b, SSMax s) cannot be conjured from a model that never learned them: that is refused.
The check runs the file in onnxruntime (CPU; with sharp's native kernel when it is built, else the file's fallback
bodies — --no-native forces those) at lengths other than the traced one and with a past cache, against the PyTorch
model, and exits 1 over tolerance.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch

from sharp.exporter import metadata, rotary
from sharp.exporter.cache_form import KV_DTYPES
from sharp.exporter.export import ExportSettings
from sharp.exporter.metadata import ModelMetadata
from sharp.exporter.op_schema import STREAMED_BLOCK
from sharp.exporter.precision import (
    BOUNDS,
    CPU_RUNS,
    EXPORTABLE,
    QUANT_BLOCK,
    QUANTIZED,
    Agreement,
    PrecisionError,
    check_block,
)
from sharp.models import registry
from sharp.models.checkpoint import CheckpointError, load
from sharp.models.config import ModelShape
from sharp.models.lm import SharpLM
from sharp.plugins.onnxruntime import NativeOpUnavailable, choose_library

TOLERANCE = 1e-4
# Parameters an inference-time norm change needs from the command line (the model never learned them).
CHANGE_PARAMS = tuple(dict.fromkeys(p for n in registry.all_norms() for p in n.change_requires))


def _flag(param: str) -> str:
    return "--" + param.replace("_", "-")


class UsageError(Exception):
    """A user mistake: printed as one line, exit 2."""


def check_norm_change(model: SharpLM, norm: str, values: dict[str, float]) -> None:
    """Refuse a norm the model cannot be exported with; `values` are the change parameters given."""
    cfg = model.cfg
    if cfg.layer_norms_override and norm != cfg.norm:
        raise UsageError(f"this model sets a norm per layer ({', '.join(cfg.layer_norms())}); export it without --norm")
    given = [name for name, value in values.items() if value is not None]
    if (why := registry.norm_change_problem(cfg.norm, norm, given, spell=_flag)) is not None:
        raise UsageError(why)


def _check_output(model: Path, out: Path) -> None:
    """The output path can be written and is not the input."""
    if out.resolve() == model.resolve() or (out.exists() and model.exists() and out.samefile(model)):
        raise UsageError(f"-o {out} is the input checkpoint; choose another output path")
    if out.is_dir():
        raise UsageError(f"-o {out} is a directory; give a file path such as {out / model.with_suffix('.onnx').name}")
    if out.exists() and not out.stat().st_mode & 0o222:
        raise UsageError(f"-o {out} is a read-only file; choose another output path (sharp-export never forces one)")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise UsageError(f"cannot write {out}: {out.parent} is not a writable directory")


def _cuda() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def _session(path: Path, library: str | None, cuda: bool = False):
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

    sess = _session(path, library)
    names, _ = io_names(shape.layers, kv_cache)
    g = torch.Generator().manual_seed(0)
    rows = []

    def run(ids: torch.Tensor, past: list[torch.Tensor], mask: torch.Tensor, pos: torch.Tensor):
        feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "position_ids": pos.numpy()}
        if kv_cache:
            feed.update({n: t.numpy() for n, t in zip(names[3:], past, strict=True)})
        return sess.run(None, feed)

    vocab = min(shape.vocab_size, 256)
    for batch, length in ((1, 9), (3, 2)):
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        pos = torch.arange(length).expand(batch, length).contiguous()
        mask = torch.ones(batch, length, dtype=torch.int64)
        empty = [torch.zeros(batch, shape.kv_heads, 0, shape.head_dim) for _ in range(2 * shape.layers)]
        got = run(ids, empty, mask, pos)
        rows.append((f"prefill B={batch} L={length}", *_diffs(got, *reference(ids))))
        if kv_cache and length == 9:
            past = got[1:-1]
            nxt = torch.randint(0, vocab, (1, 1), generator=g)
            got2 = run(
                nxt, [torch.from_numpy(p) for p in past], torch.ones(1, 10, dtype=torch.int64), torch.tensor([[9]])
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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sharp-export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "model",
        type=Path,
        help="a sharp checkpoint (model.pt), or a Hugging Face model directory (config.json, weights, tokenizer.json)",
    )
    ap.add_argument("--norm", choices=registry.NORMS, help="normalizer in the file (default: the checkpoint's)")
    ap.add_argument("-o", "--output", type=Path, help="output .onnx (default: MODEL with .onnx)")
    ap.add_argument(
        "--fallback",
        choices=["dense", "streamed", "none"],
        default="dense",
        help="standard-op bodies: dense (materialises the logits; fastest for short contexts), streamed (a Loop"
        " over key blocks, O(L·block) memory; long contexts), none (the file then needs a sharp plugin)",
    )
    ap.add_argument(
        "--opset",
        type=int,
        default=18,
        choices=[18],
        help="ONNX opset the graph is traced at (18; converting would inline the custom op away); a file whose RoPE"
        " becomes RotaryEmbedding nodes imports opset 23",
    )
    ap.add_argument(
        "--weights",
        "--dtype",
        dest="dtype",
        choices=EXPORTABLE,
        default="fp32",
        help="precision of the weights: fp32 (as traced); fp16 or bf16 (the graph computes in it; I/O, the KV cache"
        " and the attention op stay fp32); int8 or int4 (blockwise weight-only MatMulNBits through onnxruntime's"
        " quantizer; int4 keeps the value and down projections at 8 bits). The check then compares the file with"
        " the fp32 model on text against the bounds of docs/op.md and refuses a file outside them (bf16 needs"
        " onnxruntime-gpu for that: the CPU provider cannot run it)",
    )
    ap.add_argument(
        "--quant-block",
        type=int,
        help=f"weights per quantization scale of int8/int4 (a power of two >= 16; default {QUANT_BLOCK})",
    )
    ap.add_argument(
        "--block-size", type=int, default=STREAMED_BLOCK, help="keys per Loop iteration of --fallback streamed"
    )
    ap.add_argument(
        "--genai",
        action="store_true",
        help="write an onnxruntime-genai package into the directory -o (model.onnx, genai_config.json, tokenizer"
        " files, sharp's op library unless --no-native)",
    )
    ap.add_argument(
        "--genai-isa",
        choices=["portable", "this-cpu"],
        help="which build of sharp's op library a --genai package ships: portable (default: the baseline, any CPU of"
        " the architecture) or this-cpu (the widest this machine runs, e.g. AVX2 — attention up to ~2.7× faster,"
        " but the package then runs only on CPUs with those instructions: onnxruntime-genai cannot check, and a"
        " lesser CPU dies on the first one)",
    )
    ap.add_argument(
        "--tensorrt",
        action="store_true",
        help="write the TensorRT form of the op: nodes TensorRT's ONNX parser maps to sharp's AOT plugin (int32 key"
        " mask, packed parameters; docs/tensorrt.md); checked here through its fallback bodies",
    )
    ap.add_argument("--no-kv-cache", dest="kv_cache", action="store_false")
    ap.add_argument(
        "--kv-cache-dtype",
        choices=list(KV_DTYPES),
        default="fp32",
        help="the KV cache's element type: fp32, or fp16 (half the bytes every decode step reads and half the memory"
        " per token; keys and values rounded to fp16 when written, attention still computed in fp32). The check"
        " then compares the file with the fp32 model on text, as for --weights fp16",
    )
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument(
        "--no-native",
        dest="native",
        action="store_false",
        help="check with the file's fallback bodies, not sharp's native onnxruntime kernel",
    )
    ap.add_argument("--poly", type=float, nargs="+", help="adaptive polynomial, highest power first")
    for param in CHANGE_PARAMS:
        users = ", ".join(n.name for n in registry.all_norms() if param in n.change_requires)
        ap.add_argument(_flag(param), type=float, help=f"{param} for an inference-time change to {users}")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with warnings.catch_warnings():
        quiet_libraries()
        try:
            return _export(args)
        except (UsageError, CheckpointError, PrecisionError) as e:
            print(f"sharp-export: {e}", file=sys.stderr)
            return 2


def quiet_libraries() -> None:
    """Silence what torch.onnx says about itself during an export (optional packages it lacks, deprecations,
    renamed axes): it means nothing to the user of this command. Library callers still see it."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"# The axis name", category=UserWarning)


def _load_sharplm(args) -> tuple[ModelMetadata, Callable[[ExportSettings], onnx.ModelProto], Reference]:
    from sharp.exporter.export import export_model, with_norm

    model = load(args.model)
    if not isinstance(model, SharpLM):
        raise UsageError(
            f"{args.model}: a {type(model).__name__} is not a language model; sharp-export takes SharpLM checkpoints"
        )
    norm = args.norm or model.cfg.norm
    values = {param: getattr(args, param) for param in CHANGE_PARAMS}
    check_norm_change(model, norm, values)
    try:
        model = with_norm(model, norm, tuple(args.poly) if args.poly else None, **values)
    except ValueError as e:  # the changed config's own validation (e.g. --poly nan, --ssmax-s inf)
        raise UsageError(str(e)) from None
    return ModelMetadata.from_model(model), lambda s: export_model(model, s), sharplm_reference(model)


def _load_transformers(args) -> tuple[ModelMetadata, Callable[[ExportSettings], onnx.ModelProto], Reference]:
    if not (args.model / "config.json").is_file():
        raise UsageError(f"{args.model}: a directory without config.json; expected a Hugging Face model directory")
    try:
        from sharp.exporter import hf as hf_export
        from sharp.models import hf
    except ImportError as e:
        msg = f"exporting a Hugging Face model needs transformers ({e}); pip install 'sharp-attention[hf]'"
        raise UsageError(msg) from None
    try:
        config = hf.load_config(args.model)
        norm = args.norm or hf.AttentionSettings.of(config).norm
        values = {param: getattr(args, param) for param in CHANGE_PARAMS}
        hf.sharpen(config, norm, tuple(args.poly) if args.poly else None, **values)
        tokenizer = hf_export.load_tokenizer(args.model, config)
    except (ValueError, OSError) as e:  # UnsupportedModel, a bad config.json, a refused norm change
        raise UsageError(f"{args.model}: {e}") from None
    model = hf.load_model(args.model, config)
    return (
        hf_export.metadata(model, tokenizer, ExportSettings(norm=norm)),
        lambda s: hf_export.export_hf(model, tokenizer, s),
        lambda ids: hf_export.reference(model, ids),
    )


def _check_package_dir(model: Path, out: Path) -> None:
    """--genai: `out` is a new or empty directory that is not the input."""
    if out.resolve() == model.resolve() or model.resolve() in out.resolve().parents:
        raise UsageError(f"-o {out} is (inside) the input model; choose another directory")
    if out.suffix == ".onnx" and not out.is_dir():
        raise UsageError(f"-o {out}: --genai writes a package directory (model.onnx, genai_config.json, tokenizer);"
                         f" give a directory such as {out.with_suffix('')}")  # fmt: skip
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"-o {out} exists and is not an empty directory; --genai writes a new directory")
    parent = out.parent if not out.exists() else out
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"cannot write {out}: {parent} is not a writable directory")


def _check_precision(args) -> None:
    if args.quant_block is not None and args.dtype not in QUANTIZED:
        raise UsageError(f"--quant-block sets the blocks of int8/int4 weights; --weights {args.dtype} has none")
    if args.kv_cache_dtype != "fp32" and (not args.kv_cache or args.tensorrt):
        raise UsageError(
            f"--kv-cache-dtype {args.kv_cache_dtype} keeps the cache in the op's cache form, which "
            + ("needs the KV cache: drop --no-kv-cache" if not args.kv_cache else "--tensorrt files do not have")
        )
    if args.dtype != "fp32" and args.tensorrt:
        raise UsageError(
            f"--weights {args.dtype} --tensorrt: TensorRT files are fp32 and sharp-build-engine --fp16|--bf16 builds"
            " the engine's precision (int8/int4 would be onnxruntime's MatMulNBits, which TensorRT cannot parse)"
        )
    if args.check and args.dtype not in CPU_RUNS and not _cuda():
        raise UsageError(
            f"--weights {args.dtype}: onnxruntime's CPU provider cannot run the check ({args.dtype} Pow, ReduceMean …)"
            " and onnxruntime-gpu is not installed; export where it is, or add --no-check to write it unchecked"
        )
    check_block(args.quant_block or QUANT_BLOCK)


def _export(args) -> int:
    if args.genai:
        out = args.output or args.model.with_name(args.model.stem + "-genai")
        _check_package_dir(args.model, out)
        if not args.kv_cache:
            raise UsageError("--genai needs the KV cache graph; drop --no-kv-cache")
        if args.tensorrt:
            raise UsageError("--genai packages run in onnxruntime-genai; --tensorrt files are for TensorRT")
    else:
        out = args.output or args.model.with_suffix(".onnx")
        _check_output(args.model, out)  # before any work: never after 20 s of it, never over the input
    if args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {args.block_size}")
    _check_precision(args)
    meta, export, reference = (_load_transformers if args.model.is_dir() else _load_sharplm)(args)
    norm = meta.norm
    settings = ExportSettings(
        norm=norm,
        fallback=args.fallback,
        opset=args.opset,
        kv_cache=args.kv_cache,
        dtype=args.dtype,
        quant_block=args.quant_block or QUANT_BLOCK,
        block_size=args.block_size,
        tensorrt=args.tensorrt,
        kv_dtype=args.kv_cache_dtype,
    )
    # sharp's native onnxruntime library takes the standard form only: a TensorRT-form file runs its fallback bodies
    if args.genai_isa and not args.genai:
        raise UsageError("--genai-isa chooses the op library a --genai package ships; add --genai")
    portable = args.genai and args.genai_isa != "this-cpu"  # the baseline runs on any CPU of the architecture
    try:
        library, attention = choose_library(args.native, tensorrt_form=args.tensorrt, portable=portable)
    except NativeOpUnavailable as e:
        raise UsageError(str(e)) from None
    if args.genai and args.fallback == "none" and library is None:
        raise UsageError(
            f"--genai --fallback none needs sharp's op library in the package, and there is none ({attention})"
        )
    proto = export(settings)
    ropes = rotary.count(proto)
    # Written beside `out` under a temporary name, checked there, and only then moved into place: a file that fails
    # its check is never left where a server would pick it up, and an existing `out` is kept.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        if args.genai:
            from sharp.exporter.genai import MODEL_FILE, write_package

            write_package(proto, metadata.read(proto), tmp, library)
            written = tmp / MODEL_FILE
        else:
            try:
                onnx.save(proto, tmp)
            except PermissionError as e:
                raise UsageError(f"cannot write {out}: {e.strerror}") from None
            written = tmp
        del proto
        size = written.stat().st_size / 2**20
        if args.check and (status := _run_check(args, written, meta.shape, reference, library, attention)) != 0:
            print(f"sharp-export: {out} not written", file=sys.stderr)
            return status
        tmp.replace(out)  # atomic: `out` is either the old file (or empty directory) or the whole new one
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    shape = meta.shape
    where = f"{out}/: {', '.join(sorted(f.name for f in out.iterdir()))}; {out / MODEL_FILE}" if args.genai else out
    print(
        f"wrote {where} ({size:.1f} MiB): {shape.layers} × sharp::SharpAttention[{norm}], {args.dtype} weights, "
        + (f"{args.kv_cache_dtype} KV cache, " if args.kv_cache_dtype != "fp32" else "")
        + f"fallback {args.fallback}, opset {rotary.OPSET if ropes else args.opset}"
        + (f", RoPE as {ropes} RotaryEmbedding nodes" if ropes else "")
        + (", TensorRT form" if args.tensorrt else "")
    )
    return 0


def _run_check(args, path: Path, shape: ModelShape, reference: Reference, library: str | None, attention: str) -> int:
    """The export check of the file at `path`: 0 when it passes, 1 with the numbers when it does not."""
    onnx.checker.check_model(str(path), full_check=True)
    if args.fallback == "none" and library is None:
        print(f"check: onnx.checker passed; not run (no fallback body and no kernel; {attention})")
        return 0
    # weights below fp32 are judged by their bound; an fp16 cache under fp32 weights by fp16's
    precision = args.dtype if args.dtype in BOUNDS else args.kv_cache_dtype if args.kv_cache_dtype in BOUNDS else None
    if precision is not None:
        cuda = args.dtype not in CPU_RUNS
        rows = verify_text(path, shape, args.kv_cache, reference, library, cuda)
        return _judge_precision(precision, rows, attention + (" (onnxruntime CUDA)" if cuda else ""))
    rows = verify(path, shape, args.kv_cache, reference, library)
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


TEXT_LENGTH = 256  # tokens per window of the precision check's text
DECODE_STEPS = 32


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
    sess = _session(path, library, cuda)
    names, _ = io_names(shape.layers, kv_cache)

    def run(x: np.ndarray, past: list[np.ndarray], start: int):
        batch, n = x.shape
        feed = {
            "input_ids": x,
            "attention_mask": np.ones((batch, start + n), np.int64),
            "position_ids": np.tile(np.arange(start, start + n), (batch, 1)),
        }
        if kv_cache:
            feed.update(zip(names[3:], past, strict=True))
        return sess.run(None, feed)

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


if __name__ == "__main__":
    sys.exit(main())
