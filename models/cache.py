"""sharp's on-disk cache: where derived files (a GGUF read as a Hugging Face directory, an export of a directory)
are kept, and the content key that names them — the same bytes in, the same entry out."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from sharp import __version__


def root() -> Path:
    """$SHARP_CACHE, else $XDG_CACHE_HOME/sharp (~/.cache/sharp)."""
    if os.environ.get("SHARP_CACHE"):
        return Path(os.environ["SHARP_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sharp"


def content_key(path: Path) -> str:
    """A digest of a file's bytes (not its name), or of every file in a directory (names and bytes; hidden ones,
    such as a download cache, left out), and of this sharp's version: an edited weight, config or tokenizer — or a
    new sharp — is a new entry."""
    digest = hashlib.blake2b(__version__.encode(), digest_size=16)
    if path.is_file():
        _add_bytes(digest, path)
        return digest.hexdigest()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path)
        if any(part.startswith(".") for part in rel.parts):
            continue
        digest.update(str(rel).encode() + b"\0")
        _add_bytes(digest, file)
        digest.update(b"\0")
    return digest.hexdigest()


def _add_bytes(digest, file: Path) -> None:
    with file.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
