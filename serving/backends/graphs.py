"""Decode steps of the torch backend replayed from CUDA graphs, one per batch-size bucket (as vLLM and SGLang capture
them): a decode step of a 135M model on a GPU is ~30 layers × a dozen kernel launches, and launching them from Python
costs more than running them. A step of B sequences runs the graph of the smallest bucket ≥ B, its inputs copied
into the graph's static tensors and the rows past B padded; a step that does not fit (more sequences than the largest
bucket) runs eagerly.

What the graph freezes is made step-independent: the block table is as wide as the model's context (the paged
kernel skips pages past each row's length), and a padded row is a one-token sequence on the pool's scratch page
(PagedKVCache's `scratch`, which no sequence owns), so its key write and its attention touch nothing real.

On CPU there is no graph to capture: `capture=False` keeps the same static buffers, padding and bucket choice and
runs the model eagerly at each replay — the code path the tests check on machines without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sharp.models.kvcache import PagedStep

if TYPE_CHECKING:
    from sharp.serving.kv.pages import PagedKVCache

log = logging.getLogger("sharp.serving")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class _Graph:
    """One bucket's static inputs, its captured graph (None on CPU) and its output."""

    ids: Tensor  # (bucket, 1) int64
    positions: Tensor  # (bucket, 1) int64
    step: PagedStep  # its block table, lengths and write slots are the static tensors the graph reads
    graph: torch.cuda.CUDAGraph | None = None
    logits: Tensor | None = None
    entropy: Tensor | None = None
    replays: int = 0


@dataclass
class DecodeGraphs:
    """The decode graphs of one model on one paged cache; `run` replays (capturing on first use) the bucket a step
    fits, or returns None when it fits none."""

    model: torch.nn.Module
    cache: PagedKVCache
    context_pages: int
    impl: str
    capture: bool
    max_batch: int = BUCKETS[-1]
    graphs: dict[tuple[int, bool], _Graph] = field(default_factory=dict)
    pool: object | None = None  # the graphs' shared memory pool
    disabled: str | None = None  # why graphs are off: a capture failed, every later step runs eagerly

    def bucket(self, batch: int) -> int | None:
        return next((b for b in BUCKETS if b >= batch and b <= self.max_batch), None)

    def run(self, seqs: list[Hashable], tokens: Tensor, positions: Tensor, entropy: bool):
        """The step's last-position logits (B, V) and entropy (B, layers, heads, 1) or None, from the bucket's
        graph; None when no bucket holds `len(seqs)` sequences."""
        size = self.bucket(len(seqs))
        if size is None or self.disabled is not None:
            return None
        g = self.graphs.get((size, entropy))
        if g is None:
            try:
                g = self._build(size, entropy)
            except RuntimeError as e:  # an op the capture refuses: serve eagerly rather than fail the step
                self.disabled = f"capturing the decode graph of {size} sequences failed: {str(e).splitlines()[0]}"
                self.graphs.clear()
                log.warning("%s; decode steps run eagerly from now on", self.disabled)
                return None
        self._fill(g, seqs, tokens, positions)
        if g.graph is not None:
            g.graph.replay()
        else:
            self._forward(g, entropy)
        g.replays += 1
        b = len(seqs)
        for s in seqs:  # the step ran: the real sequences hold their new token
            self.cache.lengths[s] += 1
        return g.logits[:b], None if g.entropy is None else g.entropy[:b]

    def _fill(self, g: _Graph, seqs: list[Hashable], tokens: Tensor, positions: Tensor) -> None:
        """Copy the step's inputs into the bucket's static tensors; rows past the batch: the scratch sequence."""
        cache, b = self.cache, len(seqs)
        page = cache.page_size
        past = torch.tensor([cache.lengths[s] for s in seqs])
        table = torch.full((len(g.ids), self.context_pages), cache.scratch, dtype=torch.int32)
        for i, s in enumerate(seqs):
            row = cache._table_rows[s]
            table[i, : len(row)] = row
        write_pages = torch.full((len(g.ids), 1), cache.scratch, dtype=torch.int64)
        write_pages[:b, 0] = table[:b].gather(1, (past // page)[:, None].long())[:, 0].long()
        write_slots = torch.zeros(len(g.ids), 1, dtype=torch.int64)
        write_slots[:b, 0] = past % page
        lengths = torch.ones(len(g.ids), dtype=torch.int32)
        lengths[:b] = past.to(torch.int32) + 1
        step = g.step
        step.block_table.copy_(table)
        step.seq_lens.copy_(lengths)
        step.write_pages.copy_(write_pages)
        step.write_slots.copy_(write_slots)
        step.longest = int(lengths.max())  # read on the host by the eager (CPU) path only
        g.ids.zero_()
        g.ids[:b].copy_(tokens)
        g.positions.zero_()
        g.positions[:b].copy_(positions)

    def _forward(self, g: _Graph, entropy: bool) -> None:
        """The eager replay (no GPU): the same model call the graph captures, on the same static tensors."""
        out = self.model.step(g.ids, cache=g.step, positions=g.positions, return_entropy=entropy, impl=self.impl)
        g.logits = out.logits[:, -1]
        g.entropy = out.entropy if entropy else None

    def _build(self, size: int, entropy: bool) -> _Graph:
        cache, dev = self.cache, self.cache.device
        step = PagedStep(
            cache.keys, cache.values, {}, [("graph", size, i) for i in range(size)], 1, 1,
            torch.full((size, self.context_pages), cache.scratch, dtype=torch.int32, device=dev),
            torch.ones(size, dtype=torch.int32, device=dev),
            torch.full((size, 1), cache.scratch, dtype=torch.int64, device=dev),
            torch.zeros(size, 1, dtype=torch.int64, device=dev),
        )  # fmt: skip
        column = lambda: torch.zeros(size, 1, dtype=torch.int64, device=dev)
        g = _Graph(column(), column(), step)
        if self.capture:
            self._capture(g, entropy)
        self.graphs[(size, entropy)] = g
        return g

    def _capture(self, g: _Graph, entropy: bool) -> None:  # pragma: no cover - needs a GPU
        """Warm the bucket's shapes up on a side stream (kernel compiles, allocator), then capture one step."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                self.model.step(g.ids, cache=g.step, positions=g.positions, return_entropy=entropy, impl=self.impl)
        torch.cuda.current_stream().wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        with torch.cuda.graph(g.graph, pool=self.pool), torch.inference_mode():
            out = self.model.step(g.ids, cache=g.step, positions=g.positions, return_entropy=entropy, impl=self.impl)
        g.logits = out.logits[:, -1]
        g.entropy = out.entropy if entropy else None
