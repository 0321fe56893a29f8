"""A paged KV cache: keys and values of every running sequence in fixed-size pages of one preallocated pool per
layer, found through a per-sequence block table (the layout `sharp.plugins.triton.paged.paged_decode` reads).

Unlike the left-padded `BatchCache`, a sequence holds only the pages its own tokens need — memory does not grow
with the longest sequence in the batch — and joining or leaving the batch moves no data: it edits block tables.
The budget is counted in pages; `usage()` is the fraction in use (a gauge for metrics).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


class OutOfPages(Exception):
    """The pool cannot hold the request; nothing was allocated."""


class PageAllocator:
    """Page ids 0..n−1 on a free list. Pages are never moved; any free page serves any sequence, so freeing in any
    order leaves no unusable fragments."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest ids go first
        self._used: set[int] = set()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return len(self._used) / self.num_pages

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"{n} pages requested, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        stray = [p for p in pages if p not in self._used]
        if stray or len(set(pages)) != len(pages):
            raise ValueError(f"pages {stray or list(pages)} are not allocated (double free?)")
        self._used.difference_update(pages)
        self._free.extend(reversed(pages))


class PagedKVCache:
    """Per-layer pools (pages, kv_heads, page_size, head_dim) of keys and values, and each sequence's pages."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 16 (a kernel tile), got {page_size}")
        self.page_size = page_size
        shape = (num_pages, kv_heads, page_size, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.allocator = PageAllocator(num_pages)
        self.tables: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def reserve(self, seq: Hashable, tokens: int) -> None:
        """Make room for `seq` to hold `tokens` tokens in all (allocating its missing pages), or raise OutOfPages
        and change nothing."""
        table = self.tables.get(seq, [])
        missing = self.pages_for(tokens) - len(table)
        if missing > 0:
            self.tables[seq] = table + self.allocator.allocate(missing)
        self.lengths.setdefault(seq, 0)

    def write(self, seq: Hashable, layer: int, k: Tensor, v: Tensor) -> None:
        """Append k, v (kv_heads, n, head_dim) — the sequence's next n tokens — into its pages at `layer`; the
        sequence's length advances after its last layer (`advance`)."""
        start, n = self.lengths[seq], k.shape[1]
        table = self.tables[seq]
        if self.pages_for(start + n) > len(table):
            raise ValueError(f"sequence {seq!r} has pages for {len(table) * self.page_size} tokens; reserve first")
        positions = torch.arange(start, start + n)
        pages = torch.tensor(table, device=k.device)[positions // self.page_size]
        slots = positions.to(k.device) % self.page_size
        self.keys[layer][pages, :, slots] = k.transpose(0, 1).to(self.keys[layer].dtype)
        self.values[layer][pages, :, slots] = v.transpose(0, 1).to(self.values[layer].dtype)

    def advance(self, seq: Hashable, n: int) -> None:
        self.lengths[seq] += n

    def free(self, seq: Hashable) -> None:
        """The sequence left (finished, cancelled, failed): its pages return to the pool."""
        self.allocator.release(self.tables.pop(seq, []))
        self.lengths.pop(seq, None)

    def block_table(self, seqs: Sequence[Hashable]) -> tuple[Tensor, Tensor]:
        """(B, max pages) int32 block table (unused entries 0, never read past a length) and (B,) int32 lengths."""
        width = max((len(self.tables[s]) for s in seqs), default=0) or 1
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        lengths = torch.tensor([self.lengths[s] for s in seqs], dtype=torch.int32)
        device = self.keys[0].device
        return table.to(device), lengths.to(device)

    def gather(self, seq: Hashable, layer: int) -> tuple[Tensor, Tensor]:
        """The sequence's keys and values as dense (1, kv_heads, length, head_dim) tensors (the reference path)."""
        n = self.lengths[seq]
        pages = torch.tensor(self.tables[seq], device=self.keys[layer].device)
        k = self.keys[layer][pages].transpose(0, 1).reshape(self.keys[layer].shape[1], -1, self.keys[layer].shape[3])
        v = self.values[layer][pages].transpose(0, 1).reshape(k.shape)
        return k[None, :, :n], v[None, :, :n]
