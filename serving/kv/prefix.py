"""The graph backends' prefix cache: finished sequences' KV caches, whole, kept where the backend keeps its cache
(host memory for onnxruntime on CPU) in an LRU within a byte budget, and matched on the longest common token prefix
when a prompt is admitted.

A graph backend's running batch is one left-padded buffer written in place, so pages cannot be shared with it as
the torch backend's paged cache shares them (kv/pages.py); instead a hit copies the matched columns into the
joining sequence's own cache — the copy a join makes anyway — and only the rest of its prompt is prefilled. Every
normalizer is causal and per query, so a prefix's keys, values and per-position entropies depend on the prefix
alone and are reused exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

Cache = Any  # a KV tensor as the backend keeps it: a NumPy array, or a torch tensor on CUDA (TensorRT)


def common_prefix(a: np.ndarray, b: np.ndarray, cap: int | None = None) -> int:
    """The length of the longest common prefix of two id arrays, at most `cap`."""
    m = min(len(a), len(b), len(a) if cap is None else cap)
    if m <= 0:
        return 0
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if differ.size else m


@dataclass
class Entry:
    """A kept cache: its token ids, per-layer keys and values (1, kv_heads, n, head_dim) and the per-head entropy
    of its first positions (layers, heads, ≤ n), when they were computed."""

    tokens: np.ndarray
    cache: list[Cache]
    entropy: np.ndarray | None
    nbytes: int
    owner: Hashable | None = None  # the running sequence it was taken from, until that one ends well

    def covered(self) -> int:
        """Positions whose entropies are kept."""
        return 0 if self.entropy is None else min(self.entropy.shape[-1], len(self.tokens))


MAX_ENTRIES = 512  # kept caches at most: a lookup compares the prompt with each (a flood of short prompts stays cheap)


class PrefixStore:
    """Kept caches, least recently used first, within `budget` bytes (0: off) and MAX_ENTRIES entries."""

    def __init__(self, budget: int, max_entries: int = MAX_ENTRIES):
        self.budget, self.max_entries = budget, max_entries
        self.nbytes = 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def describe(self) -> str:
        return f"prefix cache {self.budget / 2**20:g} MiB" if self.budget else "prefix cache off"

    def match(self, prompt: np.ndarray, entropy: bool) -> tuple[Entry | None, int]:
        """The kept entry sharing the longest prefix with `prompt`, and that length — capped at all but the prompt's
        last token and, when `entropy`, at the entry's positions with entropies. The entry becomes the most recent."""
        best, best_n, cap = None, 0, len(prompt) - 1
        for key, e in self._entries.items():
            n = common_prefix(e.tokens, prompt, cap)
            if entropy:
                n = min(n, e.covered())
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        return self._entries[best], best_n

    def put(
        self, tokens: np.ndarray, cache: list[Cache], entropy: np.ndarray | None, owner: Hashable | None = None
    ) -> None:
        """Keep a cache of `tokens` (its columns beyond the budget dropped); an entry it extends is dropped, and it
        is not kept where an entry already holds it. `owner`: the sequence it comes from is still running (`settle`
        drops it if that one fails)."""
        if not self.budget or not len(tokens):
            return
        per_token = sum(_nbytes(t) for t in cache) // cache[0].shape[2]
        n = min(len(tokens), self.budget // max(per_token, 1))
        if n <= 0:
            return
        tokens = np.asarray(tokens[:n], np.int64)
        covered = 0 if entropy is None else min(entropy.shape[-1], n)
        for key, e in list(self._entries.items()):
            common = common_prefix(e.tokens, tokens)
            if common == n and e.covered() >= covered:  # held already
                self._entries.move_to_end(key)
                return
            if common == len(e.tokens) and covered >= e.covered():  # this one extends it
                self._drop(key)
        while self._entries and (self.nbytes + n * per_token > self.budget or len(self._entries) >= self.max_entries):
            self._drop(next(iter(self._entries)))
        kept = [_own(t, n) for t in cache]
        ent = None if not covered else np.ascontiguousarray(entropy[..., :covered], np.float32)
        self._entries[self._next] = Entry(tokens, kept, ent, n * per_token, owner)
        self._next += 1
        self.nbytes += n * per_token

    def settle(self, owner: Hashable | None, failed: bool) -> None:
        """`owner` ended (None: every running one): its entries are dropped if it failed (its cache may be what
        failed), else kept as anyone's."""
        for key, e in list(self._entries.items()):
            if e.owner is not None and (owner is None or e.owner == owner):
                if failed:
                    self._drop(key)
                else:
                    e.owner = None

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes


def _nbytes(t: Cache) -> int:
    return int(t.nbytes)


def _own(t: Cache, n: int) -> Cache:
    """The first `n` columns of `t` as an array of their own: never a view of another array (a batch buffer written
    again, or a larger array it would keep alive). A sequence's own cache — an array onnxruntime returned, or the
    batch's copy of its row — is nobody else's and never written again: it is taken as it is, uncopied."""
    if isinstance(t, np.ndarray):
        whole = n == t.shape[2] and t.flags.c_contiguous and not isinstance(t.base, np.ndarray)
        return t if whole else t[:, :, :n].copy()
    return t[:, :, :n].clone()
