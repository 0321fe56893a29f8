"""PyTorch reference: the normalizers and the attention entry point."""

from sharp.models.attention import IMPLS, attend
from sharp.models.normalizers import (
    NORMS,
    PAPER_POLY,
    adaptive_softmax,
    entmax,
    entropy,
    softmax,
    ssa,
    ssmax,
)

__all__ = [
    "IMPLS",
    "NORMS",
    "PAPER_POLY",
    "adaptive_softmax",
    "attend",
    "entmax",
    "entropy",
    "softmax",
    "ssa",
    "ssmax",
]
