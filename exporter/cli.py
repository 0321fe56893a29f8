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
import dataclasses
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sharp.exporter.precision import CPU_RUNS, QUANTIZED, PrecisionError
from sharp.exporter.settings import ExportSettings, flag_names
from sharp.models import registry
from sharp.models.messages import Parser, UsageError, did_you_mean, one_line

if TYPE_CHECKING:  # torch and onnx load only once the command is known to be sound
    import onnx

    from sharp.exporter.check import Reference
    from sharp.exporter.metadata import ModelMetadata
    from sharp.models.lm import SharpLM

# A quantized GGUF's default --weights: the precision that keeps its blocks as they are (exporter/grid.py).
GGUF_WEIGHTS = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}
# Parameters an inference-time norm change needs from the command line (the model never learned them).
CHANGE_PARAMS = tuple(dict.fromkeys(p for n in registry.all_norms() for p in n.change_requires))
SETTINGS = {f.name: f for f in dataclasses.fields(ExportSettings)}


def _flag(param: str) -> str:
    return "--" + param.replace("_", "-")


def check_norm_change(model: SharpLM, norm: str, values: dict[str, float]) -> None:
    """Refuse a norm the model cannot be exported with; `values` are the change parameters given."""
    cfg = model.cfg
    if cfg.layer_norms_override and norm != cfg.norm:
        raise UsageError(f"this model sets a norm per layer ({', '.join(cfg.layer_norms())}); export it without --norm")
    given = [name for name, value in values.items() if value is not None]
    if (why := registry.norm_change_problem(cfg.norm, norm, given, spell=_flag)) is not None:
        raise UsageError(why)


def _gguf(path: Path) -> Path | None:
    """The GGUF file MODEL names (a .gguf, or a directory holding one and no config.json), checked by its header
    (architecture, tensors within the file), or None."""
    from sharp.models import gguf

    try:
        found = gguf.find(path)
        if found is not None:
            gguf.read_header(found)
    except gguf.GGUFError as e:
        raise UsageError(str(e)) from None
    return found


def gguf_weights(tensor_types: dict[str, int]) -> str:
    """The default --weights of a GGUF with these tensor types: the lowest that holds its quantized blocks exactly
    (int4 for Q4_0/Q4_1, int8 for Q8_0), fp32 for F32/F16 files (or other types, which dequantize to fp32)."""
    found = {GGUF_WEIGHTS[t] for t in tensor_types if t in GGUF_WEIGHTS}
    return "int4" if "int4" in found else "int8" if "int8" in found else "fp32"


def _check_model(path: Path) -> None:
    """MODEL names a file or a Hugging Face directory; a mistyped one gets the near names beside it."""
    if _gguf(path) is not None:
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(
                f"{path}: a directory without config.json or a .gguf; expected a Hugging Face model directory"
            )
        return
    if path.is_file():
        return
    raise UsageError(
        f"{path}: no such file or directory (expected a sharp checkpoint such as model.pt, a GGUF file, or a Hugging"
        f" Face model directory with config.json){did_you_mean(path)}"
    )


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


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="sharp-export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "model",
        type=Path,
        help="a sharp checkpoint (model.pt), a GGUF file (llama.cpp's; Llama, Mistral, Qwen2/3), or a Hugging Face"
        " model directory (config.json, weights, tokenizer.json)",
    )
    ap.add_argument("-o", "--output", type=Path, help="output .onnx (default: MODEL with .onnx)")
    _settings_flags(ap)
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
    ap.add_argument("--no-check", dest="check", action="store_false", help="write the file without checking it")
    ap.add_argument(
        "--no-native",
        dest="native",
        action="store_false",
        help="check with the file's fallback bodies, not sharp's native onnxruntime kernel",
    )
    ap.add_argument("--poly", type=float, nargs="+", help="adaptive polynomial, highest power first")
    ap.add_argument(
        "--scaled-heads",
        nargs="+",
        metavar="LAYER.HEAD",
        help="length-scale these heads (e.g. 21.8 18.6, counted from 0): their queries × max(1, log n / log"
        " --scaled-from) at n keys, every other head unchanged; `sharp-bench quality --find-heads` names the heads"
        " of a model that retrieve",
    )
    ap.add_argument(
        "--scaled-from", type=int, metavar="KEYS", help="the keys from which --scaled-heads sharpen (default: 512)"
    )
    for param in CHANGE_PARAMS:
        users = ", ".join(n.name for n in registry.all_norms() if param in n.change_requires)
        ap.add_argument(_flag(param), type=float, help=f"{param} for an inference-time change to {users}")
    return ap


