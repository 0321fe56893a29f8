"""`python -m sharp.plugins.tensorrt.launch_check --kernels DIR`: on a CUDA GPU without TensorRT, launch exactly what
the plugin's `aot_impl` hands TensorRT — the PTX, its entry, grid/block/shared memory and the argument list in
TensorRT's order (inputs, int32 extras, outputs, two null scratch pointers) — through the CUDA driver API, on torch
tensors, and compare with `attend`'s reference. Everything but TensorRT's acceptance (docs/tensorrt.md).

The same argument builder feeds the CPU test, which launches the Triton function in the interpreter instead.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sharp.models import NORMS, attend
from sharp.plugins.tensorrt.plugin import EXTRAS, PACKED_HEAD_PARAMS, PLUGIN_NAME, KernelManifest, register
from sharp.plugins.tensorrt.standin import TRT, Registry, Sym, TensorDesc

_TRT_DTYPE = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
POLY = (-0.037, 0.481, -2.3, 4.917, -1.791)


def tensorrt_form_inputs(norm: str, b: int, hq: int, hkv: int, lq: int, lk: int, d: int, dtype, device, seed=0):
    """Random inputs in the TensorRT form (Q, K, V, int32 mask with a left-padded row, packed params, query scale)
    and the keyword arguments that give `attend` the same problem."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    mask = torch.ones(b, lk, dtype=torch.bool)
    if b > 1:
        mask[1, : lk // 10] = False
    heads = {
        "alibi_slopes": torch.linspace(0.5, 0.0, hq),
        "alpha": torch.linspace(1.3, 2.0, hq),
        "ssa_n": torch.linspace(1.0, 2.0, hq),
        "ssa_b": torch.linspace(0.5, 1.5, hq),
        "ssmax_s": torch.linspace(0.5, 1.5, hq),
    }
    qs = torch.rand(b, hq, lq, generator=g) + 0.5
    params = torch.cat([*(heads[n] for n in PACKED_HEAD_PARAMS), torch.tensor(POLY)]).float()
    inputs = {
        "Q": q.to(dtype),
        "K": k.to(dtype),
        "V": v.to(dtype),
        "KMASK": mask.to(torch.int32),
        "PARAMS": params,
        "QSCALE": qs if norm == "asentmax" else torch.ones(1),
    }
    inputs = {n: t.to(device).contiguous() for n, t in inputs.items()}
    ref = dict(norm=norm, key_mask=mask.to(device), poly=POLY, **{n: t.to(device) for n, t in heads.items()})
    ref["query_scale"] = qs.to(device) if norm == "asentmax" else None
    return inputs, ref


@dataclass
class Launch:
    """What `aot_impl` returned, evaluated for concrete shapes, and the argument list in TensorRT's order."""

    entry: dict
    name: bytes
    ptx: bytes
    grid: tuple[int, int, int]
    block: int
    shared: int
    arguments: list  # tensors and ints, outputs included; the hidden scratch pointers are not in it
    out: torch.Tensor
    entropy: torch.Tensor


def aot_launch(registry: Registry, manifest: KernelManifest, norm: str, causal: bool, inputs: dict, kv_heads: int,
               scale: float) -> Launch:  # fmt: skip
    """Call the registered `aot_impl` as TensorRT would for these static shapes and attributes."""
    q, k = inputs["Q"], inputs["K"]
    desc = TensorDesc.of_shape
    name, ptx, params, extras = registry.registered[("aot_impl", PLUGIN_NAME)](
        desc(_TRT_DTYPE[q.dtype], q.shape), desc(_TRT_DTYPE[k.dtype], k.shape), None, None, None, None,
        norm, int(causal), scale, q.shape[1], kv_heads, np.asarray(POLY, np.float32), (), 0,
    )  # fmt: skip
    entry = next(
        e for e in manifest.entries
        if e["entry"].encode() == name and norm in e["norms"] and e["constexprs"]["CAUSAL"] == causal
        and e["dtype"] == {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[_TRT_DTYPE[q.dtype]]
    )  # fmt: skip
    out = torch.zeros_like(q)
    ent = torch.zeros(q.shape[:3], device=q.device)
    values = [Sym.of(e)() for e in extras]
    assert len(values) == len(EXTRAS)
    grid = tuple(Sym.of(x)() for x in (params.grid_x, params.grid_y, params.grid_z))
    arguments = [*inputs.values(), *values, out, ent]
    return Launch(entry, name, ptx, grid, params.block_x, params.shared_mem, arguments, out, ent)


_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def launch_ptx(launch: Launch) -> None:
    """Load the PTX with the CUDA driver (torch's current context) and launch it with the argument list."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with CUDA error {status}")

    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(launch.ptx + b"\0")), "cuModuleLoadData")
    check(cuda.cuModuleGetFunction(ctypes.byref(func), module, ctypes.c_char_p(launch.name)), "cuModuleGetFunction")
    if launch.shared > 48 * 1024:
        check(cuda.cuFuncSetAttribute(func, _MAX_DYNAMIC_SHARED, ctypes.c_int(launch.shared)), "cuFuncSetAttribute")
    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int32(a)
              for a in launch.arguments]  # fmt: skip
    values += [ctypes.c_void_p(None), ctypes.c_void_p(None)]  # Triton's scratch pointers: null, as TensorRT passes
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    check(cuda.cuLaunchKernel(func, *launch.grid, launch.block, 1, 1, launch.shared, stream, pointers, None),
          "cuLaunchKernel")  # fmt: skip
    torch.cuda.synchronize()
    check(cuda.cuModuleUnload(module), "cuModuleUnload")


def output_tolerance(v: torch.Tensor) -> float:
    """The output's rounding bound: each output is a convex combination of V's rows, computed from attention weights
    rounded to V's dtype before P·V (≤ eps/2 relative each) and rounded to that dtype itself (≤ eps/2): at most
    eps · max|V| from the fp32 reference on the same inputs. A wrong mask or weight is off by O(max|V|)."""
    return torch.finfo(v.dtype).eps * v.abs().max().item()


# The entropy comes from fp32 logits of the same rounded inputs and fp32 row state: it does not see the weights'
# rounding, only accumulation order and entmax's threshold tolerance.
ENTROPY_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sharp.plugins.tensorrt.launch_check", description=__doc__)
    ap.add_argument("--kernels", type=Path, required=True, help="python -m sharp.plugins.triton.aot --out DIR")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 4096], help="prefill lengths (Lq = Lk)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_check: needs a CUDA GPU (it launches the PTX through the CUDA driver)", file=sys.stderr)
        return 2
    registry = Registry()
    manifest = register(args.kernels, trt=TRT, trtp=registry.trtp())
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    worst_ok, failures = 0.0, 0
    print(f"{'norm':<9}{'causal':>7}{'dtype':>6}{'D':>5}{'L':>7}{'max |Δ out|':>13}{'max |Δ H|':>11}")
    for entry in sorted({(e["dtype"], e["head_dim"]) for e in manifest.entries}):
        dtype, d = dtypes[entry[0]], entry[1]
        for norm in NORMS:
            for causal in (False, True):
                for length in args.lengths:
                    inputs, ref = tensorrt_form_inputs(norm, 2, 8, 2, length, length, d, dtype, "cuda")
                    launch = aot_launch(registry, manifest, norm, causal, inputs, 2, d**-0.5)
                    launch_ptx(launch)
                    o_ref, h_ref = attend(*(inputs[n].float() for n in "QKV"), causal=causal, return_entropy=True,
                                          **ref)  # fmt: skip
                    d_out = (launch.out.float() - o_ref).abs().max().item()
                    d_ent = (launch.entropy - h_ref).abs().max().item()
                    ok = d_out <= output_tolerance(inputs["V"]) and d_ent <= ENTROPY_TOLERANCE[dtype]
                    failures += not ok
                    worst_ok = max(worst_ok, d_out, d_ent)
                    print(f"{norm:<9}{causal!s:>7}{entry[0]:>6}{d:>5}{length:>7}{d_out:>13.2e}{d_ent:>11.2e}"
                          + ("" if ok else "  FAIL"))  # fmt: skip
    print(f"{'all passed' if not failures else f'{failures} FAILED'} (largest difference {worst_ok:.2e})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
