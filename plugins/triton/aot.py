"""Ahead-of-time compilation of the kernels to PTX/CUBIN for a given CUDA arch, with no GPU present.

This is what the TensorRT plugin is built from: `python -m sharp.plugins.triton.aot --arch 90 --out DIR`
writes one `.ptx` and one `.cubin` per kernel variant plus `manifest.json` (entry name, the norms it serves,
shared memory, warps, the constexprs, the argument signature and the launch contract: grid as expressions of the
size arguments, block, shared memory and its opt-in, scratch, parameter order). `--kernels tensorrt` (the default)
compiles the TensorRT entry points, `--kernels torch` the torch path's prefill kernels (to inspect their code),
`--kernels jit` every kernel the torch path launches (prefill, split-K decode, paged decode, merge) under the
specialisations Triton's JIT applies on a GPU — the compile check of a Triton version — and `--kernels all` both
the TensorRT entry points and that check. The PTX ISA is the highest this Triton's ptxas writes, at most 9.0.
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

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from sharp.models import registry
from sharp.models.registry import Family, Norm, Transform
from sharp.plugins.triton import floor, kernels, paged
from sharp.plugins.triton.attention import (
    MERGE_ROWS,
    THRESHOLD_KEYS,
    THRESHOLD_ROWS,
    entmax_stages,
    triton_version,
)

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
    # "aligned": only pointers are assumed 16-byte aligned (the AOT launch contract); "plain" / "jit": the torch
    # path's JIT specialisations (see jit_variants), with `units` the integer arguments that are 1 in its launches
    spec: str = "aligned"
    units: tuple[str, ...] = ()
    # "jit" only: integer arguments' values of one problem class (the rest as the rule in `_jit_value`); the JIT
    # derives the same specialisation from them as from that problem's launch (sharp-bench kernels --static)
    values: tuple[tuple[str, int], ...] = ()

    @property
    def name(self) -> str:
        on = "_".join(k.lower() for k, v in sorted(self.flags.items()) if v is True)
        name = f"{self.kernel}_{self.dtype}_d{self.block_d}" + (f"_{on}" if on else "")
        if self.spec == "aligned":
            return name
        return name + (f"_fast{self.flags['FAST']}" if "FAST" in self.flags else "") + f"_{self.spec}"


def _signature(kernel: str, dtype: str, constexprs: dict) -> dict[str, str | tuple[str, ...]]:
    """Pointers to the element dtype for Q/K/V, int8 for the key mask, fp32 for state buffers, i32 sizes/strides,
    fp32 scale; a tuple argument (TUPLES) has one type per element."""

    def kind(arg: str) -> str:
        if arg in ("Q", "K", "V", "OUT"):
            return f"*{_DTYPES[dtype]}"
        if arg in ("SKIPPED_OUT", "COUNTS"):
            return "*i32"
        if arg == "KMASK":  # int8 from torch; int32 in the TensorRT form (its parser rejects bool plugin inputs)
            return "*i32" if kernel.startswith("trt_") else "*i8"
        if arg in ("scale", "beta_threshold", "tol"):
            return "fp32"
        if arg in _SIZES or arg.startswith("s"):  # sizes and strides
            return "i32"
        return "*fp32"

    return {arg: "constexpr" if arg in constexprs else tuple(map(kind, TUPLES[arg])) if arg in TUPLES else kind(arg)
            for arg in kernels.KERNELS[kernel].arg_names}  # fmt: skip


def _leaves(signature: dict) -> list[tuple[tuple[int, ...], str, str]]:
    """(path, element name, type) of every argument the compiled entry takes, in its order: a tuple argument's
    elements one by one (path (argument, element)); constexprs left out."""
    out = []
    for i, (arg, kind) in enumerate(signature.items()):
        if isinstance(kind, tuple):
            out += [((i, j), name, k) for j, (name, k) in enumerate(zip(TUPLES[arg], kind, strict=True))
                    if k != "constexpr"]  # fmt: skip
        elif kind != "constexpr":
            out.append(((i,), arg, kind))
    return out


def tensorrt_entry(norm: Norm) -> tuple[str, dict]:
    """The TensorRT entry kernel and constexprs that run `norm`, from its registry family and logit transform."""
    if norm.family is Family.ENTMAX:
        return "trt_entmax", {"HAS_LAMBDA": norm.query_scale}
    kinds = {Transform.IDENTITY: {}, Transform.LOG_N_SCALE: {"LOGN": True}, Transform.SIGNED_LOG: {"SSA": True},
             Transform.ENTROPY_BETA: {"ADAPTIVE": True}}  # fmt: skip
    if norm.transform not in kinds:
        raise ValueError(f"no TensorRT kernel for {norm.name}'s transform {norm.transform}")
    flags = {"SSA": False, "LOGN": False, "ADAPTIVE": False, "MMA_SUMS": tensorrt_partials()}
    return "trt_softmax_family", {**flags, **kinds[norm.transform]}


def tensorrt_partials() -> bool:
    """Whether the TensorRT softmax family keeps its half-precision row sums as column partials (MMA_SUMS), by the
    compiling Triton: `sharp-bench kernels --static` at bf16, D = 128 reads, under Triton 3.9, no spill with them
    (adaptive's output sweep spills without) and 4–5% fewer instructions per element; under 3.6, 12–14% more with
    them and no spill without. Versions between were not measured and take the newer's choice."""
    return triton_version() > (3, 6)


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
                prefill = {
                    **base,
                    "FINALIZE": True,
                    "WITH_V": True,
                    "HAS_ROWF": False,
                    "ENTROPY": True,
                    "PACKED": False,
                }
                for ssa, logn, adaptive in ((False, False, False), (False, True, False), (True, False, False),
                                            (False, False, True)):  # fmt: skip
                    flags = {**prefill, "SSA": ssa, "LOGN": logn, "ADAPTIVE": adaptive}
                    out.append(Variant("softmax_family", dtype, d, flags))
                # entmax / asentmax: max, threshold and output sweeps in one program (general α; no counters)
                out.append(Variant("entmax", dtype, d, {**base, "FAST": 0, "COUNT": False, "ENTROPY": True,
                                                        "EXACT_D": True}))  # fmt: skip
    return out


def jit_variants(dtypes=("bf16",), head_dims=(128,)) -> list[Variant]:
    """Every launch of the torch path (plugins/triton/attention.py and paged.py), under two specialisations.

    On a GPU the JIT specialises each launch on its argument values: pointers and integers divisible by 16 get
    `tt.divisibility`, integers equal to 1 become constants. Triton versions differ in what they can compile under
    those (Triton 3.6 failed on the split-K threshold kernel once its sizes were divisible by 16), so each launch is
    compiled "plain" (no integer divisible or 1) and "jit" (the GPU's usual values: last-dimension strides 1, batch,
    group and — for decode — the query length 1, every other integer a multiple of 16), through Triton's own
    specialisation function. Tiles: the host's defaults (64×64 prefill, 16-row decode, 16-token pages)."""
    out = []
    for dtype in dtypes:
        for d in head_dims:
            for spec in ("plain", "jit"):
                out += [Variant(k, dtype, d, flags, spec=spec, units=u) for k, flags, u in _torch_launches(dtype)]
    return out


def _torch_launches(dtype: str) -> list[tuple[str, dict, tuple[str, ...]]]:
    """(kernel, constexprs, integer arguments that are 1) of each kind of launch the torch path makes."""
    base = dict(CAUSAL=True, HAS_ALIBI=False, HAS_LAMBDA=False, HAS_KMASK=False, DOT_F32=dtype == "fp32")
    prefill = {**base, "BLOCK_M": 64, "BLOCK_N": 64}
    decode = {**base, "BLOCK_M": 16, "BLOCK_N": 64, "PACKED": True}  # a KV head's queries a program
    plain, logn, ssa = dict(SSA=False, LOGN=False), dict(SSA=False, LOGN=True), dict(SSA=True, LOGN=False)
    one, dec = ("B", "GROUP"), ("B", "GROUP", "LQ")
    finish = {"HAS_ROWF": False, "FINALIZE": True, "WITH_V": True, "PACKED": False}
    kinds = ((plain, False, True), (logn, False, True), (ssa, False, True), (plain, True, True), (plain, False, False))
    out = [  # prefill: one launch finishes output and entropy (adaptive: both sweeps on chip), or output only
        ("softmax_family", {**prefill, **t, **finish, "ADAPTIVE": a, "ENTROPY": e}, one) for t, a, e in kinds
    ]
    # a head dim that fills its block (D = BLOCK_D); the first tile's stages, as the host caps entmax's
    exact = {**prefill, "EXACT_D": True, "num_stages": entmax_stages(3)}
    general = {**exact, "FAST": 0}
    out += [  # entmax prefill: with and without its entropy
        ("entmax", {**general, "COUNT": False, "ENTROPY": True}, one),
        ("entmax", {**general, "COUNT": False, "ENTROPY": False}, one),
        ("entmax", {**exact, "HAS_LAMBDA": True, "HAS_KMASK": True, "FAST": 2, "COUNT": True, "ENTROPY": True}, one),
    ]
    split = {**decode, "ADAPTIVE": False, "FINALIZE": False, "ENTROPY": True}  # split-K decode: merged by merge_softmax
    out += [("softmax_family", {**split, **t, "HAS_ROWF": False, "WITH_V": True}, dec) for t in (plain, logn, ssa)]
    out += [  # adaptive split-K: statistics without V, then the output with β per row
        ("softmax_family", {**split, **plain, "HAS_ROWF": False, "WITH_V": False}, dec),
        ("softmax_family", {**split, **plain, "HAS_ROWF": True, "WITH_V": True}, dec),
        ("entmax_logits", decode, dec),
        ("entmax_output", {**decode, "FAST": 0}, dec),
        ("entmax_output", {**decode, "HAS_LAMBDA": True, "FAST": 2}, dec),
    ]
    out += [  # split-K and paged decode share the threshold kernel
        (
            "entmax_threshold",
            {"FAST": fast, "COUNT": fast == 2, "BLOCK_R": THRESHOLD_ROWS, "BLOCK_N": THRESHOLD_KEYS},
            ("LQ",),
        )
        for fast in (0, 1, 2)
    ]
    pages = {"HAS_ALIBI": False, "CAUSAL": True, "DOT_F32": dtype == "fp32", "BLOCK_M": 16, "PAGE": 16,
             "BLOCK_N": paged.PAGED_KEYS}  # fmt: skip
    bounds = {"HAS_ALIBI": False, "BLOCK_M": 16, "PAGE": 16, "BLOCK_P": paged.BOUND_PAGES}
    out += [("paged_softmax", {**pages, **t, "HAS_ROWF": False, "WITH_V": True}, dec) for t in (plain, logn, ssa)]
    out += [
        ("paged_softmax", {**pages, **plain, "HAS_ROWF": False, "WITH_V": False}, dec),
        ("paged_softmax", {**pages, **plain, "HAS_ROWF": True, "WITH_V": True}, dec),
        ("merge_softmax", {"WITH_V": True, "BLOCK_R": MERGE_ROWS}, ("SPLITS",)),
        ("merge_softmax", {"WITH_V": False, "BLOCK_R": MERGE_ROWS}, ("SPLITS",)),
        ("paged_entmax_logits", {**pages, "HAS_LAMBDA": True, "SKIP": False}, dec),
        ("paged_entmax_logits", {**pages, "HAS_LAMBDA": True, "SKIP": True}, dec),  # sparse decode: pages skipped
        ("paged_entmax_bounds", {**bounds, "HAS_LAMBDA": True, "CAUSAL": True}, dec),
        ("paged_entmax_output", {"FAST": 0, "DOT_F32": dtype == "fp32", "BLOCK_M": 16, "PAGE": 16}, dec),
        ("paged_entmax_output", {"FAST": 2, "DOT_F32": dtype == "fp32", "BLOCK_M": 16, "PAGE": 16}, dec),
    ]
    return out


_ALL_KERNELS = {**kernels.KERNELS, **paged.KERNELS, **floor.KERNELS}
_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_JIT_SIZES = {"H", "GROUP", "LQ", "LK", "D", "BH", "NPOLY", "B", "HKV", "ROWS", "SPLITS", "WIDTH"}
_JIT_FLOATS = {"scale", "beta_threshold", "tol"}
# the element dtype; other pointers as the host allocates them
_JIT_ELEMENTS = {"Q", "K", "V", "OUT", "K_PAGES", "V_PAGES"}
_JIT_POINTERS = {"KMASK": torch.int8, "BT": torch.int32, "SEQ": torch.int32, "COUNTS": torch.int32,
                 "SKIPPED_OUT": torch.int32, "KEPT_OUT": torch.int32}  # fmt: skip
_UNIT_STRIDES = {"sqd", "skd", "svd", "spd", "sbd"}  # contiguous last dimensions
# The torch path's tuple arguments by name, element by element (the host packs them in this order): each element is
# specialised as a flat argument of its name would be.
TUPLES: dict[str, tuple[str, ...]] = {
    "q_strides": ("sqb", "sqh", "sqm", "sqd"),
    "k_strides": ("skb", "skh", "skn", "skd"),
    "v_strides": ("svb", "svh", "svn", "svd"),
    "p_strides": ("spp", "sph", "spn", "spd"),
    "b_strides": ("sb0", "sbh", "sbp", "sbd"),
    "SPARSE": ("PB", "TAU_S", "KEPT_OUT"),
    "sizes": ("H", "GROUP", "LQ", "LK", "D"),
    "split": ("BH", "keys_per_split"),
    "stop": ("max_passes", "tol"),
    "NORM": ("ROWF", "SSMAX_S", "SSA_N", "SSA_B", "SLOPES", "LAMBDA", "POLY", "NPOLY", "beta_threshold"),
    "OUTS": ("OUT", "ENT_OUT", "M_OUT", "L_OUT", "KP_OUT", "ACC_OUT"),
    "STATE": ("M_OUT", "L_OUT", "KP_OUT", "ACC_OUT"),
}


def kernel_sources() -> dict[str, str]:
    """The kernels' modules by file name (what their line information names): a kernel inlines functions of
    several."""
    return {p.name: str(p) for p in Path(__file__).parent.glob("*.py")}


def _jit_value(name: str, v: Variant) -> object:
    """A value of argument `name` like the torch path passes: a 16-byte-aligned tensor for a pointer, a float,
    or an integer (17 under "plain"; under "jit" 1 for unit strides and sizes, else 64); a tuple of those for a
    tuple argument."""
    if name in TUPLES:
        return tuple(_jit_value(element, v) for element in TUPLES[name])
    if name in _JIT_FLOATS:
        return 0.5
    if name in (given := dict(v.values)):
        return given[name]
    if name[0].isupper() and name not in _JIT_SIZES:
        dtype = _TORCH_DTYPES[v.dtype] if name in _JIT_ELEMENTS else _JIT_POINTERS.get(name, torch.float32)
        return torch.empty(16, dtype=dtype)
    if v.spec == "plain":
        return 17
    return 1 if name in _UNIT_STRIDES or name in v.units else 64


def _check_constexprs(kernel: str, constexprs: dict) -> dict:
    """`constexprs`, refused when one of the kernel's is missing: it would be compiled as an ordinary argument."""
    fn = _ALL_KERNELS[kernel]
    missing = [fn.arg_names[i] for i in fn.constexprs if fn.arg_names[i] not in constexprs]
    if missing:
        raise ValueError(f"{kernel}: no value for constexpr {', '.join(missing)}")
    return constexprs


def jit_specialise(v: Variant) -> tuple[dict, dict, dict]:
    """Signature, constexprs and attributes of `v` as the JIT derives them from argument values (Triton's own
    `native_specialize_impl`): divisibility by 16 as an attribute, integers equal to 1 as constants."""
    fn = _ALL_KERNELS[v.kernel]
    constexprs = _check_constexprs(v.kernel, {k: x for k, x in {**v.flags, "BLOCK_D": v.block_d}.items()
                                              if k in fn.arg_names})  # fmt: skip
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        kind, spec = native_specialize_impl(BaseBackend, _jit_value(name, v), False, True, True)
        signature[name] = "constexpr" if kind == "constexpr" else kind
        # a tuple's elements are specialised one by one, each addressed by its path (argument, element)
        leaves = zip(((i, j) for j in range(len(kind))), kind, spec, strict=True) if isinstance(kind, tuple) else [
            ((i,), kind, spec)]  # fmt: skip
        for path, k, s in leaves:
            if k == "constexpr":
                constexprs[path if len(path) > 1 else name] = s
            elif s == "D":
                attrs[path] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


POINTER_ALIGNMENT = 16  # bytes; part of the launch contract

# PTX ISA 9.0: the newest the 580-series driver (CUDA 13.0) of the GPUs we are lent loads; a newer Triton's ptxas
# would otherwise stamp its own version (9.4 with Triton 3.9) and the driver would refuse the module.
PTX_CAP = 90


def default_ptx_version(arch: int) -> int:
    """The highest PTX ISA this Triton's ptxas accepts (8.7 with Triton 3.6's CUDA 12.8 ptxas), capped at PTX_CAP."""
    from triton.backends.nvidia.compiler import get_ptxas, ptx_get_version

    return min(PTX_CAP, ptx_get_version(get_ptxas(arch).version))


def compile_variant(v: Variant, arch: int, ptx_version: int) -> triton.compiler.CompiledKernel:
    if v.spec != "aligned":
        signature, constexprs, attrs = jit_specialise(v)
        src = ASTSource(fn=_ALL_KERNELS[v.kernel], signature=signature, constexprs=constexprs, attrs=attrs)
        stages = {"num_stages": v.flags["num_stages"]} if "num_stages" in v.flags else {}  # else Triton's default, 3
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"ptx_version": ptx_version, **stages})
    fn = kernels.KERNELS[v.kernel]
    constexprs = _check_constexprs(v.kernel, {**v.flags, **_TILE, "BLOCK_D": v.block_d})
    signature = _signature(v.kernel, v.dtype, constexprs)
    # every pointer is 16-byte aligned (TensorRT and torch allocations are): lets Q/K/V tiles move as vectors
    aligned = {path: [["tt.divisibility", POINTER_ALIGNMENT]] for path, _, t in _leaves(signature) if t[0] == "*"}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    options = {"ptx_version": ptx_version, "num_stages": tensorrt_stages(v)}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def tensorrt_stages(v: Variant) -> int:
    """Pipeline stages of an AOT variant. The TensorRT form always takes a key mask and ALiBi slopes, which hold
    more registers in the key loop than the torch path's launches: with Triton's default 3 stages its loops spill
    (`sharp-bench kernels --static`), with 2 none does."""
    return 2