def _settings_flags(ap: argparse.ArgumentParser) -> None:
    """A flag per `ExportSettings` field — its names, help, choices and default — the one source of each setting.
    A flag not given is absent from the parsed arguments: the dataclass's default applies."""
    for f in SETTINGS.values():
        kw = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata["help"]}
        if isinstance(f.default, bool):
            kw["action"] = "store_false" if f.default else "store_true"
        else:
            kw["type"] = int if isinstance(f.default, int) else str
            kw["choices"] = f.metadata["choices"]
            if f.default is not None:
                kw["help"] += f" (default: {f.default})"
        ap.add_argument(*flag_names(f), **kw)


def _settings(args) -> ExportSettings:
    """The flags given, as ExportSettings checked by its own rules; a refusal names the flags."""
    given = {name: getattr(args, name) for name in SETTINGS if hasattr(args, name)}
    dtype = given.get("dtype", SETTINGS["dtype"].default)
    if "quant_block" in given and dtype not in QUANTIZED:
        raise UsageError(f"--quant-block sets the blocks of int8/int4 weights; --weights {dtype} has none")
    try:
        return ExportSettings(**given)
    except ValueError as e:
        raise UsageError(re.sub(r"`(\w+)`", lambda m: flag_names(SETTINGS[m[1]])[0], str(e))) from None


def _scaled(args) -> tuple[tuple[tuple[int, int], ...], int] | None:
    """--scaled-heads and --scaled-from as (pairs, from); None when not given."""
    if args.scaled_heads is None:
        if args.scaled_from is not None:
            raise UsageError("--scaled-from says where --scaled-heads start sharpening; give --scaled-heads too")
        return None
    pairs = []
    for text in args.scaled_heads:
        layer, dot, head = text.partition(".")
        if not (dot and layer.isdigit() and head.isdigit()):
            raise UsageError(f"--scaled-heads {text!r}: each head is LAYER.HEAD, counted from 0 (e.g. 21.8)")
        pairs.append((int(layer), int(head)))
    start = 512 if args.scaled_from is None else args.scaled_from
    if start < 2:
        raise UsageError(f"--scaled-from {start}: it must be >= 2 keys")
    if len(set(pairs)) != len(pairs):
        raise UsageError("--scaled-heads names a head twice")
    return tuple(pairs), start


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with warnings.catch_warnings():
        try:
            return _export(args)
        except (UsageError, PrecisionError) as e:  # one line, whatever a library's message held
            print(f"sharp-export: {one_line(e)}", file=sys.stderr)
            return 2


def quiet_libraries() -> None:
    """Silence what torch.onnx says about itself during an export (optional packages it lacks, deprecations,
    renamed axes): it means nothing to the user of this command. Library callers still see it. Torch sets its
    loggers' levels as it loads, so this imports it first."""
    import torch  # noqa: F401

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"# The axis name", category=UserWarning)


def _load_sharplm(
    args, settings: ExportSettings
) -> tuple[ModelMetadata, Callable[[ExportSettings], onnx.ModelProto], Reference]:
    from sharp.exporter.check import sharplm_reference
    from sharp.exporter.export import export_model, with_norm
    from sharp.exporter.metadata import ModelMetadata
    from sharp.models.checkpoint import CheckpointError, load
    from sharp.models.lm import SharpLM

    try:
        model = load(args.model)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    if not isinstance(model, SharpLM):
        raise UsageError(
            f"{args.model}: a {type(model).__name__} is not a language model; sharp-export takes SharpLM checkpoints"
        )
    norm = settings.norm or model.cfg.norm
    values = {param: getattr(args, param) for param in CHANGE_PARAMS}
    check_norm_change(model, norm, values)
    try:
        model = with_norm(model, norm, tuple(args.poly) if args.poly else None, _scaled(args), **values)
    except ValueError as e:  # the changed config's own validation (e.g. --poly nan, --ssmax-s inf)
        raise UsageError(str(e)) from None
    return ModelMetadata.from_model(model), lambda s: export_model(model, s), sharplm_reference(model)


def _load_transformers(
    args, settings: ExportSettings
) -> tuple[ModelMetadata, Callable[[ExportSettings], onnx.ModelProto], Reference]:
    try:
        from sharp.exporter import hf as hf_export
        from sharp.models import hf
    except ImportError as e:
        msg = f"exporting a Hugging Face model needs transformers ({e}); pip install 'sharp-attention[hf]'"
        raise UsageError(msg) from None
    source = args.model
    if (found := _gguf(source)) is not None:
        from sharp.models import gguf

        try:
            source = gguf.hf_directory(found)
        except ImportError as e:
            raise UsageError(f"reading a GGUF file needs gguf ({e}); pip install 'sharp-attention[hf]'") from None
        except gguf.GGUFError as e:
            raise UsageError(str(e)) from None
    try:
        config = hf.load_config(source)
        norm = settings.norm or hf.AttentionSettings.of(config).norm
        values = {param: getattr(args, param) for param in CHANGE_PARAMS}
        hf.sharpen(config, norm, tuple(args.poly) if args.poly else None, _scaled(args), **values)
        tokenizer = hf_export.load_tokenizer(source, config)
    except (ValueError, OSError) as e:  # UnsupportedModel, a bad config.json, a refused norm change
        raise UsageError(f"{args.model}: {e}") from None
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its weight-loading bar is library chatter at this command
    model = hf.load_model(source, config)
    return (
        hf_export.metadata(model, tokenizer, dataclasses.replace(settings, norm=norm)),
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


def _export(args) -> int:
    settings = _settings(args)  # every refusal the command line alone shows comes before torch loads
    _check_model(args.model)
    if not hasattr(args, "dtype") and (found := _gguf(args.model)) is not None:
        from sharp.models import gguf

        settings = dataclasses.replace(settings, dtype=gguf_weights(gguf.read_header(found).tensor_types))
    if args.genai:
        out = args.output or args.model.with_name(args.model.stem + "-genai")
        _check_package_dir(args.model, out)
        if not settings.kv_cache:
            raise UsageError("--genai needs the KV cache graph; drop --no-kv-cache")
        if settings.tensorrt:
            raise UsageError("--genai packages run in onnxruntime-genai; --tensorrt files are for TensorRT")
    else:
        out = args.output or args.model.with_suffix(".onnx")
        _check_output(args.model, out)  # before any work: never after 20 s of it, never over the input
    if args.genai_isa and not args.genai:
        raise UsageError("--genai-isa chooses the op library a --genai package ships; add --genai")
    from sharp.exporter.check import cuda_available

    if args.check and settings.dtype not in CPU_RUNS and not cuda_available():
        raise UsageError(
            f"--weights {settings.dtype}: onnxruntime's CPU provider cannot run the check ({settings.dtype} Pow,"
            " ReduceMean …) and onnxruntime-gpu is not installed; export where it is, or add --no-check to write it"
            " unchecked"
        )
    from sharp.plugins.onnxruntime import NativeOpUnavailable, choose_library

    # sharp's native onnxruntime library takes the standard form only: a TensorRT-form file runs its fallback bodies
    portable = args.genai and args.genai_isa != "this-cpu"  # the baseline runs on any CPU of the architecture
    try:
        library, attention = choose_library(args.native, tensorrt_form=settings.tensorrt, portable=portable)
    except NativeOpUnavailable as e:
        raise UsageError(str(e)) from None
    if args.genai and settings.fallback == "none" and library is None:
        raise UsageError(
            f"--genai --fallback none needs sharp's op library in the package, and there is none ({attention})"
        )
    quiet_libraries()
    transformers_model = args.model.is_dir() or _gguf(args.model) is not None
    meta, export, reference = (_load_transformers if transformers_model else _load_sharplm)(args, settings)
    settings = dataclasses.replace(settings, norm=meta.norm)
    proto = export(settings)
    from sharp.exporter import metadata
    from sharp.exporter.check import run_check

    metadata.named(proto, metadata.source_name(_gguf(args.model) or args.model))  # the served id, whatever -o says

    passes = lambda path: run_check(settings, path, meta.shape, reference, library, attention) == 0
    return _write(args, settings, out, proto, library, meta.shape.layers, passes)


def _write(args, settings: ExportSettings, out: Path, proto: onnx.ModelProto, library: str | None, layers: int,
           passes: Callable[[Path], bool]) -> int:  # fmt: skip
    """Write `proto` beside `out` under a temporary name, check it there (`passes`), and only then move it into
    place: a file that fails its check is never left where a server would pick it up, and an existing `out` is
    kept. 0 when written, 1 when the check failed."""
    import onnx

    from sharp.exporter import metadata, rotary

    ropes = rotary.count(proto)
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
        if args.check and not passes(written):
            print(f"sharp-export: {out} not written", file=sys.stderr)
            return 1
        try:
            tmp.replace(out)  # atomic: `out` is either the old file (or empty directory) or the whole new one
        except OSError as e:  # e.g. an immutable file, or a directory of another owner with the sticky bit
            raise UsageError(f"-o {out}: cannot be replaced ({e.strerror}); choose another output path") from None
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    where = f"{out}/: {', '.join(sorted(f.name for f in out.iterdir()))}; {out / MODEL_FILE}" if args.genai else out
    s = settings
    print(
        f"wrote {where} ({size:.1f} MiB): {layers} × sharp::SharpAttention[{s.norm}], {s.dtype} weights, "
        + (f"{s.kv_dtype} KV cache, " if s.kv_dtype != "fp32" else "")
        + f"fallback {s.fallback}, opset {rotary.OPSET if ropes else s.opset}"
        + (f", RoPE as {ropes} RotaryEmbedding nodes" if ropes else "")
        + (", TensorRT form" if s.tensorrt else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
