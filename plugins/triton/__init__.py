"""Triton streamed normalizer kernels (docs/attention.md): `attention(...)` ≡ `attend(..., impl="triton")`.

On a machine without a GPU, set TRITON_INTERPRET=1 before triton is imported to run them on the CPU.
"""

from sharp.plugins.triton.attention import attend_impl, attention

__all__ = ["attend_impl", "attention"]
