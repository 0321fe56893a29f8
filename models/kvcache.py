"""Attention over a paged KV cache (vLLM-style): the keys and values of every running sequence in fixed-size pages of
one preallocated pool per layer, found through a per-sequence block table — the layout the paged attention kernels
read (`sharp.paged_attention_impls`; the Triton one is `sharp.plugins.triton.paged.paged_decode`). The pools, the
pages' allocation and their prefix-cache names are serving's (serving/kv/pages.py); this module takes them as
arguments.

A forward over some sequences is a `PagedStep`: each layer writes the step's new keys and values into their slots
and attends over the pages; the sequences' lengths advance only when the whole step succeeded (`commit`), so a
failed step can be run again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sharp.models import registry
from sharp.models.attention import PAGED_IMPL_GROUP, attend, registered_impl
from sharp.models.sparse_decode import SparseStats, sparse_entmax_decode

# Queries (GQA group × new tokens per sequence) up to which a step runs the paged kernel directly; longer chunks
# (prefill) attend over a dense copy of the sequence's keys with the prefill kernels.
PAGED_KERNEL_ROWS = 64
# Pools up to this many elements per layer are read in place by the prefill kernels (their offsets into a strided
# view are int32); a larger pool is gathered.
VIEW_MAX_ELEMENTS = 2**31


@dataclass(frozen=True)
class PagesRead:
    """What the Triton paged kernel's sparse decode read in one layer: the pages each sequence's KV head read
    (B, Hkv) and the sequences' lengths, left on the device until `skipped` is asked for (the step's metrics)."""

    read: Tensor
    lengths: Tensor
    page_size: int

    @property
    def skipped(self) -> float:
        """The fraction of the sequences' (KV head, page) pairs not read."""
        pages = int((-(-self.lengths.long() // self.page_size)).sum()) * self.read.shape[1]
        return 1.0 - int(self.read.sum()) / pages if pages else 0.0


@dataclass
class PagedStep:
    """One forward over `seqs`, each appending `new` tokens, on per-layer pools of keys and values stored (kv_heads,
    pages, page_size, head_dim): the longest length after the step (on the host), the block table (B, pages) int32,
    the lengths after the step (B,) int32, where each new token goes (pool page and slot, (B, new)), and for a single
    sequence on consecutive pages the first of them. `lengths` are the sequences' committed lengths, advanced by
    `commit`. `bounds`, where the cache keeps them, are each layer's page summaries (2, kv_heads, pages, head_dim):
    the minimum and maximum of every page's keys, which entmax decode reads to skip pages (models/sparse_decode.py)
    unless `skip_pages` is off (they are still kept up to date); `sparse` collects what each layer's sparse decode
    read."""

    keys: list[Tensor]
    values: list[Tensor]
    lengths: dict[Hashable, int]
    seqs: list[Hashable]
    new: int
    longest: int
    block_table: Tensor
    seq_lens: Tensor
    write_pages: Tensor
    write_slots: Tensor
    run_start: int | None = None
    bounds: list[Tensor] | None = None
    skip_pages: bool = True
    sparse: dict[int, SparseStats | PagesRead] = field(default_factory=dict)

    def layer(self, index: int) -> PagedLayer:
        return PagedLayer(self, index)

    def commit(self) -> None:
        """Every layer has written: the sequences now hold their new tokens."""
        for s in self.seqs:
            self.lengths[s] += self.new


@dataclass
class PagedLayer:
    """One layer's share of a PagedStep: what SharpAttention receives as its cache."""

    step: PagedStep
    index: int

    @property
    def pools(self) -> tuple[Tensor, Tensor]:
        """The layer's storage, (kv_heads, pages, page_size, head_dim)."""
        return self.step.keys[self.index], self.step.values[self.index]

    def write(self, k: Tensor, v: Tensor) -> None:
        """k, v (B, kv_heads, new, head_dim): the step's new keys and values into their slots."""
        kp, vp = self.pools
        s = self.step
        kp[:, s.write_pages, s.write_slots] = k.transpose(0, 1).to(kp.dtype)
        vp[:, s.write_pages, s.write_slots] = v.transpose(0, 1).to(vp.dtype)
        if s.bounds is not None:
            self._summarise(k.to(kp.dtype))

    def _summarise(self, k: Tensor) -> None:
        """Fold the keys just written (as stored) into their pages' minima and maxima; a page whose first slot is
        written starts afresh (it was free, or is being filled from its start)."""
        s = self.step
        bounds = s.bounds[self.index]
        hkv, d = bounds.shape[1], bounds.shape[3]
        pages = s.write_pages.reshape(-1)
        keys = k.transpose(0, 1).reshape(hkv, -1, d).float()  # (kv_heads, B·new, D) in the order of `pages`
        fresh = pages[s.write_slots.reshape(-1) == 0]
        bounds[0][:, fresh] = float("inf")
        bounds[1][:, fresh] = float("-inf")
        index = pages.view(1, -1, 1).expand(hkv, -1, d)
        bounds[0].scatter_reduce_(1, index, keys, "amin")
        bounds[1].scatter_reduce_(1, index, keys, "amax")

    def dense(self) -> tuple[Tensor, Tensor, Tensor]:
        """Keys and values of every sequence as left-padded (B, kv_heads, longest, head_dim) tensors — each row's keys
        at the right end, its new tokens last — and the (B, longest) mask of real keys. A single sequence on
        consecutive pages is a view of the pools (no copy); otherwise the keys are gathered."""
        kp, vp = self.pools
        s = self.step
        width = s.longest
        if s.run_start is not None and kp.numel() < VIEW_MAX_ELEMENTS:
            hkv, _, page, d = kp.shape
            n = -(-width // page)
            run = slice(s.run_start, s.run_start + n)
            k = kp[:, run].reshape(hkv, n * page, d)[None, :, :width]
            v = vp[:, run].reshape(hkv, n * page, d)[None, :, :width]
            return k, v, torch.ones(1, width, dtype=torch.bool, device=kp.device)
        token = torch.arange(width, device=kp.device)[None] - (width - s.seq_lens.long())[:, None]
        real = token >= 0
        token = token.clamp(min=0)
        pages = s.block_table.long().gather(1, token // kp.shape[2])[:, None]
        slots = (token % kp.shape[2])[:, None]
        heads = torch.arange(kp.shape[0], device=kp.device)[None, :, None]
        return kp[heads, pages, slots], vp[heads, pages, slots], real  # (B, kv_heads, longest, D), contiguous

    def attend(self, q: Tensor, impl: str, entropy: bool = True, **norm: object) -> tuple[Tensor, Tensor | None]:
        """Attention of q (B, Hq, new, D) — the step's new tokens, causal — over the sequences' keys (written
        first): output and entropy (B, Hq, new) as `attend` returns them."""
        skips = self._skips(norm)
        if skips and q.shape[2] == 1 and impl != "triton":
            return self._sparse_decode(q, norm)
        kp, vp = (pool.transpose(0, 1) for pool in self.pools)  # (pages, kv_heads, page_size, head_dim) views
        group_rows = q.shape[1] // kp.shape[1] * q.shape[2]
        if impl == "triton" and group_rows <= PAGED_KERNEL_ROWS:
            s = self.step
            if not skips:
                return _paged_impl("triton")(q, kp, vp, s.block_table, s.seq_lens, causal=True, **norm)
            read = torch.empty(q.shape[0], kp.shape[1], dtype=torch.int32, device=q.device)  # the kernel fills it
            res = _paged_impl("triton")(q, kp, vp, s.block_table, s.seq_lens, causal=True,
                                        page_bounds=s.bounds[self.index], pages_read=read, **norm)  # fmt: skip
            s.sparse[self.index] = PagesRead(read, s.seq_lens, kp.shape[2])
            return res
        k, v, real = self.dense()
        mask = None if len(self.step.seqs) == 1 else real  # one sequence has no padding
        res = attend(q, k, v, causal=True, key_mask=mask, impl=impl, return_entropy=entropy, **norm)
        return res if entropy else (res, None)

    def _skips(self, norm: dict) -> bool:
        """Whether this step's attention may skip pages by their summaries: summaries kept and used, a norm of the
        entmax family with every α > 1. The torch implementations do it for a decode step (one new query per
        sequence, `_sparse_decode`), the Triton paged kernel for every step it runs."""
        step = self.step
        if step.bounds is None or not step.skip_pages:
            return False
        if registry.get(str(norm.get("norm", "softmax"))).family != registry.Family.ENTMAX:
            return False
        alpha = norm.get("alpha", registry.ALPHA.default)
        return bool((torch.as_tensor(alpha) > 1).all())

    def _sparse_decode(self, q: Tensor, norm: dict) -> tuple[Tensor, Tensor]:
        s = self.step
        alpha = torch.as_tensor(norm.get("alpha", registry.ALPHA.default), dtype=torch.float32, device=q.device)
        lam = norm.get("query_scale")
        out, ent, stats = sparse_entmax_decode(
            q[:, :, 0], *self.pools, s.bounds[self.index], s.block_table, s.seq_lens, alpha.expand(q.shape[1]),
            query_scale=None if lam is None else lam[:, :, 0], alibi_slopes=norm.get("alibi_slopes"),
            scale=norm.get("scale"),
        )  # fmt: skip
        s.sparse[self.index] = stats
        return out[:, :, None], ent[:, :, None]


def _paged_impl(name: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """A paged attention kernel registered by a higher layer (sharp.plugins.triton) by entry point."""
    return registered_impl(PAGED_IMPL_GROUP, name)
