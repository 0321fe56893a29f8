"""`sharp-build-engine MODEL.onnx -o MODEL.plan`: a TensorRT engine of a `sharp-export --tensorrt` file, with sharp's
AOT plugin for the attention and two optimization profiles for the generation graph (prefill: no past; decode:
one new token per row over a past), a timing cache and progress lines.

Everything that can be checked without TensorRT — the file is a sharp export in the TensorRT form with a KV cache,
the kernels were compiled for its head dim, the output path — is checked before TensorRT is imported, so mistakes
exit 2 with one line on any machine. The engine's sharp metadata is written beside it (`MODEL.plan.json`: the
export's metadata entries, same schema) for `sharp-serve MODEL.plan --backend tensorrt`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import onnx

from sharp.exporter import metadata
from sharp.exporter.metadata import ModelMetadata, plan_metadata_path
from sharp.exporter.tensorrt import is_tensorrt_form
from sharp.models.messages import Parser, UsageError
from sharp.plugins.tensorrt.plugin import KernelManifest, TensorRTUnavailable, import_tensorrt, register

PROFILES = ("prefill", "decode")
DEFAULT_KERNELS = Path("build/trt-kernels")


@dataclass(frozen=True)
class Dims:
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


def profiles(meta: ModelMetadata, max_batch: int, max_context: int) -> dict[str, dict[str, Dims]]:
    """Shape ranges of the generation graph's inputs per profile. Prefill: chunks of 1..max_context tokens over a
    past of 0..max_context − 1 (the engine prefills long prompts in chunks). Decode: one token per row over a past
    of 1..max_context − 1. A profile bounds each axis on its own: past + chunk ≤ max_context is the engine's to keep."""
    s = meta.shape

    def kv(batch: int, past: int) -> tuple[int, ...]:
        return (batch, s.kv_heads, past, s.head_dim)

    opt_b = max(1, max_batch // 2)
    opt_l = min(512, max_context)
    opt_p = max(1, max_context // 2)
    prefill = {
        "input_ids": Dims((1, 1), (opt_b, opt_l), (max_batch, max_context)),
        "position_ids": Dims((1, 1), (opt_b, opt_l), (max_batch, max_context)),
        "attention_mask": Dims((1, 1), (opt_b, opt_l), (max_batch, max_context)),
        "past": Dims(kv(1, 0), kv(opt_b, 0), kv(max_batch, max_context - 1)),
    }
    decode = {
        "input_ids": Dims((1, 1), (opt_b, 1), (max_batch, 1)),
        "position_ids": Dims((1, 1), (opt_b, 1), (max_batch, 1)),
        "attention_mask": Dims((1, 2), (opt_b, opt_p + 1), (max_batch, max_context)),
        "past": Dims(kv(1, 1), kv(opt_b, opt_p), kv(max_batch, max_context - 1)),
    }
    return {"prefill": prefill, "decode": decode}


def profile_for(new_tokens: int, past_length: int) -> int:
    """The profile index a step runs under: decode for one new token per row over a past, prefill otherwise
    (a prompt, or a chunk of one over its earlier chunks)."""
    return PROFILES.index("decode" if new_tokens == 1 and past_length > 0 else "prefill")


def check_model(path: Path) -> tuple[onnx.ModelProto, ModelMetadata]:
    """A sharp export in the TensorRT form with a KV cache, or UsageError saying what it is instead."""
    if not path.is_file():
        raise UsageError(f"{path}: no such file (expected an .onnx file from sharp-export --tensorrt)")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # DecodeError and friends for non-ONNX bytes
        raise UsageError(f"{path}: not an ONNX file ({type(e).__name__}); expected sharp-export --tensorrt") from None
    try:
        meta = metadata.read(proto)
        metadata.check_graph(meta, *metadata.graph_io(proto))
    except metadata.MetadataError as e:
        raise UsageError(f"{path}: {e}") from None
    if not is_tensorrt_form(proto):
        raise UsageError(f"{path}: not in the TensorRT form; re-export with `sharp-export MODEL --tensorrt`")
    if not meta.export.get("kv_cache", False):
        raise UsageError(f"{path}: exported without a KV cache; re-export without --no-kv-cache")
    return proto, meta


def check_kernels(directory: Path, meta: ModelMetadata, dtype: str) -> KernelManifest:
    """The compiled kernels cover every norm of the model at its head dim in `dtype`."""
    try:
        manifest = KernelManifest.load(directory)
        for layer in meta.layers:
            manifest.find(layer.norm, dtype, meta.shape.head_dim, causal=True)  # generation graphs are causal
    except (FileNotFoundError, ValueError, LookupError) as e:
        raise UsageError(f"--kernels {directory}: {e}") from None
    return manifest


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="sharp-build-engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="an .onnx file from `sharp-export MODEL --tensorrt`")
    ap.add_argument("-o", "--output", type=Path, required=True, help="the engine file to write (MODEL.plan)")
    precision = ap.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_const", dest="dtype", const="fp16", help="fp16 kernels (default)")
    precision.add_argument("--bf16", action="store_const", dest="dtype", const="bf16", help="bf16 kernels")
    ap.add_argument("--max-batch", type=int, default=8, help="rows per step the engine accepts (default 8)")
    ap.add_argument("--max-context", type=int, help="tokens per row, prompt + generated (default: the model's)")
    ap.add_argument("--kernels", type=Path, default=DEFAULT_KERNELS, help="python -m sharp.plugins.triton.aot --out")
    ap.add_argument("--timing-cache", type=Path, help="read and update TensorRT's timing cache in this file")
    ap.set_defaults(dtype="fp16")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _build(args)
    except (UsageError, TensorRTUnavailable) as e:
        print(f"sharp-build-engine: {e}", file=sys.stderr)
        return 2


def _build(args) -> int:
    proto, meta = check_model(args.model)
    out: Path = args.output
    if out.resolve() == args.model.resolve() or out.is_dir():
        raise UsageError(f"-o {out} is the input or a directory; give a new file path such as model.plan")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise UsageError(f"cannot write {out}: {out.parent} is not a writable directory")
    context = args.max_context or meta.shape.context_length
    if not 1 <= args.max_batch <= 4096:
        raise UsageError(f"--max-batch must be 1-4096, got {args.max_batch}")
    if not 2 <= context <= meta.shape.context_length:
        raise UsageError(f"--max-context must be 2-{meta.shape.context_length} (the model's context), got {context}")
    check_kernels(args.kernels, meta, args.dtype)
    trt, trtp = import_tensorrt()  # everything above holds on any machine; from here TensorRT is needed
    register(args.kernels, trt, trtp)
    plan = _build_engine(trt, args.model, meta, args.dtype, args.max_batch, context, args.timing_cache)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(plan)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    props = {p.key: p.value for p in proto.metadata_props if p.key.startswith(metadata.KEY)}
    plan_metadata_path(out).write_text(json.dumps(props))
    print(f"wrote {out} ({len(plan) / 2**20:.1f} MiB) and {plan_metadata_path(out).name}")
    return 0


def _build_engine(trt, model: Path, meta: ModelMetadata, dtype: str, max_batch: int, context: int, cache: Path | None):
    """TensorRT's builder over the parsed file (not verified here: no TensorRT; docs/tensorrt.md)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    onnx_parser = trt.OnnxParser(network, logger)
    if not onnx_parser.parse_from_file(str(model)):
        errors = "; ".join(str(onnx_parser.get_error(i)) for i in range(onnx_parser.num_errors))
        raise UsageError(f"{model}: TensorRT's ONNX parser refused it: {errors}")
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16 if dtype == "fp16" else trt.BuilderFlag.BF16)
    timing = config.create_timing_cache(cache.read_bytes() if cache and cache.is_file() else b"")
    config.set_timing_cache(timing, ignore_mismatch=False)
    names = [network.get_input(i).name for i in range(network.num_inputs)]
    for ranges in profiles(meta, max_batch, context).values():
        profile = builder.create_optimization_profile()
        for name in names:
            dims = ranges["past" if name.startswith("past_key_values.") else name]
            profile.set_shape(name, dims.min, dims.opt, dims.max)
        config.add_optimization_profile(profile)
    print(f"building: {len(meta.layers)} layers, {dtype}, batch ≤ {max_batch}, context ≤ {context} …", flush=True)
    start = time.monotonic()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise UsageError(f"{model}: TensorRT could not build an engine (its log above says why)")
    print(f"built in {time.monotonic() - start:.0f} s", flush=True)
    if cache is not None:
        cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    return bytes(plan)


if __name__ == "__main__":
    sys.exit(main())
