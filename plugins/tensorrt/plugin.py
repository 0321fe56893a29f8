"""The QDP registration of `sharp::SharpAttention`: descriptors, type combinations and an AOT implementation that
hands TensorRT the PTX of the matching Triton variant, its launch parameters and its int32 extra arguments.

Annotations here are real objects (no `from __future__ import annotations`): `tensorrt.plugin` reads them to learn
the plugin's inputs and attribute types.
"""

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from sharp.models.normalizers import ADAPTIVE_THRESHOLD
from sharp.models.streamed import MAX_THRESHOLD_PASSES, threshold_tol

PLUGIN_NAME = "sharp::SharpAttention"
# The TensorRT form of the op (docs/tensorrt.md): inputs, then the int32 extras, then outputs — TensorRT's order.
INPUTS = ("Q", "K", "V", "KMASK", "PARAMS", "QSCALE")
EXTRAS = ("H", "GROUP", "LQ", "LK", "BH", "scale_bits", "NPOLY", "threshold_bits", "max_passes", "tol_bits")
OUTPUTS = ("OUT", "ENT_OUT")
HIDDEN = ("global_scratch", "profile_scratch")  # Triton's; TensorRT passes null, so the kernels must need none
# PARAMS: these per-head vectors (H each) in this order, then the adaptive polynomial (highest power first).
PACKED_HEAD_PARAMS = ("alibi_slopes", "alpha", "ssa_n", "ssa_b", "ssmax_s")
THRESHOLD_TOL = threshold_tol(torch.float32)  # the kernels work in fp32
_TRT_TYPES = {"fp16": ("float16", "FP16"), "bf16": ("bfloat16", "BF16"), "fp32": ("float32", "FP32")}


class TensorRTUnavailable(RuntimeError):
    """TensorRT (with its `tensorrt.plugin` module) is not importable here; the message says what to install."""


def import_tensorrt() -> tuple[ModuleType, ModuleType]:
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as e:
        raise TensorRTUnavailable(
            f"TensorRT is not installed ({e}); sharp's plugin needs TensorRT >= 10.10 with its Python package "
            "(pip install tensorrt on a machine with an NVIDIA driver)"
        ) from e
    return trt, trtp


def float_bits(x: float) -> int:
    """The int32 whose bits are the float32 `x` (TensorRT's extra kernel arguments are all int32)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


_GRID_TERM = re.compile(r"^(?:ceil_div\(([A-Za-z_]\w*), (\d+)\)|([A-Za-z_]\w*)|(\d+))$")


def grid_dims(launch: dict, sizes: dict[str, Any], ceil_div) -> list[Any]:
    """The manifest's grid expressions (`ceil_div(NAME, INT)`, `NAME` or `INT`) over `sizes`, which may be ints or
    TensorRT shape expressions; parsed, never evaluated as code."""
    dims = []
    for expr in launch["grid"]:
        m = _GRID_TERM.match(expr)
        if m is None:
            raise ValueError(f"unsupported grid expression in the kernel manifest: {expr!r}")
        name, block, single, const = m.groups()
        dims.append(ceil_div(sizes[name], int(block)) if name else sizes[single] if single else int(const))
    return dims


def extra_arguments(q_shape, k_shape, q_heads: int, kv_heads: int, scale: float, npoly: int) -> dict[str, Any]:
    """The int32 extras by name, from the shapes (ints or shape expressions) and the node's attributes."""
    return {
        "H": q_heads,
        "GROUP": q_heads // kv_heads,
        "LQ": q_shape[2],
        "LK": k_shape[2],
        "BH": q_shape[0] * q_shape[1],
        "scale_bits": float_bits(scale),
        "NPOLY": npoly,
        "threshold_bits": float_bits(ADAPTIVE_THRESHOLD),  # the op's default `threshold`
        "max_passes": MAX_THRESHOLD_PASSES,
        "tol_bits": float_bits(THRESHOLD_TOL),
    }


