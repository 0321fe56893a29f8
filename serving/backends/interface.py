"""Model backends behind one interface: the engine batches, samples and streams; a backend runs the model over the
sequences it is given and owns their KV cache.

The engine speaks in sequences: `reserve` room for one (or hear that it does not fit now), `prefill` a chunk of its
prompt, `join` it to the decode batch, `decode` one token for every running sequence, `release` it. How keys and
values are kept is the backend's business:
- `GraphBackend` (onnxruntime, TensorRT) runs the exported generation graph, whose flat tensors are left-padded
  `input_ids` (B, L), `attention_mask` (B, past + L), `position_ids` (B, L) and per-layer past keys/values
  (B, kv_heads, past, head_dim) (exporter/export.py, Optimum names): the running batch shares one left-padded
  cache (serving/kv/cache.py), so its memory follows the longest sequence;
- `TorchBackend` runs a SharpLM on a paged KV cache (kv/pages.py): each sequence holds only its own pages, a
  sequence joins and leaves without moving data, and on CUDA the attention reads the pages with the Triton kernels.
A row the model fails on in a batched decode or prefill ends alone: the rows are run one by one and only failing ones
end.
This module holds the interface and the graph backends' shared part; each backend has its own module
(onnxruntime_backend.py, torch_backend.py, tensorrt_backend.py), and loading.py imports only the one asked for.
The engine and a backend exchange NumPy arrays (ids in, logits and entropies out): torch is the torch and TensorRT
backends' own business, and a server of ONNX files never imports it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sharp.serving.backends.sampler import Sampler
from sharp.serving.kv import cache as arrays
from sharp.serving.kv.cache import BatchCache, roomy
from sharp.serving.kv.names import PageNames
from sharp.serving.kv.prefix import PrefixStore
from sharp.serving.spec import ModelSpec

log = logging.getLogger("sharp.serving")

BACKENDS = ("onnxruntime", "torch", "tensorrt")  # each in its own module (serving/backends/<name>_backend.py)
DTYPES = ("fp32", "bf16", "fp16")  # the torch backend's --dtype
Cache = Any  # a KV tensor as a backend keeps it: a NumPy array (onnxruntime) or a torch tensor (CUDA, TensorRT)


class BackendError(Exception):
    """The model file cannot be served (missing, wrong kind, unsupported architecture)."""


@dataclass
class StepOutput:
    """What a forward of the generation graph returns."""

    logits: np.ndarray  # (B, V) float32 at each row's last position
    presents: list[Cache]  # 2 × layers of (B, kv_heads, past + L, head_dim)
    entropy: np.ndarray | None  # (B, layers, heads, L) nats, when asked
    every: np.ndarray | None = None  # (B, L, V) float32 logits at every position, when asked


@dataclass
class StepResult:
    """What the engine receives from a prefill chunk or a decode step: the last position's logits (B, V) and the
    per-head entropy (B, layers, heads, L) of the rows that ran, in order, and the sequences the model failed on
    (left out of both); a prefill chunk that asked for them, its logits at every position (n, V) (`scores`). The
    logits are of the backend's `sampler`'s kind: a host array, or the torch backend's tensor on its device. A
    decode step that skipped KV pages (entmax, models/sparse_decode.py) says which share of them, per layer
    (`pages_skipped`, NaN for a layer that read them all)."""

    logits: Any
    entropy: np.ndarray | None
    failed: list[Hashable] = field(default_factory=list)
    scores: np.ndarray | None = None
    pages_skipped: np.ndarray | None = None


@dataclass
class Prefix:
    """What a leaving sequence's cache holds, to keep for later prompts: the token ids of its cached positions and,
    where every one of its first n positions had it computed, their per-head attention entropy (layers, heads, n)."""

    pages: PageNames  # its token ids and their page names
    entropy: np.ndarray | None

    @property
    def tokens(self) -> np.ndarray:
        return self.pages.ids


@dataclass
class Hit:
    """An admitted sequence's cached prefix: its first `tokens` prompt tokens need no prefill; `entropy` (layers,
    heads, tokens), when asked, is what their prefill would have reported."""

    tokens: int = 0
    entropy: np.ndarray | None = None


@dataclass
class Chunk:
    """A prefill chunk: the reserved sequence's prompt tokens start..start+n−1 as ids (1, n) int64; `scores`: return
    the logits at every position (to score the prompt), not only the last."""

    seq: Hashable
    ids: np.ndarray
    start: int
    scores: bool = False


class Backend(ABC):
    spec: ModelSpec
    kv_bytes_per_token: int  # what one token of one sequence costs in the KV cache
    block_tokens: int = 1  # tokens per unit of KV allocation (the metrics' block size)
    sampler: Sampler = Sampler()  # the array operations on its logits (StepResult.logits' kind)

    @abstractmethod
    def allocate(self, budget_bytes: int, prefix_bytes: int = 0) -> int:
        """Set up the KV cache within `budget_bytes` and the prefix cache within `prefix_bytes` (0: off); returns
        the bytes the KV cache can hold (what requests are checked against). Raises BackendError if not even one
        token fits."""

    @abstractmethod
    def reserve(self, seq: Hashable, tokens: int) -> bool:
        """Room for `seq` to hold `tokens` tokens, or False (nothing reserved) when that does not fit now."""

    def admit(self, seq: Hashable, prompt: PageNames, tokens: int, reuse: bool, entropy: bool) -> Hit | None:
        """Reserve room for `seq` to hold `tokens` tokens and, when `reuse`, start it on the longest cached prefix
        of `prompt` (its ids and page names; at most all but its last token: that one's logits start the answer),
        whose entropies come with it when `entropy`; None (nothing held) when it does not fit now."""
        return Hit() if self.reserve(seq, tokens) else None

    def cache_info(self) -> str:
        """The prefix cache's size, in words (the start-up line)."""
        return "prefix cache off"

    @abstractmethod
    def prefill(self, seq: Hashable, ids: np.ndarray, start: int, entropy: bool, scores: bool = False) -> StepResult:
        """ids (1, n): the reserved sequence's prompt tokens start..start+n−1, after its first `start`; `scores`: the
        result's `scores` are the logits at every position."""

    def prefill_many(self, chunks: list[Chunk], entropy: bool) -> list[StepResult | None]:
        """Each chunk's `prefill`, in order; None for a chunk the model failed on (the others are unaffected)."""
        results: list[StepResult | None] = []
        for c in chunks:
            try:
                results.append(self.prefill(c.seq, c.ids, c.start, entropy, c.scores))
            except Exception:
                log.exception("prefill failed")
                results.append(None)
        return results

    def join(self, seq: Hashable, keep: Prefix | None = None) -> None:  # noqa: B027  (a no-op by default)
        """The sequence's prompt is in: it decodes with the others from now on. `keep`: what its cache holds now,
        to offer to later prompts while it runs (its prompt: requests with the same prefix need not wait for it to
        end)."""

    @abstractmethod
    def release(self, seq: Hashable, keep: Prefix | None = None) -> None:
        """The sequence left (finished, cancelled, failed); unknown sequences are ignored. `keep`: what its cache
        holds, to keep in the prefix cache (None: forget it, e.g. after a failure)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every sequence (after a failure the engine could not attribute)."""

    @abstractmethod
    def kv_usage(self) -> float:
        """The fraction of the KV cache in use (the metrics' gauge)."""

    @abstractmethod
    def _decode_step(self, seqs: list[Hashable], tokens: np.ndarray, entropy: bool) -> StepResult:
        """One batched decode step: tokens (B, 1) the sequences' last sampled tokens."""

    def _unbatch(self, seqs: list[Hashable]) -> None:  # noqa: B027
        """Before running the rows alone: give each row what `_decode_step([seq])` needs."""

    def _rebatch(self, seqs: list[Hashable]) -> None:  # noqa: B027
        """After running the rows alone: the survivors form the batch again, in order."""

    def decode(self, seqs: list[Hashable], tokens: np.ndarray, entropy: bool) -> StepResult:
        """One token for each of `seqs` (the running batch, in order). If the batched step raises, each row runs
        alone and only the rows that raise again are reported failed."""
        try:
            return self._decode_step(seqs, tokens, entropy)
        except Exception:
            log.warning("a batched decode step of %d rows failed; running them one by one", len(seqs))
        self._unbatch(seqs)
        kept, results, failed = [], [], []
        for i, seq in enumerate(seqs):
            try:
                results.append(self._decode_step([seq], tokens[i : i + 1], entropy))
                kept.append(seq)
            except Exception:
                log.exception("decode failed for one row")
                failed.append(seq)
        self._rebatch(kept)
        if not kept:
            return StepResult(self.sampler.empty(self.spec.vocab_size), None, failed)
        ent = None if results[0].entropy is None else np.concatenate([r.entropy for r in results])
        return StepResult(self.sampler.concat([r.logits for r in results]), ent, failed)


class GraphBackend(Backend):
    """A backend that runs the exported generation graph (flat tensors in, presents out): prefilling sequences
    keep their own cache, running ones share one left-padded `BatchCache` whose memory is slots × the longest.
    A step's small host arrays are NumPy's (torch's dispatch and thread pool cost more than the work on them).
    `in_place`: the file is in the op's cache form and `forward(..., in_place=True)` writes a decode step's keys
    into the batch's own buffers (serving/kv/cache.py)."""

    in_place = False

    def __init__(self) -> None:
        self._kv_array_type = self.spec.metadata.kv_numpy_dtype  # the file's cache type (spec.kv_dtype names it)
        self.kv_bytes_per_token = self.spec.kv_bytes_per_token(np.dtype(self._kv_array_type).itemsize)
        self.budget_bytes = 0
        self._batch = self._new_batch()
        self._own: dict[Hashable, list[Cache]] = {}  # caches of sequences prefilling (or run alone)
        self._reserved: dict[Hashable, int] = {}
        self.prefixes = PrefixStore(0)

    @abstractmethod
    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        past: list[Cache],
        entropy: bool,
        last: np.ndarray | None = None,
        in_place: bool = False,
        every: bool = False,
    ) -> StepOutput:
        """One run of the graph; the logits are each row's at column last[row] (default: the last column).
        in_place: `past` are buffers with room for this step's keys, and the presents must be those buffers.
        every: the output's `every` holds the logits at every column too."""

    def _new_batch(self) -> BatchCache:
        """An empty batch cache; in place, its buffers never hold more keys than the budget."""
        return BatchCache(self.in_place, limit=self.budget_bytes // self.kv_bytes_per_token or None)

    def empty_past(self, batch: int) -> list[Cache]:
        s = self.spec
        return [np.zeros((batch, s.kv_heads, 0, s.head_dim), self._kv_array_type) for _ in range(2 * s.layers)]

    def allocate(self, budget_bytes: int, prefix_bytes: int = 0) -> int:
        if budget_bytes < self.kv_bytes_per_token:
            raise BackendError(f"a KV budget of {budget_bytes} bytes holds no token ({self.kv_bytes_per_token} each)")
        self.budget_bytes = budget_bytes
        self._batch.limit = budget_bytes // self.kv_bytes_per_token
        self.prefixes = PrefixStore(prefix_bytes)
        return budget_bytes

    def admit(self, seq, prompt, tokens, reuse, entropy):
        if not self.reserve(seq, tokens):
            return None
        entry, n = self.prefixes.match(prompt, entropy) if reuse else (None, 0)
        if not n:
            return Hit()
        self._own[seq] = [arrays.contiguous(t[:, :, :n]) for t in entry.cache]  # the copy a join makes anyway
        return Hit(n, entry.entropy[..., :n] if entropy else None)

    def cache_info(self):
        return self.prefixes.describe()

    def reserve(self, seq, tokens):
        wanted = {**self._reserved, seq: tokens}
        if len(wanted) * max(wanted.values()) * self.kv_bytes_per_token > self.budget_bytes:
            return False  # the batch cache pads every row to the longest one
        self._reserved = wanted
        return True

    def prefill(self, seq, ids, start, entropy, scores=False):
        n = ids.shape[1]
        positions = np.arange(start, start + n, dtype=np.int64)[None]
        mask = np.ones((1, start + n), np.int64)
        if self.in_place:  # the chunk's keys go into the sequence's own buffers: no chunk copies the keys before it
            past = self._room(seq, start + n)
            out = self.forward(ids, mask, positions, past, entropy, in_place=True, every=scores)
            self._own[seq] = [b[:, :, : start + n] for b in past]  # views: the batch adopts their buffers (cache.py)
        else:
            past = self._own.get(seq) or self.empty_past(1)
            out = self.forward(ids, mask, positions, past, entropy, every=scores)
            self._own[seq] = out.presents
        return StepResult(out.logits, out.entropy, scores=out.every[0] if scores else None)

    def _room(self, seq: Hashable, keys: int) -> list[Cache]:
        """In place: the sequence's own cache as buffers with room for `keys` keys — those it has, or new zeroed ones
        as wide as its reservation (calloc'd: untouched columns take no memory) holding its keys so far."""
        own = self._own.get(seq)
        if own and all(roomy(c, keys) for c in own):
            return [c.base for c in own]
        s, capacity = self.spec, max(keys, self._reserved.get(seq, 0))
        buffers = [np.zeros((1, s.kv_heads, capacity, s.head_dim), self._kv_array_type) for _ in range(2 * s.layers)]
        for b, c in zip(buffers, own or [], strict=False):
            b[:, :, : c.shape[2]] = c
        return buffers

    def prefill_many(self, chunks, entropy):
        """Chunks that start at the same position run as one batch, right-padded to the longest: a padding token
        sits after its row's prompt, so causal attention hides it from every real one, and each row's cache keeps
        only its own columns (one forward of B rows costs far less than B forwards: a graph's per-node cost is paid
        once). Padding is bounded: a batch is never more than twice its real tokens. If a batch raises, its rows run
        alone and only those that raise again fail."""
        results: list[StepResult | None] = [None] * len(chunks)
        for batch in _prefill_batches(chunks):
            members, outs = [chunks[i] for i in batch], None
            if len(batch) > 1:
                try:
                    outs = self._prefill_batch(members, entropy)
                except Exception:
                    log.warning("a batched prefill of %d prompts failed; running them one by one", len(batch))
            if outs is None:
                outs = Backend.prefill_many(self, members, entropy)
            for i, out in zip(batch, outs, strict=True):
                results[i] = out
        return results

    def _prefill_batch(self, chunks: list[Chunk], entropy: bool) -> list[StepResult]:
        start, lengths = chunks[0].start, [c.ids.shape[1] for c in chunks]
        width = max(lengths)
        ids = np.zeros((len(chunks), width), np.int64)
        for row, c in enumerate(chunks):
            ids[row, : lengths[row]] = c.ids[0]
        if start:
            past = [arrays.concat(layer) for layer in zip(*(self._own[c.seq] for c in chunks), strict=True)]
        else:
            past = self.empty_past(len(chunks))
        out = self.forward(
            ids,
            np.ones((len(chunks), start + width), np.int64),
            np.tile(np.arange(start, start + width, dtype=np.int64), (len(chunks), 1)),
            past,
            entropy,
            last=np.asarray(lengths) - 1,
            every=any(c.scores for c in chunks),
        )
        results = []
        for row, (c, n) in enumerate(zip(chunks, lengths, strict=True)):
            own = [p[row : row + 1, :, : start + n] for p in out.presents]
            self._own[c.seq] = own if n == width else [arrays.contiguous(p) for p in own]
            ent = None if out.entropy is None else out.entropy[row : row + 1, ..., :n]
            every = out.every[row, :n] if c.scores else None
            results.append(StepResult(out.logits[row : row + 1], ent, scores=every))
        return results

    def join(self, seq, keep=None):
        cache = self._own.pop(seq)
        if keep is not None and self.prefixes.budget:  # its own arrays, which the batch only copies from
            self.prefixes.put(keep.pages, cache, keep.entropy, owner=seq, limit=cache[0].shape[2])
        self._batch.join(seq, cache, cache[0].shape[2])

    def release(self, seq, keep=None):
        own = self._own.pop(seq, None)
        self._reserved.pop(seq, None)
        if keep is not None and self.prefixes.budget:
            cache = own if own is not None else self._batch.row(seq) if seq in self._batch else None
            if cache is not None:
                self.prefixes.put(keep.pages, cache, keep.entropy, limit=cache[0].shape[2])
        self.prefixes.settle(seq, failed=keep is None)  # what a failed sequence offered is withdrawn
        self._batch.leave(seq)

    def clear(self):
        self.prefixes.settle(None, failed=True)  # a failure nobody could attribute: what ran is withdrawn
        self._batch, self._own, self._reserved = self._new_batch(), {}, {}

    def _held(self) -> int:
        """Token slots held: the batch's (padding and free slots included) and the prefilling sequences' own."""
        return self._batch.slots() + sum(c[0].shape[2] for c in self._own.values())

    def kv_usage(self):
        return self._held() * self.kv_bytes_per_token / self.budget_bytes

    def _decode_step(self, seqs, tokens, entropy):
        cache = self._batch
        if len(seqs) == cache.live and all(s in cache for s in seqs):
            cache.settle()
            if cache.free and (self._held() + len(cache.owners)) * self.kv_bytes_per_token > self.budget_bytes:
                cache.compact()  # this step's column would take the free slots past the budget
            cache.reserve()  # a move to larger buffers drops free slots: the rows are numbered after it
            slots = cache.index(seqs)
            rows = None  # every slot live, in the engine's order: nothing to scatter or gather
            if slots != list(range(len(cache.owners))):
                rows = np.asarray(slots)
                scattered = np.zeros((len(cache.owners), 1), np.int64)
                scattered[rows] = tokens
                tokens = scattered
            mask, positions = cache.attention_mask(), cache.positions()
            out = self.forward(tokens, mask, positions, cache.tensors, entropy, in_place=self.in_place)
            cache.advance(out.presents)
            if rows is None:
                return StepResult(out.logits, out.entropy)
            return StepResult(out.logits[rows], None if out.entropy is None else out.entropy[rows])
        (seq,) = seqs  # a row run alone (after _unbatch)
        past = self._own[seq]
        n = past[0].shape[2]
        out = self.forward(tokens, np.ones((1, n + 1), np.int64), np.array([[n]], np.int64), past, entropy)
        self._own[seq] = out.presents
        return StepResult(out.logits, out.entropy)

    def _unbatch(self, seqs):
        for seq in seqs:
            self._own[seq] = self._batch.row(seq)
        self._batch = self._new_batch()

    def _rebatch(self, seqs):
        for seq in seqs:  # rows that failed keep their own cache until the engine releases them
            self.join(seq)


def _prefill_batches(chunks: list[Chunk]) -> list[list[int]]:
    """Indices of `chunks` grouped into prefill batches: the same start (their pasts are equally wide), longest
    first, a batch closed before its padded size would pass twice its real tokens."""
    batches: list[list[int]] = []
    by_start: dict[int, list[int]] = {}
    for i, c in enumerate(chunks):
        by_start.setdefault(c.start, []).append(i)
    for rows in by_start.values():
        rows.sort(key=lambda i: -chunks[i].ids.shape[1])
        batch, real = [], 0
        for i in rows:
            n = chunks[i].ids.shape[1]
            if batch and (len(batch) + 1) * chunks[batch[0]].ids.shape[1] > 2 * (real + n):
                batches.append(batch)
                batch, real = [], 0
            batch.append(i)
            real += n
        batches.append(batch)
    return batches
