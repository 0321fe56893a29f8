"""Page names, the one prefix index's keys for every backend: a token sequence's full pages, each named by a hash of
its parent page's name and its own tokens — so a name stands for the whole prefix up to its page, and a prompt's
cached prefix is found by walking its names (vLLM's block hashes). BLAKE2b: a prompt cannot be crafted to collide
with another user's. A sequence's names are computed once (`PageNames`), however often admission, joining and
leaving ask for them."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

PAGE_SIZE = 16  # tokens per named page; the torch backend's KV page (a kernel tile: decode reads whole pages)


ROOT = b""  # the parent of a sequence's first page: every unsalted prefix starts there


def _name(parent: bytes, page: np.ndarray) -> bytes:
    return hashlib.blake2b(parent + page.tobytes(), digest_size=16).digest()


def root(salt: str | None) -> bytes:
    """The parent of a sequence's first page: ROOT, or a digest of the request's `cache_salt` (vLLM's field) — so
    salted pages are named apart from everyone else's, and a prefix is found only by a request with the same salt."""
    return (
        ROOT if salt is None else hashlib.blake2b(salt.encode("utf-8"), digest_size=16, person=b"sharp-salt").digest()
    )


class PageNames:
    """Token ids (int64) and the names of their full pages, computed on first need and kept; `root` the first
    page's parent (`root(salt)`)."""

    def __init__(self, ids: Sequence[int] | np.ndarray, page_size: int = PAGE_SIZE, root: bytes = ROOT):
        self.ids = np.asarray(ids, np.int64)
        self.page_size = page_size
        self.root = root
        self._names: list[bytes] = []

    def __len__(self) -> int:
        return len(self.ids)

    def names(self, tokens: int | None = None) -> list[bytes]:
        """The names of the full pages within the first `tokens` ids (all of them by default)."""
        n = len(self.ids) if tokens is None else max(0, min(tokens, len(self.ids)))
        size, names = self.page_size, self._names
        for i in range(len(names), n // size):
            names.append(_name(names[-1] if names else self.root, self.ids[i * size : (i + 1) * size]))
        return names[: n // size]

    def extended(self, ids: Sequence[int] | np.ndarray) -> PageNames:
        """The names of `ids`, which start as these ids do (the same prompt, or part of it, then the tokens generated
        since): the pages named here already are not hashed again."""
        other = PageNames(ids, self.page_size, self.root)
        other._names = list(self.names(len(other.ids)))
        return other
