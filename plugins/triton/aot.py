"""Ahead-of-time compilation of the kernels to PTX/CUBIN for a given CUDA arch, with no GPU present.

This is what the TensorRT plugin is built from: `python -m sharp.plugins.triton.aot --arch 90 --out DIR`
writes one `.ptx` and one `.cubin` per kernel variant plus `manifest.json` (entry name, the norms it serves,
shared memory, warps, the constexprs, the argument signature and the launch contract: grid as expressions of the
size arguments, block, shared memory and its opt-in, scratch, parameter order). `--kernels tensorrt` (the default)
compiles the TensorRT entry points, `--kernels torch` the torch path's prefill kernels (to inspect their code).
Must run without TRITON_INTERPRET (the interpreter replaces the JIT functions that `triton.compile` needs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated so it cannot drift

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sharp.models import registry
from sharp.models.registry import Family, Norm, Transform
from sharp.plugins.triton import kernels

_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
_TILE = {"BLOCK_M": 64, "BLOCK_N": 64}
_SIZES = {"H", "GROUP", "LQ", "LK", "D", "BH", "keys_per_split", "NPOLY", "max_passes", "threshold_bits", "tol_bits"}


@dataclass(frozen=True)
class Variant:
    """One specialisation: kernel, element dtype, head-dim block and constexpr flags."""

    kernel: str
    dtype: str
    block_d: int
    flags: dict = field(default_factory=dict)
    norms: tuple[str, ...] = ()  # the op norms a TensorRT entry point serves

    @property
    def name(self) -> str:
        on = "_".join(k.lower() for k, v in sorted(self.flags.items()) if v is True)
        return f"{self.kernel}_{self.dtype}_d{self.block_d}" + (f"_{on}" if on else "")


def _signature(kernel: str, dtype: str, constexprs: dict) -> dict[str, str]:
    """Pointers to the element dtype for Q/K/V, int8 for the key mask, fp32 for state buffers, i32 sizes/strides,
    fp32 scale."""
    sig = {}
    for arg in kernels.KERNELS[kernel].arg_names:
        if arg in constexprs:
            sig[arg] = "constexpr"
        elif arg in ("Q", "K", "V", "OUT"):
            sig[arg] = f"*{_DTYPES[dtype]}"
        elif arg in ("SKIPPED_OUT", "COUNTS"):
            sig[arg] = "*i32"
        elif arg == "KMASK":  # int8 from torch; int32 in the TensorRT form (its parser rejects bool plugin inputs)
            sig[arg] = "*i32" if kernel.startswith("trt_") else "*i8"
        elif arg in ("scale", "beta_threshold", "tol"):
            sig[arg] = "fp32"
        elif arg in _SIZES or arg.startswith("s"):  # sizes and strides
            sig[arg] = "i32"
        else:
            sig[arg] = "*fp32"
    return sig


def tensorrt_entry(norm: Norm) -> tuple[str, dict]:
    """The TensorRT entry kernel and constexprs that run `norm`, from its registry family and logit transform."""
    if norm.family is Family.ENTMAX:
        return "trt_entmax", {"HAS_LAMBDA": norm.query_scale}
    kinds = {Transform.IDENTITY: {}, Transform.LOG_N_SCALE: {"LOGN": True}, Transform.SIGNED_LOG: {"SSA": True},
             Transform.ENTROPY_BETA: {"ADAPTIVE": True}}  # fmt: skip
    if norm.transform not in kinds:
        raise ValueError(f"no TensorRT kernel for {norm.name}'s transform {norm.transform}")
    return "trt_softmax_family", {"SSA": False, "LOGN": False, "ADAPTIVE": False, **kinds[norm.transform]}


def tensorrt_variants(dtypes=("bf16", "fp16"), head_dims=(64, 128)) -> list[Variant]:
    """One variant per (entry kernel, constexprs) the registry's norms need × dtype × head dim × causal."""
    out = []
    for dtype in dtypes:
        for d in head_dims:
            for causal in (False, True):
                served: dict[tuple, list[str]] = {}
                for norm in registry.NORMS:
                    kernel, flags = tensorrt_entry(registry.get(norm))
                    key = (kernel, tuple(sorted(flags.items())))
                    served.setdefault(key, []).append(norm)
                for (kernel, flags), norms in served.items():
                    constexprs = {**dict(flags), "CAUSAL": causal, "DOT_F32": dtype == "fp32"}
                    out.append(Variant(kernel, dtype, d, constexprs, tuple(norms)))
    return out


