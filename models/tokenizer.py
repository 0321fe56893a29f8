"""The byte-level tokenizer of sharp's own models: the one object every layer (training, checkpoints, export
metadata, serving) uses, so its ids are written down in exactly one place."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are tokens 0–255; BOS = 256, EOS = 257."""

    bos: int = 256
    eos: int = 257
    vocab_size: int = 258
    kind: str = "bytes"

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos] if bos else []) + list(text.encode("utf-8"))

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (b"" for BOS, EOS and ids outside the byte range)."""
        return bytes((token,)) if 0 <= token < 256 else b""

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ByteTokenizer:
        """The tokenizer a checkpoint or a file's metadata describes; refuses what this one cannot be."""
        if not isinstance(d, dict) or d.get("kind", "bytes") != "bytes":
            raise ValueError(f"tokenizer {d!r}: only the byte tokenizer (kind 'bytes') is supported")
        tok = cls()
        if any(d.get(k, getattr(tok, k)) != getattr(tok, k) for k in ("bos", "eos")):
            raise ValueError(f"tokenizer {d!r}: the byte tokenizer has bos {tok.bos}, eos {tok.eos}")
        return tok


BYTES = ByteTokenizer()