# Shared memory a kernel may use without cudaFuncSetAttribute(MaxDynamicSharedMemorySize): above it the launcher
# (a TensorRT plugin, the CUDA driver API) must opt in first.
SHARED_DEFAULT_LIMIT = 48 * 1024
HIDDEN_ARGUMENTS = ("global_scratch", "profile_scratch")  # appended by Triton to every kernel's parameters


def launch_contract(v: Variant, md) -> dict:
    """How to launch the compiled variant without Triton: grid (expressions in the kernel's own size arguments;
    prefill, one key split), block, shared memory and whether it needs the > 48 KB opt-in, scratch (must be 0:
    TensorRT passes null for the hidden pointers) and the parameters in order, hidden ones last."""
    signature = _signature(v.kernel, v.dtype, {**v.flags, **_TILE, "BLOCK_D": v.block_d})
    return {
        "grid": [f"ceil_div(LQ, {_TILE['BLOCK_M']})", "BH", "1"],
        "block": [md.num_warps * 32, 1, 1],
        "shared_bytes": md.shared,
        "shared_opt_in": md.shared > SHARED_DEFAULT_LIMIT,
        "scratch_bytes": md.global_scratch_size + md.profile_scratch_size,
        "pointer_alignment": POINTER_ALIGNMENT,
        "arguments": [name for _, name, _ in _leaves(signature)] + list(HIDDEN_ARGUMENTS),
    }


_KERNEL_SETS = {
    "tensorrt": tensorrt_variants,
    "torch": torch_variants,
    "jit": jit_variants,
    "all": lambda dtypes, head_dims: tensorrt_variants(dtypes, head_dims) + jit_variants(dtypes, head_dims),
}


def _manifest_entry(v: Variant, md, arch: int, ptx_version: int) -> dict:
    entry = {
        "variant": v.name,
        "kernel": v.kernel,
        "norms": list(v.norms),
        "dtype": v.dtype,
        "head_dim": v.block_d,
        "entry": md.name,
        "arch": arch,
        "ptx_version": f"{ptx_version // 10}.{ptx_version % 10}",
        "num_warps": md.num_warps,
        "num_stages": md.num_stages,
        "shared_bytes": md.shared,
        "specialisation": v.spec,
    }
    if v.spec != "aligned":  # a compile check of a JIT launch: what the specialisation made of its arguments
        signature, constexprs, attrs = jit_specialise(v)
        names = list(signature)

        def named(path: str | tuple[int, ...]) -> str:  # a tuple's element by its own name
            if isinstance(path, str):
                return path
            return names[path[0]] if len(path) == 1 else TUPLES[names[path[0]]][path[1]]

        return {**entry, "constexprs": {named(k): c for k, c in constexprs.items()},
                "divisible_by_16": [named(path) for path in attrs]}  # fmt: skip
    return {
        **entry,
        "constexprs": {**v.flags, **_TILE, "BLOCK_D": v.block_d},
        "signature": _signature(v.kernel, v.dtype, {**v.flags, **_TILE, "BLOCK_D": 0}),
        "launch": launch_contract(v, md),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sharp.plugins.triton.aot", description=__doc__)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an integer (90 = sm_90)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kernels", choices=sorted(_KERNEL_SETS), default="tensorrt", help="which entry points")
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=sorted(_DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    ap.add_argument(
        "--ptx-version",
        type=int,
        default=None,
        help="PTX ISA version as an integer (90 = 9.0); default: the highest this Triton's ptxas writes, at most "
        "9.0 (what the 580-series driver, CUDA 13.0, loads)",
    )
    args = ap.parse_args(argv)
    if args.ptx_version is not None and not 60 <= args.ptx_version <= 99:
        ap.error(f"--ptx-version {args.ptx_version}: give the ISA version as an integer 60-99 (90 = PTX 9.0)")
    if triton.knobs.runtime.interpret:
        print("aot: unset TRITON_INTERPRET; the interpreter cannot compile kernels", file=sys.stderr)
        return 2
    ptx_version = args.ptx_version or default_ptx_version(args.arch)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest, failed = [], []
    print(f"triton {triton.__version__}, sm_{args.arch}, PTX {ptx_version // 10}.{ptx_version % 10}")
    for v in _KERNEL_SETS[args.kernels](tuple(args.dtype), tuple(args.head_dim)):
        try:
            ck = compile_variant(v, args.arch, ptx_version)
        except Exception as e:  # report every variant that fails, not only the first
            failed.append(v.name)
            print(f"{v.name}: FAILED: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}", file=sys.stderr)
            continue
        (args.out / f"{v.name}.ptx").write_text(ck.asm["ptx"])
        if "cubin" in ck.asm:
            (args.out / f"{v.name}.cubin").write_bytes(ck.asm["cubin"])
        manifest.append(_manifest_entry(v, ck.metadata, args.arch, ptx_version))
        print(f"{v.name}: {ck.metadata.name}, {ck.metadata.num_warps} warps, {ck.metadata.shared} B shared")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    if failed:
        print(f"aot: {len(failed)} of {len(failed) + len(manifest)} variants failed to compile", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
