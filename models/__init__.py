"""PyTorch reference: normalizers, `attend`, models, checkpoints and training."""

from sharp.models.attention import IMPLS, attend
from sharp.models.checkpoint import CheckpointError, load, save
from sharp.models.config import ModelConfig
from sharp.models.layers import SharpAttention
from sharp.models.lm import LMOutput, SharpLM
from sharp.models.max_retrieval import MaxRetrieval, MaxRetrievalConfig
from sharp.models.normalizers import (
    PAPER_POLY,
    adaptive_softmax,
    entmax,
    entropy,
    softmax,
    ssa,
    ssmax,
)
from sharp.models.registry import NORMS
from sharp.models.sampling import SamplingParams
from sharp.models.tokenizer import ByteTokenizer

__all__ = [
    "IMPLS",
    "NORMS",
    "PAPER_POLY",
    "ByteTokenizer",
    "CheckpointError",
    "LMOutput",
    "MaxRetrieval",
    "MaxRetrievalConfig",
    "ModelConfig",
    "SamplingParams",
    "SharpAttention",
    "SharpLM",
    "adaptive_softmax",
    "attend",
    "entmax",
    "entropy",
    "load",
    "save",
    "softmax",
    "ssa",
    "ssmax",
]