@dataclass(frozen=True)
class KernelManifest:
    """The TensorRT entry variants of `python -m sharp.plugins.triton.aot --kernels tensorrt --out DIR`."""

    directory: Path
    entries: tuple[dict, ...]

    @classmethod
    def load(cls, directory: str | Path) -> "KernelManifest":
        directory = Path(directory)
        path = directory / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: compile the kernels with `python -m sharp.plugins.triton.aot --out {directory}`"
            )
        entries = tuple(e for e in json.loads(path.read_text()) if e["kernel"].startswith("trt_"))
        if not entries:
            raise ValueError(f"{path} has no TensorRT entry points (compile with --kernels tensorrt)")
        expected = [*INPUTS, *EXTRAS, *OUTPUTS, *HIDDEN]
        for e in entries:
            launch = e["launch"]
            if launch["arguments"] != expected:
                raise ValueError(f"{e['variant']}: arguments {launch['arguments']} are not TensorRT's order {expected}")
            if launch["scratch_bytes"] != 0:
                raise ValueError(f"{e['variant']} needs {launch['scratch_bytes']} B of scratch; TensorRT passes none")
        return cls(directory, entries)

    def dtypes(self) -> list[str]:
        return sorted({e["dtype"] for e in self.entries})

    def find(self, norm: str, dtype: str, head_dim: int, causal: bool) -> dict:
        for e in self.entries:
            same_kind = norm in e["norms"] and e["dtype"] == dtype and e["head_dim"] == head_dim
            if same_kind and e["constexprs"]["CAUSAL"] == bool(causal):
                return e
        have = sorted({(e["dtype"], e["head_dim"]) for e in self.entries if norm in e["norms"]})
        raise LookupError(
            f"no compiled kernel for norm={norm} dtype={dtype} head_dim={head_dim} causal={bool(causal)}; "
            f"{self.directory} has (dtype, head dim) {have}: compile with "
            f"`python -m sharp.plugins.triton.aot --dtype {dtype} --head-dim {head_dim} --out {self.directory}`"
        )

    def ptx(self, entry: dict) -> bytes:
        return (self.directory / f"{entry['variant']}.ptx").read_bytes()


def _dtype_name(trt: ModuleType, dtype: Any) -> str:
    for name, (attr, _) in _TRT_TYPES.items():
        if dtype == getattr(trt, attr):
            return name
    raise ValueError(f"sharp::SharpAttention runs fp16, bf16 or fp32 inputs, got {dtype}")


def _constant(expr: Any, what: str) -> int:
    if not expr.is_constant:
        raise ValueError(f"{what} must be fixed when the engine is built (it selects the kernel variant)")
    return int(expr.constant_value())


def register(manifest_dir: str | Path, trt: ModuleType | None = None, trtp: ModuleType | None = None) -> KernelManifest:
    """Register `sharp::SharpAttention` with TensorRT's plugin registry, backed by the compiled kernels in
    `manifest_dir`. `trt`/`trtp` default to the installed `tensorrt` and `tensorrt.plugin`."""
    if trt is None or trtp is None:
        trt, trtp = import_tensorrt()
    manifest = KernelManifest.load(manifest_dir)

    @trtp.register(PLUGIN_NAME)
    def describe(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        key_mask: trtp.TensorDesc,
        params: trtp.TensorDesc,
        query_scale: trtp.TensorDesc,
        norm: str,
        causal: int,
        scale: float,
        q_heads: int,
        kv_heads: int,
        poly: npt.NDArray[np.float32],
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        """O like Q; the entropy (B, Hq, Lq) in fp32."""
        shape = q.shape_expr
        return q.like(), trtp.from_shape_expr((shape[0], shape[1], shape[2]), dtype=trt.float32)

    @trtp.autotune(PLUGIN_NAME)
    def combinations(q, k, v, key_mask, params, query_scale, outputs) -> list[trtp.AutoTuneCombination]:
        """Q, K, V and O share one of the compiled dtypes; the mask is int32, parameters and entropy fp32."""
        t = "|".join(_TRT_TYPES[d][1] for d in manifest.dtypes())
        return [trtp.AutoTuneCombination(f"{t}, {t}, {t}, INT32, FP32, FP32, {t}, FP32")]

    @trtp.aot_impl(PLUGIN_NAME)
    def kernel(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        key_mask: trtp.TensorDesc,
        params: trtp.TensorDesc,
        query_scale: trtp.TensorDesc,
        norm: str,
        causal: int,
        scale: float,
        q_heads: int,
        kv_heads: int,
        poly: npt.NDArray[np.float32],
        outputs: tuple[trtp.TensorDesc, trtp.TensorDesc],
        tactic: int,
    ) -> tuple[bytes, bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        """The variant for (norm, dtype, head dim, causal): its PTX, grid/block/shared memory as expressions of
        the input shapes, and the extras in the kernel's order."""
        head_dim = _constant(q.shape_expr[3], "the head dim (Q's last axis)")
        entry = manifest.find(norm, _dtype_name(trt, q.dtype), head_dim, bool(causal))
        sizes = extra_arguments(q.shape_expr, k.shape_expr, q_heads, kv_heads, scale, int(np.size(poly)))
        launch = entry["launch"]
        params_out = trtp.KernelLaunchParams()
        params_out.grid_x, params_out.grid_y, params_out.grid_z = grid_dims(launch, sizes, trtp.cdiv)
        params_out.block_x = launch["block"][0]
        params_out.shared_mem = launch["shared_bytes"]
        extras = trtp.SymIntExprs.from_tuple([trtp.SymInt32(sizes[name]) for name in EXTRAS])
        return entry["entry"].encode(), manifest.ptx(entry), params_out, extras

    return manifest
