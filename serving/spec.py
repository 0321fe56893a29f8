"""`ModelSpec`: what the engine, the metrics and GetModelInfo know about the served model — read from the file's
metadata, with no backend behind it (metrics and the engine need it without loading a model runtime)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sharp.exporter.metadata import LayerAttention, ModelMetadata
from sharp.models.config import ModelShape
from sharp.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelSpec:
    """What the engine and GetModelInfo need to know about the served model, from its metadata."""

    name: str  # the model's id: in replies, metrics and GetModelInfo
    backend: str
    metadata: ModelMetadata
    aliases: tuple[str, ...] = ()  # further ids a request may name (--served-model-name's others)
    config: ModelShape = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", self.metadata.shape)

    @property
    def names(self) -> tuple[str, ...]:
        """Every id this model answers to, its own first."""
        return (self.name, *self.aliases)

    @property
    def norm(self) -> str:
        return self.metadata.norm

    @property
    def precision(self) -> str:
        """The weights' precision: fp32, int8, int4 … (exporter/precision.py)."""
        return self.metadata.precision

    @property
    def kv_dtype(self) -> str:
        """The KV cache's element type as the file keeps it: fp32, or fp16 (`sharp-export --kv-cache-dtype`)."""
        return self.metadata.kv_dtype

    @property
    def tokenizer(self) -> Tokenizer:
        return self.metadata.tokenizer

    @property
    def attention(self) -> list[LayerAttention]:
        return self.metadata.layers

    @property
    def context_length(self) -> int:
        return self.config.context_length

    @property
    def layers(self) -> int:
        return self.config.layers

    @property
    def heads(self) -> int:
        return self.config.heads

    @property
    def kv_heads(self) -> int:
        return self.config.kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def kv_bytes_per_token(self, element_bytes: int = 4) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes
