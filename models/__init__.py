"""PyTorch reference: normalizers, `attend`, models, checkpoints and training.

The names below load on first use (PEP 562): a process that needs only the torch-free parts — the registry's table,
configs, tokenizers, sampling, as an ONNX server does — never imports torch.
"""

from importlib import import_module

_HOMES = {
    "available_impls": "attention",
    "attend": "attention",
    "CheckpointError": "checkpoint",
    "load": "checkpoint",
    "save": "checkpoint",
    "ModelConfig": "config",
    "SharpAttention": "layers",
    "LMOutput": "lm",
    "SharpLM": "lm",
    "MaxRetrieval": "max_retrieval",
    "MaxRetrievalConfig": "max_retrieval",
    "PAPER_POLY": "registry",
    "adaptive_softmax": "normalizers",
    "entmax": "normalizers",
    "entropy": "normalizers",
    "softmax": "normalizers",
    "ssa": "normalizers",
    "ssmax": "normalizers",
    "NORMS": "registry",
    "SamplingParams": "sampling",
    "ByteTokenizer": "tokenizer",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)


def __dir__() -> list[str]:
    return __all__