def torch_variants(dtypes=("bf16", "fp16"), head_dims=(64, 128)) -> list[Variant]:
    """The torch path's one-launch prefill kernels, causal and not, at the common head dims."""
    out = []
    for dtype in dtypes:
        for d in head_dims:
            for causal in (False, True):
                base = {
                    "CAUSAL": causal,
                    "HAS_ALIBI": False,
                    "HAS_LAMBDA": False,
                    "HAS_KMASK": False,
                    "DOT_F32": dtype == "fp32",
                }
                # one launch per call: softmax, ssmax (log n on chip), SSA, adaptive (both sweeps in the program)
                prefill = {**base, "FINALIZE": True, "WITH_V": True, "HAS_ROWF": False}
                for ssa, logn, adaptive in ((False, False, False), (False, True, False), (True, False, False),
                                            (False, False, True)):  # fmt: skip
                    flags = {**prefill, "SSA": ssa, "LOGN": logn, "ADAPTIVE": adaptive}
                    out.append(Variant("softmax_family", dtype, d, flags))
                # entmax / asentmax: max, threshold and output sweeps in one program (general α; no counters)
                out.append(Variant("entmax", dtype, d, {**base, "FAST": 0, "COUNT": False}))
    return out


POINTER_ALIGNMENT = 16  # bytes; part of the launch contract

# PTX ISA 9.0: the newest the 580-series driver (CUDA 13.0) of the GPUs we are lent loads; Triton's own ptxas
# would otherwise stamp its newer version (9.4 with Triton 3.9) and the driver would refuse the module.
PTX_VERSION = 90


def compile_variant(v: Variant, arch: int, ptx_version: int = PTX_VERSION) -> triton.compiler.CompiledKernel:
    fn = kernels.KERNELS[v.kernel]
    constexprs = {**v.flags, **_TILE, "BLOCK_D": v.block_d}
    signature = _signature(v.kernel, v.dtype, constexprs)
    # every pointer is 16-byte aligned (TensorRT and torch allocations are): lets Q/K/V tiles move as vectors
    aligned = {(i,): [["tt.divisibility", POINTER_ALIGNMENT]] for i, t in enumerate(signature.values()) if t[0] == "*"}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"ptx_version": ptx_version})


# Shared memory a kernel may use without cudaFuncSetAttribute(MaxDynamicSharedMemorySize): above it the launcher
# (a TensorRT plugin, the CUDA driver API) must opt in first.
SHARED_DEFAULT_LIMIT = 48 * 1024
HIDDEN_ARGUMENTS = ("global_scratch", "profile_scratch")  # appended by Triton to every kernel's parameters


def launch_contract(v: Variant, md) -> dict:
    """How to launch the compiled variant without Triton: grid (expressions in the kernel's own size arguments;
    prefill, one key split), block, shared memory and whether it needs the > 48 KB opt-in, scratch (must be 0:
    TensorRT passes null for the hidden pointers) and the parameters in order, hidden ones last."""
    fn = kernels.KERNELS[v.kernel]
    constexprs = {**v.flags, **_TILE, "BLOCK_D": v.block_d}
    return {
        "grid": [f"ceil_div(LQ, {_TILE['BLOCK_M']})", "BH", "1"],
        "block": [md.num_warps * 32, 1, 1],
        "shared_bytes": md.shared,
        "shared_opt_in": md.shared > SHARED_DEFAULT_LIMIT,
        "scratch_bytes": md.global_scratch_size + md.profile_scratch_size,
        "pointer_alignment": POINTER_ALIGNMENT,
        "arguments": [a for a in fn.arg_names if a not in constexprs] + list(HIDDEN_ARGUMENTS),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sharp.plugins.triton.aot", description=__doc__)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an integer (90 = sm_90)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kernels", choices=["tensorrt", "torch"], default="tensorrt", help="which entry points")
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=sorted(_DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    ap.add_argument(
        "--ptx-version",
        type=int,
        default=PTX_VERSION,
        help="PTX ISA version as an integer (90 = 9.0); at most what the target driver's CUDA version loads",
    )
    args = ap.parse_args(argv)
    if not 60 <= args.ptx_version <= 99:
        ap.error(f"--ptx-version {args.ptx_version}: give the ISA version as an integer 60-99 (90 = PTX 9.0)")
    if triton.knobs.runtime.interpret:
        print("aot: unset TRITON_INTERPRET; the interpreter cannot compile kernels", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = []
    variants = tensorrt_variants if args.kernels == "tensorrt" else torch_variants
    for v in variants(tuple(args.dtype), tuple(args.head_dim)):
        ck = compile_variant(v, args.arch, args.ptx_version)
        (args.out / f"{v.name}.ptx").write_text(ck.asm["ptx"])
        if "cubin" in ck.asm:
            (args.out / f"{v.name}.cubin").write_bytes(ck.asm["cubin"])
        md = ck.metadata
        manifest.append(
            {
                "variant": v.name,
                "kernel": v.kernel,
                "norms": list(v.norms),
                "dtype": v.dtype,
                "head_dim": v.block_d,
                "entry": md.name,
                "arch": args.arch,
                "ptx_version": f"{args.ptx_version // 10}.{args.ptx_version % 10}",
                "num_warps": md.num_warps,
                "shared_bytes": md.shared,
                "constexprs": {**v.flags, **_TILE, "BLOCK_D": v.block_d},
                "signature": _signature(v.kernel, v.dtype, {**v.flags, **_TILE, "BLOCK_D": 0}),
                "launch": launch_contract(v, md),
            }
        )
        print(f"{v.name}: {md.name}, {md.num_warps} warps, {md.shared} B shared")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
