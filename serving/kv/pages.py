"""The torch backend's KV memory (vLLM-style paging): one preallocated pool of fixed-size pages per layer, each
running sequence's block table into it, reference-counted pages, and the prefix cache's names for full pages — a
hash chained from the parent page's, so a page's name stands for its whole prefix. A sequence holds only the pages its
own tokens need, so memory does not grow with the longest sequence in a batch, and a sequence joining or leaving a
batch moves no data: it edits block tables. The attention over the pages is the model's (models/kvcache.py
`PagedStep`, built here per forward)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from sharp.models.kvcache import PagedStep


class OutOfPages(Exception):
    """The pool cannot hold the request; nothing was allocated."""


class PageAllocator:
    """Page ids 0..n−1 with reference counts. A request gets the lowest run of n consecutive free pages when there is
    one (a sequence whose pages are consecutive is read in place by the prefill kernels), else the lowest free pages:
    pages are never moved and any free page serves any sequence, so freeing in any order leaves no unusable
    fragments.

    Prefix caching (vLLM's scheme): a full page whose content is known is `register`ed under its block hash; when
    its last holder lets go it is not freed but kept, unreferenced, in an LRU (at most `keep` pages), so a later
    prompt with the same prefix `lookup`s it and shares it. Kept pages count as free: an allocation takes truly free
    pages first and evicts the least recently used kept ones only when it must."""

    def __init__(self, num_pages: int, keep: int = 0):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages, self.keep = num_pages, keep
        self._free = np.ones(num_pages, dtype=bool)
        self._refs = np.zeros(num_pages, dtype=np.int64)
        self._hash_of: dict[int, bytes] = {}  # registered pages' block hashes
        self._page_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # registered pages nobody holds, oldest first

    @property
    def free_pages(self) -> int:
        """Pages an allocation can take: the free ones and the kept ones nobody holds."""
        return int(self._free.sum()) + len(self._lru)

    @property
    def cached_pages(self) -> int:
        """Registered pages nobody holds (kept for a later prefix hit)."""
        return len(self._lru)

    def usage(self) -> float:
        return 1.0 - self.free_pages / self.num_pages

    def allocate(self, n: int) -> list[int]:
        free = self.free_pages
        if n > free:
            raise OutOfPages(f"{n} pages requested, {free} of {self.num_pages} free")
        while int(self._free.sum()) < n:  # eviction before refusal: the least recently used kept page first
            self._forget(next(iter(self._lru)))
        edges = np.diff(np.concatenate(([0], self._free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # runs of free pages [start, end)
        long_enough = np.flatnonzero(ends - starts >= n)
        if long_enough.size:
            pages = np.arange(starts[long_enough[0]], starts[long_enough[0]] + n)
        else:
            pages = np.flatnonzero(self._free)[:n]
        self._free[pages] = False
        self._refs[pages] = 1
        return pages.tolist()

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; a page nobody holds is freed, or kept if registered."""
        index = np.asarray(pages, dtype=np.int64)
        bad = (index < 0) | (index >= self.num_pages)
        if bad.any() or len(set(pages)) != len(pages) or (self._refs[index[~bad]] < 1).any():
            raise ValueError(f"pages {list(pages)} are not allocated (double free?)")
        self._refs[index] -= 1
        for page in reversed(index[self._refs[index] == 0].tolist()):  # a sequence's tail is evicted first
            if page in self._hash_of and self.keep:
                self._lru[page] = None
            else:
                self._forget(page)
        while len(self._lru) > self.keep:
            self._forget(next(iter(self._lru)))

    def _forget(self, page: int) -> None:
        """A page nobody holds becomes free and loses its hash."""
        self._lru.pop(page, None)
        self._unname(page)
        self._free[page] = True

    def _unname(self, page: int) -> None:
        digest = self._hash_of.pop(page, None)
        if digest is not None:
            del self._page_of[digest]

    def register(self, page: int, digest: bytes) -> bool:
        """Name a held, full page by its block hash; False when that hash already names a page (this one stays
        unnamed and is freed when let go) or the page is named already."""
        if not self.keep or digest in self._page_of or page in self._hash_of:
            return False
        self._hash_of[page], self._page_of[digest] = digest, page
        return True

    def unregister(self, pages: Sequence[int]) -> None:
        """Withdraw the pages' names (what a failed sequence wrote is offered to nobody); held pages stay held."""
        for page in pages:
            if page in self._lru:
                self._forget(page)
            else:
                self._unname(page)

    def lookup(self, digests: Sequence[bytes], usable: Callable[[int], bool] | None = None) -> list[int]:
        """The pages of the longest run of `digests` registered from the first (and, with `usable`, passing it),
        each now held once more."""
        pages = []
        for d in digests:
            page = self._page_of.get(d)
            if page is None or (usable is not None and not usable(page)):
                break
            pages.append(page)
        for page in pages:
            self._lru.pop(page, None)
            self._refs[page] += 1
        return pages


class PagedKVCache:
    """Per-layer pools of keys and values, stored (kv_heads, pages, page_size, head_dim) so that a sequence's
    consecutive pages are one strided (kv_heads, tokens, head_dim) view; `pages(layer)` gives the kernels'
    (pages, kv_heads, page_size, head_dim) view of the same storage. And each sequence's pages."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        keep: int = 0,
        bounds: bool = False,
    ):
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 16 (a kernel tile), got {page_size}")
        self.page_size = page_size
        self.scratch = num_pages  # one page beyond the allocator's, owned by no sequence: padded rows of a decode
        shape = (kv_heads, num_pages + 1, page_size, head_dim)  # graph write and read it (backends/graphs.py)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        # Page summaries for exact sparse entmax decode (models/sparse_decode.py): per layer, KV head and page the
        # minimum and maximum of its keys in each dimension, fp32 — 2·D numbers per page_size·D keys (1/8 of the
        # keys at 16 keys a page and fp32 keys; 1/4 at fp16). Kept only when a layer's norm can skip pages.
        summary = (2, kv_heads, num_pages + 1, head_dim)
        self.bounds = [torch.zeros(summary, device=device) for _ in range(layers)] if bounds else None
        self.allocator = PageAllocator(num_pages, keep)  # keep: cached pages nobody holds, at most
        self.tables: dict[Hashable, list[int]] = {}
        self._table_rows: dict[Hashable, Tensor] = {}  # the same as int32 rows: a step's table is one padded stack
        self.lengths: dict[Hashable, int] = {}
        self.page_entropy: dict[int, np.ndarray] = {}  # a registered page's entropies (layers, heads, page_size)

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def pages(self, layer: int) -> tuple[Tensor, Tensor]:
        """The layer's key and value pools as (pages, kv_heads, page_size, head_dim) views (no copy)."""
        return self.keys[layer].transpose(0, 1), self.values[layer].transpose(0, 1)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def reserve(self, seq: Hashable, tokens: int) -> None:
        """Make room for `seq` to hold `tokens` tokens in all (allocating its missing pages), or raise OutOfPages
        and change nothing."""
        table = self.tables.get(seq, [])
        missing = self.pages_for(tokens) - len(table)
        if missing > 0:
            self.tables[seq] = table + self.allocator.allocate(missing)
            self._table_rows[seq] = torch.tensor(self.tables[seq], dtype=torch.int32)
        self.lengths.setdefault(seq, 0)

    def share(self, seq: Hashable, digests: Sequence[bytes], usable: Callable[[int], bool] | None = None) -> int:
        """Start `seq` on the cached pages of the longest registered run of `digests` (its prompt's block hashes),
        held until it is freed; returns the tokens they hold. Call before `reserve`, which adds the rest."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} already holds pages")
        pages = self.allocator.lookup(digests, usable)
        if pages:
            self.tables[seq] = pages
            self._table_rows[seq] = torch.tensor(pages, dtype=torch.int32)
        self.lengths[seq] = len(pages) * self.page_size
        return self.lengths[seq]

    def publish(self, seq: Hashable, digests: Sequence[bytes], entropy: np.ndarray | None = None) -> list[int]:
        """Register the sequence's first full pages under `digests` (their block hashes, from its tokens) so that
        they outlive it for later prompts with the same prefix; only pages its committed tokens fill. `entropy`
        (layers, heads, n): the per-head attention entropy of its first n positions, kept with each page it covers
        (`page_entropy`), so a hit reports the statistics a cold prefill would. Returns the pages it named."""
        full = min(len(digests), self.lengths.get(seq, 0) // self.page_size)
        size, named = self.page_size, []
        for i, (page, digest) in enumerate(zip(self.tables.get(seq, [])[:full], digests[:full], strict=True)):
            if not self.allocator.register(page, digest):
                continue
            named.append(page)
            if entropy is not None and entropy.shape[-1] >= (i + 1) * size:
                self.page_entropy[page] = np.ascontiguousarray(entropy[..., i * size : (i + 1) * size])
            else:
                self.page_entropy.pop(page, None)
        return named

    def free(self, seq: Hashable) -> None:
        """The sequence left (finished, cancelled, failed): its pages return to the pool. Unknown sequences are
        ignored, so every way out may call it."""
        self.allocator.release(self.tables.pop(seq, []))
        self._table_rows.pop(seq, None)
        self.lengths.pop(seq, None)

    def clear(self) -> None:
        for seq in list(self.tables):
            self.free(seq)

    def step(self, seqs: Sequence[Hashable], new: int) -> PagedStep:
        """The view of one forward that appends `new` tokens to each of `seqs` (reserved beforehand)."""
        past = [self.lengths[s] for s in seqs]
        short = [s for s, n in zip(seqs, past, strict=True) if self.pages_for(n + new) > len(self.tables[s])]
        if short:
            raise ValueError(f"sequences {short!r} have too few pages for {new} more tokens; reserve first")
        table = pad_sequence([self._table_rows[s] for s in seqs], batch_first=True)  # unused entries 0, never read
        positions = torch.tensor(past)[:, None] + torch.arange(new)[None]  # (B, new) positions being written
        pages = table.gather(1, positions // self.page_size).long()
        dev = self.device
        lengths = torch.tensor(past, dtype=torch.int32) + new
        slots = positions % self.page_size
        run_start = None  # one sequence whose pages are consecutive: its keys are one strided view of the pools
        if len(seqs) == 1:
            row = self._table_rows[seqs[0]]
            if bool((row[1:] - row[:-1] == 1).all()):
                run_start = int(row[0])
        return PagedStep(
            self.keys, self.values, self.lengths, list(seqs), new, max(past) + new, table.to(dev), lengths.to(dev),
            pages.to(dev), slots.to(dev), run_start, self.bounds,
        )  # fmt: skip

    def gather(self, seq: Hashable, layer: int) -> tuple[Tensor, Tensor]:
        """The sequence's keys and values as dense (1, kv_heads, length, head_dim) tensors."""
        view = self.step([seq], 0).layer(layer)
        k, v, _ = view.dense()
        return k, v
