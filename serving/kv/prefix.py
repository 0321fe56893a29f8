"""The graph backends' prefix cache: finished sequences' KV caches, whole, kept where the backend keeps its cache
(host memory for onnxruntime on CPU) in an LRU within a byte budget, and found under the page names every backend
uses (kv/names.py): a prompt's cached prefix is a walk down its page names, not a scan of the entries.

A graph backend's running batch is one left-padded buffer written in place, so pages cannot be shared with it as
the torch backend's paged cache shares them (kv/pages.py); instead a hit copies the matched columns into the
joining sequence's own cache — the copy a join makes anyway — and only the rest of its prompt is prefilled. Past its
last whole page the hit goes on token by token into the entries that hold that page (the CANDIDATES most recent),
so a hit is not cut to whole pages. Every normalizer is causal and per query, so a prefix's keys, values and
per-position entropies depend on the prefix alone and are reused exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np

from sharp.serving.kv.names import ROOT, PageNames

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
    names: list[bytes] = field(default_factory=list)  # its full pages' names
    root: bytes = ROOT  # where its path of pages starts: ROOT, or its cache_salt's root (kv/names.py)

    def covered(self) -> int:
        """Positions whose entropies are kept."""
        return 0 if self.entropy is None else min(self.entropy.shape[-1], len(self.tokens))


MAX_ENTRIES = 512  # kept caches at most (a flood of short prompts keeps few)
CANDIDATES = 4  # entries holding a prompt's last matched page that a lookup compares token by token past it


class PrefixStore:
    """Kept caches, least recently used first, within `budget` bytes (0: off) and MAX_ENTRIES entries, indexed by
    page name: `_holders[name]` the entries that hold that page (a root: every entry of that salt, or of none),
    `_covered[name]` those whose
    kept entropies cover it, oldest first. `comparisons` counts the entries a lookup compared token by token."""

    def __init__(self, budget: int, max_entries: int = MAX_ENTRIES):
        self.budget, self.max_entries = budget, max_entries
        self.nbytes = 0
        self.comparisons = 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._holders: dict[bytes, dict[int, None]] = {}
        self._covered: dict[bytes, dict[int, None]] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def describe(self) -> str:
        return f"prefix cache {self.budget / 2**20:g} MiB" if self.budget else "prefix cache off"

    def _along(self, pages: PageNames, tokens: int, index: dict[bytes, dict[int, None]]) -> list[bytes]:
        """The names, from its root, of the pages of `pages`' first `tokens` ids that some entry in `index` holds."""
        path = [pages.root]
        for name in pages.names(tokens):
            if name not in index:
                break
            path.append(name)
        return path

    def _recent(self, index: dict[bytes, dict[int, None]], name: bytes) -> Iterator[int]:
        """The CANDIDATES most recently kept entries of `index` under `name`."""
        return islice(reversed(index.get(name, {})), CANDIDATES)

    def match(self, prompt: PageNames, entropy: bool) -> tuple[Entry | None, int]:
        """The kept entry sharing the longest prefix with `prompt`, and that length — capped at all but the prompt's
        last token and, when `entropy`, at the entry's positions with entropies. The entry becomes the most recent."""
        cap, index = len(prompt) - 1, self._covered if entropy else self._holders
        best, best_n = None, 0
        for key in self._recent(index, self._along(prompt, cap, index)[-1]):
            e = self._entries[key]
            self.comparisons += 1
            n = common_prefix(e.tokens, prompt.ids, cap)
            if entropy:
                n = min(n, e.covered())
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        return self._entries[best], best_n

    def put(
        self,
        pages: PageNames,
        cache: list[Cache],
        entropy: np.ndarray | None,
        owner: Hashable | None = None,
        limit: int | None = None,
    ) -> None:
        """Keep a cache of `pages`' ids (the first `limit`; its columns beyond the budget dropped); an entry it
        extends is dropped, and it is not kept where an entry already holds it. `owner`: the sequence it comes from
        is still running (`settle` drops it if that one fails)."""
        if not self.budget or not len(pages):
            return
        per_token = sum(_nbytes(t) for t in cache) // cache[0].shape[2]
        n = min(len(pages), self.budget // max(per_token, 1), len(pages) if limit is None else limit)
        if n <= 0:
            return
        tokens = pages.ids[:n]
        covered = 0 if entropy is None else min(entropy.shape[-1], n)
        path = self._along(pages, n, self._holders)  # the entries along it, each compared once
        for key in list(dict.fromkeys(k for name in path for k in self._recent(self._holders, name))):
            e = self._entries.get(key)
            if e is None:
                continue  # dropped as another extension on the way
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
        key, names = self._next, pages.names(n)
        self._entries[key] = Entry(tokens.copy(), kept, ent, n * per_token, owner, names, pages.root)
        for name in (pages.root, *names):
            self._holders.setdefault(name, {})[key] = None
        for name in (pages.root, *names[: covered // pages.page_size]):
            self._covered.setdefault(name, {})[key] = None
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
        e = self._entries.pop(key)
        self.nbytes -= e.nbytes
        for index in (self._holders, self._covered):
            for name in (e.root, *e.names):
                held = index.get(name)
                if held is not None and held.pop(key, 0) is None and not held:
                    del index[name]


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
