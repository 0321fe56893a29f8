"""The TensorRT entry points: the softmax family and entmax in TensorRT's argument order, compiled ahead of time
(aot.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from sharp.plugins.triton.entmax import (
    _entmax_program,
)
from sharp.plugins.triton.softmax import (
    _softmax_family_program,
)
from sharp.plugins.triton.threshold import (
    GENERAL_SELECTED,
)

# TensorRT launches an AOT plugin kernel with the plugin's input pointers, then its int32 extra arguments, then its
# output pointers (Triton's two hidden scratch pointers last, passed as null). These wrappers take exactly that
# order for the TensorRT form of the op (docs/tensorrt.md): contiguous (B, H, L, D) tensors whose head dim is the
# compile-time BLOCK_D, an int32 key mask, every per-head parameter packed in one fp32 PARAMS vector
# [slopes, alpha, ssa_n, ssa_b, ssmax_s] (H each) followed by the adaptive polynomial, and float scalars as int32
# bit patterns. Both take the same extras, so one launch contract serves every norm.


@triton.jit
def _contiguous_strides(H, L, D: tl.constexpr):
    """Strides (b, h, l, d) of a contiguous (B, H, L, D) tensor; the batch stride in int64 (it passes 2^31)."""
    return H.to(tl.int64) * L * D, L * D, D, 1


@triton.jit
def _trt_softmax_family_kernel(
    Q, K, V, KMASK, PARAMS, QSCALE,
    H, GROUP, LQ, LK, BH, scale_bits, NPOLY, threshold_bits, max_passes, tol_bits,
    OUT, ENT_OUT,
    SSA: tl.constexpr, LOGN: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr,
    MMA_SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """softmax, ssmax (LOGN), SSA, adaptive in TensorRT's argument order: one launch, grid (⌈Lq/BLOCK_M⌉, B·H).
    MMA_SUMS: the row sums as column partials in half precision, as the host's compiler favours (aot.py)."""
    q_strides = _contiguous_strides(H, LQ, BLOCK_D)
    kv_strides = _contiguous_strides(H // GROUP, LK, BLOCK_D)
    _softmax_family_program(
        Q, K, V, KMASK, q_strides, kv_strides, kv_strides, LK,
        (OUT, PARAMS + 4 * H, PARAMS + 2 * H, PARAMS + 3 * H, PARAMS, QSCALE, PARAMS + 5 * H, NPOLY,
         threshold_bits.to(tl.float32, bitcast=True)),
        scale_bits.to(tl.float32, bitcast=True), (OUT, ENT_OUT, OUT, OUT, OUT, OUT), (H, GROUP, LQ, LK, BLOCK_D),
        (BH, LK),
        SSA, False, LOGN, ADAPTIVE, True, CAUSAL, True, False, True, True, True, DOT_F32, MMA_SUMS and not DOT_F32,
        False, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip


@triton.jit
def _trt_entmax_kernel(
    Q, K, V, KMASK, PARAMS, QSCALE,
    H, GROUP, LQ, LK, BH, scale_bits, NPOLY, threshold_bits, max_passes, tol_bits,
    OUT, ENT_OUT,
    HAS_LAMBDA: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """entmax, asentmax (HAS_LAMBDA: λ from QSCALE) in TensorRT's argument order: one launch, seeded and stepping to
    its class model's root as the torch path's does. Every head's threshold sweep selects its powers and counts the
    support at α > 2 (GENERAL_SELECTED): a second, select-free sweep for the heads that allow it makes this form's
    output loop spill."""
    q_strides = _contiguous_strides(H, LQ, BLOCK_D)
    kv_strides = _contiguous_strides(H // GROUP, LK, BLOCK_D)
    _entmax_program(
        Q, K, V, KMASK, PARAMS + H, PARAMS, QSCALE, OUT, ENT_OUT, OUT, q_strides, kv_strides, kv_strides, LK,
        (H, GROUP, LQ, LK, BLOCK_D), scale_bits.to(tl.float32, bitcast=True),
        (max_passes, tol_bits.to(tl.float32, bitcast=True)),
        CAUSAL, True, HAS_LAMBDA, True, DOT_F32, GENERAL_SELECTED, False, not DOT_F32, BLOCK_M, BLOCK_N, BLOCK_N,
        BLOCK_D, True,
    )  # fmt: skip
